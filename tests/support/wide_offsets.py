"""The kernels whose offsets can pass 2^31 elements at sizes a user may set (rotary_store's KV-cache rows, sample_rows'
logits rows, prompt_attention's two kernels: the rows' queries and own keys and values, the prompt slots' keys and
values), run in Triton's interpreter on tensors whose row stride is ROW_STRIDE: row 2 starts past 2^31 elements.
Each must write what it writes on contiguous copies of the same values; with 32-bit offsets row 2's address wraps
below the tensor (a crash, a write elsewhere, or a read of other values). The storage is a sparse file mapped
shared: the gigabytes it spans are neither allocated nor written, only the pages the rows touch. Prints `<op> ok`; run by
tests/kernels/test_kernel_binary.py in a process of its own (a crash must not take pytest with it), with
TRITON_INTERPRET=1."""

import os
import sys
import tempfile

import torch

from nanochat.kernels.prompt_attention import cell_rows, own_key_attention, prompt_attention
from nanochat.kernels.rotary_store import rotary_store
from nanochat.kernels.sampling import sample_rows

ROW_STRIDE = (1 << 30) + (1 << 20)  # elements: 2 x this > 2^31 - 1 while the stride itself is an int32
ROWS = 3


def wide_rows(directory, name, shape, dtype):
    """A (ROWS, *shape) tensor of `dtype` with row stride ROW_STRIDE, over a sparse file in `directory` (zeros)."""
    inner = torch.empty(shape).stride()
    size = (ROWS - 1) * ROW_STRIDE + torch.Size(shape).numel()
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.truncate(size * torch.tensor([], dtype=dtype).element_size())
    storage = torch.from_file(path, shared=True, size=size, dtype=dtype)
    return storage.as_strided((ROWS, *shape), (ROW_STRIDE, *inner))


def random_wide_rows(directory, name, shape, generator):
    """wide_rows in float32 (the attention kernels take fp32 as they are; other dtypes get contiguous fp32 copies in
    the interpreter), filled with normal values."""
    rows = wide_rows(directory, name, shape, torch.float32)
    rows.copy_(torch.randn(ROWS, *shape, generator=generator))
    return rows


def check_rotary_store(directory):
    """Keys and values written into a cache whose rows are ROW_STRIDE apart, as into a contiguous one."""
    H, Hkv, D, capacity = 2, 1, 4, 4
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(ROWS, H + 2 * Hkv, D, generator=g).bfloat16()
    cos, sin = torch.randn(8, D // 2, generator=g), torch.randn(8, D // 2, generator=g)
    positions, pos = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])
    wide = [wide_rows(directory, n, (Hkv, capacity, D), torch.bfloat16)[None] for n in ("k", "v")]  # (1, ROWS, ...)
    narrow = [torch.zeros_like(t, memory_format=torch.contiguous_format) for t in wide]
    outputs = [rotary_store(qkv, cos, sin, positions, k, v, 0, pos, H, 1.0, None, positions, None,
                            qkv.view(ROWS, -1), 0.0, False) for k, v in (narrow, wide)]
    assert torch.equal(outputs[0], outputs[1])
    assert all(torch.equal(a, b) for a, b in zip(narrow, wide)), "keys or values written elsewhere"


def check_sample_rows(directory):
    """The sampler reading logits whose rows are ROW_STRIDE apart draws what it draws from contiguous ones."""
    V = 64
    logits = wide_rows(directory, "logits", (V,), torch.float32)
    logits.copy_(torch.randn(ROWS, V, generator=torch.Generator().manual_seed(1)))
    seeds, active = torch.tensor([3, 4, 5]), torch.ones(ROWS, dtype=torch.long)
    results = []
    for rows in (logits.contiguous(), logits):
        draws, sampled = torch.zeros(ROWS, dtype=torch.long), torch.zeros(ROWS, 3)
        sample_rows(rows, None, None, seeds, draws, active, sampled, 1.0)
        results.append(sampled)
    assert torch.equal(results[0], results[1]), "the sampler read other logits"


def attention_rows(directory, seed):
    """Queries (ROWS, H, D) and own keys and values (ROWS, Hkv, capacity, D) of 3 rows, ROW_STRIDE apart: row 2's
    read past 2^31 elements (the kernels' row offsets), GQA of 2 query heads a kv head."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, capacity = 4, 2, 4, 6
    return [random_wide_rows(directory, name, shape, g)
            for name, shape in (("q", (H, D)), ("own_k", (Hkv, capacity, D)), ("own_v", (Hkv, capacity, D)))]


def check_own_key_attention(directory):
    """The own-key kernel's parts (maximum, sum, weighted sum) of rows ROW_STRIDE apart, as of contiguous ones."""
    q, own_k, own_v = attention_rows(directory, 2)
    pos, sample = torch.tensor([4, 2, 5]), torch.tensor([0, 1, 2])
    parts = [own_key_attention(*tensors, pos, sample, 3, 6, 3, 2)  # 6 keys, window 3: 3 splits of 2 keys
             for tensors in ([t.contiguous() for t in (q, own_k, own_v)], (q, own_k, own_v))]
    assert all(torch.equal(a, b) for a, b in zip(*parts)), "the own-key kernel read other keys or queries"
    assert parts[0][1][:, 2].sum() > 0, "row 2 saw no key: its offsets are not checked"


def check_prompt_attention(directory):
    """Both kernels (own keys, then the prompts and the merge) over rows and prompt slots ROW_STRIDE apart, as over
    contiguous ones: each row in a slot of its own, slot 2's keys and values past 2^31 elements."""
    q, own_k, own_v = attention_rows(directory, 3)
    g = torch.Generator().manual_seed(4)
    Hkv, D, prompt_keys = own_k.size(1), own_k.size(3), 5
    pool_k, pool_v = (random_wide_rows(directory, name, (Hkv, prompt_keys, D), g) for name in ("pool_k", "pool_v"))
    pool_len, pos, sample = torch.tensor([5, 3, 4]), torch.tensor([4, 2, 5]), torch.zeros(ROWS, dtype=torch.long)
    cells = cell_rows(torch.arange(ROWS), sample, ROWS, 1)
    outs = [prompt_attention(q_, k, v, pool_len, cells, own_k_, own_v_, pos, sample, 1, 6, 7, split_keys=2)
            for q_, k, v, own_k_, own_v_ in ([t.contiguous() for t in (q, pool_k, pool_v, own_k, own_v)],
                                             (q, pool_k, pool_v, own_k, own_v))]
    assert torch.equal(outs[0], outs[1]), "the prompt kernel read other keys, values or queries"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        for check in (check_rotary_store, check_sample_rows, check_own_key_attention, check_prompt_attention):
            check(directory)
            print(check.__name__.removeprefix("check_"), "ok", flush=True)
    sys.exit(0)
