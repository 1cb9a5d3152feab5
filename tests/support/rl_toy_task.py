"""A user-style task (the `--task=package.module:ClassName` interface) with a reward a random tiny model
earns about half of the time, so tests of the RL loop see non-zero advantages."""

import os
import time

from tasks.arithmetic import Arithmetic


class ParityTask:
    """Questions 'q0'..'qN'; reward 1.0 when the response has an even number of characters."""

    def __init__(self, split="train"):
        self.questions = [f"question {i}" for i in range(16 if split == "train" else 6)]

    def __len__(self):
        return len(self.questions)

    def __getitem__(self, i):
        return {"messages": [{"role": "user", "content": self.questions[i]},
                             {"role": "assistant", "content": "even"}]}

    def evaluate(self, conversation, response_text):
        return int(len(response_text) % 2 == 0)

    def reward(self, conversation, response_text):
        return float(self.evaluate(conversation, response_text))



class HalfSilentParity(ParityTask):
    """ParityTask whose odd questions earn nothing, whatever the answer: they never have a reward signal (for
    --dynamic-sampling, which draws more questions until a step has enough with one)."""

    def reward(self, conversation, response_text):
        index = int(conversation["messages"][0]["content"].split()[-1])
        return 0.0 if index % 2 else super().reward(conversation, response_text)


class FourSilentQuestions(ParityTask):
    """ParityTask cut to 4 train questions, none of which ever earns anything: with --dynamic-sampling and
    --examples-per-step=4 every draw of a step walks the whole split, so each draw after the first samples every
    question again (the draws never find a signal, so all --dynamic-sampling-rounds are drawn)."""

    def __init__(self, split="train"):
        super().__init__(split)
        self.questions = self.questions[:4]

    def reward(self, conversation, response_text):
        return 0.0


class ScriptedParity(ParityTask):
    """ParityTask graded from a hand-written table instead of the text: the k-th grading of question i (counted
    per process) is outcome(i, k), whatever the model wrote: here OUTCOMES[i][k % 4] (4 samples), and 0 for questions
    without an entry. Held-out pass@1 of the last 6 questions, by hand: (1 + 2 + 0 + 4 + 1 + 3) / 24 = 11/24; of the
    even positions among them (questions 10, 12, 14): (1 + 0 + 1) / 12 = 1/6."""
    OUTCOMES = {10: [1, 0, 0, 0], 11: [1, 1, 0, 0], 12: [0, 0, 0, 0], 13: [1, 1, 1, 1], 14: [0, 1, 0, 0], 15: [1, 1, 1, 0]}

    def __init__(self, split="train"):
        super().__init__(split)
        self.graded = {}

    def outcome(self, i, k):
        return self.OUTCOMES.get(i, [0] * 4)[k % 4]

    def evaluate(self, conversation, response_text):
        i = self.questions.index(conversation["messages"][0]["content"])
        k = self.graded.get(i, 0)
        self.graded[i] = k + 1
        return self.outcome(i, k)


class ScriptedEval(ScriptedParity):
    """ScriptedParity's table for chat_eval, which grades each test question once greedily, then its samples in
    order: OUTCOMES[i] = [greedy, sample 0, sample 1, ...]. The pass@k these give are worked out by hand in
    tests/rl/test_pass_at_k.py."""
    OUTCOMES = {0: [1, 1, 0, 0, 0], 1: [0, 1, 1, 1, 1], 2: [0, 0, 0, 0, 0], 3: [1, 0, 0, 0, 1], 4: [0, 0, 1, 0, 0],
                5: [1, 1, 0, 0, 0]}

    def __init__(self, split="test"):
        super().__init__(split)

    def outcome(self, i, k):
        return self.OUTCOMES[i][k]


class GatedParityTask(ParityTask):
    """ParityTask whose rewards wait until the file $GATE_FILE exists, when that variable is set: a test holds every
    rank inside step 0, before its stop check, signals them, then opens the gate, so the step a signal lands in is
    known, not raced."""

    def reward(self, conversation, response_text):
        gate = os.environ.get("GATE_FILE")
        while gate and not os.path.exists(gate):
            time.sleep(0.01)
        return super().reward(conversation, response_text)


class OneStepArithmetic(Arithmetic):
    """The arithmetic task at difficulty 1 (one calculator call), as --task=rl_toy_task:OneStepArithmetic: small
    enough for a 2-layer model to reach partial credit after seconds of SFT (the learning test)."""

    def __init__(self, split="train"):
        super().__init__(split=split, difficulty=1)


class RecordedParityTask(ParityTask):
    """ParityTask that writes down which questions a run trains on: the index of every question it rewards is
    appended to $QUESTION_LOG.rank<RANK> (one line per reward, so a question's samples give consecutive lines)."""

    def reward(self, conversation, response_text):
        path = os.environ.get("QUESTION_LOG")
        if path:
            with open(f"{path}.rank{os.environ.get('RANK', '0')}", "a") as f:
                f.write(conversation["messages"][0]["content"].split()[-1] + "\n")
        return super().reward(conversation, response_text)
