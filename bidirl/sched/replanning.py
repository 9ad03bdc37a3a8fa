"""Re-planning at run time: when the measured response lengths drift, the partition follows.

A :class:`Replanner` is asked after every optimizer step for the rollout-pool size it wants now
(``None``: no opinion). The policy then moves devices between home pools with ``Rehome`` actions
(:func:`repartition_toward`), under these rules, which the bookkeeping asserts:

* only at a step boundary (no train step in progress), so every step's trainers are one fixed set
  and every optimizer replica has stepped the same updates;
* only devices idle at home (not lent: a lease in force ends first) and never the primary, which
  owns the optimizer and the version counter;
* a rollout device picked to move takes no new groups (``Cluster.leaving``) and moves at the first
  step boundary where it is idle; a trainer moves at once (trainers are idle between steps);
* a device that joins the train pool adopts the primary's training state as it switches, so it steps
  an identical replica from the next step on (the switch costs that transfer too).

:class:`LengthReplanner` is the measured-lengths trigger: every ``every`` steps it hands the mean
response length measured since the last re-plan to ``choose`` -- the planner, supplied by the layer
above (the scheduling core never imports it) -- and caches its answers per 5% band of length. The
measured mean is after the length cap, the planner's workload mean before it: where many samples hit
the cap, the planner is asked about slightly shorter responses than the real ones.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Protocol

from bidirl.sched import events as ev
from bidirl.sched.cluster import Cluster
from bidirl.sched.roles import Role


class Replanner(Protocol):
    def rollout_devices(self, cluster: Cluster) -> Optional[int]:
        """The rollout-pool size wanted after the step that just ended, or None to keep the current one."""
        ...


class NoReplanning:
    def rollout_devices(self, cluster: Cluster) -> Optional[int]:
        return None


NO_REPLANNING = NoReplanning()


class ResponseLengths:
    """What a driver measures for the :class:`LengthReplanner`: response tokens and samples of the
    batches trained since it last asked (the simulator and the live controller both keep one)."""

    def __init__(self) -> None:
        self.tokens = self.samples = 0

    def trained(self, tokens: int, samples: int) -> None:
        self.tokens += tokens
        self.samples += samples

    def mean_since_last_asked(self) -> Optional[float]:
        tokens, samples = self.tokens, self.samples
        self.tokens = self.samples = 0
        return tokens / samples if samples else None


class LengthReplanner:
    def __init__(self, every: int, measured: Callable[[], Optional[float]], choose: Callable[[float], int]):
        if every < 1:
            raise ValueError(f"re-planning every {every} steps: give a whole number >= 1")
        self.every, self.measured, self.choose = every, measured, choose
        self.cache: Dict[int, int] = {}
        self.history: List[tuple] = []  # (version, mean response tokens measured, rollout devices chosen)

    def rollout_devices(self, cluster: Cluster) -> Optional[int]:
        if cluster.version % self.every or cluster.version >= cluster.steps:
            return None
        mean = self.measured()
        if not mean:
            return None
        band = round(math.log(mean) / math.log(1.05))
        if band not in self.cache:
            self.cache[band] = self.choose(1.05 ** band)
        self.history.append((cluster.version, round(mean, 1), self.cache[band]))
        return self.cache[band]


def repartition_toward(cluster: Cluster, actions: List[ev.Action], target: int) -> None:
    """Rehome devices toward ``target`` rollout-home devices, as far as the rules above allow now."""
    target = max(1, min(len(cluster.devices) - 1, target))
    rollout_home = [d for d in cluster.devices if d.home is Role.ROLLOUT]
    excess = target - len(rollout_home)

    def rehome(device, home: Role, reason: str) -> None:
        action = ev.Rehome(device.index, home, reason)
        cluster.apply(action)
        actions.append(action)

    if excess >= 0:
        cluster.leaving.clear()
    if excess > 0:  # trainers move to rollout: they are idle between steps
        if cluster.training is not None:
            return
        movable = [d for d in cluster.devices if d.home is Role.TRAIN and d.index != cluster.primary
                   and d.idle and not d.lent and not d.after_work]
        for device in movable[::-1][:excess]:
            rehome(device, Role.ROLLOUT, f"re-plan: {target} rollout devices")
        return
    cluster.leaving.intersection_update(d.index for d in rollout_home if not d.lent)
    if len(cluster.leaving) > -excess:  # the target rose since they were picked: fewer leave (those that
        # drain soonest); every one left marked would move, and the next call would move devices back
        first = sorted(cluster.leaving, key=lambda i: (cluster.inflight[i], -i))[:-excess]
        cluster.leaving.intersection_update(first)
    staying = [d for d in rollout_home if d.index not in cluster.leaving and not d.lent]
    while len(cluster.leaving) < -excess and len(staying) > 1:  # least loaded first: it drains soonest
        pick = min(staying, key=lambda d: (cluster.inflight[d.index], -d.index))
        staying.remove(pick)
        cluster.leaving.add(pick.index)
    if cluster.training is None:
        for index in sorted(cluster.leaving):
            device = cluster.devices[index]
            if device.idle and not device.after_work and not cluster.inflight[index]:
                rehome(device, Role.TRAIN, f"re-plan: {target} rollout devices")
