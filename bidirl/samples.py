"""What a rollout engine produces and a trainer consumes: the ground-floor data types.

A :class:`Sample` carries everything the trainer needs to correct for staleness: the token ids, the
behaviour policy's per-token log-probs and the policy version that produced them. Imports nothing
from bidirl, so every layer (engines, GRPO, the runtime's messages) can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (the GRPO group size)
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: Optional[int] = None
    ignore_eos: bool = False  # always generate max_new_tokens (profiling decode steps at a known length)


@dataclass
class Sample:
    prompt_index: int  # which prompt of the request this sample answers
    prompt_ids: List[int]
    completion_ids: List[int]
    text: str
    logprobs: List[float]  # behaviour log-prob of each completion token (at the sampling temperature)
    version: int  # policy version of the weights that generated it
    finished: bool = True  # ended with EOS (False: cut at max_new_tokens)
    reward: float = 0.0
    advantage: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)
