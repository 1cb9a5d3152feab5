"""On-policy distillation (issue 75: --teacher, --distill-coef, --reward-coef): one step's gradient against a loss
written out by hand over the same tiny models and rows, a teacher that is the student itself, the flags at their
defaults against a run without them, the flags' one-line refusals, and --resume with a teacher. 2 gloo ranks
against 1: tests/rl/test_rl_options.py's cases (tests/support/rl_options_worker.py) include the teacher's."""

import copy
import json
import os
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from helpers import (FP32_GAP_BOUND, TINY_RL_FLAGS, assert_same_weights, install_generation, make_sft_checkpoint,
                     prompt_of, random_model, tiny_config, weights)

from nanochat.checkpoints.loading import build_model
from nanochat.engine.engine import Engine
from nanochat.engine.spec import rollout_spec
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.objective import PolicyLoss
from nanochat.rl.policy_gradient import accumulate_policy_gradient
from nanochat.rl.config import RLConfig
from nanochat.rl.resume import run_target, train_further_command
from nanochat.rl.teacher import Teacher, load_teacher
from nanochat.tokenizer import get_tokenizer
from scripts import chat_rl

V, DEVICE_BATCH = 64, 2
# three questions of 4 rows, every row and token its own; the last question's rewards are all equal (its reward
# advantages 0): its rows carry the teacher's term alone
QUESTIONS = [([5, 6, 7], [([8, 9, 10], [1, 1, 1]), ([11], [1]), ([12, 13, 14, 15], [1, 0, 0, 1]), ([16, 17], [1, 1])],
              [1.0, 0.0, 0.0, 1.0]),
             ([20, 21], [([22], [1]), ([23, 24, 25], [1, 1, 1]), ([26, 27], [0, 1]), ([28, 29, 30, 31, 32], [1] * 5)],
              [0.0, 0.0, 1.0, 0.0]),
             ([40], [([41, 42], [1, 1]), ([43, 50, 51], [1, 1, 1]), ([44], [1]), ([45, 46, 47], [1, 0, 1])], [1.0] * 4)]


def hand_logprobs(model, batch):
    """(R, T) log-probabilities of batch's targets under `model` (a float64 copy), its logits as GPT.logits computes
    them (softcapped), 0 where there is no target: written here, not taken from the training pass."""
    softcap = model.generation.softcap
    logits = softcap * torch.tanh(F.linear(model.hidden_states(batch.inputs), model.lm_head.weight)[..., :V] / softcap)
    logp = torch.log_softmax(logits, -1).gather(-1, batch.targets.clamp(min=0)[..., None])[..., 0]
    return torch.where(batch.targets >= 0, logp, torch.zeros_like(logp))


def hand_distillation_objective(student, teacher, batches, reward_coef, distill_coef):
    """sum over questions, rows and sampled tokens of A_t * logp_t / D_row, A_t = reward_coef * (r - mean r) +
    distill_coef * (teacher logp - student logp, detached), D_row nanochat's: the sampled tokens of the row's pass of
    DEVICE_BATCH rows * passes * questions. Returns (objective, the mean of logp - teacher logp over the tokens)."""
    objective, gaps = 0.0, []
    for batch in batches:
        logp, teacher_logp = hand_logprobs(student, batch), hand_logprobs(teacher, batch).detach()
        valid = batch.targets >= 0
        rewards = batch.rewards.double()
        advantages = reward_coef * (rewards - rewards.mean())[:, None] + distill_coef * (teacher_logp - logp.detach())
        passes = batch.targets.size(0) // DEVICE_BATCH
        for row in range(batch.targets.size(0)):
            first = row // DEVICE_BATCH * DEVICE_BATCH
            denominator = int(valid[first:first + DEVICE_BATCH].sum()) * passes * len(batches)
            objective = objective + (advantages[row] * logp[row])[valid[row]].sum() / denominator
        gaps.append((logp.detach() - teacher_logp)[valid])
    return objective, torch.cat(gaps).mean().item()


