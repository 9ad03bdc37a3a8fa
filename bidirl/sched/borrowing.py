"""Policies that lend devices across pools at run time, and the static baselines they are compared with.

All of them start from a fixed partition (rollout pool + train pool, the primary trainer owns the
optimizer) and run asynchronously under the staleness bound eta, like ``async`` (AReaL). They differ in
what an idle device may do:

* ``roll``          ROLL-style: generation runs up to eta steps ahead (``async_generation_ratio``) on a
                    fixed device mapping, one batch-share per rollout device per step (no finer
                    interruption); no lending.
* ``streamrl``      StreamRL-style: stream generation in small chunks, and the split chosen from the
                    profile so that rollout and training stage times balance; no run-time lending
                    (the paper's run-time rollout scaling is not modelled).
* ``verl-dynamic``  veRL dynamic scheduling (PR #6556), one direction: idle trainer devices host rollout
                    while the next batch is not ready, if the expected wait beats two switch costs;
                    rollout devices never train.
* ``bidirl``        both directions. Rollout-on-TrainPool as above (lent trainers only generate groups of
                    the batch the train pool needs next, so the lease ends before the pool needs them,
                    and their samples are fresh). Trainer-on-RollPool: a rollout device idle because
                    admission blocks it joins the train step when the time saved, T/n - T/(n+k) for the
                    k blocked devices together (they switch in parallel), beats two switches plus the
                    gradient transfer; the primary stays the only optimizer. Steps stream: a step
                    starts on the groups of its batch already done while those it must contain still
                    generate (at eta 0 the rest of version k, at eta >= 1 the due tail)
                    (``bidirl-nostream`` waits for the whole batch, for the ablation).

Cost/benefit uses :class:`~bidirl.sched.estimates.Estimates` from the policy's provider: the
performance model (simulator) or measurements of the run itself (live).
"""

from __future__ import annotations

from typing import List

from bidirl.sched import events as ev
from bidirl.sched.cluster import Cluster
from bidirl.sched.estimates import StepProgress, balanced_split
from bidirl.sched.policies import AsyncPolicy, admission_blocked, fill_rollout, issue
from bidirl.sched.roles import DeviceState, Role


