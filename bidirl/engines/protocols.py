"""The two engine protocols, exactly as the runtime, the evaluation and the experiments use them.

A :class:`RolloutEngine` turns prompts into :class:`~bidirl.samples.Sample` objects (token ids,
behaviour log-probs, the version that produced them). A :class:`TrainEngine` turns samples into
gradients and optimizer steps and hands out its weights for rollout engines to load. Engines are
chosen once by name (:mod:`bidirl.engines`); callers only ever use what is written here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from bidirl.samples import Sample, SamplingParams


@dataclass(frozen=True)
class RolloutSite:
    """Where a rollout engine runs and within what memory, fixed at construction (``rollout.*`` keys).

    ``device_type`` "cuda": the worker's one visible GPU (``cuda:0``), vLLM with CUDA graphs; "cpu":
    eager. The memory keys bound vLLM on a GPU beside the resident trainer (see ``RolloutConfig``)."""

    device_type: str = "cpu"
    gpu_memory_utilization: float = 0.35
    max_model_len: int = 0  # 0: the model's own limit
    max_num_seqs: int = 256


class RolloutEngine(Protocol):
    tokenizer: Any  # the model's tokenizer (chat templates, prompt encoding)
    version: int  # policy version of the weights it serves; update_weights sets it

    def generate(self, prompts: Sequence[str], params: SamplingParams, handover: Optional["HandOver"] = None,
                 done: Optional[Callable[[List[Sample]], None]] = None) -> List[Sample]:
        """``params.n`` samples per prompt, in prompt order. With ``handover``, another thread may ask,
        while this runs, for some prompt groups to be stopped and handed over mid-generation (in-flight
        migration): between two decode steps the engine stops them and gives their samples so far to
        ``handover`` (finished ones whole, the rest with ``finished=False``, to be continued elsewhere
        with :meth:`continue_samples`); it returns only the groups it kept. With ``done``, an engine that
        can tell when a group's last sample ends (continuous batching: vLLM) calls it with that group's
        samples at once, and neither returns nor hands over that group afterwards; one that cannot (a
        static batch: HF ``generate``) returns every group at the end, as without it."""
        ...

    def serve(self, joins: Callable[[], Optional["Generation"]]) -> None:
        """Runs every :class:`Generation` that ``joins`` hands it, each reported through its own ``done``,
        hand-over window and ``over``, until ``joins`` has none and nothing runs. An engine that batches
        continuously (vLLM) polls ``joins`` between two decode steps, so a generation that comes while
        others decode joins their running batch (the slots of requests that ended take new ones); one that
        cannot (HF: static batches) runs them one after the other, polling when each is over."""
        ...

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


@dataclass
class Generation:
    """One chunk's prompts for :meth:`RolloutEngine.serve`: as a ``generate`` call's, with ``over`` called
    once its last request has ended (or been handed over), with its samples not given to ``done`` or to
    the hand-over window, in prompt order (``Sample.prompt_index``: the index in ``prompts``)."""

    prompts: Sequence[str]
    params: SamplingParams
    over: Callable[[List[Sample]], None]
    handover: Optional["HandOver"] = None
    done: Optional[Callable[[List[Sample]], None]] = None
    # set by an engine that batches continuously: it came in while another generation's requests decoded
    # (joined), or its requests shared decode steps with another's at some point (shared: its time is not
    # its own)
    joined: bool = False
    shared: bool = False


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


class HandOver:
    """Prompt groups asked for by another thread while an engine generates them (in-flight migration).

    The asking thread calls :meth:`ask` (how many groups, and what to do with their samples); the
    engine polls :meth:`wanted` between decode steps -- the only points where a request can stop with
    every token it has so far, each with its behaviour log-prob -- and calls :meth:`give` once per ask,
    in order. Groups with requests still running go first (that is the tail worth moving), then
    finished ones. :meth:`close` ends the window: an ask that comes later (the groups finished first)
    is refused, and the caller settles it from the engine's own result instead."""

    def __init__(self, deliver: Callable[[Any, List[int], List[Sample]], None]):
        self.deliver = deliver  # (the ask's tag, prompt indices handed over, their samples)
        self._lock = threading.Lock()
        self._asked: List[Tuple[int, Any]] = []  # (groups, tag) not yet polled
        self._answering: List[Any] = []  # tags polled, not yet answered, in order
        self._open = True

    def ask(self, groups: int, tag: Any = None) -> bool:
        """Ask for ``groups`` groups; ``tag`` comes back with the answer (False: refused, too late)."""
        with self._lock:
            if self._open:
                self._asked.append((groups, tag))
            return self._open

    def pending(self) -> bool:
        with self._lock:
            return bool(self._asked)

    def wanted(self) -> List[int]:
        """Asks not yet answered (group counts, oldest first); the engine answers each with ``give``."""
        with self._lock:
            asked, self._asked = self._asked, []
            self._answering += [tag for _, tag in asked]
            return [groups for groups, _ in asked]

    def give(self, prompt_indices: List[int], samples: List[Sample]) -> None:
        self.deliver(self._answering.pop(0), prompt_indices, samples)

    def close(self) -> None:
        """Generation is over: later asks are refused (and asks not yet polled are dropped)."""
        with self._lock:
            self._open = False
            self._asked = []
