"""
A run's device beyond computing on it: waiting for its queued work, feeding it host tensors without waiting, and
running out of its memory (telling it from other errors, and giving the cached blocks back before a retry).
"""

import gc

import torch


def synchronize(device):
    """Wait for the device's queued work (CUDA, MPS), so that a wall-clock time measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def to_device(tensor, device):
    """`tensor`, a host tensor, on `device` without waiting for it. A plain CPU -> CUDA copy synchronizes the stream
    (PyTorch waits for the copy, so the host waits for every kernel queued before it): in the training pass that
    stopped the host from queuing the next chunk while the GPU ran this one, once per small index tensor. Copied
    from pinned memory the transfer is queued like a kernel (PyTorch's host allocator keeps the pinned block until
    the copy is done). Elsewhere (CPU, MPS) a plain .to(device)."""
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


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


def release_cached_memory(runtime_error):
    """After an out-of-memory of the CUDA runtime (runtime_error; not the allocator's, which gave back its cached
    blocks before raising), once the failed attempt's tensors are gone, give the cached blocks back to the driver,
    which a stream or a library workspace is made from, so that a retry with less finds the room."""
    if runtime_error and torch.cuda.is_initialized():
        gc.collect()  # a failed frame caught in a reference cycle, with the tensors it held
        torch.cuda.empty_cache()
