"""
The project's own GPU kernels for the decode step, in Triton (it comes with every CUDA build of torch), each a torch
custom op with a fake (meta) implementation: the meta op count, Dynamo and CUDA-graph capture see one op each.

    launch.py            where a kernel runs: compiled on CUDA, in Triton's interpreter on a CPU (tests); or
                         recorded, not run (the sm_90 compile of nanochat/diagnostics/kernel_binary.py)
    prompt_attention.py  the shared-prompt decode attention, two kernels a layer (own keys in splits; prompts + merge)
    rotary_store.py      rotary, q/k norm and scale, the value embedding's term, the KV write: one kernel a layer
    residual_norm.py     residual add + lambdas/backout + RMSNorm; the MLP's relu^2
    sampling.py          temperature, Gumbel-max over top-k, both log-probabilities, the streams' draws

Ops only: the kernels import nothing of the model or the engine (they sit below nanochat/model/). The decode step
composed from them is the engine's: nanochat/engine/variants/triton_step.py (the decode step "triton").
"""
