"""
The scripts' settings, each written once: its default, its help and how argparse reads it (type=, choices=). A
setting's name is its flag's with underscores (device_type <- --device-type, nanochat.cli.flag_name).

chat_rl's settings are a table in nanochat/rl/config.py, RLConfig's fields derived from it; the settings several
scripts share are SHARED below, which that table and nanochat.cli's add_* helpers (every other script) both take. No
script declares a shared flag itself (tests/rl/test_one_source.py): where its help says more, or its default is its
own (chat_cli's --temperature), it takes the setting varied (Setting.varied), the rest from SHARED. Where the library
needs a default too (the sampling, the calculator's format, the memory budget), the setting takes the library's value.
Checks that argparse cannot make are the config's (RLConfig's construction) or the function's that takes the value (a
SettingError, shown under the flag's name).
"""

import dataclasses
from dataclasses import dataclass

from nanochat.compiling.plan import COMPILE_MODES, SFT_CPU_MIN_STEPS
from nanochat.engine.calculator import CALCULATOR_FORMATS, DEFAULT_FORMAT
from nanochat.engine.cuda_graphs import DECODE_MODES
from nanochat.engine.decode_steps import DECODE_KERNELS
from nanochat.engine.spec import AUTO, FIXED_GB, FRACTION, parse_budget
from nanochat.model.generations import VE_ERA_WITH_NEW_META


@dataclass(frozen=True)
class Setting:
    """One flag: its default and help, and how argparse reads it. A bool whose default is False is a switch
    (store_true); any other value is read with `type` (default: the default's own type; str for a None default)."""
    default: object
    help: str
    type: object = None
    choices: tuple = None
    nargs: str = None     # with const: --resume alone means --resume=latest
    const: object = None
    group: str = None     # the heading chat_rl's --help shows it under
    typed: bool = True    # False: no type= at all (argparse keeps the text), as bench_rl has always declared its flags

    def shown_in(self, group):
        return dataclasses.replace(self, group=group)

    def varied(self, **changes):
        """This setting as one script declares it: its own help (or group), and only where the script's differs on
        purpose, its own default; everything not changed stays the shared setting's."""
        return dataclasses.replace(self, **changes)

    def argparse_kwargs(self):
        """add_argument's keyword arguments for this setting."""
        if self.default is False:
            return {"action": "store_true", "help": self.help}
        kwargs = {"default": self.default, "help": self.help}
        if self.typed:
            kwargs["type"] = self.type or (str if self.default is None else type(self.default))
        return kwargs | {k: v for k, v in (("choices", self.choices), ("nargs", self.nargs), ("const", self.const))
                         if v is not None}


def decode_setting(auto_note=""):
    """--decode: how the rollout engine runs its decode step (nanochat.engine.cuda_graphs.decode_mode). Uncompiled, the
    tokens are the same in every mode; only the speed differs (compiled, a near-tie may fall the other way).
    auto_note: what the script's auto does besides (its help)."""
    return Setting("auto", f"decode step of rollouts: auto (graph on CUDA, eager elsewhere{auto_note}), eager (exact "
                           "shapes), static (bucketed shapes, eagerly), graph (bucketed shapes replayed from CUDA graphs)",
                   choices=DECODE_MODES)