class RollPolicy(AsyncPolicy):
    name = "roll"

    def fill(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        share = -(-cluster.B // max(1, len(cluster.pool(Role.ROLLOUT))))  # one batch share per device
        fill_rollout(cluster, actions, share)


class StreamRLPolicy(AsyncPolicy):
    name = "streamrl"
    needs_estimates = True

    def default_rollout_devices(self, devices: int) -> int:
        if not self.estimates.measured:  # a live run measures as it goes: start from half
            return super().default_rollout_devices(devices)
        return balanced_split(devices, self.estimates, self.batch_groups)  # from the profile


class VerlDynamicPolicy(AsyncPolicy):
    """Rollout-on-TrainPool only."""

    name = "verl-dynamic"
    needs_estimates = True

    def before_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        self.end_trainer_leases(cluster, actions)
        self.lend_idle_trainers(cluster, actions)

    def next_batch_open(self, cluster: Cluster) -> int:
        """Groups of the batch the train pool needs next that are not admitted yet."""
        return max(0, min(cluster.version + 1, cluster.steps) * cluster.B - cluster.admitted)

    def lend_idle_trainers(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        if cluster.training is not None or cluster.batch_ready() or cluster.stream_ready():
            return  # (a trainer with gradient work to start is not idle)
        open_groups = self.next_batch_open(cluster)
        if not open_groups or not cluster.idle_sets[Role.TRAIN]:
            return
        generating = max(1, sum(1 for d in cluster.devices if d.role is Role.ROLLOUT))
        expected_wait = open_groups * self.estimates.generate_group_s / generating
        if expected_wait <= 2 * self.estimates.switch_s + self.estimates.lease_s(cluster.chunk_groups):
            return
        for d in cluster.idle(Role.TRAIN):
            if d.home is Role.TRAIN and not d.after_work and d.version == cluster.version:
                issue(cluster, actions, ev.Switch(d.index, Role.ROLLOUT, "trainer idle: lent to rollout"))

    def end_trainer_leases(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        for d in cluster.idle(Role.ROLLOUT):
            if d.home is Role.TRAIN and not d.after_work and (self.next_batch_open(cluster) == 0 or cluster.batch_ready()
                                                             or cluster.stream_ready()):
                issue(cluster, actions, ev.Switch(d.index, Role.TRAIN, "lease ends: batch complete"))

    def fill(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        fill_rollout(cluster, actions, home=Role.ROLLOUT)
        if self.next_batch_open(cluster) > 0:  # lent trainers only work on the batch the pool needs next
            fill_rollout(cluster, actions, min(cluster.chunk_groups, self.next_batch_open(cluster)), home=Role.TRAIN)


class BidirlPolicy(VerlDynamicPolicy):
    """Both directions; ``rollout_on_train``/``train_on_rollout`` switch each off for ablations.

    Trainer-on-RollPool follows the RFC: a step never waits for a borrowed device (the home trainers
    start at once, "startup drain"); a rollout device that admission blocks -- at the step's start or
    in the middle of it -- switches in and *joins* the step in progress (``Join``: it pulls part of the
    gradient work not yet done), if the time it saves on the work left beats its switch and gradient
    transfer. The primary stays the only optimizer; a borrowed device goes home when the step ends.
    The policy keeps its own estimate of the step's work left (from ``Estimates``), never a clock."""

    name = "bidirl"
    streams_gradients = True  # a step starts on the groups already done (Cluster.stream_plan)
    rollout_on_train = True  # idle trainers generate (Rollout-on-TrainPool)
    train_on_rollout = True  # blocked rollout devices compute gradients (Trainer-on-RollPool)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step = StepProgress(0.0, 1, 0.0)  # estimate of the step in progress
        self.stream_left = 0  # groups of a streamed step in progress still generating, as last seen

    def default_rollout_devices(self, devices: int) -> int:
        if not self.estimates.measured:  # a live run measures as it goes: start from half
            return max(1, devices // 2)
        return balanced_split(devices, self.estimates, self.batch_groups)  # the planner's job; balanced for now

    def before_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        self.follow_stream(cluster)
        self.end_trainer_leases(cluster, actions)
        if self.rollout_on_train:
            self.lend_idle_trainers(cluster, actions)
        self.join_or_return(cluster, actions)
        if self.train_on_rollout:
            self.lend_blocked_rollout(cluster, actions)

    def step_devices(self, cluster: Cluster) -> List:
        """Home trainers (all back from their leases, idle, current) plus borrowed devices already in;
        devices still switching in join the step later instead of delaying it."""
        home = cluster.pool(Role.TRAIN)
        if not all(d.role is Role.TRAIN and d.idle and d.version == cluster.version for d in home):
            return []
        switching_in = any(d.home is Role.ROLLOUT and d.role is Role.TRAIN and not d.idle for d in cluster.devices)
        if switching_in and not cluster.allows_join:
            return []  # a driver that cannot add devices to a running step: wait for the borrowed devices
        borrowed = [d for d in cluster.idle(Role.TRAIN) if d.home is Role.ROLLOUT and d.version == cluster.version]
        devices = home + borrowed
        plan = cluster.stream_plan()  # streamed: the groups the step will wait for
        done = cluster.B - (sum(plan.values()) if plan else 0)
        self.step = StepProgress(self.estimates.train_batch_s * done / cluster.B, len(devices), cluster.now)
        self.stream_left = cluster.B - done
        return devices

    def follow_stream(self, cluster: Cluster) -> None:
        """A streamed step's estimate gets the work of the groups that finished since (T/B each)."""
        if cluster.training is not None and cluster.streaming < self.stream_left:
            arrived = self.stream_left - cluster.streaming
            self.step.add(cluster.now, self.estimates.train_batch_s * arrived / cluster.B)
            self.stream_left = cluster.streaming

    def trainers(self, cluster: Cluster) -> int:
        """Devices sharing the step in progress, or the home trainers that will start the next one."""
        return self.step.devices if cluster.training is not None else len(cluster.pool(Role.TRAIN))

    def remaining_s(self, cluster: Cluster) -> float:
        """Estimated seconds left in the step in progress (the whole step, T/n, if it has not started)."""
        if cluster.training is None:
            return self.estimates.train_batch_s / self.trainers(cluster)
        return self.step.seconds_left(cluster.now)

    def pays(self, cluster: Cluster, joining: int) -> bool:
        """Would ``joining`` more devices, arriving after one switch, finish the work left sooner by
        more than the switch home they cost afterwards?"""
        est, left = self.estimates, self.remaining_s(cluster)
        n = self.trainers(cluster) + sum(1 for d in cluster.devices if d.home is Role.ROLLOUT and d.role is Role.TRAIN
                                         and d.state is DeviceState.SWITCHING)  # already on their way in
        # joiners return their gradients to the primary one after another
        with_help = est.switch_s + max(0.0, left - est.switch_s) * n / (n + joining) + joining * est.grad_transfer_s
        return left - with_help > est.switch_s

    def join_or_return(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """A borrowed device that has switched in joins the step in progress; between steps it waits for
        the next one only if that batch is ready, else it goes home."""
        for d in cluster.idle(Role.TRAIN):
            if d.home is not Role.ROLLOUT or d.after_work:
                continue
            if cluster.accepting_joins and d.version == cluster.version and d.index not in cluster.expired \
                    and self.remaining_s(cluster) > self.estimates.grad_transfer_s + self.estimates.switch_s:
                issue(cluster, actions, ev.Join(d.index))
                self.step.join(cluster.now)
            elif cluster.training is not None or not self.step_can_start(cluster) or d.version != cluster.version:
                issue(cluster, actions, ev.Switch(d.index, Role.ROLLOUT, "lease ends"))

    @staticmethod
    def step_can_start(cluster: Cluster) -> bool:
        """The next step may start now: its batch is ready, or (streamed) part of it is done."""
        return cluster.training is None and (cluster.batch_ready() or cluster.stream_ready())

    def lend_blocked_rollout(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """Lend every rollout device that admission blocks, while a step runs (if the driver lets devices
        join it) or its batch is ready."""
        if not (cluster.accepting_joins or self.step_can_start(cluster)):
            return
        blocked = [d for d in cluster.idle(Role.ROLLOUT)
                   if d.home is Role.ROLLOUT and not d.after_work and d.version == cluster.version
                   and admission_blocked(cluster, d)]
        if blocked and self.pays(cluster, len(blocked)):
            for d in blocked:
                issue(cluster, actions, ev.Switch(d.index, Role.TRAIN, "admission blocked: lent to training"))


# ablations: the bidirl partition with no borrowing, or one direction only
class BidirlNoBorrowing(BidirlPolicy):
    name, rollout_on_train, train_on_rollout = "bidirl-none", False, False


class BidirlRolloutOnTrainOnly(BidirlPolicy):
    name, rollout_on_train, train_on_rollout = "bidirl-rot", True, False


class BidirlTrainOnRolloutOnly(BidirlPolicy):
    name, rollout_on_train, train_on_rollout = "bidirl-tor", False, True


class BidirlNoStreaming(BidirlPolicy):  # both directions, every step waits for its whole batch
    name, streams_gradients = "bidirl-nostream", False
