"""
The decode step's variants beside the hand-written one (nanochat/engine/shared_prompt_cache.py's SharedPromptStep, run
by nanochat/engine/decode_batch.py's static_step), each named in nanochat/engine/decode_steps.py's table, which is
where the engine picks one. Neither imports the engine: each reads the cache and the batch it is handed.

    flex_prompt_attention.py  the shared-prompt attention through PyTorch's FlexAttention (the step "flex")
    triton_step.py            the whole step in the project's Triton kernels, nanochat/kernels/ (the step "triton")
"""
