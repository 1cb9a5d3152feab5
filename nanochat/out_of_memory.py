"""
Running out of device memory, told apart from other errors: the rollouts and the training pass back off from it
with fewer rows (nanochat/rl/run.py), torch.compile does not take it for a failure to compile
(nanochat/model/compile.py), and a CUDA graph's capture raises it as itself (nanochat/engine/cuda_graphs.py).
"""

import torch


def is_out_of_memory(error):
    """Whether `error` is running out of device memory: the allocator's torch.OutOfMemoryError, or the CUDA runtime's
    (an AcceleratorError), raised outside the allocator, e.g. making a stream (an H200's warm-up stream)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "CUDA error: out of memory" in str(error))


def out_of_memory_within(error):
    """The out-of-memory error (is_out_of_memory) that `error` is or wraps (torch.compile's BackendCompilerFailed
    keeps it in inner_exception or __context__), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if is_out_of_memory(error):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def release_cached_memory(error):
    """After an out-of-memory `error` of the CUDA runtime (not the allocator's, which gave back its cached blocks
    before raising), give the cached blocks back so that a retry with less finds the room."""
    if not isinstance(error, torch.OutOfMemoryError) and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
