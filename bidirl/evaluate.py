"""Held-out greedy accuracy of a causal LM on problems with numeric answers.

Batched greedy decoding with transformers' KV-cache ``generate`` (left padding), answers scored by
:func:`bidirl.reward.numeric_reward`. Used to report a base model's quality and, during RL, the
periodic held-out evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

from bidirl.data import Problem
from bidirl.reward import numeric_reward


@dataclass
class EvalResult:
    accuracy: float
    num_problems: int
    examples: List[dict] = field(default_factory=list)  # a few (question, completion, reference) rows


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    prompt_fn: Callable[[Problem], str],
    max_new_tokens: int,
    batch_size: int = 64,
    on_batch: Optional[Callable[[int], None]] = None,
) -> EvalResult:
    import torch

    model.eval()
    correct, examples = 0.0, []
    for start in range(0, len(problems), batch_size):
        batch = problems[start : start + batch_size]
        completions = _greedy(model, tokenizer, [prompt_fn(p) for p in batch], max_new_tokens, torch)
        for problem, completion in zip(batch, completions):
            reward = numeric_reward(completion, problem.answer)
            correct += reward
            if len(examples) < 5:
                examples.append({"question": problem.question, "completion": completion,
                                 "reference": problem.answer, "reward": reward})
        if on_batch:
            on_batch(len(batch))
    return EvalResult(correct / max(1, len(problems)), len(problems), examples)


def _greedy(model: Any, tokenizer: Any, prompts: List[str], max_new_tokens: int, torch: Any) -> List[str]:
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
