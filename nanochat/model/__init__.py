"""
The GPT model of every nanochat generation, and how a run computes with it.

    gpt.py          GPT and GPTConfig, state-dict compatible with every nanochat generation's checkpoints
    blocks.py       one transformer block: its attention's projections, its MLP, the regions around its attention
    generations.py  what each nanochat version's forward computes, and how to tell a checkpoint's generation
    attention.py    attention for training and for the KV caches: the one contract between model and caches
    head.py         the vocabulary-wide head: logits, and the sampled tokens' log-probabilities chunk by chunk
    rotary.py       rotary position embeddings: every generation's tables, laid out once a forward
    sampling.py     sampling with per-row random streams (the engine's and the model's reference sampler)
    precision.py    the dtypes a run computes in, where that is a measured choice
    flops.py        FLOP counts of training and rollouts, for MFU

`nanochat.gpt` (nanochat's import path) re-exports gpt.py.
"""
