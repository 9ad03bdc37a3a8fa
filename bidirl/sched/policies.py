"""Scheduling policies: pure functions of the cluster bookkeeping, chosen by name (``launch.mode``).

Each policy answers one question after every event: *given the cluster as it is now, what starts?*
Contract: ``decide(event, cluster)`` applies each action it takes to the bookkeeping at once
(``cluster.apply``, so later choices in the same decision see it) and returns them, in order, for the
driver -- the live runtime or the simulator -- to carry out. Policies hold no clocks and no engines, so
the same object drives a real run and a simulated one.

* ``sync``  -- veRL-style colocated synchronous RL: every device generates the batch, switches to
  training, trains it (gradients reduced to the primary trainer), receives the new weights, switches
  back. The two role switches per step are veRL's hybrid-engine resharding cost.
* ``async`` -- AReaL-style disaggregated asynchronous RL with a fixed partition: rollout devices generate
  continuously under the staleness bound eta (admission control), the train pool trains each batch as
  soon as it is complete, and every optimizer step is followed by a weight sync to all devices at their
  next safe point (the end of the chunk in flight; that chunk keeps its old version).
* ``async-lend`` -- ``async`` plus the simplest Trainer-on-RollPool lending: a rollout device that is
  idle only because admission blocks it, while a batch is ready, switches to training for that step and
  switches back after the weight sync. No cost model yet (the scheduler issue adds one).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from bidirl.sched import events as ev
from bidirl.sched.cluster import Cluster
from bidirl.sched.roles import DeviceState, Role


class Policy:
    name = "base"
    synchronous = False

    def homes(self, devices: int, rollout_devices: int) -> List[Role]:
        """The home pool of each device (the partition this policy starts from)."""
        if not 0 < rollout_devices < devices:
            raise ValueError(f"launch.mode={self.name} needs 1..{devices - 1} rollout devices "
                             f"of cluster.devices={devices}, got {rollout_devices}")
        return [Role.ROLLOUT] * rollout_devices + [Role.TRAIN] * (devices - rollout_devices)

    def default_rollout_devices(self, devices: int) -> int:
        """The split used when none is given: half (a hand-picked static split)."""
        return max(1, devices // 2)

    def decide(self, event: ev.Event, cluster: Cluster) -> List[ev.Action]:
        raise NotImplementedError


def issue(cluster: Cluster, actions: List[ev.Action], action: ev.Action) -> None:
    cluster.apply(action)
    actions.append(action)


def fill_rollout(cluster: Cluster, devices: Sequence, actions: List[ev.Action], chunk: int = 0) -> None:
    """Admit one chunk (at most ``chunk`` groups, default the cluster's) on each idle rollout-serving
    device, while the staleness bound allows."""
    for device in devices:
        if device.idle and device.role is Role.ROLLOUT and not device.after_work:
            groups = cluster.next_chunk_size(chunk)
            if cluster.can_admit(device, groups):
                issue(cluster, actions, ev.Generate(device.index, groups))


def admission_blocked(cluster: Cluster, device) -> bool:
    return not cluster.can_admit(device, cluster.next_chunk_size())


class SyncPolicy(Policy):
    name = "sync"
    synchronous = True  # on-policy by construction: eta is 0 whatever the config says

    def homes(self, devices: int, rollout_devices: int) -> List[Role]:
        return [Role.TRAIN] * devices  # colocated: every device trains, and is lent to rollout each step

    def decide(self, event: ev.Event, cluster: Cluster) -> List[ev.Action]:
        actions: List[ev.Action] = []
        devices = cluster.devices
        generating_phase = all(d.role is Role.ROLLOUT for d in devices)
        if cluster.finished:
            return actions
        if not all(d.idle for d in devices):
            if generating_phase:
                fill_rollout(cluster, devices, actions)
            return actions
        if generating_phase and cluster.batch_ready():
            for d in devices:
                issue(cluster, actions, ev.Switch(d.index, Role.TRAIN, "batch complete"))
        elif generating_phase:
            fill_rollout(cluster, devices, actions)
        elif cluster.batch_ready():
            issue(cluster, actions, ev.Train(tuple(d.index for d in devices)))
        elif cluster.stale_devices():
            issue(cluster, actions, ev.Sync(tuple(d.index for d in devices)))
        else:
            for d in devices:
                issue(cluster, actions, ev.Switch(d.index, Role.ROLLOUT, "weights current"))
        return actions


class AsyncPolicy(Policy):
    name = "async"

    def decide(self, event: ev.Event, cluster: Cluster) -> List[ev.Action]:
        actions: List[ev.Action] = []
        if cluster.finished:
            return actions
        if isinstance(event, ev.TrainDone) and cluster.version < cluster.steps:
            issue(cluster, actions, ev.Sync(tuple(d.index for d in cluster.devices)))
        self.before_training(cluster, actions)
        trainers = [d for d in cluster.devices if d.role is Role.TRAIN]
        if cluster.batch_ready() and cluster.syncing is None and self.ready_to_train(cluster, trainers):
            issue(cluster, actions, ev.Train(tuple(d.index for d in trainers)))
        self.fill(cluster, actions)
        return actions

    def fill(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        fill_rollout(cluster, cluster.devices, actions)

    def before_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        """Hook for lending policies: runs after the sync decision, before the train decision."""

    @staticmethod
    def ready_to_train(cluster: Cluster, trainers: Sequence) -> bool:
        joining = any((d.state is DeviceState.SWITCHING and d.role is Role.TRAIN)
                      or (d.state is DeviceState.DRAINING and d.role is Role.ROLLOUT) for d in cluster.devices)
        return not joining and all(d.idle and d.version == cluster.version for d in trainers)


class AsyncLendPolicy(AsyncPolicy):
    name = "async-lend"

    def before_training(self, cluster: Cluster, actions: List[ev.Action]) -> None:
        if cluster.syncing is None:  # lent devices go home once they hold the new weights
            for d in cluster.devices:
                if d.lent and d.idle and not d.after_work and cluster.training is None and not cluster.batch_ready():
                    issue(cluster, actions, ev.Switch(d.index, d.home, "lease ends"))
        if cluster.batch_ready() and cluster.syncing is None and cluster.training is None:
            for d in cluster.idle(Role.ROLLOUT):
                if not d.after_work and d.version == cluster.version and admission_blocked(cluster, d):
                    issue(cluster, actions, ev.Switch(d.index, Role.TRAIN, "admission blocked, batch ready"))


def _registry() -> Dict[str, Callable[..., Policy]]:
    from bidirl.sched import borrowing as b

    return {
        "sync": SyncPolicy, "verl": SyncPolicy,  # colocated synchronous (veRL hybrid engine)
        "async": AsyncPolicy, "areal": AsyncPolicy,  # fixed partition, staleness-bounded (AReaL)
        "async-lend": AsyncLendPolicy,
        "roll": b.RollPolicy,
        "streamrl": lambda estimates, batch_groups: b.StreamRLPolicy(estimates, batch_groups),
        "verl-dynamic": lambda estimates, batch_groups: b.VerlDynamicPolicy(estimates),
        "bidirl": lambda estimates, batch_groups: b.BidirlPolicy(estimates, batch_groups),
    }


NEEDS_ESTIMATES = ("streamrl", "verl-dynamic", "bidirl")
POLICY_NAMES = ("sync", "verl", "async", "areal", "async-lend", "roll", "streamrl", "verl-dynamic", "bidirl")


def partition(policy: Policy, devices: int, rollout_devices: int = 0) -> List[Role]:
    """Home pools for ``devices``; ``rollout_devices=0`` means the policy's default split."""
    return policy.homes(devices, rollout_devices or policy.default_rollout_devices(devices))


def build_policy(name: str, estimates=None, batch_groups: int = 0) -> Policy:
    """A policy by name; cost-aware ones need performance estimates (the simulator's or measured)."""
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown scheduling policy '{name}' (known: {', '.join(POLICY_NAMES)})")
    if name in NEEDS_ESTIMATES:
        if estimates is None:
            raise ValueError(f"policy '{name}' needs performance estimates (run it under `bidirl simulate`)")
        policy = registry[name](estimates, batch_groups)
    else:
        policy = registry[name]()
    policy.name = name
    return policy
