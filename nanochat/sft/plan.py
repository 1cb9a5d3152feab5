"""
What an SFT run is set up with before its first step: the model it starts from, its plan (the train tasks, the
held-out questions, the order of the train conversations, the number of steps), and how it computes (--compile: the
training forward, and the engine of the held-out checks).
"""

from nanochat.checkpoints.loading import load_model
from nanochat.compiling.functions import maybe_compiled
from nanochat.compiling.plan import SFT_CPU_MIN_STEPS, compile_models, resolve_compile_flag
from nanochat.engine.cuda_graphs import decode_mode
from nanochat.engine.engine import Engine
from nanochat.engine.spec import rollout_spec
from nanochat.errors import SettingError, UserError
from nanochat.model.gpt import build_fresh_model
from nanochat.runtime.distributed import print0
from nanochat.sft.data import load_tasks, mixture_order
from nanochat.sft.stopping import held_out_questions
from nanochat.sft.training import summed_cross_entropy
from nanochat.tokenizer import get_tokenizer


class TooFewConversationsError(UserError):
    """The mixture's train conversations, over every epoch, do not fill one step (nanochat.cli's line names the
    flags)."""

    def __init__(self, tasks, conversations, examples_per_step, num_epochs):
        super().__init__(f"{tasks} has {conversations} train conversations: {num_epochs} epochs of them do not fill one "
                         f"step of {examples_per_step}")
        self.tasks, self.conversations = tasks, conversations
        self.examples_per_step, self.num_epochs = examples_per_step, num_epochs


def load_start_model(args, device):
    """(model, tokenizer, max_seq_len) to finetune: a fresh --depth model, or the --source checkpoint, and the cap on
    a training row's tokens, --max-seq-len (0 = the model's sequence_len; refused past it)."""
    if args.depth > 0:
        tokenizer = get_tokenizer()
        model = build_fresh_model(args.depth, args.sequence_len, tokenizer.get_vocab_size(), device)
    else:
        model, tokenizer, _ = load_model(args.source, device, phase="train", model_tag=args.model_tag, step=args.model_step,
                                         generation=args.model_generation)
    sequence_len = model.config.sequence_len
    max_seq_len = args.max_seq_len or sequence_len
    if max_seq_len > sequence_len:
        raise SettingError("max_seq_len", f"({max_seq_len}) exceeds the model's sequence_len ({sequence_len}), "
                                          f"beyond which its attention windows slide; use at most {sequence_len}")
    return model, tokenizer, max_seq_len


def training_plan(args, task_names):
    """(train tasks, the held-out questions or None, the order of the train conversations, the number of steps)."""
    train_tasks = load_tasks(task_names, "train", args.arithmetic_difficulty)
    held_out = (held_out_questions(train_tasks[0], task_names[0], args.stop_check_questions) if args.stop_at_pass1
                else None)
    train_sizes = [len(t) for t in train_tasks]
    if held_out is not None:
        train_sizes[0] = held_out.start  # the held-out questions are the last ones: train on those before them
    train_order = mixture_order(train_sizes, args.seed)
    num_steps = args.num_steps if args.num_steps > 0 else len(train_order) * args.num_epochs // args.examples_per_step
    if num_steps < 1:
        raise TooFewConversationsError(args.tasks, len(train_order), args.examples_per_step, args.num_epochs)
    held_out_note = "" if held_out is None else f" ({args.stop_check_questions} of {task_names[0]} held out)"
    print0(f"train: {len(train_order):,} conversations from {', '.join(task_names)}{held_out_note} | {num_steps} steps of "
           f"{args.examples_per_step} | lr x{args.init_lr_frac}")
    return train_tasks, held_out, train_order, num_steps


def compiled_parts(compile_flag, model, tokenizer, band, device, num_steps):
    """How the run computes, per --compile (`compile_flag`): (the training forward, compiled or not; the engine of
    every stop check, None without a band; the --compile the run records, which says what runs). The checks' engine
    serves them all with its static batch, and on CUDA its captured decode graphs; they stay allocated while training
    runs (the checks' rows x (prompt + --stop-check-max-tokens) of KV cache, and under bf16 a copy of the matmul
    weights: d20 ~1.7 GB + 0.95 GB)."""
    decode = decode_mode("auto", device) if band is not None else None  # only the checks sample
    compiling, compile_flag = resolve_compile_flag(compile_flag, device, decode, num_steps,
                                                   cpu_min_steps=SFT_CPU_MIN_STEPS)
    compile_models(compiling, model)
    forward = maybe_compiled(summed_cross_entropy, compiling.train, dynamic=True, required=compile_flag == "on")
    checks = band is not None
    engine = Engine(model, tokenizer, rollout_spec(model, decode=decode, compile=compile_flag)) if checks else None
    return forward, engine, compile_flag
