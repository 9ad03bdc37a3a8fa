"""How a problem becomes a prompt, and what a correct completion looks like.

* ``plain``: ``Question: <q>\\nAnswer:`` -- the completion is `` <answer>`` then EOS. Optional few-shot
  examples (``data.few_shot``, the first training problems) precede it in the same form. The project-built
  tiny model is trained on exactly this form.
* ``compact``: ``<q> =`` -- half the prompt tokens of ``plain``. Training cost on CPU grows with prompt
  length (every sample repeats its prompt), so short prompts buy more RL steps per minute.
* ``chat``: the tokenizer's chat template around the question plus an instruction to end with
  ``#### <answer>``, for instruct models such as SmolLM2-135M-Instruct.

One :class:`PromptBuilder` per run turns problems into prompts everywhere -- the base-model recipe,
training, the evaluate stage and the evaluation of training snapshots -- so they can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Tuple

from bidirl.config import DataConfig
from bidirl.data import Problem, load_problems

CHAT_INSTRUCTION = "Solve the problem. End your reply with '#### ' followed by the final number."


def format_prompt(problem: Problem, style: str, tokenizer: Any = None, shots: Sequence[Problem] = ()) -> str:
    if style == "chat":
        messages = []
        for shot in shots:
            messages.append({"role": "user", "content": f"{shot.question}\n{CHAT_INSTRUCTION}"})
            messages.append({"role": "assistant", "content": f"#### {shot.answer}"})
        messages.append({"role": "user", "content": f"{problem.question}\n{CHAT_INSTRUCTION}"})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if style == "compact":
        examples = "".join(f"{s.question} = {s.answer}\n" for s in shots)
        return f"{examples}{problem.question} ="
    examples = "".join(f"Question: {s.question}\nAnswer: {s.answer}\n\n" for s in shots)
    return f"{examples}Question: {problem.question}\nAnswer:"


@dataclass(frozen=True)
class PromptBuilder:
    """The run's one way of writing a prompt: style, tokenizer (for chat templates) and few-shot examples."""

    style: str
    tokenizer: Any = None
    shots: Tuple[Problem, ...] = ()

    @classmethod
    def for_run(cls, data: DataConfig, tokenizer: Any = None) -> "PromptBuilder":
        shots = tuple(load_problems(data, "train")[: data.few_shot]) if data.few_shot else ()
        return cls(data.prompt_style, tokenizer, shots)

    def __call__(self, problem: Problem) -> str:
        return format_prompt(problem, self.style, self.tokenizer, self.shots)


def target_completion(problem: Problem, style: str = "answer") -> str:
    """The completion a supervised base model learns (EOS added by the caller): the answer alone
    (``" 17"``), or with ``style="worked"`` the problem's worked steps first when it has them
    (``" 4+6=10, 10+7=17 #### 17"``): longer responses, whose length grows with the problem's size."""
    if style == "worked" and problem.solution:
        return f" {problem.solution} #### {problem.answer}"
    return f" {problem.answer}"
