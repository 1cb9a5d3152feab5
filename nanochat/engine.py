"""
Token-level inference: the KV cache, sampling, the calculator tool, and the batched rollout engine.

The engine knows nothing about text beyond the special-token ids it needs for the tool state machine:
token ids in, token ids and masks out.
"""

import torch


class KVCache:
    """Keys and values of every layer for B rows, each row at its own position.

    k, v: (n_layer, B, T_max, n_kv_head, head_dim)
    pos:  (B,) int64, how many tokens of each row are cached (rows may differ).

    Contract with `GPT.forward(idx, kv_cache=cache)` for idx of shape (B, T): row b's new tokens sit at
    positions pos[b] .. pos[b]+T-1 (rotary uses these); each layer writes its k, v there and attends to
    the row's own cached positions (causal, and windowed for short-window layers); after the last layer
    the model calls `cache.advance(T)`. Entries past a row's position are never read unmasked, and the
    storage starts zeroed so masked entries are finite (0 * garbage must not make NaN).
    """

    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers, device="cpu", dtype=torch.float32):
        shape = (num_layers, batch_size, seq_len, num_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def batch_size(self):
        return self.k.size(1)

    @property
    def max_seq_len(self):
        return self.k.size(2)

    def reset(self):
        self.pos.zero_()

    def get_pos(self):
        """The largest row position (equal to every row's position when rows move in lockstep)."""
        return int(self.pos.max())

    def advance(self, num_tokens):
        self.pos += num_tokens

    def rows(self, start, stop):
        """A cache over rows [start, stop) that shares storage with this one (writes land here)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.pos = self.k[:, start:stop], self.v[:, start:stop], self.pos[start:stop]
        return view

    def copy_rows(self, dst, src):
        """Row dst[i] becomes a copy of row src[i] (keys, values and position). dst, src: (N,) long."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.pos[dst] = self.pos[src]
