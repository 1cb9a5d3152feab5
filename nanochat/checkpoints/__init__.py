"""
Checkpoints on disk, in nanochat's layout and file formats.

    layout.py            where a checkpoint's files are (model_<step>.pt, meta_<step>.json, optim_<step>_rank<r>.pt)
    store.py             saving a step atomically on every rank, and reading files, steps and tags back
    loading.py           a checkpoint's model: GPT built from its files, older nanochat versions patched
    errors.py            what is missing or broken, as UserErrors carrying the facts
    background.py        saves off the critical path: a host snapshot written by a thread, committed later
    checkpointer.py      a run's checkpoint protocol in one object: save, settle before a collective, finish, on error
    optimizer_shards.py  chat_rl's per-rank optimizer state: checked on --resume, re-split for another rank count
    pruning.py           removing a run's older steps (--keep-last) and the shards a larger run left

`nanochat.checkpoint_manager` (nanochat's import path) re-exports layout, errors, store and loading.
"""
