"""The calibrated cost model the simulator uses: workload lengths + analytic performance model.

Rollout runs on one continuous-batching :class:`~bidirl.sim.instance.Instance` per device. Training,
background weight transfer, load and switch are timed from :class:`~bidirl.perf.analytic.PerfModel`. It also
keeps the device-seconds of useful work, from which the ideal step time tau* = (R + T) / G follows.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from bidirl.sched.cluster import Chunk
from bidirl.sched.estimates import Estimates
from bidirl.perf.analytic import PerfModel
from bidirl.perf.workload import GroupDraws, Workload
from bidirl.sim.instance import Instance


class CalibratedCosts:
    def __init__(self, perf: PerfModel, workload: Workload, group_size: int, steps: int, seed: int,
                 switch_s: float, load_s: float):
        self.perf, self.workload, self.G, self.steps = perf, workload, group_size, steps
        self.draws = GroupDraws(seed, group_size)
        self.switch_s, self.load_s = switch_s, load_s
        self.chunk_tokens: Dict[int, int] = {}
        self.train_device_s = 0.0
        self.switches = 0

    def make_instance(self) -> Instance:
        return make_instance(self.perf, self.workload)

    def lengths(self, chunk: Chunk) -> List[int]:
        lengths: List[int] = []
        for group in range(chunk.first, chunk.first + chunk.groups):
            # fixed draws per prompt group (common random numbers): policies are compared on one
            # workload, not on different draws of it
            lengths += self.workload.group_lengths(self.draws, group, chunk.version, self.steps)
        self.chunk_tokens[chunk.index] = sum(lengths) + self.workload.prompt_tokens * len(lengths)
        return lengths

    def train_work(self, batch: List[Tuple[Chunk, int]]) -> float:
        """Device-seconds of gradient work for a batch (useful work: communication excluded)."""
        tokens = sum(self.chunk_tokens[c.index] * groups / c.groups for c, groups in batch)
        work = self.perf.train_compute_seconds(tokens)
        self.train_device_s += work
        return work

    def allreduce(self, devices: int) -> float:
        return self.perf.allreduce_seconds(devices)

    def sync(self, devices: Tuple[int, ...]) -> float:
        return self.perf.sync_seconds(len(devices) + 1)

    def load(self, device: int) -> float:
        return self.load_s

    def switch(self, device: int) -> float:
        self.switches += 1
        return self.switch_s

    def tokens(self) -> int:
        return sum(self.chunk_tokens.values())


def make_instance(perf: PerfModel, workload: Workload) -> Instance:
    """One device's rollout engine: decode step, KV capacity and prefill at the workload's mean context."""
    context = workload.prompt_tokens + workload.mean_tokens / 2  # mean context while decoding
    efficiency = perf.rollout_efficiency
    prefill = 2 * perf.model.params * workload.prompt_tokens / (perf.mfu * perf.hardware.peak_flops)
    return Instance(perf.step_intercept * efficiency, perf.step_slope(context) * efficiency,
                    perf.max_concurrency(context), prefill * efficiency)


def estimates(perf: PerfModel, workload: Workload, group_size: int, batch_groups: int, devices: int,
              switch_s: float, chunk_groups: int = 8, seed: int = 12345) -> Estimates:
    """What a profiler would report: device-seconds per group when a device holds its share of a
    batch, T for a batch on one device, the wall time of one chunk alone on a device (a lent trainer's
    lease: set by its longest sequence), switch and gradient-transfer costs."""
    costs = CalibratedCosts(perf, workload, group_size, 1, seed, switch_s, 0.0)
    share = max(1, batch_groups // max(1, devices // 2))
    shared = _run_alone(costs, 0, share)
    mean_tokens = costs.chunk_tokens[0] / (share * group_size)
    train = perf.train_seconds(batch_groups * group_size * mean_tokens, 1)
    chunk_s = sum(_run_alone(costs, share + i * chunk_groups, chunk_groups) for i in range(5)) / 5
    return Estimates(shared / share, train, switch_s, perf.model.weight_bytes / perf.hardware.link_bw, chunk_s)


def _run_alone(costs: CalibratedCosts, first: int, groups: int) -> float:
    """Seconds one device takes to generate groups ``first..first+groups-1`` with nothing else running."""
    instance = costs.make_instance()
    instance.admit(0.0, 0, costs.lengths(Chunk(0, 0, first, groups, 0)))
    while instance.next_finish() is not None:
        instance.finish_due(instance.next_finish())
    return instance.clock
