"""
The Task base: a dataset of conversations with a way to score a model's answer.

A conversation is `{"messages": [{"role": "user", "content": str}, {"role": "assistant", "content": str | parts}]}`
where parts is a list of `{"type": "text" | "python" | "python_output", "text": str}`.

Subclasses implement `num_examples()`, `get_example(i)`, `evaluate(conversation, response) -> int` and,
for RL, `reward(conversation, response) -> float`. The base adds `start/stop/step` slicing so that
`task[i]` and `len(task)` see only the selected examples.

`FinalAnswerTask` grades as GSM8K does, on the number after "#### " (`extract_answer`); GSM8K and the
arithmetic task both derive from it.
"""

import re

ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(text):
    """The number after the first "#### ", commas removed ("#### 1,234" -> "1234"); None if there is none."""
    match = ANSWER_RE.search(text)
    if match is None:
        return None
    return match.group(1).strip().replace(",", "")


class Task:
    """A sliced view over a subclass's examples: task[i] is example start + i*step, for i < len(task)."""

    def __init__(self, start=0, stop=None, step=1):
        if start < 0 or step < 1 or (stop is not None and stop < start):
            raise ValueError(f"bad task slice start={start} stop={stop} step={step}: need 0 <= start <= stop and step >= 1")
        self.start, self.stop, self.step = start, stop, step

    @property
    def eval_type(self):
        """'generative' (sample an answer and check it) or 'categorical' (pick among choices)."""
        raise NotImplementedError

    def num_examples(self):
        raise NotImplementedError

    def get_example(self, index):
        raise NotImplementedError

    def evaluate(self, conversation, assistant_response):
        raise NotImplementedError

    def reward(self, conversation, assistant_response):
        """RL reward; by default 1.0 for a correct answer, else 0.0."""
        return float(self.evaluate(conversation, assistant_response))

    def __len__(self):
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, -(-(stop - self.start) // self.step))

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(f"task index {index} out of range for {len(self)} examples")
        return self.get_example(self.start + index * self.step)


class FinalAnswerTask(Task):
    """A generative task whose reference (the last message, the assistant's list of parts) ends in "#### N":
    a response scores 1 when its first "#### N" equals the reference's, compared as strings ("18" != "18.0")."""

    @property
    def eval_type(self):
        return "generative"

    def evaluate(self, conversation, assistant_response):
        reference = conversation["messages"][-1]
        if reference["role"] != "assistant" or not isinstance(reference["content"], list):
            raise ValueError(f"{type(self).__name__}.evaluate expects a conversation whose last message is the "
                             "assistant's list of parts")
        ref_answer = extract_answer(reference["content"][-1]["text"])
        pred_answer = extract_answer(assistant_response)
        return int(pred_answer is not None and pred_answer == ref_answer)
