"""The test session's pretend CUDA, for every Python process the tests start (tests/conftest.py says why).

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one; the tests put this
folder on PYTHONPATH (helpers.PYTHONPATH, and conftest for subprocesses that inherit the environment). It acts
only where $NANOCHAT_TESTS_PRETEND_CUDA=1, which conftest sets for a session on a machine without CUDA: then, as
soon as the process imports torch, torch.cuda answers like a machine with one GPU, and the first real use of CUDA
fails with a message naming the guard. A process that never imports torch loads nothing more than this file.
"""

import importlib.util
import os
import sys

ENV = "NANOCHAT_TESTS_PRETEND_CUDA"

# What torch.cuda says on a machine with one GPU.
def is_available():
    return True


def device_count():
    return 1


def refusing(name):
    """A stand-in for torch.cuda.`name` that raises at once. One function object per name: torch._dynamo's
    trace rules map torch's functions by identity and refuse one object under two names."""
    def refuse(*args, **kwargs):
        raise RuntimeError(f"torch.cuda.{name}: CUDA chosen on a machine without it; the tests pretend it is there "
                           "(tests/conftest.py), as on a GPU machine, where this would run on the GPU; pin the device "
                           "the test means (device=\"cpu\", --device-type=cpu)")
    return refuse


def pretend_cuda(cuda, setattr=setattr):
    """Give the torch.cuda module `cuda` these answers (setattr: monkeypatch.setattr, to undo it after a test)."""
    if not hasattr(cuda, "real_is_available"):
        # what the machine has, for helpers.HAS_CUDA in a process that starts under the guard: a pytest-xdist
        # worker inherits the session's environment, so its torch is patched before the tests' helpers are imported
        cuda.real_is_available = cuda.is_available
    setattr(cuda, "is_available", is_available)
    setattr(cuda, "device_count", device_count)
    # where a process would start using CUDA: torch's lazy init (tensors and modules moved to "cuda", device
    # queries, synchronize) and set_device. Without a GPU torch fails there anyway, but with "not compiled with
    # CUDA enabled" or a missing torch._C._cuda_setDevice, which do not say that a test forgot to pin the CPU.
    for name in ("_lazy_init", "set_device"):
        setattr(cuda, name, refusing(name))


class PretendCudaOnTorchImport:
    """A sys.meta_path finder that finds no module itself: when torch is imported it runs torch's own loader,
    then pretend_cuda. (Not an importlib.abc.MetaPathFinder: importing that module costs every process 10 ms.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once per process; and the real finders below must answer, not this one
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_pretend(module):
            exec_module(module)
            pretend_cuda(module.cuda)

        spec.loader.exec_module = exec_then_pretend  # this spec's own loader object: no other module sees it
        return spec


if os.environ.get(ENV) == "1":
    sys.meta_path.insert(0, PretendCudaOnTorchImport())
