"""pass@k (nanochat/rl/evaluation.py) against values worked out by hand: the unbiased estimator for several n, c
and k, and the aggregation over questions and over 2 gloo ranks, both definitions ("any" and "unbiased")."""

import json
from fractions import Fraction as F
from types import SimpleNamespace

import pytest
from gloo_ranks import run_ranks

from nanochat.rl.evaluation import aggregate_pass_at_k, unbiased_pass_at_k

# (n, c, k, 1 - C(n-c, k) / C(n, k) worked out)
UNBIASED = [
    (4, 0, 1, F(0)),                      # no correct sample: C(4,1)/C(4,1) = 1
    (4, 0, 4, F(0)),
    (4, 4, 1, F(1)),                      # every sample correct: C(0,1) = 0
    (4, 4, 4, F(1)),
    (4, 1, 1, 1 - F(3, 4)),               # C(3,1)/C(4,1) = 3/4            -> 1/4 = c/n
    (4, 1, 2, 1 - F(3, 6)),               # C(3,2)/C(4,2) = 3/6            -> 1/2
    (4, 1, 3, 1 - F(1, 4)),               # C(3,3)/C(4,3) = 1/4            -> 3/4
    (4, 1, 4, F(1)),                      # k = n: C(3,4) = 0, any correct sample is drawn
    (4, 2, 2, 1 - F(1, 6)),               # C(2,2)/C(4,2) = 1/6            -> 5/6
    (4, 2, 3, F(1)),                      # C(2,3) = 0
    (5, 2, 1, F(2, 5)),                   # 1 - 3/5
    (5, 2, 2, 1 - F(3, 10)),              # C(3,2)/C(5,2) = 3/10           -> 7/10
    (5, 2, 3, 1 - F(1, 10)),              # C(3,3)/C(5,3) = 1/10           -> 9/10
    (10, 3, 5, 1 - F(21, 252)),           # C(7,5)/C(10,5) = 21/252 = 1/12 -> 11/12
    (16, 1, 8, 1 - F(6435, 12870)),       # C(15,8)/C(16,8) = 1/2          -> 1/2
    (16, 15, 2, F(1)),                    # C(1,2) = 0
    (16, 3, 16, F(1)),                    # k = n
    (1, 0, 1, F(0)),
    (1, 1, 1, F(1)),
]


@pytest.mark.parametrize("n, c, k, want", UNBIASED)
def test_unbiased_pass_at_k_by_hand(n, c, k, want):
    assert unbiased_pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-15)


def test_pass_at_k_needs_k_samples():
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples, got 4"):
        unbiased_pass_at_k(4, 1, 5)


def outcomes(*rewards):
    """Per question, its samples' rewards in sampling order (what aggregate_pass_at_k reads)."""
    return [SimpleNamespace(rewards=list(r)) for r in rewards]


# Three questions of 4 samples: A = [0, 1, 0, 0] (c = 1), B = [1, 1, 0, 0] (c = 2), C = [0, 0, 0, 0].
#   "any": a correct one among the first k samples. A: 0, 1, 1, 1; B: 1, 1, 1, 1; C: 0, 0, 0, 0
#          -> (1/3, 2/3, 2/3, 2/3)
#   unbiased: A (c = 1): 1/4, 1/2, 3/4, 1; B (c = 2): 1/2, 5/6, 1, 1; C: 0
#          -> ((1/4 + 1/2) / 3, (1/2 + 5/6) / 3, (3/4 + 1) / 3, 2/3) = (1/4, 4/9, 7/12, 2/3)
QUESTIONS = ([0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0])
ANY = [F(1, 3), F(2, 3), F(2, 3), F(2, 3)]
UNBIASED_MEAN = [F(1, 4), F(4, 9), F(7, 12), F(2, 3)]


def assert_pass_at_k(got, num_questions, any_, unbiased):
    assert got.num_questions == num_questions
    assert got.any == pytest.approx([float(v) for v in any_], abs=1e-12)
    assert got.unbiased == pytest.approx([float(v) for v in unbiased], abs=1e-12)


def test_aggregate_over_questions_by_hand():
    got = aggregate_pass_at_k(outcomes(*QUESTIONS), 4)
    assert_pass_at_k(got, 3, ANY, UNBIASED_MEAN)
    assert got.as_dict() == {**{f"pass@{k}": got.any[k - 1] for k in range(1, 5)},
                             **{f"pass@{k}_unbiased": got.unbiased[k - 1] for k in range(1, 5)}}
    assert got.as_dict("val/")["val/pass@2_unbiased"] == pytest.approx(4 / 9)


def test_aggregate_of_no_question_is_zero():
    assert_pass_at_k(aggregate_pass_at_k([], 2), 0, [0, 0], [0, 0])


