"""
Diagnostics, apart from the run's path: how many kernels a decode step (op_count.py) or a training step's pass
(train_count.py) launches, counted on the meta device, the same on any machine; bench_rl and the tests read them.
And bench_rl's measurement: the configurations it compares (bench_configs.py), one configuration's step built, timed
and turned into figures (bench_measure.py), the results compared and tabulated (bench_results.py), and rows that end
at random lengths, alike in every configuration (early_stop.py).
"""

from nanochat.diagnostics.op_count import compiled_step_graphs, compiled_step_kernels, count_decode_step_ops
from nanochat.diagnostics.train_count import d20_train_step_kernels

__all__ = ["compiled_step_graphs", "compiled_step_kernels", "count_decode_step_ops", "d20_train_step_kernels"]
