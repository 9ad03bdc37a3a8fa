"""How a problem becomes a prompt, and what a correct completion looks like.

* ``plain``: ``Question: <q>\\nAnswer:`` -- the completion is `` <answer>`` then EOS. Optional few-shot
  examples precede it in the same form. The project-built tiny model is trained on exactly this form.
* ``compact``: ``<q> =`` -- half the prompt tokens of ``plain``. Training cost on CPU grows with prompt
  length (every sample repeats its prompt), so short prompts buy more RL steps per minute.
* ``chat``: the tokenizer's chat template around the question plus an instruction to end with
  ``#### <answer>``, for instruct models such as SmolLM2-135M-Instruct.
"""

from __future__ import annotations

from typing import Any, Sequence

from bidirl.data import Problem

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


def target_completion(problem: Problem) -> str:
    """The completion a supervised base model learns for a ``plain`` prompt (EOS added by the caller)."""
    return f" {problem.answer}"
