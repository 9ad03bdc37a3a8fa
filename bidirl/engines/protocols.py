"""The two engine protocols, exactly as the runtime, the evaluation and the experiments use them.

A :class:`RolloutEngine` turns prompts into :class:`~bidirl.samples.Sample` objects (token ids,
behaviour log-probs, the version that produced them). A :class:`TrainEngine` turns samples into
gradients and optimizer steps and hands out its weights for rollout engines to load. Engines are
chosen once by name (:mod:`bidirl.engines`); callers only ever use what is written here.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Protocol, Sequence

from bidirl.samples import Sample, SamplingParams


class RolloutEngine(Protocol):
    tokenizer: Any  # the model's tokenizer (chat templates, prompt encoding)
    version: int  # policy version of the weights it serves; update_weights sets it

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> List[Sample]: ...

    def continue_samples(self, partial: Sequence[Sample], params: SamplingParams) -> List[Sample]:
        """Continues each unfinished sample -- a request stopped mid-generation, here or on another engine
        (in-flight migration): re-prefills its prompt and tokens so far and generates until EOS or
        ``params.max_new_tokens`` tokens in all (``params.n`` is ignored: one continuation each). Returns
        the samples whole, in order: their tokens and behaviour log-probs so far unchanged, nothing
        generated twice, the new tokens appended with this engine's version (:meth:`Sample.continued`)."""
        ...

    def update_weights(self, state: Dict[str, Any], version: int) -> float:
        """Loads a full weight set in place and serves ``version`` from now on; returns the seconds it took."""
        ...


class TrainEngine(Protocol):
    tokenizer: Any
    version: int  # optimizer steps applied; a worker that loads published weights sets it

    def compute_grads(self, batch: Sequence[Sample], total_tokens: int, total_sequences: int) -> Dict[str, float]:
        """Accumulates gradients of ``batch``, scaled as a part of a batch of ``total_tokens`` tokens in
        ``total_sequences`` sequences (so parts computed on several devices add up)."""
        ...

    def apply_grads(self) -> Dict[str, float]:
        """One optimizer step on the accumulated gradients; the version advances by one."""
        ...

    def step(self, batch: Sequence[Sample]) -> Dict[str, float]:
        """``compute_grads`` and ``apply_grads`` on one whole batch (single-device use)."""
        ...

    def zero_grads(self) -> None:
        """Drops accumulated gradients without stepping (a lent device that only contributes them)."""
        ...

    def parameters(self) -> List[Any]:
        """The trainable tensors, in a fixed order (flattened for gradient reduction and weight transfer)."""
        ...

    def logprobs(self, batch: Sequence[Sample]) -> List[List[float]]: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def training_state(self) -> Dict[str, Any]:
        """Everything an identical optimizer replica needs, in memory: weights, optimizer and schedule
        state, version (what the primary hands a device that joins the train pool for good)."""
        ...

    def adopt_training_state(self, state: Dict[str, Any]) -> None:
        """Becomes the replica ``state`` describes (from :meth:`training_state` on another device)."""
        ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...


class PauseGate:
    """Mixin for rollout engines: ``pause`` makes the next ``wait_if_paused`` block until ``resume``.

    Work already in flight finishes; the engine checks the gate before each new chunk of generation.
    Not part of the protocol: no scheduler pauses an engine yet (loads happen between commands).
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
