"""
torch.compile in a run: which parts compile, what compiling costs, and when it pays.

    functions.py      a function compiled once per process, counting its compiles, their seconds and kernels
    plan.py           what --compile=auto|on|off|blocks compiles on each device (CompilePlan), checked and printed
    rule.py           chat_rl's --compile=auto on a CPU: each part compiled where its measured saving pays
    inductor_code.py  what a compiled graph launches, read from the code Inductor wrote for it
"""