RANK_WORKER = """
import json, sys
import torch.distributed as dist
from types import SimpleNamespace
from nanochat.rl.evaluation import aggregate_pass_at_k
dist.init_process_group("gloo")
results = []
for shares in json.loads(sys.argv[1]):
    got = aggregate_pass_at_k([SimpleNamespace(rewards=r) for r in shares[dist.get_rank()]], 4)
    results.append({"num_questions": got.num_questions, "any": got.any, "unbiased": got.unbiased})
print(json.dumps(results))
dist.destroy_process_group()
"""

LAYOUTS = [
    [QUESTIONS[:2], QUESTIONS[2:]],  # uneven: the ranks' own pass@1 are 1/2 and 0, whose plain mean 1/4 is wrong
    [[], list(QUESTIONS)],           # a rank without questions (fewer eval questions than ranks)
]


def test_aggregate_over_two_gloo_ranks_by_hand():
    """Each rank holds some of the three questions; the counts are summed over ranks, so every rank gets the
    pass@k of the three questions together, for each layout of LAYOUTS."""
    layouts = json.dumps([[list(share) for share in layout] for layout in LAYOUTS])
    outputs = run_ranks(lambda rank: ["-c", RANK_WORKER, layouts], timeout=120)
    for out, _ in outputs:
        results = json.loads(out.strip().splitlines()[-1])
        assert len(results) == len(LAYOUTS)
        for got in results:
            assert_pass_at_k(SimpleNamespace(**got), 3, ANY, UNBIASED_MEAN)


SCRIPTED_EVAL_FLAGS = ["--task=rl_toy_task:ScriptedEval", "--num-samples=4", "--max-new-tokens=3", "--device-type=cpu",
                      "--dtype=float32"]


def check_scripted_eval_report(result):
    """chat_eval's report on rl_toy_task.ScriptedEval (6 test questions graded from a table: greedy, then 4 samples):
    greedy pass@1 = (1+0+0+1+0+1)/6 = 1/2. Samples per question: q0 1000, q1 1111, q2 0000, q3 0001, q4 0100, q5 1000.
    Any of the first k: k=1 q0 q1 q5 = 3/6; k=2 + q4 = 4/6; k=3 the same 4/6; k=4 + q3 = 5/6. Unbiased, n=4 (order
    does not matter): four questions with c=1 give k/4, q1 gives 1, q2 gives 0: (4 * k/4 + 1) / 6 = 1/3, 1/2, 2/3, 5/6.
    Nothing compiled (--compile=auto on a CPU)."""
    assert result["num_questions"] == 6 and result["num_samples"] == 4
    assert result["greedy_pass@1"] == pytest.approx(1 / 2, abs=1e-12)
    assert result["pass@k"] == pytest.approx({"1": 3 / 6, "2": 4 / 6, "3": 4 / 6, "4": 5 / 6}, abs=1e-12)
    assert result["pass@k_unbiased"] == pytest.approx({"1": 1 / 3, "2": 1 / 2, "3": 2 / 3, "4": 5 / 6}, abs=1e-12)
    assert (result["compile"], result["compiles"], result["compile_s"]) == ("off", 0, 0.0)


def test_chat_eval_reports_the_pass_at_k_worked_out_by_hand(sft, base_dir, capsys):
    """chat_eval end to end (check_scripted_eval_report)."""
    from nanochat.cli import run_main
    from scripts import chat_eval
    out = base_dir / "eval.json"
    run_main(chat_eval.main, SCRIPTED_EVAL_FLAGS + [f"--output={out}"])
    check_scripted_eval_report(json.loads(out.read_text()))
    printed = capsys.readouterr().out
    assert "greedy pass@1: 0.5000 on 6 questions" in printed



def test_chat_eval_refuses_an_output_it_cannot_write_before_any_question(sft, base_dir, capsys):
    """Regression (issue 74): an --output under a regular file ended chat_eval with a traceback (FileExistsError), once
    every question had been sampled; now one line, exit 2, before the model loads."""
    from nanochat.cli import run_main
    from scripts import chat_eval
    blocker = base_dir / "results"
    blocker.write_text("a file where a folder should be")
    with pytest.raises(SystemExit) as e:
        run_main(chat_eval.main, SCRIPTED_EVAL_FLAGS + [f"--output={blocker / 'eval.json'}"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err == (f"error: cannot write the results to {blocker}: it is a file, not a folder; "
                                         f"pass --output=<a writable path>\n")
    assert out == ""

@pytest.mark.slow
def test_chat_eval_on_two_gloo_ranks_reports_what_one_process_does(sft, base_dir, monkeypatch):
    """chat_eval under torchrun: each of 2 ranks samples half of the questions, the counts and the compile record
    are reduced over the ranks, and rank 0 writes the report one process writes (check_scripted_eval_report)."""
    from helpers import PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)  # the ranks import rl_toy_task from tests/
    out = base_dir / "eval.json"
    run_ranks(lambda rank: ["-m", "scripts.chat_eval", *SCRIPTED_EVAL_FLAGS, f"--output={out}"])
    check_scripted_eval_report(json.loads(out.read_text()))