# the settings several scripts share, by name
SHARED = dict(
    # chat_eval's and chat_cli's; chat_rl's varies its default to nanochat's DEFAULT_FORMAT (nanochat/rl/config.py)
    calculator_format=Setting(None, "how the calculator's result is written: str (nanochat: str(), 10/2 gives 5.0) or "
                                    "int (an integral float without its .0); default: the checkpoint's own (an RL "
                                    f"run's --calculator-format), else {DEFAULT_FORMAT}", choices=CALCULATOR_FORMATS),
    # the checkpoint a script starts from or evaluates (chat_rl, chat_sft, chat_eval, bench_eval, chat_cli, bench_rl)
    source=Setting("sft", "checkpoint family: base|mid|sft|rl"),
    model_tag=Setting(None, "model tag (subdirectory) to load; default: the largest d<N>"),
    model_step=Setting(None, "checkpoint step to load; default: the last one", type=int),
    # the task chat_rl trains on and the evals measure (chat_sft's --tasks, a mixture, is its own)
    task=Setting("gsm8k", "gsm8k, arithmetic, or package.module:ClassName"),
    # how completions are sampled: nanochat's, for chat_rl's rollouts and for every eval (nanochat.rl.rollout.Sampling's
    # defaults; chat_rl's periodic eval keeps them whatever its flags, nanochat/rl/evaluation.py), and the evals' seeds
    max_new_tokens=Setting(256, "completion length cap in tokens"),
    temperature=Setting(1.0, "sampling temperature (0 = greedy)"),
    top_k=Setting(50, "top-k sampling (0 = whole vocabulary)"),
    seed=Setting(0, "base sampling seed (question i uses seed + i)"),
    # the engine's cap on the rows decoded at once (0: none, the memory budget alone decides)
    max_rows=Setting(0, "max rows decoded together in one rollout batch (0 = as many as --memory-budget-gb allows)"),
    run=Setting("dummy", "wandb run name ('dummy' disables wandb)"),
    device_type=Setting("", "cuda|cpu|mps (empty = autodetect)"),
    dtype=Setting(None, "auto|float32|bfloat16 compute dtype (autocast; chat_rl also float16, with dynamic loss "
                        "scaling); default: $NANOCHAT_DTYPE, else auto: bfloat16 on a GPU (in chat_rl float16 on "
                        "one without native bf16, before SM 80), on a CPU bfloat16 only where it is native "
                        "(AVX512-BF16, AMX) and, in chat_rl, measured faster at the start"),
    model_generation=Setting(None, "which forward a value-embedding checkpoint with nanochat's 2026-01-31+ meta layout "
                                   "was trained with (its files cannot tell): ve (to 2026-03-01), ve_mar2 "
                                   "(03-02..03-03), ve_late (03-04..03-08, the default); every other checkpoint's "
                                   "generation is detected", choices=VE_ERA_WITH_NEW_META),
    # the KV cache the rollout batches in memory at once may use: resolve it with
    # nanochat.engine.spec.resolve_memory_budget before building the Engine, which takes GiB
    memory_budget_gb=Setting(AUTO, f"KV-cache memory (GiB) the rollout batches in memory at once (a step's, an eval's "
                                   f"kept beside it) may use together; auto (the default): on CUDA {FRACTION:g} of the "
                                   f"memory free after the model, optimizer state and a training-peak reserve (stated "
                                   f"at the start), elsewhere {FIXED_GB:g}", type=parse_budget),
    decode=decode_setting(),
    # which decode step the rollout engine runs (nanochat/engine/decode_steps.py's table): a speed choice, the same
    # tokens as the torch step's in fp32 up to near-ties (chat_rl's --resume keeps it as given)
    decode_kernels=Setting(AUTO, "what the rollouts' decode step computes with: auto (torch on every device for now: "
                                 "the Triton step has not been timed on a GPU yet), torch (the hand-written step in "
                                 "torch ops; --compile may compile it), flex (torch, its shared-prompt attention "
                                 "through FlexAttention), triton (the whole step in the project's Triton kernels: on "
                                 "CUDA, or a CPU in Triton's interpreter with TRITON_INTERPRET=1 set, slow; never "
                                 "compiled, so not with --compile=on)", choices=DECODE_KERNELS),
    # whether the static decode step and the training pass run compiled (nanochat/compiling/plan.py's compile_plan),
    # those of them the script runs
    compile=Setting("auto", f"torch.compile the static decode step and the training forward, where the script runs "
                            f"them: auto (on CUDA nothing yet: not measured to pay there; on a CPU, chat_rl: each "
                            f"part timed eagerly over the first steps, then compiled where its saving over the steps "
                            f"left pays for its compile; chat_sft: the training forward for runs of "
                            f"{SFT_CPU_MIN_STEPS} steps or more), on (an error where compiling is unavailable), off, "
                            f"or blocks (instead: each transformer block around its attention, one compile for every "
                            f"layer)", choices=COMPILE_MODES),
    # the learning-rate flags of chat_rl and chat_sft (nanochat's defaults; --init-lr-frac differs)
    embedding_lr=Setting(0.2, "AdamW lr for the token embedding"),
    unembedding_lr=Setting(0.004, "AdamW lr for lm_head"),
    matrix_lr=Setting(0.02, "Muon lr for the transformer matrices"),
    weight_decay=Setting(0.0, "Muon weight decay"),
    recipe=Setting("2026-01", "optimizer recipe: 2026-01 (nanochat of January 2026: AdamW + Muon) or 2026-07 (nanochat "
                              "of July 2026: MuonAdamW with per-group betas and weight decay)",
                   choices=("2026-01", "2026-07")),
    # in every script: run_main then re-raises a UserError, so the full traceback is shown
    debug=Setting(False, "show full tracebacks instead of one-line errors"),
)



# The defaults a script has of its own, where it differs from SHARED on purpose (by script, then setting): nanochat's
# chat_cli samples at 0.6 with seed 42, its chat_sft finetunes the mid checkpoint from seed 42; chat_eval evaluates the
# task the checkpoint was trained on where it records one; bench_rl's empty source is a random-init model; rl_variants'
# small runs are meant for a CPU. nanochat.cli.add_shared_flag takes them from here.
SCRIPT_DEFAULTS = dict(
    chat_cli=dict(temperature=0.6, seed=42),
    chat_eval=dict(task=None),  # the checkpoint's own task (an RL run's --task), else SHARED's (issue 74)
    chat_sft=dict(source="mid", seed=42),
    bench_rl=dict(source="", seed=42),
    rl_variants=dict(device_type="cpu"),
)

def dataclass_of(settings):
    """A class decorator: the class as a frozen dataclass whose fields are `settings` (name -> Setting), in their
    order, each defaulting to its setting's default and holding the setting in its metadata ("setting")."""
    def make(cls):
        cls.__annotations__ = {name: object if s.default is None else type(s.default) for name, s in settings.items()}
        for name, s in settings.items():
            setattr(cls, name, dataclasses.field(default=s.default, metadata={"setting": s}))
        return dataclass(frozen=True)(cls)
    return make
