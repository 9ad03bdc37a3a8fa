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
                    rollout devices never train. Where the driver can move requests in flight, a
                    lent trainer takes in-flight requests from the most loaded rollout devices up to
                    the pool's mean load (``dynamic_schedule_enable_rebalance``: abort, resume on the
                    least-loaded replica with the generated tokens kept).
* ``bidirl``        both directions. Rollout-on-TrainPool as above (lent trainers only generate groups of
                    the batch the train pool needs next, so the lease ends before the pool needs them,
                    and their samples are fresh -- or, once the pool has started all of that batch, one
                    chunk of the batch after, sized to end with it: ``lend_ahead``). Idle trainers also
                    take over in flight the older tails rollout devices decode alone (``lend_for_tail``:
                    where trainers are to spare no new group goes beside an older tail, so tails form):
                    one trainer for them all, or, where the train pool idles longer than a tail lasts
                    every step, one per tail that cannot merge. Elsewhere new groups join older tails
                    (``tail_placement``: none), since its steps stream.
                    Trainer-on-RollPool: a rollout device idle because admission blocks it joins the
                    train step when the time saved, T/n - T/(n+k) for the k blocked devices together
                    (they switch in parallel), beats two switches plus the gradient transfer; the
                    primary stays the only optimizer. Steps stream: a step starts on the groups of
                    its batch already done while those it must contain still generate (at eta 0 the
                    rest of version k, at eta >= 1 the due tail) (``bidirl-nostream`` waits for the
                    whole batch, for the ablation). Where nothing more may be admitted while a step
                    streams (eta 0, once the batch has started), the batch's tails merge onto fewer
                    devices and the devices they leave join the step (``free_for_training``), where
                    the steps measured leave enough training after their last group.

Cost/benefit uses :class:`~bidirl.sched.estimates.Estimates` from the policy's provider: the
performance model (simulator) or measurements of the run itself (live).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Deque, List

from bidirl.sched import events as ev
from bidirl.sched.cluster import Cluster, TailPlacement
from bidirl.sched.estimates import StepProgress, balanced_split
from bidirl.sched.policies import AsyncPolicy, all_admitted, fill_rollout, issue
from bidirl.sched.roles import Device, DeviceState, Role