@pytest.mark.parametrize("micro_batch_rows", [None, 5])
def test_one_steps_gradient_is_the_hand_written_distillation_loss(micro_batch_rows):
    """A d2 student taught by a d3 teacher (reward weighed 0.5, teacher 0.7): the accumulated gradient equals
    autograd's of hand_distillation_objective on float64 copies of the same models and rows, forwards of one pass
    or across questions alike; every row runs (those of reward advantage 0 too); the step's reverse KL and teacher
    log-probability are the tokens' means."""
    batches = [make_question_batch(prompt, completions, rewards, 0) for prompt, completions, rewards in QUESTIONS]
    student = random_model(tiny_config(sequence_len=32, vocab_size=V), seed=3)
    teacher = random_model(tiny_config(sequence_len=32, vocab_size=V, n_layer=3), seed=4)
    loss = PolicyLoss(reward_coef=0.5, distill_coef=0.7)
    stats = accumulate_policy_gradient(student, batches, DEVICE_BATCH, len(batches), "cpu", nullcontext(), loss=loss,
                                       micro_batch_rows=micro_batch_rows, teacher=Teacher(teacher, nullcontext(), {}))
    student64, teacher64 = copy.deepcopy(student).double(), copy.deepcopy(teacher).double()
    student64.zero_grad(set_to_none=True)
    objective, reverse_kl = hand_distillation_objective(student64, teacher64, batches, 0.5, 0.7)
    (-objective).backward()  # the training pass's gradient is the loss's, minus the objective
    for (name, p), want in zip(student.named_parameters(), student64.parameters()):
        torch.testing.assert_close(p.grad.double(), want.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert stats.rows_trained == stats.rows_total == 12
    assert stats.objective == pytest.approx(objective.item(), rel=1e-5)
    assert stats.reverse_kl == pytest.approx(reverse_kl, rel=1e-5) and stats.reverse_kl > 0.1
    teacher_mean = torch.cat([hand_logprobs(teacher64, b)[b.targets >= 0] for b in batches]).mean().item()
    assert stats.teacher_logprob == pytest.approx(teacher_mean, rel=1e-5)


def test_a_later_ppo_epoch_keeps_the_first_epochs_per_token_advantages():
    """A second PPO epoch (pg's clip), after the student moved: each token's advantage is still the first epoch's
    (the teacher's and the first forward's log-probabilities, kept), in the clipped surrogate written out by hand:
    sum of min(rho A_t, clip(rho, 0.8, 1.28) A_t) / D_row, rho = exp(logp - first logp). Some tokens are clipped."""
    batches = [make_question_batch(prompt, completions, rewards, 0) for prompt, completions, rewards in QUESTIONS]
    student = random_model(tiny_config(sequence_len=32, vocab_size=V), seed=3)
    teacher = Teacher(random_model(tiny_config(sequence_len=32, vocab_size=V, n_layer=3), seed=4), nullcontext(), {})
    loss = PolicyLoss(reward_coef=0.5, distill_coef=0.7, clip_low=0.2, clip_high=0.28)
    run = lambda first: accumulate_policy_gradient(student, batches, DEVICE_BATCH, len(batches), "cpu", nullcontext(),
                                                   loss=loss, first_epoch=first, teacher=teacher)
    first = run(None)
    before, teacher64 = copy.deepcopy(student).double(), copy.deepcopy(teacher.model).double()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    student.zero_grad(set_to_none=True)
    second = run(first)
    after = copy.deepcopy(student).double()
    after.zero_grad(set_to_none=True)
    objective = 0.0
    for batch in batches:
        valid = batch.targets >= 0
        old, t = hand_logprobs(before, batch).detach(), hand_logprobs(teacher64, batch).detach()
        logp = hand_logprobs(after, batch)
        rewards = batch.rewards.double()
        advantages = 0.5 * (rewards - rewards.mean())[:, None] + 0.7 * (t - old)
        ratio = torch.exp(logp - old)
        term = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
        passes = batch.targets.size(0) // DEVICE_BATCH
        for row in range(batch.targets.size(0)):
            lo = row // DEVICE_BATCH * DEVICE_BATCH
            objective = objective + term[row][valid[row]].sum() / (int(valid[lo:lo + DEVICE_BATCH].sum()) * passes * 3)
    (-objective).backward()
    for (name, p), want in zip(student.named_parameters(), after.parameters()):
        torch.testing.assert_close(p.grad.double(), want.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert 0 < second.clip_fraction < 1


def rollout_batches(model, tokenizer):
    """3 questions x 4 samples of the engine (fp32, eager), rewards alternating (every row's advantage +-0.5), with
    the sampler's log-probabilities."""
    prompts = [prompt_of(tokenizer, q) for q in ("What is 12 times 7?", "Tom has 3 apples and buys 5 more.", "Hi")]
    engine = Engine(model, tokenizer, rollout_spec(model, decode="eager"))
    results = engine.generate_many(prompts, num_samples=4, max_tokens=24, temperature=1.0, top_k=50, seeds=[3, 4, 5])
    pad = tokenizer.encode_special("<|assistant_end|>")
    return [make_question_batch(prompt, [(c.tokens, c.masks) for c in completions], [float(i % 2) for i in range(4)],
                                pad, sampler_logprobs=[c.logprobs for c in completions])
            for prompt, completions in zip(prompts, results)]


def test_a_teacher_that_is_the_student_adds_nothing_and_the_sampler_would_add_its_gap(tmp_path, monkeypatch):
    """Taught by itself (a copy of the jan2026 fixture), the student's distillation term is exactly 0 at every token
    (the student's log-probability is the training forward's, and the teacher runs that very forward): the
    gradient is bitwise the run's without a teacher, the reverse KL 0. The sampler's recorded log-probability,
    the other choice, differs from the teacher's by the fp32 sampler-trainer gap, within FP32_GAP_BOUND."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, "jan2026")), 5, "cpu", "eval")
    batches = rollout_batches(model, tokenizer)
    alone = accumulate_policy_gradient(model, batches, 4, len(batches), "cpu", nullcontext())
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    taught = accumulate_policy_gradient(model, batches, 4, len(batches), "cpu", nullcontext(),
                                        loss=PolicyLoss(distill_coef=1.0),
                                        teacher=Teacher(copy.deepcopy(model), nullcontext(), {}))
    assert taught.rows_trained == alone.rows_trained == 12 and taught.reverse_kl == 0.0
    for p, want in zip(model.parameters(), grads):
        assert torch.equal(p.grad, want)
    gaps = [(teacher - batch.sampler_logprobs)[batch.targets >= 0]
            for teacher, batch in zip(taught.teacher_logprobs, batches)]
    gaps = torch.cat(gaps)
    assert gaps.numel() > 50 and not gaps.isnan().any() and gaps.abs().max() <= FP32_GAP_BOUND


def test_the_new_flags_at_their_defaults_are_todays_run(sft, base_dir):
    """--teacher= --distill-coef=0 --reward-coef=1 (the defaults, given) and the flags left out: bitwise the same
    weights after two steps (tests/rl/test_golden_trace.py holds today's run itself, unchanged)."""
    flags = TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1"]
    chat_rl.main(flags)
    without = weights(base_dir / "chatrl_checkpoints" / "d2" / "model_000001.pt")
    chat_rl.main(flags + ["--overwrite", "--teacher=", "--distill-coef=0", "--reward-coef=1"])
    assert_same_weights(weights(base_dir / "chatrl_checkpoints" / "d2" / "model_000001.pt"), without)


def test_resume_with_a_teacher_is_the_uninterrupted_run(sft, base_dir, capsys):
    """Stopped after step 2 and resumed, a run taught by a d3 teacher ends bitwise as the uninterrupted one, though
    the teacher's tag has a newer step by then: the meta records the teacher's checkpoint, and --resume loads that
    one. The step line, the history and the meta show the teacher."""
    make_sft_checkpoint(base_dir, sft.config.vocab_size, seed=5, tag="t3", n_layer=3)
    flags = TINY_RL_FLAGS + ["--model-tag=d2", "--teacher=sft:t3", "--distill-coef=0.5", "--reward-coef=0.5",
                             "--num-steps=4", "--save-every=2"]
    chat_rl.main(flags)
    out = capsys.readouterr().out
    assert "teacher sft:t3:0 (d3," in out and " | Teacher: reverse KL " in out and ", log-prob " in out
    assert f"Loading model from {base_dir / 'chatsft_checkpoints' / 't3'} with step 0" in out  # the teacher's, as the student's
    run_dir = base_dir / "chatrl_checkpoints" / "d2"
    meta = json.loads((run_dir / "meta_000003.json").read_text())
    assert meta["teacher"] == {"source": "sft", "model_tag": "t3", "step": 0}
    assert all({"reverse_kl", "teacher_logprob", "time/teacher"} <= set(h) for h in meta["history"])
    uninterrupted = weights(run_dir / "model_000003.pt")
    os.remove(run_dir / "model_000003.pt")
    make_sft_checkpoint(base_dir, sft.config.vocab_size, seed=6, tag="t3", step=9, n_layer=3)  # the tag's newest
    chat_rl.main(["--resume=d2:2", "--device-type=cpu"])
    assert_same_weights(weights(run_dir / "model_000003.pt"), uninterrupted)


def test_the_teachers_directory_is_listed_once_where_the_run_is_settled_and_once_where_it_loads(sft, base_dir,
                                                                                                   monkeypatch):
    """run_target (the teacher refused in the run's own directory) and load_teacher each list the teacher's
    checkpoint directory once. Each resolved the teacher (its last step here) and then looked that checkpoint up
    again, listing the directory twice (and load_teacher's load_model a third time)."""
    make_sft_checkpoint(base_dir, sft.config.vocab_size, seed=5, tag="t3", step=4, n_layer=3)
    teacher_dir = os.path.realpath(base_dir / "chatsft_checkpoints" / "t3")
    listed, listdir = [], os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": listed.append(os.path.realpath(path)) or listdir(path))
    config = RLConfig(task="rl_toy_task:ParityTask", device_type="cpu", source="sft", model_tag="d2",
                      teacher="sft:t3", distill_coef=1.0)
    target = run_target(config, None)
    assert listed.count(teacher_dir) == 1 and target.output_tag == "d2"
    listed.clear()
    teacher = load_teacher(config, sft, get_tokenizer(), "cpu", "float32")
    assert listed.count(teacher_dir) == 1 and teacher.checkpoint == {"source": "sft", "model_tag": "t3", "step": 4}


def test_the_side_by_side_table_reads_each_runs_last_meta(tmp_path):
    """rl_variants' table (the distillation demonstration's): pass@1 +- sqrt(p (1 - p) / Q) at every eval step of any
    run, blank where a run has none, and the mean seconds a step, the teacher's apart (0 without one)."""
    from scripts.rl_variants import pass_at_1_table
    runs = {"default": ([(0, 0.25), (2, 0.5)], [{"time/rollout": 1.0, "time/train": 0.5}] * 2),
            "distill": ([(0, 0.25), (1, 0.1)], [{"time/rollout": 2.0, "time/train": 1.0, "time/teacher": 0.25},
                                                {"time/rollout": 2.0, "time/train": 2.0, "time/teacher": 0.75}])}
    for name, (evals, history) in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_000002.pt").write_bytes(b"")
        meta = {"eval_history": [[s, {"pass@1_unbiased": p}] for s, p in evals], "history": history}
        (tmp_path / name / "meta_000002.json").write_text(json.dumps(meta))
    assert pass_at_1_table([str(tmp_path / n) for n in runs], 100).splitlines() == [
        "| run | pass@1, step 0 | pass@1, step 1 | pass@1, step 2 | s/step | teacher s/step |",
        "|---|---|---|---|---|---|",
        "| default | 0.250 ± 0.043 |  | 0.500 ± 0.050 | 1.50 | 0.00 |",
        "| distill | 0.250 ± 0.043 | 0.100 ± 0.030 |  | 3.50 | 0.50 |"]


def test_the_command_that_trains_further_names_the_teacher_that_taught_the_run():
    """--teacher=sft:t3 resolved to step 0 when the run began; the tag's newest step may be another by now: the new
    run is taught by the run's own (its meta's), unless --teacher is given again."""
    config = RLConfig(teacher="sft:t3", distill_coef=0.5)
    taught_by = {"source": "sft", "model_tag": "t3", "step": 0}
    assert train_further_command(config, "d2", {}, 5, taught_by=taught_by) == (
        "python -m scripts.chat_rl --source=rl --model-tag=d2 --teacher=sft:t3:0 --distill-coef=0.5 --num-steps=5 "
        "(a new run, written to d2_cont)")
    given = train_further_command(config, "d2", {"teacher": "sft:t3:9"}, 5, taught_by=taught_by)
    assert "--teacher=sft:t3:9 " in given and "sft:t3:0" not in given
