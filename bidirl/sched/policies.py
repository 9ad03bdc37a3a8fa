"""The static scheduling policies (no lending, or the simplest lending), chosen by name (``launch.mode``).

The interface and the registry are in :mod:`bidirl.sched.policy`; the policies that lend devices by
a cost model are in :mod:`bidirl.sched.borrowing`. The helpers here (``fill_rollout``,
``publish_and_load``) are the shared moves every asynchronous policy makes.

* ``sync`` (alias ``verl``) -- veRL-style colocated synchronous RL: every device generates the batch,
  switches to training, trains it (data-parallel: gradients all-reduced, every replica steps), and
  switches back, loading the new weights into its rollout engine. The two role switches per step are
  veRL's hybrid-engine resharding cost.
* ``async`` (alias ``areal``) -- AReaL-style disaggregated asynchronous RL with a fixed partition:
  rollout devices generate continuously under the staleness bound eta (admission control), the train
  pool trains each batch as soon as it is complete, publishes every new version in the background, and
  each rollout device loads it at its next safe point (see :mod:`bidirl.sched.cluster`).
* ``verl-async`` -- veRL's fully-async recipe (``recipe/fully_async_policy``): the same disaggregated
  pipeline, but streamed: ``staleness_threshold`` (eta, may be fractional, recommended < 1) bounds only
  how many samples are generated ahead of training, the trainer takes samples in the order they finish
  and never waits for a particular one, and partial rollout pauses generation over a weight load and
  resumes it with the new weights. Its local updates are modelled too: with
  ``algorithm.updates_per_sync`` = u (``trigger_parameter_sync_step``) a step's batch is trained as u
  updates of B/u groups, each starting as soon as its groups have streamed in, and weights are
  published after every u-th update.
* ``async-lend`` -- ``async`` plus the simplest Trainer-on-RollPool lending: a rollout device that is
  idle only because admission blocks it, while a batch is ready, joins that step's gradient work and
  goes home afterwards. No cost model (``bidirl`` in :mod:`bidirl.sched.borrowing` has one).
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence

from bidirl.sched import events as ev
from bidirl.sched.cluster import Cluster
from bidirl.sched.policy import Policy
from bidirl.sched.replanning import repartition_toward
from bidirl.sched.roles import DeviceState, Role


def issue(cluster: Cluster, actions: List[ev.Action], action: ev.Action) -> None:
    cluster.apply(action)
    actions.append(action)


def fill_rollout(cluster: Cluster, actions: List[ev.Action], chunk: int = 0, home: Optional[Role] = None,
                 until: Optional[int] = None, every_older_tail: bool = False) -> None:
    """Admit chunks (at most ``chunk`` groups each, default the cluster's) on rollout-serving devices
    (only those whose home pool is ``home``, if given) with room, least-loaded first, while the
    staleness bound allows -- and, given ``until``, no group past that many admitted in all (trainers
    lent to rollout: the end of the batch the train pool needs next).

    Two placement rules every policy shares:
      * fair share: no device takes more than its share of the work that may be outstanding now, so a
        device that becomes free a moment before the others does not swallow the batch, and when the
        batch is smaller than one chunk per device the chunks shrink instead of idling devices. The shares
        are as even as whole groups allow: N groups over n devices are N mod n shares of ceil(N / n) and
        the rest floor(N / n);
      * older tails (``cluster.tail_placement``, the policy's own unless ``launch.tail_placement`` says):
        under ``TailPlacement.DUE``, no new groups to a device still decoding an older version's tail that
        the next step must contain (``Cluster.keeps_new_groups_off``): they would share its decode batch
        and slow the tail the trainers are waiting for (veRL/AReaL-style schedulers can have it). A tail
        not due yet takes new groups beside it: nobody waits for it now, and the device would otherwise
        decode it alone at a fraction of its capacity while the window has room. Under
        ``TailPlacement.NONE`` every tail takes them (continuous batching). Either way, given
        ``every_older_tail`` -- a policy that moves older tails onto idle trainers (``BidirlPolicy``, where
        trainers are to spare) -- every older tail keeps them off, so that the tail leaves and the device
        starts new groups alone."""
    newest_limit = cluster.admission_limit(cluster.version)
    stop = newest_limit if until is None else min(newest_limit, until)
    if cluster.admitted >= stop:
        return  # nothing may start on any device (the common case while admission blocks): O(1)
    pool = cluster.idle_sets[Role.ROLLOUT] | cluster.generating  # only these can take work
    pool &= cluster.serving[(Role.ROLLOUT, home)] if home is not None else cluster.serving_role(Role.ROLLOUT)
    # devices serving rollout now or soon count: switching in, or at home in the rollout pool but lent out
    serving = (cluster.serving_role(Role.ROLLOUT) | cluster.serving[(Role.TRAIN, Role.ROLLOUT)]) - cluster.leaving
    # (a device leaving for the train pool takes no more)
    if not pool or not serving:  # (every device that could take work serves rollout)
        return
    devices, inflight = cluster.devices, cluster.inflight
    loads = list(map(inflight.__getitem__, serving))  # (map: the innermost loop of a 1,024-device simulation)
    outstanding = newest_limit - cluster.admitted + sum(loads)
    # the share: `outstanding` split as evenly as whole groups go, so `extra` devices hold one more (ceil for
    # every device would leave the last ones nothing: 128 groups over 31 devices in shares of 5 is 26 devices)
    low, extra = divmod(outstanding, len(serving))
    high = low + 1 if extra else low
    at_high = sum(load >= high for load in loads) if extra else 0
    # least loaded first (the heap orders by load, then index). Asked of every candidate: only the cheap
    # tests, its load and its weights (admission counts from the version a device holds, so one that has not
    # loaded the newest since a publish may admit nothing). The placement rule and the room are asked as a
    # device comes off the heap, and the loop ends at the first device that holds its share, since every
    # one after it does too: at 1,024 devices, asking every candidate everything was a third of a
    # simulation. The same chunks start on the same devices: starting one changes no other device's answers.
    oldest = cluster.version
    while oldest > 0 and cluster.admission_limit(oldest - 1) > cluster.admitted:
        oldest -= 1
    heap = [(inflight[i], i) for i in pool if inflight[i] < high and devices[i].version >= oldest]
    heapq.heapify(heap)
    while heap and cluster.admitted < stop:
        _, index = heapq.heappop(heap)
        share = high if at_high < extra else low  # with no remainder high == low
        if inflight[index] >= share:
            break  # (the share only falls, from high to low, as devices reach high)
        device = devices[index]
        if cluster.keeps_new_groups_off(device, every_older_tail) or not cluster.has_room(device, 1):
            continue
        room = min(share, cluster.inflight_groups) - cluster.inflight[index]
        groups = min(cluster.next_chunk_size(chunk), cluster.admissible(device), room, stop - cluster.admitted)
        if groups > 0 and cluster.has_room(device, groups) and cluster.can_admit(device, groups):
            issue(cluster, actions, ev.Generate(index, groups))
            if extra and cluster.inflight[index] >= high:
                at_high += 1
            if cluster.inflight[index] < share:
                heapq.heappush(heap, (cluster.inflight[index], index))


def all_admitted(cluster: Cluster) -> bool:
    """Every group of the run has been admitted: a rollout device has nothing left to start."""
    return cluster.admitted >= cluster.steps * cluster.B


def admission_blocked(cluster: Cluster, device) -> bool:
    return cluster.admissible(device) <= 0 and not all_admitted(cluster)


def publish_and_load(cluster: Cluster, actions: List[ev.Action], event: ev.Event) -> None:
    """Publish a new version once trained; every device loads the newest published version.

    Loads are decided when a version finishes arriving (every stale device) and when a device
    finishes a load (it may have loaded an older version meanwhile superseded); busy devices get
    theirs queued behind their work, so no other event needs to look."""
    window_end = cluster.version % cluster.updates_per_sync == 0 or cluster.version >= cluster.steps
    if cluster.syncing is None and cluster.published < cluster.version and window_end:
        stale = [d.index for d in cluster.devices if d.version < cluster.version]
        if stale:
            issue(cluster, actions, ev.Sync(tuple(stale)))
    if isinstance(event, ev.SyncDone):
        candidates = cluster.devices
    elif isinstance(event, ev.LoadDone):
        candidates = [cluster.devices[event.device]]
    else:
        return
    for device in candidates:
        if cluster.needs_load(device) and device.state is not DeviceState.SYNCING:
            issue(cluster, actions, ev.Load(device.index))


class SyncPolicy(Policy):
    name, aliases = "sync", ("verl",)  # colocated synchronous (veRL hybrid engine)
    style = "veRL-style colocated synchronous"
    synchronous = True  # on-policy by construction: eta is 0 whatever the config says
    repartitions = False  # colocated: no partition

    def homes(self, devices: int, rollout_devices: int) -> List[Role]:
        return [Role.TRAIN] * devices  # colocated: every device trains, and is lent to rollout each step

    def decide(self, event: ev.Event, cluster: Cluster) -> List[ev.Action]:
        actions: List[ev.Action] = []
        devices = cluster.devices
        generating_phase = all(d.role is Role.ROLLOUT for d in devices)
        if cluster.finished:
            return actions
        if generating_phase:
            if cluster.batch_ready() and all(d.idle for d in devices):
                for d in devices:
                    issue(cluster, actions, ev.Switch(d.index, Role.TRAIN, "batch complete"))
            elif all(d.state in (DeviceState.IDLE, DeviceState.GENERATING) for d in devices):
                fill_rollout(cluster, actions)  # once every device has switched
        elif all(d.idle for d in devices):
            if cluster.batch_ready():
                issue(cluster, actions, ev.Train(tuple(d.index for d in devices)))
            elif cluster.version < cluster.steps:  # every replica stepped: weights are current everywhere
                for d in devices:
                    issue(cluster, actions, ev.Switch(d.index, Role.ROLLOUT, "weights current"))
        return actions


class AsyncPolicy(Policy):
    name, aliases = "async", ("areal",)  # fixed partition, staleness-bounded (AReaL)
    style = "AReaL-style disaggregated asynchronous, staleness-bounded"
    target: Optional[int] = None  # rollout-pool size the replanner asked for (None: keep the partition)

    def decide(self, event: ev.Event, cluster: Cluster) -> List[ev.Action]:
        actions: List[ev.Action] = []
        if cluster.finished:
            return actions
        if cluster.version < cluster.steps:
            publish_and_load(cluster, actions, event)
        self.replan(event, cluster, actions)
        self.before_training(cluster, actions)
        if cluster.batch_ready() or cluster.stream_ready():  # (streamed: only where the cluster streams)
            trainers = self.step_devices(cluster)
            if trainers:
                issue(cluster, actions, ev.Train(tuple(d.index for d in trainers)))
        self.fill(cluster, actions)
        return actions

    def replan(self, event: ev.Event, cluster: Cluster, actions: List[ev.Action]) -> None:
        """After each step, ask the replanner; move devices toward its split whenever the rules allow."""
        if isinstance(event, ev.TrainDone):
            self.target = self.replanner.rollout_devices(cluster) or self.target
        if self.target is not None and cluster.version < cluster.steps:
            repartition_toward(cluster, actions, self.target)

    def step_devices(self, cluster: Cluster) -> List:
        """The devices of the next train step, or none if it cannot start yet: every device serving
        train, once all are idle with the newest weights and nobody is on the way in or out."""
        trainers = [cluster.devices[i] for i in sorted(cluster.serving_role(Role.TRAIN))]
        return trainers if self.ready_to_train(cluster, trainers) else []

    def fill(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        fill_rollout(cluster, actions)

    def before_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """Hook for lending policies: runs after the weight decisions, before the train decision."""

    @staticmethod
    def ready_to_train(cluster: Cluster, trainers: Sequence) -> bool:
        joining = any((d.state is DeviceState.SWITCHING and d.role is Role.TRAIN)
                      or (d.state is DeviceState.DRAINING and d.role is Role.ROLLOUT) for d in cluster.devices)
        home_back = all(d.role is Role.TRAIN for d in cluster.pool(Role.TRAIN))  # trainer leases ended
        return home_back and not joining and all(d.idle and d.version == cluster.version for d in trainers)


class VerlAsyncPolicy(AsyncPolicy):
    name = "verl-async"  # veRL fully-async: streamed, count-only staleness, partial rollout
    style = "veRL fully-async style: streamed, count-only staleness, partial rollout"
    deadlines = False
    recomputes_logprob = False  # the recipe takes old log-probs from the rollout


class AsyncLendPolicy(AsyncPolicy):
    name = "async-lend"
    recomputes_logprob = False  # bidirl's own trainer: no baseline's

    def before_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        for d in cluster.devices:  # the lease ends with the step; the device loads new weights at home
            if not (d.lent and d.home is Role.ROLLOUT and d.idle and not d.after_work):
                continue
            if d.index in cluster.expired:  # at once, whatever comes next: it may still hang, and its
                # gradients (discarded) must not reach a later step
                issue(cluster, actions, ev.Switch(d.index, d.home, "lease expired"))
            elif cluster.training is None and not cluster.batch_ready():
                issue(cluster, actions, ev.Switch(d.index, d.home, "lease ends"))
        if cluster.batch_ready() and cluster.training is None:
            for d in cluster.idle(Role.ROLLOUT):
                if not d.after_work and d.version == cluster.version and admission_blocked(cluster, d):
                    issue(cluster, actions, ev.Switch(d.index, Role.TRAIN, "admission blocked, batch ready"))
