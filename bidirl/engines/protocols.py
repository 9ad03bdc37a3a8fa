"""The two engine protocols every runtime mode uses, and the sample they exchange.

A :class:`RolloutEngine` turns prompts into :class:`Sample` objects that carry everything the trainer
needs to correct for staleness: the token ids, the behaviour policy's per-token log-probs and the
policy version that produced them. A :class:`TrainEngine` turns batches of samples into gradients and
optimizer steps, and hands out its weights for synchronisation to rollout engines.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Sequence


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (the GRPO group size)
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: Optional[int] = None


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


class RolloutEngine(Protocol):
    version: int

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> List[Sample]: ...

    def update_weights(self, state: Dict[str, Any], version: int) -> float:
        """Loads a full weight set in place; returns the seconds it took."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class TrainEngine(Protocol):
    version: int

    def compute_grads(self, batch: Sequence[Sample]) -> Dict[str, float]: ...

    def apply_grads(self) -> Dict[str, float]: ...

    def step(self, batch: Sequence[Sample]) -> Dict[str, float]: ...

    def logprobs(self, batch: Sequence[Sample]) -> List[List[float]]: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...


class PauseGate:
    """Mixin for rollout engines: ``pause`` makes the next ``wait_if_paused`` block until ``resume``.

    Work already in flight finishes; the engine checks the gate before each new chunk of generation.
    """

    def __init__(self) -> None:
        self._running_gate = threading.Event()
        self._running_gate.set()

    def wait_if_paused(self) -> None:
        self._running_gate.wait()

    def pause(self) -> None:
        self._running_gate.clear()

    def resume(self) -> None:
        self._running_gate.set()
