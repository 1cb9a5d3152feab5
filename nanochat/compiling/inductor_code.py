"""
What a graph Inductor compiled launches per call, read from the code Inductor wrote for it (GraphKernels), in the
unit of the eager count of the meta device (nanochat/diagnostics/op_count.py): how compiling a step is judged.
"""

import contextlib
import re
from typing import NamedTuple


class GraphKernels(NamedTuple):
    """What one call of a compiled graph launches, counted in the code Inductor wrote for it (its wrapper's calls):
    `generated`, the calls of kernels Inductor generated (fused Triton kernels on a GPU, C++ loops on a CPU; one reused
    by 20 layers counts 20), and `library`, its calls into libraries and ATen (matmuls, attention, top-k, the
    engine's own operators). Both in the unit of the eager count of the meta device (nanochat/diagnostics/op_count.py),
    which counts every kernel an eager step runs.

    Not Inductor's own counter (torch._inductor.metrics.generated_kernel_count): on a CPU it counts the loop nests
    the C++ backend builds, trial ones included (the ones it builds to decide an outer-loop fusion, then drops),
    not what runs: 81 for a 2-layer decode step whose wrapper calls 19 times 16 kernels (docs/performance.md)."""
    generated: int
    library: int

    @property
    def launches(self):
        return self.generated + self.library

    def asdict(self):
        return {"generated": self.generated, "library": self.library, "launches": self.launches}

    @classmethod
    def of(cls, codes):
        """From the code of the wrappers Inductor wrote while compiling a graph (the forward's; a training graph's
        backward's too where AOTAutograd compiles it at once, as it does under dynamic shapes, else not), or None where
        no code was seen (a graph compiler other than Inductor, or a torch that no longer hands its code over)."""
        counts = [wrapper_calls(code) for code in codes]
        return cls(*map(sum, zip(*counts))) if counts else None

    def __str__(self):
        return f"{self.generated} generated kernels and {self.library} library calls a call"


# a line of an Inductor wrapper that launches something: `triton_poi_fused_add_0.run(`, `cpp_fused_mul_1(`,
# `extern_kernels.mm(`, `buf3 = torch.ops.aten.topk.default(`, `aten.index_put_(` (a fallback written bare)
_WRAPPER_CALL = re.compile(r"^\s+(?:\w+(?:, \w+)* = )?(?P<callee>[\w.]+?)(?:\.run)?\(", re.M)
_GENERATED_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)
_LIBRARY = ("extern_kernels.", "torch.ops.", "aten.")
_VIEWS = ("aten.view.dtype",)  # written like a fallback, launches nothing


def wrapper_calls(code):
    """(generated, library): the launches in an Inductor wrapper's code, from its `def call(` on (what runs per call;
    the kernels' own sources come before it)."""
    generated_names = set(_GENERATED_KERNEL.findall(code))
    start = code.find("def call(")
    callees = [m.group("callee") for m in _WRAPPER_CALL.finditer(code, start)] if start >= 0 else []
    generated = sum(callee in generated_names for callee in callees)
    library = sum(callee.startswith(_LIBRARY) and callee not in _VIEWS for callee in callees)
    return generated, library


@contextlib.contextmanager
def inductor_code_to(codes):
    """Appends to `codes` the code of each graph Inductor writes (or loads from its cache) meanwhile, through the hook
    its own tests use (GraphLowering.save_output_code); any hook already set still gets it. A torch without the hook:
    nothing is appended."""
    try:
        from torch._inductor.graph import GraphLowering
        previous = GraphLowering.save_output_code
    except (ImportError, AttributeError):
        yield
        return

    def save(code):
        codes.append(code)
        if previous is not None:
            previous(code)
    GraphLowering.save_output_code = save
    try:
        yield
    finally:
        GraphLowering.save_output_code = previous
