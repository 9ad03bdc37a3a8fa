"""Coarse instances: the performance of a unit of k devices that the scheduler moves as one.

With ``cluster.instance_devices: k`` every scheduling unit is k devices: a rollout unit runs one
engine tensor-parallel over its k devices (the analytic model's ``instance_devices``: 1/k of the
weights and KV heads per device, two all-reduces per layer, the KV cache of all k), and a train unit
is k data-parallel devices with their training state sharded. The bookkeeping sees one device per
unit, so a lease lends a whole instance and a switch switches its k devices together. Times for a
unit, each from the one-device model (nothing new is fitted):

    train work            device-seconds / k            the unit's k devices share it
    all-reduce over n     the one-device ring over n*k devices
    gradient return       the one-device figure / k     each device sends its 1/k shard, in parallel
    training state        the one-device figure / k     likewise
    switch                fixed + weight bytes / k / host bandwidth   each device moves its 1/k
    weight publish        to n*k devices

A profile measures one-device instances only (:class:`~bidirl.perf.fitted.FittedModel` refuses k > 1).
"""

from __future__ import annotations

from typing import Optional, Tuple

from bidirl.perf.model import PerformanceModel


class InstanceModel:
    """:class:`~bidirl.perf.model.PerformanceModel` of a k-device unit, from a one-device model."""

    def __init__(self, perf: PerformanceModel, devices: int):
        self.perf, self.k = perf, devices

    def __repr__(self) -> str:  # a stable key for the simulator's memoised bound
        return f"InstanceModel({self.perf!r}, {self.k})"

    def decode_line(self, context: float, instance_devices: int = 1) -> Tuple[float, float]:
        return self.perf.decode_line(context, instance_devices * self.k)

    def prefill_seconds_per_token(self, instance_devices: int = 1) -> float:
        return self.perf.prefill_seconds_per_token(instance_devices * self.k)

    def request_overhead_seconds(self) -> float:
        return self.perf.request_overhead_seconds()

    def warmup_seconds(self, stage: str) -> float:
        return self.perf.warmup_seconds(stage)

    def micro_batch_overhead_seconds(self) -> float:
        return self.perf.micro_batch_overhead_seconds()

    def step_overhead_seconds(self) -> float:
        return self.perf.step_overhead_seconds()

    def max_concurrency(self, context: float, instance_devices: int = 1) -> int:
        return self.perf.max_concurrency(context, instance_devices * self.k)

    def decode_slowdown_beside_training(self) -> float:
        return self.perf.decode_slowdown_beside_training()

    def decode_slowdown_beside_decoding(self) -> float:
        return self.perf.decode_slowdown_beside_decoding()

    def train_compute_seconds(self, tokens: float, recompute_logprob: Optional[bool] = None) -> float:
        return self.perf.train_compute_seconds(tokens, recompute_logprob) / self.k

    def allreduce_seconds(self, devices: int) -> float:
        return self.perf.allreduce_seconds(devices * self.k)

    def gradient_return_seconds(self, devices: int) -> float:
        return self.perf.gradient_return_seconds(devices) / self.k

    def sync_seconds(self, devices: int) -> float:
        return self.perf.sync_seconds(devices * self.k)

    def load_seconds(self) -> float:
        return self.perf.load_seconds()

    def train_state_seconds(self) -> float:
        return self.perf.train_state_seconds() / self.k

    def switch_seconds(self, to: str = "") -> float:
        return self.perf.switch_seconds(to, instance_devices=self.k)
