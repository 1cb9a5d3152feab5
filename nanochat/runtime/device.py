"""
A run's device beyond computing on it: waiting for its queued work, feeding it host tensors without waiting, and
running out of its memory (telling it from other errors, giving the cached blocks back before a retry, and retrying
with fewer rows at a time: with_fewer_rows_on_oom, which the engine's rollouts and the run's training both take).
"""

import gc

import torch

from nanochat.runtime.distributed import print0


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


def with_fewer_rows_on_oom(attempt, rows, message, rows_in_use=None, free_memory=None):
    """attempt(rows), retried on out-of-memory with half the rows the failed attempt used (rows_in_use(), by
    default rows) until one row fails too; message is formatted with the new rows and printed. First, if given,
    free_memory() may give back memory held for later and return what to print: then the same rows are tried
    again. The result does not depend on the rows (per-row sampling streams; gradients summed in chunks).
    Returns (result, rows)."""
    while True:
        try:
            return attempt(rows), rows
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            runtime_error = not isinstance(error, torch.OutOfMemoryError)
            freed = free_memory() if free_memory else None
            if freed:
                print0(freed)
            else:
                used = (rows_in_use() if rows_in_use else rows) or 1
                if used <= 1:
                    raise
                rows = used // 2
                print0(message.format(rows=rows))
        # out of the except clause: the failed attempt's frames, and the tensors they held, are gone with the error
        release_cached_memory(runtime_error)