class RollPolicy(AsyncPolicy):
    name = "roll"
    style = "ROLL-style asynchronous, one batch share per rollout device"

    def fill(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        share = -(-cluster.B // max(1, cluster.pool_size(Role.ROLLOUT)))  # one batch share per device
        fill_rollout(cluster, actions, share)


class StreamRLPolicy(AsyncPolicy):
    name = "streamrl"
    style = "StreamRL-style streamed generation on a balanced static split"
    needs_estimates = True

    def default_rollout_devices(self, devices: int) -> int:
        if not self.estimates.measured:  # a live run measures as it goes: start from half
            return super().default_rollout_devices(devices)
        return balanced_split(devices, self.estimates, self.batch_groups)  # from the profile


class VerlDynamicPolicy(AsyncPolicy):
    """Rollout-on-TrainPool only."""

    name = "verl-dynamic"
    style = "veRL dynamic scheduling: idle trainers generate (one direction)"
    needs_estimates = True
    migrates = True  # requests in flight move onto lent trainers

    def before_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        self.rebalance(cluster, actions)
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
        est = self.estimates
        serving = cluster.serving_role(Role.ROLLOUT)
        # an engine's first chunk of the run takes its warm-up too (est.rollout_warmup_s): the pool's, if
        # none of its devices has finished one yet, and a lent trainer's, before its lease does any good
        warming = est.rollout_warmup_s if serving.isdisjoint(cluster.warmed) else 0.0
        expected_wait = warming + open_groups * est.generate_group_s / max(1, len(serving))
        lease = 2 * est.switch_s + est.lease_s(cluster.chunk_groups)
        if expected_wait <= lease:
            return
        for d in cluster.idle(Role.TRAIN):
            if d.home is Role.TRAIN and not d.after_work and d.version == cluster.version \
                    and expected_wait > lease + self.warm_up_left(cluster, d) and self.may_lend(cluster, d):
                issue(cluster, actions, ev.Switch(d.index, Role.ROLLOUT, "trainer idle: lent to rollout"))

    def may_lend(self, cluster: Cluster, trainer: Device) -> bool:
        """May ``trainer``, idle, be lent to generate the next batch's open groups? Any trainer may here."""
        return True

    def warm_up_left(self, cluster: Cluster, device: Device) -> float:
        """What ``device``'s rollout engine still has to warm up before it generates: all of the estimated
        warm-up until it has finished a chunk this run, then nothing."""
        return 0.0 if device.index in cluster.warmed else self.estimates.rollout_warmup_s

    # ---- in-flight migration ------------------------------------------------------------------------
    def migrating(self, cluster: Cluster) -> bool:
        return self.migrates and cluster.allows_migration

    def rebalance(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """veRL's ``dynamic_schedule_enable_rebalance``: a trainer lent to rollout takes requests in flight
        from the most loaded rollout devices (their oldest groups first, so the batch the train pool needs
        next is what it helps finish) until it holds the pool's mean load -- from one source, one version, where
        moved requests do not join a running batch (``Cluster.can_take_requests``: it is idle, then not)."""
        if not self.migrating(cluster) or self.lease_over(cluster):
            return  # (a lent trainer whose lease is over goes home instead of taking more)
        takers = self.lent_to_rollout(cluster)
        pool = [d for d in cluster.at_home(Role.ROLLOUT) if d.state is DeviceState.GENERATING and not d.after_work]
        if not takers or not pool:
            return
        load = {d.index: cluster.inflight[d.index] for d in pool + takers}
        mean = sum(load.values()) // len(load)
        for taker in takers:
            while load[taker.index] < mean:
                source = max(pool, key=lambda d: (load[d.index], -d.index))
                version = min(cluster.inflight_by_version[source.index], default=taker.version + 1)
                surplus = load[source.index] - mean
                if surplus <= 0 or version > taker.version:
                    break
                groups = min(mean - load[taker.index], surplus, cluster.inflight_by_version[source.index][version])
                issue(cluster, actions, ev.Migrate(source.index, taker.index, groups, version))
                load[source.index] -= groups
                load[taker.index] += groups
                if not cluster.can_take_requests(taker):
                    break  # (it runs moved requests after its batch: it takes them from one source, now)

    @staticmethod
    def lent_to_rollout(cluster: Cluster) -> List[Device]:
        """Home trainers lent to rollout that can take requests now (``Cluster.can_take_requests``)."""
        return [d for d in cluster.lent_to(Role.ROLLOUT) if cluster.can_take_requests(d)]

    def lease_over(self, cluster: Cluster) -> bool:
        """A trainer lent to rollout goes home once idle: the next batch is fully admitted or can train."""
        return self.next_batch_open(cluster) == 0 or cluster.batch_ready() or cluster.stream_ready()

    def end_trainer_leases(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        if not cluster.serving[(Role.ROLLOUT, Role.TRAIN)]:  # no trainer is lent (most events): O(1)
            return
        for d in cluster.lent_to(Role.ROLLOUT):
            if d.idle and not d.after_work and self.lease_over(cluster):
                issue(cluster, actions, ev.Switch(d.index, Role.TRAIN, "lease ends: batch complete"))

    def fill(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        every_older_tail = self.tails_go_to_trainers(cluster)
        fill_rollout(cluster, actions, home=Role.ROLLOUT, every_older_tail=every_older_tail)
        open_groups = self.next_batch_open(cluster)
        if open_groups > 0:  # lent trainers only work on the batch the pool needs next (every chunk they
            # take, not only each one: the fair share alone let them run on into later batches)
            fill_rollout(cluster, actions, min(cluster.chunk_groups, open_groups), home=Role.TRAIN,
                         until=cluster.admitted + open_groups, every_older_tail=every_older_tail)

    def tails_go_to_trainers(self, cluster: Cluster) -> bool:
        """Do idle trainers take older tails over, so that no new group should go beside one? Never here."""
        return False


class BidirlPolicy(VerlDynamicPolicy):
    """Both directions; ``rollout_on_train``/``train_on_rollout`` switch each off for ablations.

    Trainer-on-RollPool follows the RFC: a step never waits for a borrowed device (the home trainers
    start at once, "startup drain"); a rollout device that admission blocks -- at the step's start or
    in the middle of it -- switches in and *joins* the step in progress (``Join``: it pulls part of the
    gradient work not yet done), if the time it saves on the work left beats its switch and gradient
    transfer. The primary stays the only optimizer; a borrowed device goes home when the step ends.
    The policy keeps its own estimate of the step's work left (from ``Estimates``), never a clock."""

    name = "bidirl"
    MERGE_SLOWDOWN = 1.25  # the most a tail merge may slow the decode steps of the groups it moves
    streams_gradients = True  # a step starts on the groups already done (Cluster.stream_plan)
    rollout_on_train = True  # idle trainers generate (Rollout-on-TrainPool)
    train_on_rollout = True  # blocked rollout devices compute gradients (Trainer-on-RollPool)
    recomputes_logprob = False  # one optimizer step per batch: proximal log-probs from the training forward
    # new groups join every older tail's decode batch (unless lent trainers take those tails over,
    # tails_go_to_trainers): a streamed step trains the groups already done while a due tail decodes, so a
    # slower tail costs its trainers less than the capacity the tail alone leaves idle. Measured (bidirl-none:
    # streamed steps only, 7B/32 H100, seeds 0-2, 2026-12-06): +18% at gsm8k eta 1 16/16, +23-25% at math
    # eta 1 16/16 and 20/12; areal (no streamed steps) loses 9-14% at gsm8k eta 1 without the due rule
    tail_placement = TailPlacement.NONE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step = StepProgress(0.0, 1, 0.0)  # estimate of the step in progress
        self.stream_left = 0  # groups of a streamed step in progress still generating, as last seen
        self.ahead = {}  # trainer lent ahead (lend_ahead) -> groups past the next batch it may still start
        self.last_step_start, self.step_period = None, 0.0  # (moving average of the time between step starts)
        # the training a streamed step had left when its last group arrived, in steps where no tail merged for
        # it (free_for_training): what merging tails could have done earlier, measured where it did not
        self.backlogs: Deque[float] = deque(maxlen=3)
        self.unmerged_steps, self.merged_in_step = 0, False

    def default_rollout_devices(self, devices: int) -> int:
        if not self.estimates.measured:  # a live run measures as it goes: start from half
            return max(1, devices // 2)
        return balanced_split(devices, self.estimates, self.batch_groups)  # the planner's job; balanced for now

    def before_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        self.follow_stream(cluster)
        self.consolidate_tail(cluster, actions)
        self.free_for_training(cluster, actions)
        self.end_trainer_leases(cluster, actions)
        if self.rollout_on_train:
            self.lend_idle_trainers(cluster, actions)
            self.lend_for_tail(cluster, actions)
        self.join_or_return(cluster, actions)
        if self.train_on_rollout:
            self.lend_blocked_rollout(cluster, actions)

    def fill(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """The rollout pool, then trainers lent for the next batch (as ``verl-dynamic``), then a trainer lent
        ahead: its one chunk of the groups after the next batch; last, whether to lend one ahead now."""
        before = cluster.admitted
        super().fill(cluster, actions)
        for index, groups in list(self.ahead.items()):
            device = cluster.devices[index]
            if self.may_start_ahead(cluster, device) and device.idle and self.next_batch_open(cluster) == 0:
                fill_rollout(cluster, actions, groups, home=Role.TRAIN, until=cluster.admitted + groups)
            if not self.may_start_ahead(cluster, device):
                del self.ahead[index]  # its chunk started (one per lease), or it never will: the lease ends
        if self.rollout_on_train:
            self.lend_ahead(cluster, actions, before)

    def may_lend(self, cluster: Cluster, trainer: Device) -> bool:
        """Not the primary, where steps stream, it has other trainers, and it pays to keep it home
        (``primary_pays_home``): no step starts without it, and a streamed step could start on the first
        groups done (at eta 0, a few seconds into the batch), while a lent primary is back only once its
        chunk's longest sequence ends, near the end of the batch. So the step trained nothing while the
        batch generated, and all of it after (math eta 0, 7B on 32 H100s: 8.5-18 s of a 78-86 s step). Kept
        home, it starts the step on the first group done, and the lent trainers join it as their chunks
        end: 6-11 s of training followed the last group."""
        return not (self.streams_gradients and trainer.index == cluster.primary and cluster.pool_size(Role.TRAIN) > 1
                    and self.primary_pays_home(cluster))

    def primary_pays_home(self, cluster: Cluster) -> bool:
        """Does the training a primary kept home overlaps with the batch's generation beat the generation
        it then leaves to the others? Of U units, home it overlaps about half of a unit's share of the
        step's work, T / 2U (traced: the training after the last group fell from 8.5-18 s to 6-11 s, of T / U
        = 14.6 s); lent, it would generate its share of the batch, B g / U, and the other U - 1 end that much
        sooner: B g / (U (U - 1)). So: T (U - 1) > 2 B g. With one-device units (U = 32) it holds by 3.5-15x in
        the table's eta 0 rows; with instances of 8 devices (U = 4, 32B) it does not: there a unit is a
        quarter of the cluster, and keeping it home cost 10%. Nothing measured yet: no."""
        est, units = self.estimates, len(cluster.devices)
        return est.train_batch_s * (units - 1) > 2 * cluster.B * est.generate_group_s > 0

    def may_start_ahead(self, cluster: Cluster, device: Device) -> bool:
        """May ``device``, lent ahead, still start its chunk? Not once it has work in flight (its chunk, or
        tails moved onto it), nor once a step runs or can start (one that started without it, if it is not
        the primary, waits for it to join), nor while the bound admits nothing more."""
        return (device.role is Role.ROLLOUT and not cluster.inflight[device.index] and cluster.training is None
                and not self.step_can_start(cluster) and cluster.admissible(device) > 0)

    def lend_ahead(self, cluster: Cluster, actions: List[ev.Action], before: int) -> None:
        """Rollout-on-TrainPool past the next batch, at eta >= 1. When the rollout pool has just started the
        last groups of the batch the train pool needs next, the home trainers have nothing to do until those
        end -- nothing to train, and nothing of that batch left to generate, so ``lend_idle_trainers`` finds
        no work for them (it never does where one chunk is a whole batch: then the first batch of every run
        waited on one device while the trainers idled). One idle trainer is lent for one chunk of the groups
        after that batch the staleness bound already admits, no bigger than the chunk just started: on an
        equal engine, with the same weights and task, it ends with that chunk in expectation, so the lease
        ends when the step needs the trainer -- if that chunk's time beats the two switches (and the
        trainer's engine warm-up, if any). Nothing measured (a live run without a prior): nothing lent.
        (If older tails await it when it arrives, ``consolidate_tail`` gives it those instead, as any trainer
        lent to rollout, and its lease ends with them: one piece of work per lease, ``may_start_ahead``.)"""
        end = min(cluster.version + 1, cluster.steps) * cluster.B  # the next batch's groups end here
        if not before < end <= cluster.admitted:
            return  # its last groups did not start now (most calls: O(1)), so how long they have left is not known
        if cluster.training is not None or self.step_can_start(cluster) or cluster.serving[(Role.ROLLOUT, Role.TRAIN)] \
                or self.ahead:
            return
        largest = max((a.groups for a in actions if isinstance(a, ev.Generate)
                       and cluster.devices[a.device].home is Role.ROLLOUT), default=0)  # the chunk just started
        est = self.estimates
        wait = est.lease_s(cluster.chunk_groups) * largest / cluster.chunk_groups
        for d in cluster.idle(Role.TRAIN):
            if d.home is not Role.TRAIN or d.after_work or d.version != cluster.version:
                continue
            groups = min(largest, cluster.chunk_groups, cluster.admissible(d))
            if groups > 0 and wait > 2 * est.switch_s + self.warm_up_left(cluster, d):
                self.ahead[d.index] = groups
                issue(cluster, actions, ev.Switch(d.index, Role.ROLLOUT, "trainer idle: lent ahead of the next batch"))
            return  # one trainer at a time

    def lease_over(self, cluster: Cluster) -> bool:
        """As ``verl-dynamic``'s, except while a trainer lent ahead may still start its chunk."""
        if any(self.may_start_ahead(cluster, cluster.devices[i]) for i in self.ahead):
            return False
        return super().lease_over(cluster)

    def step_devices(self, cluster: Cluster) -> List:
        """Home trainers (idle, current; those away on a lease join when back, the primary never is)
        plus borrowed devices already in; devices still switching in join the step later instead of
        delaying it."""
        home = cluster.at_home(Role.TRAIN)
        if cluster.devices[cluster.primary].lent or \
                not all(d.role is Role.TRAIN and d.idle and d.version == cluster.version for d in home):
            return []
        switching_in = any(not d.idle for d in cluster.lent_to(Role.TRAIN))
        if switching_in and not cluster.allows_join:
            return []  # a driver that cannot add devices to a running step: wait for the borrowed devices
        borrowed = [d for d in cluster.idle(Role.TRAIN) if d.home is Role.ROLLOUT and d.version == cluster.version]
        devices = home + borrowed
        plan = cluster.stream_plan()  # streamed: the groups the step will wait for
        done = cluster.B - (sum(plan.values()) if plan else 0)
        self.step = StepProgress(self.estimates.train_batch_s * done / cluster.B, len(devices), cluster.now)
        if self.last_step_start is not None:
            period = cluster.now - self.last_step_start
            self.step_period = 0.7 * self.step_period + 0.3 * period if self.step_period else period
        self.last_step_start = cluster.now
        self.stream_left = cluster.B - done
        self.merged_in_step = False
        return devices

    def follow_stream(self, cluster: Cluster) -> None:
        """A streamed step's estimate gets the work of the groups that finished since (T/B each)."""
        if cluster.training is not None and cluster.streaming < self.stream_left:
            arrived = self.stream_left - cluster.streaming
            self.step.add(cluster.now, self.estimates.train_batch_s * arrived / cluster.B)
            self.stream_left = cluster.streaming
            if not self.stream_left and not self.merged_in_step:  # (a run's first such step is not its steady state)
                self.unmerged_steps += 1
                if self.unmerged_steps > 1:
                    self.backlogs.append(self.step.seconds_left(cluster.now))

    def trainers(self, cluster: Cluster) -> int:
        """Devices sharing the step in progress, or the home trainers that will start the next one."""
        return self.step.devices if cluster.training is not None else cluster.pool_size(Role.TRAIN)

    def remaining_s(self, cluster: Cluster) -> float:
        """Estimated seconds left in the step in progress (the whole step, T/n, if it has not started)."""
        if cluster.training is None:
            return self.estimates.train_batch_s / self.trainers(cluster)
        return self.step.seconds_left(cluster.now)

    def pays(self, cluster: Cluster, joining: int) -> bool:
        """Would ``joining`` more devices, arriving after one switch, finish the work left sooner by
        more than the switch home they cost afterwards?"""
        est, left = self.estimates, self.remaining_s(cluster)
        switching = (cluster.devices[i] for i in cluster.switching)  # (a set the cluster keeps: not every device)
        on_their_way_in = sum(1 for d in switching if d.home is Role.ROLLOUT and d.role is Role.TRAIN)
        n = self.trainers(cluster) + on_their_way_in
        # joiners return their gradients to the primary one after another
        with_help = est.switch_s + max(0.0, left - est.switch_s) * n / (n + joining) + joining * est.grad_transfer_s
        return left - with_help > est.switch_s

    def join_or_return(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """A borrowed device that has switched in joins the step in progress; between steps it waits for
        the next one only if that batch is ready, else it goes home."""
        if cluster.training is None:  # (home trainers join only a step in progress: only lent ones to look at)
            idle = [d for d in cluster.lent_to(Role.TRAIN) if d.idle]
        else:
            idle = cluster.idle(Role.TRAIN)
        for d in idle:
            if d.after_work:
                continue
            if d.home is Role.TRAIN:  # back from a lease while a step runs: it steps its replica with the rest
                if d.index not in cluster.training_devices and d.version == cluster.version:
                    issue(cluster, actions, ev.Join(d.index))
                    self.step.join(cluster.now)
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

    # ---- in-flight migration: the tail consolidated, on a lent trainer where one is idle -------------
    @staticmethod
    def tail_holders(cluster: Cluster) -> List[Device]:
        """Rollout-pool devices decoding only groups older than the weights they hold -- or will load once
        that work ends, where generation cannot be interrupted for a load (the live runtime). Each decodes
        a few sequences at a fraction of its capacity: no new group went beside its tail, because
        admission blocked, because the placement rule kept them off (``fill_rollout``: a due tail under
        ``TailPlacement.DUE``, every tail where bidirl's trainers take them over), or because the driver
        gives a device one chunk at a time (the live runtime, unless ``launch.inflight_groups`` lets chunks
        join a batch in flight)."""
        return [cluster.devices[i] for i in cluster.older_tails()]  # (kept by the cluster as devices change)

    @staticmethod
    def any_admissible_next(cluster: Cluster) -> bool:
        """Could any device start new groups once its tail has gone? False while admission blocks every
        device (most events): no device holds or loads weights newer than ``cluster.version`` and the
        admission limit never falls as the version grows, so ``admissible_next`` is then <= 0 for every
        tail holder -- an O(1) answer where ``tail_holders`` looks at every generating device."""
        return cluster.admission_limit(cluster.version) > cluster.admitted

    @staticmethod
    def admissible_next(cluster: Cluster, device: Device) -> int:
        """Groups ``device`` could start once its tail has gone, with the weights it will then hold."""
        return cluster.admission_limit(cluster.weights_next(device)) - cluster.admitted

    def consolidate_tail(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """Move the older tails of rollout devices onto a trainer lent to rollout, if one is -- onto each of
        them where trainers are to spare (``trainers_to_spare``) -- else onto the holder with the most
        groups, where the driver adds moved requests to a running batch (``migrates_into_batch``; the live
        runtime does not, so there only an idle lent trainer takes tails): smallest tails first, while the
        target has room and the weights to continue them, so the devices they leave start admissible new
        groups. What a target takes is ``tail_merge``'s: tails merge
        only while no group's decode step grows past ``MERGE_SLOWDOWN`` of its present one (the decode line
        at a tail's context: short tails are weight-bound and merge almost for free, long-context ones are
        not and stay put, or go to a lent trainer of their own) -- every older group is awaited by some
        batch soon."""
        if not self.migrating(cluster) or not self.any_admissible_next(cluster):
            return
        holders = self.tail_holders(cluster)
        if not holders or all(self.admissible_next(cluster, d) <= 0 for d in holders):
            return
        # (a lent trainer the next step could use goes home instead)
        takers = [] if self.step_wants_trainers(cluster) else self.lent_to_rollout(cluster)
        spare = bool(takers) and self.trainers_to_spare(cluster)
        if len(takers) > 1 and not spare:
            takers = takers[:1]
        for taker in takers or [None]:
            # (a holder is generating: it takes tails only where moved requests join its batch; one with a
            # load queued takes nothing)
            can_take = [d for d in holders if cluster.can_take_requests(d)]
            if taker is None and (len(holders) < 2 or not can_take):
                return
            target = taker or max(can_take, key=lambda d: (cluster.inflight[d.index], -d.index))
            for d, version, n in self.tail_merge(cluster, target, holders, spare):
                issue(cluster, actions, ev.Migrate(d.index, target.index, n, version))
            holders = self.tail_holders(cluster)  # (the next taker: those this one emptied are gone)
            if not holders:
                return

    def free_for_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """While a streamed step runs and nothing more may be admitted (on-policy, once the whole batch has
        started), merge the tails of the devices still generating onto the fullest of them, so the devices
        they leave switch to the step -- a rollout device by Trainer-on-RollPool (``lend_blocked_rollout``),
        a lent trainer by going home and joining it. Merges are ``tail_merge``'s: the smallest tails first,
        each within ``MERGE_SLOWDOWN`` and the target's room. Only where it pays twice over: the steps that
        merged nothing left more training after their last group than a freed device's round trip
        (``backlog_pays``), and one more device on the step in progress pays (``pays``).

        Why: at eta 0 every device holds a share of the batch, and every share holds a long sequence or two,
        so every device generates until near the batch's end, and much of the step's training comes after it
        (traced at math eta 0, 2/30, seed 0, chunk 8: 31 devices generating for 70% of a 79 s step, then
        11 s of training after the last group). Merged, the tails decode a little slower (the generation
        ended 68 -> 71 s into the step) and the devices they leave train meanwhile (11 -> 5 s after it).
        Where little training is left after the batch (gsm8k on 8 devices: 0.1 s), a merge only slows the
        tails: there the measured backlog keeps it off.
        Only where moved requests join a running batch (``migrates_into_batch``): the live runtime's devices
        each hold one chunk, so there no generating device takes a tail, and this does nothing."""
        if not self.migrating(cluster) or not self.train_on_rollout or not cluster.migrates_into_batch \
                or cluster.training is None or not cluster.accepting_joins or self.any_admissible_next(cluster) \
                or not self.backlog_pays():
            return
        devices, inflight = cluster.devices, cluster.inflight
        holders = [devices[i] for i in cluster.serving_role(Role.ROLLOUT)
                   if devices[i].state is DeviceState.GENERATING and inflight[i] and not devices[i].after_work]
        if len(holders) < 2 or not self.pays(cluster, 1):
            return
        holders.sort(key=lambda d: (-inflight[d.index], d.index))
        done = set()  # devices that gave their tail away, or took others' (a target gives nothing away)
        for target in holders:
            if target.index in done or not cluster.can_take_requests(target):
                continue
            rest = [d for d in holders if d is not target and d.index not in done and d.version <= target.version]
            if not rest:
                return
            for d, version, n in self.tail_merge(cluster, target, rest, True):
                issue(cluster, actions, ev.Migrate(d.index, target.index, n, version))
                done.add(d.index)
                self.merged_in_step = True
            done.add(target.index)

    def backlog_pays(self) -> bool:
        """Did the last steps that merged no tail (up to three, from the run's second on) have more training
        left when their last group arrived than a device freed for it spends getting there and back (two
        switches and its gradients' transfer)? Measured, since nothing else says how a batch's generation
        ends; once merges run, only a step that merged nothing measures again."""
        est, measured = self.estimates, self.backlogs
        return bool(measured) and sum(measured) / len(measured) > 2 * est.switch_s + est.grad_transfer_s

    def tail_merge(self, cluster: Cluster, target: Device, holders: List[Device], spare: bool) -> List:
        """(holder, version, groups) of the older tails ``target`` takes: the smallest first, while each
        merge keeps every group's decode step within ``MERGE_SLOWDOWN`` and fits ``target``'s room. A
        rollout-pool target takes whole tails, and so does a lent trainer where trainers are to ``spare``
        (``trainers_to_spare``, as the caller found); else a lent trainer takes only the groups due (the
        next batch's), so that it is back when the step needs it. Where moved requests do not join a running
        batch (``migrates_into_batch``), one tail of one version only."""
        due, est = cluster.due_version, self.estimates
        inflight, by_version = cluster.inflight, cluster.inflight_by_version
        everything = spare or target.home is Role.ROLLOUT
        merged = inflight[target.index]
        slowest = merged or math.inf  # the smallest decode batch a merge so far would slow down
        moves = []
        # (the innermost scan of a simulated run, at most events: the cheap tests first, and the groups that
        # would move listed only for a merge that happens)
        for d in sorted(holders, key=lambda d: (inflight[d.index], d.index)):
            if d is target or d.version > target.version:
                continue  # (a tail continues only on weights at least as new as those it last decoded with)
            versions = by_version[d.index]
            groups = inflight[d.index] if everything else sum(n for v, n in versions.items() if v <= due)
            if not groups or merged + groups > cluster.inflight_groups:
                continue
            smallest = min(slowest, inflight[d.index])
            if est.merged_slowdown(smallest, merged + groups) > self.MERGE_SLOWDOWN:
                continue
            if not cluster.migrates_into_batch:  # (an idle target runs one move now, a second only after it)
                oldest = min(versions)  # (<= due: some due groups are there)
                return [(d, oldest, versions[oldest])]
            moves += [(d, version, n) for version, n in sorted(versions.items()) if everything or version <= due]
            merged, slowest = merged + groups, smallest
        return moves

    def step_wants_trainers(self, cluster: Cluster) -> bool:
        """Should idle trainers stay for the next step rather than take tails over? Yes once it can start --
        except, where trainers are to spare, a streamed step that can start only because its due groups are
        known: it would wait for them with every trainer idle in it. Trainers lent now take the older tails
        over (among them the due groups it waits for); the primary starts it with the rest, and the lent
        ones join it when back."""
        if cluster.training is not None:
            return False  # (step_can_start, with batch_ready asked once)
        return cluster.batch_ready() or (not self.trainers_to_spare(cluster) and cluster.stream_ready())

    def tails_go_to_trainers(self, cluster: Cluster) -> bool:
        """Where trainers are to spare, lent trainers take older tails over whole (``lend_for_tail``), due or
        not: the placement rule then keeps new groups away from every older tail, not only from due ones,
        so the tail moves and the device it leaves starts new groups alone. (Beside a tail that stays,
        they would slow it; at case C's 4/12, eta 4, new groups beside undue tails read 8.69 samples/s
        against 10.02 with the tails moved.)"""
        return self.rollout_on_train and self.migrating(cluster) and self.tail_lease_pays(cluster) \
            and self.trainers_to_spare(cluster)

    def tail_lease_pays(self, cluster: Cluster) -> bool:
        """Does a tail's expected time left (half a chunk's time alone on a device) beat the two switches a
        lease costs? If not, no trainer takes a tail (``lend_for_tail``), so no tail waits for one."""
        est = self.estimates
        return 0.5 * est.lease_s(cluster.chunk_groups) - 2 * est.switch_s > 0

    def trainers_to_spare(self, cluster: Cluster) -> bool:
        """Does the train pool idle longer than a tail lasts (half a chunk's time alone on a device), every
        step? Measured: the time between step starts (a moving average) less the step's own work on the
        pool's trainers. Where it does (a rollout-bound split, as case C's 4 rollout / 12 train), trainers
        lent to take older tails over are back before the next step needs them, in expectation. Never for
        a train pool of one: that trainer is the primary, and no step starts without it."""
        est, trainers = self.estimates, cluster.pool_size(Role.TRAIN)
        return trainers > 1 and self.step_period - est.train_batch_s / trainers > 0.5 * est.lease_s(cluster.chunk_groups)

    def lend_for_tail(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """Home trainers (the primary only if it is the train pool's one device), idle while their next
        batch is not ready, are lent to take over the rollout pool's older tails, so the devices holding
        them start new groups -- if a tail's expected time left (half a chunk's time alone on a device)
        beats the two switches a lease costs. How many, and which tails:
          * one for the groups of those tails the next batch awaits, if none is lent already and merging
            them all stays within ``MERGE_SLOWDOWN``;
          * where trainers are to spare (``trainers_to_spare``), as many as the tails need when merged as
            ``consolidate_tail`` merges them (a long-context tail that merges with nothing gets a trainer of
            its own), less those lent already and still without work; and they take whole tails, the next
            batch's groups or later ones.
        Only where trainers are to spare more than one: each trainer away holds up the next step's
        optimizer step until its tail is done, and at a balanced split the next step soon needs every
        trainer. (With one trainer for all, the rollout-bound case C lent none at eta >= 1: its long-context
        tails could not merge, and every rollout device spent most of its time decoding its older tail alone
        while 11 trainers idled.)"""
        if not self.migrating(cluster) or cluster.training is not None or not cluster.idle_sets[Role.TRAIN] \
                or not self.any_admissible_next(cluster) or self.step_wants_trainers(cluster):
            return
        holders, est = self.tail_holders(cluster), self.estimates
        due = {d.index: cluster.due_groups(d.index) for d in holders}
        spare = self.trainers_to_spare(cluster)
        awaited = holders if spare else [d for d in holders if due.get(d.index, 0)]
        if not awaited or all(self.admissible_next(cluster, d) <= 0 for d in holders):
            return
        if not self.tail_lease_pays(cluster):
            return
        if spare:
            needed = 0
            while awaited:  # the trainers the tails need: each takes what consolidate_tail would give it
                moved = {d.index for d, _, _ in self.tail_merge(cluster, cluster.devices[cluster.primary], awaited,
                                                                   spare)}
                if not moved:
                    break  # (no tail left fits a trainer's room)
                awaited, needed = [d for d in awaited if d.index not in moved], needed + 1
            needed -= sum(1 for d in cluster.lent_to(Role.ROLLOUT)
                          if d.state is DeviceState.SWITCHING or (d.idle and not cluster.inflight[d.index]))
        else:  # one lease for all the tails merged
            sizes = [due[d.index] for d in awaited]
            if cluster.serving[(Role.ROLLOUT, Role.TRAIN)] or \
                    est.merged_slowdown(min(sizes), sum(sizes)) > self.MERGE_SLOWDOWN:
                return
            needed = 1
        alone = cluster.pool_size(Role.TRAIN) == 1  # the primary may go only if no other trainer could
        # (a cold trainer's engine warm-up is not weighed here, unlike in lend_idle_trainers: it is paid once
        # a run, and gated on it a tail lease would turn on the first chunk's timing -- with the CPU default's
        # 2 s warm-up inside the run, beside tails of a tenth of a second, it ruled tail leases out for good.
        # The live workers now pay that warm-up at start-up: bidirl.runtime.worker, warm_up_rollout)
        for d in cluster.idle(Role.TRAIN):
            if needed <= 0:
                return
            if d.home is Role.TRAIN and (d.index != cluster.primary or alone) and not d.after_work \
                    and d.version == cluster.version:
                issue(cluster, actions, ev.Switch(d.index, Role.ROLLOUT, "trainer idle: takes over older tails"))
                needed -= 1

    def lend_blocked_rollout(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """Lend every rollout device that has nothing to start -- admission blocks it, or (the run's last
        steps) every group is admitted -- while a step runs (if the driver lets devices join it) or its
        batch is ready."""
        if not (cluster.accepting_joins or self.step_can_start(cluster)) or not cluster.idle_sets[Role.ROLLOUT]:
            return
        done = all_admitted(cluster)
        # (admission blocks a device by the weights it holds, and only devices holding the newest are lent:
        # asked once, not per idle device -- at 1,024 devices this list was a fifth of a simulation's time)
        if not done and cluster.admission_limit(cluster.version) > cluster.admitted:
            return
        blocked = [d for d in cluster.idle(Role.ROLLOUT)
                   if d.home is Role.ROLLOUT and not d.after_work and d.version == cluster.version]
        if blocked and self.pays(cluster, len(blocked)):
            why = "every group admitted" if done else "admission blocked"
            for d in blocked:
                issue(cluster, actions, ev.Switch(d.index, Role.TRAIN, f"{why}: lent to training"))


# ablations: the bidirl partition with no borrowing, or one direction only
class BidirlNoBorrowing(BidirlPolicy):  # streamed steps only: nothing lent, no request moved
    name, rollout_on_train, train_on_rollout, migrates = "bidirl-none", False, False, False


class BidirlRolloutOnTrainOnly(BidirlPolicy):
    name, rollout_on_train, train_on_rollout = "bidirl-rot", True, False


class BidirlTrainOnRolloutOnly(BidirlPolicy):
    name, rollout_on_train, train_on_rollout = "bidirl-tor", False, True


class BidirlNoStreaming(BidirlPolicy):  # both directions, every step waits for its whole batch
    name, streams_gradients = "bidirl-nostream", False
    tail_placement = TailPlacement.DUE  # (none pays for streamed steps, BidirlPolicy.tail_placement: not here)


class BidirlNoMigration(BidirlPolicy):  # no request moves: lent trainers only start new groups
    name, migrates = "bidirl-nomigrate", False
