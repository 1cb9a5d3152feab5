"""
What a run stands on, below the model and the engine.

    distributed.py    ranks, a rank's share, the collectives every rank calls, tearing the process group down
    device.py         waiting for the device, feeding it host tensors, running out of its memory
    dtypes.py         the compute dtype asked for, what it is on a device, and its autocast
    cpu_features.py   the CPU's bf16 kind (probed or $NANOCHAT_CPU_BF16), its name, the one-line summary
    graceful_stop.py  SIGINT/SIGTERM: stop at the step's end and save; a second signal exits at once
    machine.py        this machine's measured limits (matmul peak, bandwidth, peak memory) and profiles
"""
