"""Held-out greedy accuracy on problems with numeric answers, scored by :func:`bidirl.reward.numeric_reward`.

* :func:`engine_accuracy` decodes through any :class:`~bidirl.engines.protocols.RolloutEngine` (vLLM or
  transformers): the evaluate stage and the periodic evaluation during RL use it.
* :func:`greedy_accuracy` decodes with a bare transformers model in memory (left-padded KV-cache
  ``generate``): for a model that is not saved yet (the tiny base model right after its SFT) and for
  peers such as TRL that hold their own model object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

from bidirl.data import Problem
from bidirl.reward import numeric_reward
from bidirl.samples import stop_token_ids


@dataclass
class EvalResult:
    accuracy: float
    num_problems: int
    examples: List[dict] = field(default_factory=list)  # a few (question, completion, reference) rows


def engine_accuracy(
    engine: Any,
    problems: Sequence[Problem],
    prompts: Sequence[str],
    max_new_tokens: int,
    chunk: int = 256,
    on_batch: Optional[Callable[[int], None]] = None,
) -> EvalResult:
    from bidirl.samples import SamplingParams

    greedy = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
    texts: List[str] = []
    for start in range(0, len(prompts), chunk):
        texts += [s.text for s in engine.generate(prompts[start : start + chunk], greedy)]
        if on_batch:
            on_batch(len(prompts[start : start + chunk]))
    return _score(problems, texts)


def _score(problems: Sequence[Problem], completions: Sequence[str]) -> EvalResult:
    correct, examples = 0.0, []
    for problem, completion in zip(problems, completions):
        reward = numeric_reward(completion, problem.answer)
        correct += reward
        if len(examples) < 5:
            examples.append({"question": problem.question, "completion": completion,
                             "reference": problem.answer, "reward": reward})
    return EvalResult(correct / max(1, len(problems)), len(problems), examples)


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
    completions: List[str] = []
    for start in range(0, len(problems), batch_size):
        batch = problems[start : start + batch_size]
        completions += _greedy(model, tokenizer, [prompt_fn(p) for p in batch], max_new_tokens, torch)
        if on_batch:
            on_batch(len(batch))
    return _score(problems, completions)


def _greedy(model: Any, tokenizer: Any, prompts: List[str], max_new_tokens: int, torch: Any) -> List[str]:
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop_token_ids(model.generation_config, tokenizer.eos_token_id),  # (as the engines stop)
        )
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
