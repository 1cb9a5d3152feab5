"""
Reinforcement learning on a task's questions, as nanochat's chat_rl does it.

The run, in the order scripts/chat_rl.py uses it:
    config.py           chat_rl's settings, one table (SETTINGS), and RLConfig: the frozen dataclass of them, checked
    resume.py           where a run starts: a new run from --source, or --resume of a saved step; --kl-coef's
                        frozen reference
    teacher.py          --teacher's frozen distillation teacher: loaded, its tokenizer checked, its forwards
    plan.py             every "auto" resolved once and printed, into the run's frozen RunPlan: dtypes, decode mode,
                        compile, memory budget, output tag, --keep-last, and the engine's RolloutSpec
    run.py              RLRun (what is fixed for a run) and its step(); setup_run and build_run, the one factory;
                        a step's two halves (sample_rollouts, train_on_rollouts)
    training.py         TrainingState: what only the training half holds (objective, forward, rows, loss scale)
    auto_switch.py      --compile=auto during the run: each step's parts timed apart from their compiling
                        (CompileMarks), the rule's switches made into the run's next plan and training state
    progress.py         RunProgress (what changes each step: history, data position, counters, timings), each
                        step's record and log line, and the warnings of a run with nothing to learn

The data path of one step, top-down:
    rollout.py          questions -> prompts -> the engine's samples -> rewards, one record per question
    advantages.py       one question's samples -> (inputs, targets) rows and each row's advantage
    objective.py        the policy-gradient objective: per-token terms and their denominators (and its options)
    policy_gradient.py  the training pass: rows through the model in chunks, the objective backpropagated
    metrics.py          what a step's rollouts and training looked like, combined across ranks
    evaluation.py       pass@k on the test split
"""
