"""The calibrated cost model the simulator uses: workload lengths + analytic performance model.

It also keeps the device-seconds of all useful work, from which the ideal step time
tau* = (R + T) / G follows (R, T: rollout and training device-seconds per step, G devices).
"""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

from bidirl.sched.borrowing import Estimates
from bidirl.sched.cluster import Chunk
from bidirl.sim.perf import PerfModel
from bidirl.sim.workload import Workload


class CalibratedCosts:
    def __init__(self, perf: PerfModel, workload: Workload, group_size: int, steps: int, seed: int,
                 switch_s: float, sync_free: bool = False):
        self.perf, self.workload, self.G, self.steps = perf, workload, group_size, steps
        self.rng = random.Random(seed)
        self.switch_s, self.sync_free = switch_s, sync_free
        self.chunk_tokens: Dict[int, int] = {}
        self.rollout_device_s = 0.0
        self.train_device_s = 0.0
        self.switches = 0

    def generate(self, chunk: Chunk) -> float:
        lengths: List[int] = []
        for _ in range(chunk.groups):
            lengths += self.workload.group_lengths(self.rng, self.G, chunk.version, self.steps)
        self.chunk_tokens[chunk.index] = sum(lengths) + self.workload.prompt_tokens * len(lengths)
        seconds = self.perf.generate_seconds(lengths, self.workload.prompt_tokens)
        self.rollout_device_s += seconds
        return seconds

    def train(self, devices: Tuple[int, ...], batch: List[Chunk]) -> float:
        tokens = sum(self.chunk_tokens[c.index] for c in batch)
        seconds = self.perf.train_seconds(tokens, len(devices))
        self.train_device_s += self.perf.train_seconds(tokens, 1)  # useful work, without communication
        return seconds

    def sync(self, devices: Tuple[int, ...]) -> float:
        return 0.0 if self.sync_free else self.perf.sync_seconds(len(devices))

    def switch(self, device: int) -> float:
        self.switches += 1
        return self.switch_s

    def tokens(self) -> int:
        return sum(self.chunk_tokens.values())


def estimates(perf: PerfModel, workload: Workload, group_size: int, batch_groups: int, chunk_groups: int,
              switch_s: float, seed: int = 12345) -> Estimates:
    """What a profiler would report: per-group generation time at chunk scale, T, switch and transfer."""
    rng = random.Random(seed)
    lengths: List[int] = []
    for _ in range(chunk_groups):
        lengths += workload.group_lengths(rng, group_size, 0, 1)
    per_group = perf.generate_seconds(lengths, workload.prompt_tokens) / chunk_groups
    mean_tokens = sum(lengths) / len(lengths) + workload.prompt_tokens
    train = perf.train_seconds(batch_groups * group_size * mean_tokens, 1)
    return Estimates(per_group, train, switch_s, perf.model.weight_bytes / perf.hardware.link_bw)
