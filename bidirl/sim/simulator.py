"""The discrete-event driver: a heap of (time, seq, event); policies decide, cost models time the work.

    push Started at t=0
    while heap:                                  # a dozen lines, vidur-style
        t, _, event = pop()
        cluster.now = t; cluster.complete(event)  # shared bookkeeping (skipped for Started)
        for action in policy.decide(event, cluster):
            schedule completion of action        # ChunkDone / TrainDone at t + cost
        schedule syncs whose participants all arrived, and switches that began

Deterministic: ties break by sequence number, and cost models draw from their own seeded RNG.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, List, Protocol, Tuple

from bidirl.sched import events as ev
from bidirl.sched.cluster import Chunk, Cluster
from bidirl.sched.roles import DeviceState


class CostModel(Protocol):
    def generate(self, chunk: Chunk) -> float: ...

    def train(self, devices: Tuple[int, ...], batch: List[Chunk]) -> float: ...

    def sync(self, devices: Tuple[int, ...]) -> float: ...

    def load(self, device: int) -> float: ...

    def switch(self, device: int) -> float: ...


@dataclass
class FixedCosts:
    """Constant durations: per prompt group generated, per train step (split over devices), sync, switch."""

    generate_per_group: float = 1.0
    train_step: float = 4.0
    sync_s: float = 0.1
    switch_s: float = 0.01

    def generate(self, chunk: Chunk) -> float:
        return self.generate_per_group * chunk.groups

    def train(self, devices: Tuple[int, ...], batch: List[Chunk]) -> float:
        return self.train_step / len(devices)

    def sync(self, devices: Tuple[int, ...]) -> float:
        return self.sync_s

    def load(self, device: int) -> float:
        return self.switch_s

    def switch(self, device: int) -> float:
        return self.switch_s


class Simulator:
    def __init__(self, cluster: Cluster, policy: Any, costs: CostModel, max_events: int = 10_000_000):
        self.cluster, self.policy, self.costs, self.max_events = cluster, policy, costs, max_events
        self.heap: List[Tuple[float, int, Any]] = []
        self.seq = itertools.count()
        self.scheduled: set = set()  # (device, state) whose completion is already on the heap

    def push(self, time: float, event: Any) -> None:
        heapq.heappush(self.heap, (time, next(self.seq), event))

    def run(self) -> Cluster:
        self.push(0.0, ev.Started())
        for _ in range(self.max_events):
            if not self.heap:
                break
            now, _, event = heapq.heappop(self.heap)
            self.cluster.now = now
            if not isinstance(event, ev.Started):
                self.cluster.complete(event)
            for action in self.policy.decide(event, self.cluster):
                self.start(action, now)
            self.start_collectives(now)
        if not self.cluster.finished:
            raise RuntimeError(f"simulation stalled at t={self.cluster.now:.3f} after version "
                               f"{self.cluster.version}/{self.cluster.steps}: the policy started nothing")
        return self.cluster

    def start(self, action: ev.Action, now: float) -> None:
        cluster = self.cluster
        if isinstance(action, ev.Generate):
            chunk = next(c for c in reversed(cluster.chunks) if c.device == action.device and not c.done)
            self.push(now + self.costs.generate(chunk), ev.ChunkDone(action.device, chunk.index))
        elif isinstance(action, ev.Train):
            self.push(now + self.costs.train(action.devices, cluster.batch_chunks(cluster.version)),
                      ev.TrainDone(cluster.version + 1))
        elif isinstance(action, ev.Sync):  # a background transfer: nobody waits for it
            self.push(now + self.costs.sync(action.devices), ev.SyncDone(cluster.syncing))

    def start_collectives(self, now: float) -> None:
        """Loads and switches start when a device enters SYNCING / SWITCHING (at once or after draining)."""
        for device in self.cluster.devices:
            key = (device.index, device.state)
            if device.state is DeviceState.SWITCHING and key not in self.scheduled:
                self.scheduled.add(key)
                self.push(now + self.costs.switch(device.index), ev.SwitchDone(device.index, device.role))
            elif device.state is DeviceState.SYNCING and key not in self.scheduled:
                self.scheduled.add(key)
                self.push(now + self.costs.load(device.index), ev.LoadDone(device.index, device.loading))
            for state in (DeviceState.SWITCHING, DeviceState.SYNCING):
                if device.state is not state:
                    self.scheduled.discard((device.index, state))
