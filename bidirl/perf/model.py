"""The one interface every performance model offers, whatever its source.

Two sources implement it: :class:`~bidirl.perf.analytic.PerfModel` (analytic, for hardware we do not
have, calibrated on public figures) and :class:`~bidirl.perf.fitted.FittedModel` (fitted from a
profile measured on the user's own devices by ``bidirl profile``). The simulator, the planner and the
cost gates of the cost-aware policies use only what is written here. All times are seconds on one
device of the kind modelled.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple


class PerformanceModel(Protocol):
    # rollout: one engine instance of ``instance_devices`` devices (tensor parallel; 1 = a device each)
    def decode_line(self, context: float, instance_devices: int = 1) -> Tuple[float, float]:
        """(a, b): one decode step of B running sequences of mean context ``context`` takes a + b * B."""
        ...

    def prefill_seconds_per_token(self, instance_devices: int = 1) -> float: ...

    def request_overhead_seconds(self) -> float:
        """Seconds each request costs its device beyond its prefill and decode steps: the engine's per-request
        work, scoring the answer, and carrying the sample to the controller."""
        ...

    def max_concurrency(self, context: float, instance_devices: int = 1) -> int:
        """Sequences of that context the instance's KV cache holds at once."""
        ...

    def warmup_seconds(self, stage: str) -> float:
        """Seconds a device's first use of ``stage`` ("rollout" or "train") takes beyond the same work
        warm: a fresh engine's first call (allocations, kernel selection) -- charged once per device."""
        ...

    def decode_slowdown_beside_training(self) -> float:
        """How much slower decoding runs while another device of the same host trains (1.0 where devices
        do not share a host's memory bandwidth and caches, as GPUs do not)."""
        ...

    def decode_slowdown_beside_decoding(self) -> float:
        """How much slower decoding runs while another device of the same host decodes too (1.0 where
        devices do not share a host)."""
        ...

    # training
    def train_compute_seconds(self, tokens: float, recompute_logprob: Optional[bool] = None) -> float:
        """Device-seconds of gradient work for ``tokens`` (prompt + response), shared by data-parallel devices."""
        ...

    def allreduce_seconds(self, devices: int) -> float: ...

    def micro_batch_overhead_seconds(self) -> float:
        """Seconds each pulled micro-batch costs its device beyond its gradient work (the round trip of
        its command and reply)."""
        ...

    def step_overhead_seconds(self) -> float:
        """Seconds a train step's finish costs beyond its all-reduce and optimizer step (checks, the
        gradient gather, the finish command's round trip)."""
        ...

    def gradient_return_seconds(self, devices: int) -> float:
        """``devices`` lent trainers' gradients sent to the primary, one after another."""
        ...

    # weights and roles
    def sync_seconds(self, devices: int) -> float:
        """Publishing a version to ``devices`` staging buffers (in the background)."""
        ...

    def load_seconds(self) -> float:
        """Applying staged weights in a rollout engine."""
        ...

    def train_state_seconds(self) -> float:
        """The primary's training state (weights and optimizer moments) sent to a device joining the pool."""
        ...

    def switch_seconds(self, to: str = "", instance_devices: int = 1) -> float:
        """One role switch into ``to`` ("rollout" or "train"; "" = either) of an instance of
        ``instance_devices`` devices, all switching at once."""
        ...
