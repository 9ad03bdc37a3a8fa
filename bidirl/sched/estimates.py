"""What the cost-aware policies believe work costs: cost estimates, where they come from, and the
estimate of a train step in progress. Pure Python.

A policy is constructed with an :class:`EstimatesProvider` and asks it for :class:`Estimates` when it
decides; it never receives new numbers from outside. Providers:

* :class:`Estimates` itself -- fixed numbers (the simulator's performance model: what a profiler
  would report);
* :class:`MeasuredEstimates` -- moving averages of what a live run measures as it goes, starting
  from a *prior* (the performance model's estimates: a profile of the devices, or the analytic model)
  so that a cost-aware policy can lend from the first step; each figure's first measurement replaces
  its prior. Without a prior they are zero until measured, and a cost-aware policy lends no trainer
  before it has measured a chunk (after a device's first, which times its engine's warm-up), and no
  rollout device before it has measured a step;
* :data:`NO_ESTIMATES` -- for policies that need none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Estimates:
    generate_group_s: float  # device-seconds to generate one prompt group (all G samples)
    train_batch_s: float  # device-seconds of one optimizer step's gradient work (T)
    switch_s: float  # one role switch
    grad_transfer_s: float = 0.0  # returning one device's gradients to the primary
    chunk_s: float = 0.0  # wall time of one chunk alone on a device: how long a lent trainer is away
    # one decode step at a tail's context: decode_step_s + decode_group_s * (groups decoding together);
    # zero where unknown (then no policy merges awaited groups into a bigger decode batch)
    decode_step_s: float = 0.0
    decode_group_s: float = 0.0
    # what a device's first chunk of the run takes beyond a chunk's time: its fresh engine's warm-up, which
    # a trainer lent to rollout for the first time pays before its lease does any good
    rollout_warmup_s: float = 0.0

    def lease_s(self, chunk_groups: int) -> float:
        return self.chunk_s or self.generate_group_s * chunk_groups

    def merged_slowdown(self, groups: int, merged: int) -> float:
        """How much slower a decode batch of ``groups`` groups steps once ``merged`` groups decode together
        (infinite where the decode line is unknown, unless the batch does not grow)."""
        if merged <= groups:
            return 1.0
        if self.decode_step_s <= 0:
            return math.inf
        return (self.decode_step_s + self.decode_group_s * merged) / (self.decode_step_s + self.decode_group_s * groups)

    @property
    def measured(self) -> bool:
        return self.generate_group_s > 0 and self.train_batch_s > 0

    def current(self) -> "Estimates":
        return self  # fixed numbers are their own provider


NO_ESTIMATES = Estimates(0.0, 0.0, 0.0)


class EstimatesProvider(Protocol):
    def current(self) -> Estimates: ...


class MeasuredEstimates:
    """Estimates from the live run itself: moving averages of what the workers report, starting from
    ``prior`` (a performance model's figures, or zero). A figure's first measurement replaces its prior
    outright -- the run's own devices, engines and lengths beat any model of them -- and later ones are
    averaged in with ``weight``."""

    NAMES = ("generate_group_s", "train_batch_s", "switch_s", "grad_transfer_s", "chunk_s", "decode_step_s",
             "decode_group_s", "rollout_warmup_s")  # (the decode line is never measured live: it stays the prior's)

    def __init__(self, weight: float = 0.3, prior: Estimates = NO_ESTIMATES):
        self.weight, self.prior = weight, prior
        self.values = {name: getattr(prior, name) for name in self.NAMES}
        self.seen: set = set()  # figures measured at least once
        self.first_chunks: list = []  # (seconds, groups) of each device's first chunk (its engine's warm-up in it)

    def _observe(self, name: str, value: float) -> None:
        old = self.values[name]
        self.values[name] = (1 - self.weight) * old + self.weight * value if name in self.seen else value
        self.seen.add(name)

    def chunk(self, seconds: float, groups: int, first: bool = False) -> None:
        """A chunk of ``groups`` took ``seconds``. ``first``: the device's first of the run, which includes
        whatever of its engine's warm-up is left (2 s beside 0.13 s per chunk after it on this machine's CPU
        while live engines warmed inside the run; about 0.1 s since each worker warms its engine at start-up):
        it is timed apart, as the warm-up, instead of making generation look dearer than it is."""
        if first:
            self.first_chunks.append((seconds, groups))
            return
        self._observe("generate_group_s", seconds / groups)
        self._observe("chunk_s", seconds)

    def step(self, work_s: float, reduce_s: float, lent: int = 0) -> None:
        """A step took ``work_s`` device-seconds of gradient work (summed over its devices), and the
        primary ``reduce_s`` to take in the gradients of its ``lent`` devices (one after another) and
        all-reduce with the home trainers. ``grad_transfer_s`` is one lent device's return: measured only
        on steps that had lent devices, per device (a step without any says nothing of their cost; it
        read as free, and a step with four read four times too dear)."""
        self._observe("train_batch_s", work_s)
        if lent:
            self._observe("grad_transfer_s", reduce_s / lent)

    def switch(self, seconds: float) -> None:
        self._observe("switch_s", seconds)

    def current(self) -> Estimates:
        values = dict(self.values)
        if self.first_chunks:  # the warm-up: a first chunk beyond what its groups take warm (measured or the
            # prior's; all of it until either is known), whatever the chunk's size
            per_group = values["generate_group_s"]
            beyond = [max(0.0, seconds - groups * per_group) for seconds, groups in self.first_chunks]
            values["rollout_warmup_s"] = sum(beyond) / len(beyond)
        return Estimates(**values)

    def measured_names(self) -> list:
        """The figures this run has measured (the warm-up once any device's first chunk is in)."""
        return sorted(self.seen | ({"rollout_warmup_s"} if self.first_chunks else set()))


def pulled_items(samples: int, micro_batch: int, devices: int) -> int:
    """Micro-batches a step of ``samples`` is cut into when its devices pull them: at most
    ``micro_batch`` samples each, and at least two per starting device (so every device of the step
    has work and one that joins mid-step can still find some), never more than one per sample."""
    return max(1, min(samples, max(-(-samples // max(1, micro_batch)), 2 * devices)))


def lease_timeout_s(given: float, slowest_item_s: float) -> float:
    """How long a borrowed device may take over one micro-batch before its lease expires, in both drivers:
    ``given`` (``launch.lease_timeout_s``), else 10 times the slowest micro-batch so far, at least 10 s."""
    return given or max(10.0, 10 * slowest_item_s)


def balanced_split(devices: int, estimates: Estimates, batch_groups: int) -> int:
    """Rollout devices x minimising max(R / x, T / (n - x)): StreamRL's / the planner's static balance."""
    rollout_work = estimates.generate_group_s * batch_groups
    return min(range(1, devices), key=lambda x: max(rollout_work / x, estimates.train_batch_s / (devices - x)))


@dataclass
class StepProgress:
    """The gradient work of a train step in progress, shared evenly by its devices: ``work_left``
    device-seconds as of ``since``. A device that joins takes a share of what is left. The simulator
    times steps with it; the bidirl policy keeps one as its estimate of the step in progress."""

    work_left: float
    devices: int
    since: float
    epoch: int = 0  # the simulator's: unique across steps, so a superseded finish never matches
    waited: float = 0.0  # device-seconds a streamed step's devices had nothing to compute

    def seconds_left(self, now: float) -> float:
        return max(0.0, self.work_left - self.devices * (now - self.since)) / self.devices

    def finish(self, communication_s: float = 0.0) -> float:
        return self.since + self.work_left / self.devices + communication_s

    def join(self, now: float, epoch: int = 0) -> float:
        """One more device at ``now``; returns the device-seconds the others had nothing to compute until then."""
        waited = self._ran_out(now)
        self.work_left = self.seconds_left(now) * self.devices
        self.devices, self.since, self.epoch = self.devices + 1, now, epoch
        return waited

    def add(self, now: float, work: float, epoch: int = 0) -> float:
        """``work`` more device-seconds arrived at ``now`` (a streamed step's groups as they finish); returns
        the device-seconds the step's devices had nothing to compute until then."""
        waited = self._ran_out(now)
        self.work_left = self.seconds_left(now) * self.devices + work
        self.since, self.epoch = now, epoch
        return waited

    def _ran_out(self, now: float) -> float:
        waited = max(0.0, self.devices * (now - self.since) - self.work_left)  # out of work until now
        self.waited += waited
        return waited
