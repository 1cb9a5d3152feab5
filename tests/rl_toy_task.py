"""A user-style task (the `--task=package.module:ClassName` interface) with a reward a random tiny model
earns about half of the time, so tests of the RL loop see non-zero advantages."""

import os

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
