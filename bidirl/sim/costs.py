"""The calibrated cost model the simulator uses: workload lengths + analytic performance model.

Rollout runs on one continuous-batching :class:`~bidirl.sim.instance.Instance` per device. Training,
background weight transfer, gradient return, load and switch are timed from
:class:`~bidirl.perf.analytic.PerfModel`. A batch's training is charged for exactly the groups it
took (their own tokens), whatever chunks they were generated in.

:func:`step_bound` is the policy-independent lower bound on the step time every policy is measured
against (see its docstring).
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

from bidirl.sched.cluster import Chunk
from bidirl.sched.estimates import Estimates
from bidirl.sched.replanning import ResponseLengths
from bidirl.perf.model import PerformanceModel as PerfModel
from bidirl.perf.workload import GroupDraws, Workload
from bidirl.sim.instance import Instance


class DrawnGroups:
    """What :func:`step_bound` needs of each prompt group the simulation drew -- the mean it was drawn
    at, its generated tokens, its longest sequence -- so that the bound need not draw every group again
    (it would take as long as the simulation's own drawing). Groups are admitted in rising order, so
    group ``g`` is entry ``g``; one drawn out of order is not kept (the bound draws it itself)."""

    def __init__(self) -> None:
        self.mean, self.generated, self.longest = array("d"), array("q"), array("q")

    def record(self, group: int, mean: float, lengths: List[int]) -> None:
        if group == len(self.mean):
            self.mean.append(mean)
            self.generated.append(sum(lengths))
            self.longest.append(max(lengths))

    def record_all(self, first: int, mean: float, groups: List[List[int]]) -> None:
        """``record`` of ``groups``, numbered from ``first`` on."""
        if first == len(self.mean):
            self.mean.extend([mean] * len(groups))
            self.generated.extend(map(sum, groups))
            self.longest.extend(map(max, groups))
        else:
            for i, lengths in enumerate(groups):
                self.record(first + i, mean, lengths)

    def get(self, group: int, mean: float) -> Optional[Tuple[int, int]]:
        """(generated tokens, longest sequence) of ``group`` if it was drawn at ``mean``."""
        if group < len(self.mean) and self.mean[group] == mean:
            return self.generated[group], self.longest[group]
        return None


class CalibratedCosts:
    def __init__(self, perf: PerfModel, workload: Workload, group_size: int, steps: int, seed: int,
                 switch_s: float = 0.0, load_s: float = -1.0):
        self.perf, self.workload, self.G, self.steps = perf, workload, group_size, steps
        # a step's fixed train cost (a fitted line's intercept: the optimizer step, paid once per step by
        # each replica; the analytic model has none): in ``step_overhead``, not in shared gradient work
        self.train_fixed_s = perf.train_compute_seconds(0)
        self.draws = GroupDraws(seed, group_size)
        self.switch_s = switch_s  # 0: the model's, by direction
        self.load_s = perf.load_seconds() if load_s < 0 else load_s
        self.chunk_tokens: Dict[int, int] = {}
        self.group_tokens: Dict[Tuple[int, int], int] = {}  # (chunk, group index) -> prompt + response tokens
        self.finished: Dict[int, Deque[int]] = {}  # chunk -> tokens of its groups done, in completion order
        self.train_device_s = 0.0
        self.switches = 0
        self.trained_lengths = ResponseLengths()  # what the re-planner reads
        self.drawn = DrawnGroups()  # (for the step bound)

    def make_instance(self) -> Instance:
        return make_instance(self.perf, self.workload)

    def decode_slowdown_beside_training(self) -> float:
        return self.perf.decode_slowdown_beside_training()

    def decode_slowdown_beside_decoding(self) -> float:
        return self.perf.decode_slowdown_beside_decoding()

    def warmup(self, stage: str) -> float:
        return self.perf.warmup_seconds(stage)

    def lengths(self, chunk: Chunk) -> List[int]:
        lengths: List[int] = []
        mean = self.workload.mean_at(chunk.version, self.steps)  # (one version per chunk)
        # fixed draws per prompt group (common random numbers): policies are compared on one workload,
        # not on different draws of it
        groups = self.workload.groups_lengths(self.draws, chunk.first, chunk.groups, chunk.version, self.steps)
        self.drawn.record_all(chunk.first, mean, groups)
        prompt, index, group_tokens = self.workload.prompt_tokens, chunk.index, self.group_tokens
        for i, mine in enumerate(groups):
            group_tokens[(index, i)] = sum(mine) + prompt * len(mine)
            lengths += mine
        self.chunk_tokens[index] = sum(lengths) + prompt * len(lengths)
        self.finished[chunk.index] = deque()
        return lengths

    def group_done(self, chunk: int, group: int) -> None:
        self.finished[chunk].append(self.group_tokens.pop((chunk, group)))

    def train_work(self, batch: List[Tuple[Chunk, int]]) -> float:
        """Device-seconds of gradient work for a batch (useful work: communication excluded). The cluster
        takes a chunk's completed groups in the order they completed, so they are popped in that order."""
        tokens = sum(self.finished[c.index].popleft() for c, groups in batch for _ in range(groups))
        samples = sum(groups for _, groups in batch) * self.G
        self.trained_lengths.trained(tokens - samples * self.workload.prompt_tokens, samples)
        # GRPO trains those; the fixed cost is not work the step's devices share, nor paid per streamed part
        work = self.perf.train_compute_seconds(tokens * self.workload.informative) - self.train_fixed_s
        self.train_device_s += work
        return work

    def trained_samples(self, batch: List[Tuple[Chunk, int]]) -> float:
        """Samples of a batch that GRPO trains (in groups whose rewards differ)."""
        return sum(groups for _, groups in batch) * self.G * self.workload.informative

    def adopt(self, device: int) -> float:
        """A device joining the train pool for good receives the primary's training state."""
        return self.perf.train_state_seconds()

    def allreduce(self, devices: int) -> float:
        return self.perf.allreduce_seconds(devices)

    def micro_batch_overhead(self) -> float:
        return self.perf.micro_batch_overhead_seconds()

    def step_overhead(self) -> float:
        """A step's finish beyond its all-reduce, and its fixed train cost (see ``train_work``)."""
        return self.perf.step_overhead_seconds() + self.train_fixed_s

    def gradient_return(self, lent: int) -> float:
        """Lent devices (Trainer-on-RollPool) send their gradients to the primary, serialised there."""
        return self.perf.gradient_return_seconds(lent)

    def sync(self, devices: Tuple[int, ...]) -> float:
        return self.perf.sync_seconds(len(devices) + 1)

    def load(self, device: int) -> float:
        return self.load_s

    def switch(self, device: int, to: str = "") -> float:
        self.switches += 1
        return self.switch_s or self.perf.switch_seconds(to)

    def tokens(self) -> int:
        return sum(self.chunk_tokens.values())


def make_instance(perf: PerfModel, workload: Workload) -> Instance:
    """One device's rollout engine: decode step, KV capacity and prefill at the workload's mean context."""
    context = workload.prompt_tokens + workload.mean_tokens / 2  # mean context while decoding
    intercept, slope = perf.decode_line(context)
    per_token = perf.prefill_seconds_per_token()
    per_request = per_token * workload.prompt_tokens + perf.request_overhead_seconds()  # (charged as prefill)
    return Instance(intercept, slope, perf.max_concurrency(context), per_request, per_token)


def generation_seconds(perf: PerfModel, workload: Workload, lengths: List[int], group_size: int) -> float:
    """Seconds one device takes to generate ``lengths`` (groups of ``group_size``; 0: one group), all
    requested at once with nothing else running: what the model says a chunk costs."""
    instance = make_instance(perf, workload)
    instance.admit(0.0, 0, lengths, group_size)
    while instance.next_finish() is not None:
        instance.finish_due(instance.next_finish())
    return instance.clock


def step_bound(perf: PerfModel, workload: Workload, group_size: int, batch_groups: int, steps: int,
               devices: int, seed: int, eta: float, drawn: Optional[DrawnGroups] = None,
               window_groups: int = 0) -> float:
    """A lower bound on the mean step time that no policy can beat, and that no policy can move.

    Per step k (groups kB .. kB+B-1, drawn as every policy draws them), the larger of
      * work / devices: every sequence decoded at the *saturated* per-token cost of a full instance
        (decode step at KV capacity / capacity) plus its prefill, plus the cheapest training of all
        tokens (no log-prob recompute), spread over every device with no idle time and free switches;
      * on-policy only (eta = 0): the longest sequence decoded alone (a batch-1 decode step per token)
        plus the shortest possible training of its group (its tokens on every device at once) --
        step k+1 cannot start generating before step k's weights exist.
    Unlike tau* = (R + T) / G from each policy's own busy time, a policy that spreads generation
    thinly does not get a kinder bound. (Lengths drift with the version a group is generated at; the
    work term draws them at the earliest version any policy within the staleness bound could use.)
    ``drawn``: the groups a simulation of this workload and seed drew already; those drawn at the same
    mean are read, not drawn again (the same numbers: the draws depend only on seed and group).

    ``window_groups`` > 0: the bound for a policy that never has more than that many groups in flight
    (every policy here: the admission rule holds (eta + 1) batches of ``batch_groups``, whatever the
    updates per sync), which caps how full decoding can be -- the larger of the bound above and
    :func:`window_bound`'s."""
    steps_work = bound_work(perf, workload, group_size, batch_groups, steps, devices, seed, eta, drawn)
    return bound_of(make_instance(perf, workload), steps_work, devices, window_groups * group_size)


def bound_of(instance: Instance, steps_work: List[Tuple[float, ...]], devices: int, window_sequences: int = 0) -> float:
    """:func:`step_bound` from its per-step work (``bound_work``): the work term or the tail, step by step,
    and, given a window of ``window_sequences`` in flight, at least :func:`window_bound`'s."""
    bound = sum(max(saturated_work / devices, tail) for _, _, _, saturated_work, tail in steps_work) / len(steps_work)
    if window_sequences:
        bound = max(bound, window_bound(instance, steps_work, devices, window_sequences) / len(steps_work))
    return bound


def bound_work(perf: PerfModel, workload: Workload, group_size: int, batch_groups: int, steps: int, devices: int,
               seed: int, eta: float, drawn: Optional[DrawnGroups] = None) -> List[Tuple[float, ...]]:
    """Per step of :func:`step_bound`: (tokens generated, prefill device-seconds, training device-seconds at
    the cheapest -- no log-prob recompute --, all of the step's work in device-seconds with decoding
    saturated, and the on-policy tail: 0 where eta > 0)."""
    instance, draws = make_instance(perf, workload), GroupDraws(seed, group_size)
    saturated = instance.step_time(instance.capacity) / instance.capacity  # seconds per token at full batch
    prompt, on_policy, lag = workload.prompt_tokens, eta == 0, math.ceil(eta) + 1
    out = []
    for k in range(steps):
        gen = train_tokens = tokens_generated = 0.0
        tail = 0.0
        version = k if on_policy else max(0, k - lag)
        mean = workload.mean_at(version, steps)
        for group in range(k * batch_groups, (k + 1) * batch_groups):
            known = drawn.get(group, mean) if drawn is not None else None
            if known is None:
                lengths = workload.group_lengths(draws, group, version, steps)
                known = sum(lengths), max(lengths)
            generated, longest = known
            tokens = generated + prompt * group_size
            gen += generated * saturated + group_size * instance.prefill
            tokens_generated += generated
            train_tokens += tokens
            if on_policy:
                alone = longest * instance.step_time(1) + instance.prefill
                tail = max(tail, alone + perf.train_compute_seconds(tokens * workload.informative,
                                                                    recompute_logprob=False) / devices)
        train = perf.train_compute_seconds(train_tokens * workload.informative, recompute_logprob=False)
        out.append((tokens_generated, batch_groups * group_size * instance.prefill, train, gen + train, tail))
    return out


def window_bound(instance: Instance, steps_work: List[Tuple[float, ...]], devices: int, sequences: int) -> float:
    """The least time in which ``devices`` instances can do ``steps_work`` (``bound_work``) if no more than
    ``sequences`` sequences ever decode at once -- the admission window's cap on how full decoding gets.

    Why it holds: a decode step of b sequences takes at least a + c b (the decode line; slowed down, more),
    so an instance decodes at most f(b) = b / (a + c b) tokens a second, f concave, flat past the KV
    capacity. At any instant, d instances decoding n <= ``sequences`` between them make at most d f(n / d)
    (Jensen); over a run of T seconds whose decode instance-time is X, at most X f(N T / X) (the same, for
    the perspective of f, which is concave; where X < T, X f(N): a decoding instance never holds more
    than N, so between none and one instance the rate grows at most linearly). The instance-time left for
    decoding is at most devices * T - prefill - training, and X f(N T / X) grows with X and T; so T is the
    least time at which that much decoding makes every token (bisection). Re-prefill after a load or a
    migration, switches and waiting are left out, as in the saturated bound."""
    a, c, cap = instance.step_a, instance.step_b, instance.capacity
    tokens = sum(w[0] for w in steps_work)
    other = sum(w[1] + w[2] for w in steps_work)

    def made(seconds: float) -> float:  # the most tokens ``seconds`` of the whole cluster can decode
        decoding = devices * seconds - other
        if decoding <= 0:
            return 0.0
        batch = min(cap, sequences, sequences * seconds / decoding)  # (less than one instance on average: <= N)
        return decoding * batch / (a + c * batch)

    low, high = 0.0, max(1.0, other / devices)
    while made(high) < tokens:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if made(mid) < tokens else (low, mid)
    return high


def estimates(perf: PerfModel, workload: Workload, group_size: int, batch_groups: int, devices: int,
              switch_s: float, chunk_groups: int = 8, seed: int = 12345) -> Estimates:
    """What a profiler would report: device-seconds per group when a device holds its share of a
    batch, T for a batch on one device, the wall time of one chunk alone on a device (a lent trainer's
    lease: set by its longest sequence), switch and gradient-transfer costs, and the decode line at a
    tail's context (prompt + the length cap)."""
    costs = CalibratedCosts(perf, workload, group_size, 1, seed, switch_s, load_s=0.0)
    share = max(1, batch_groups // max(1, devices // 2))
    shared = _run_alone(costs, 0, share)
    mean_tokens = costs.chunk_tokens[0] / (share * group_size)
    train = perf.train_compute_seconds(batch_groups * group_size * mean_tokens * workload.informative)
    chunk_s = sum(_run_alone(costs, share + i * chunk_groups, chunk_groups) for i in range(5)) / 5
    step_s, per_sequence = perf.decode_line(workload.prompt_tokens + workload.cap)  # a tail nears the cap
    return Estimates(shared / share, train, switch_s, perf.gradient_return_seconds(1), chunk_s,
                     step_s, per_sequence * group_size, perf.warmup_seconds("rollout"))


def _run_alone(costs: CalibratedCosts, first: int, groups: int) -> float:
    """Seconds one device takes to generate groups ``first..first+groups-1`` with nothing else running."""
    return generation_seconds(costs.perf, costs.workload, costs.lengths(Chunk(0, 0, first, groups, 0)), 0)
