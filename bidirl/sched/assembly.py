"""One run assembly for every driver: (policy name, run shape, driver capabilities) -> policy + Cluster.

The live controller, the simulator and ``bidirl launch``'s pre-flight check all build a run here, so
the rules are written once:

* the partition: ``rollout_devices`` = 0 means the policy's own default split; a resumed run passes
  the partition its checkpoint was taken on (``resumed``: re-planning may have moved devices since the
  start), homes and primary as they were;
* the staleness bound: :meth:`~bidirl.sched.policy.Policy.effective_eta` (a synchronous policy runs at
  0 whatever the config says), checked against what the policy can keep (whole versions with
  per-group deadlines, any fraction when only counted);
* streamed updates (``updates_per_sync`` = u > 1, veRL fully-async): only for count-only policies, only
  on drivers that can carry them out, and u must divide the batch -- the cluster then counts u
  updates of B/u groups per published version;
* streamed gradient work (a step starting on the part of its batch already done): only for policies
  that stream (``Policy.streams_gradients``), on drivers that can, with per-group deadlines (they say
  which groups a batch must wait for);
* the older-tail placement rule (``TailPlacement``): the policy's own unless the run says;
* what the driver can do (:class:`DriverCapabilities`) goes into the bookkeeping, so policies ask the
  cluster instead of knowing which driver runs them.

Impossible combinations raise ``ValueError`` with a one-line message naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from bidirl.sched.cluster import Cluster, TailPlacement, check_staleness
from bidirl.sched.estimates import NO_ESTIMATES, EstimatesProvider
from bidirl.sched.policy import Policy, build_policy
from bidirl.sched.replanning import NO_REPLANNING, Replanner
from bidirl.sched.roles import Role


@dataclass(frozen=True)
class RunShape:
    """The sizes of a run, as configured (``PipelineConfig.run_shape()``)."""

    devices: int
    rollout_devices: int  # 0: the policy's default split
    batch_groups: int  # prompt groups per optimizer step (B)
    steps: int
    chunk_groups: int
    staleness: float  # eta, in versions (count-only policies accept fractions)
    updates_per_sync: int = 1
    tail_placement: TailPlacement = TailPlacement.AUTO  # which older tails keep new groups off (AUTO: the policy's)


@dataclass(frozen=True)
class DriverCapabilities:
    """What the driver that carries the run out can do."""

    allows_join: bool  # add a device to a train step in progress (Join)
    interruptible: bool  # pause generation for a weight load instead of waiting for the chunk to end
    streams_updates: bool  # several optimizer updates per weight sync
    inflight_groups: int = 0  # groups a rollout device may hold at once (0: one chunk)
    rehomes: bool = False  # move a device to another home pool at run time (Rehome: re-planning)
    # a step's devices pull its work in micro-batches (train.micro_batch_size samples) rather than
    # dividing it continuously: a device that joins mid-step takes only micro-batches nobody started
    pulls_micro_batches: bool = False
    # a train step may start on the groups of its batch already done and take the rest as they finish
    streams_gradients: bool = True
    # move requests in flight to another device, which continues them (Migrate)
    migrates: bool = False
    # moved requests join the target's running decode batch; without it, a target that is generating would
    # run them only after its batch (the live runtime: ``ContinueGroups`` waits in the device's queue), so
    # only idle devices take requests over, and they run as one continuation, reported whole when it ends
    migrates_into_batch: bool = True
    # each group is reported as its last sequence ends; without it, a chunk's groups come when the chunk
    # ends (the live runtime on an engine that returns a chunk whole: bidirl.engines.CONTINUOUS_BATCHING)
    reports_groups: bool = True


LIVE = DriverCapabilities(allows_join=True, interruptible=False, streams_updates=False, rehomes=True,
                          pulls_micro_batches=True, migrates=True, migrates_into_batch=False)


@dataclass
class Assembly:
    policy: Policy
    cluster: Cluster

    @property
    def homes(self) -> List[Role]:
        return [d.home for d in self.cluster.devices]

    @property
    def rollout_devices(self) -> int:
        return sum(home is Role.ROLLOUT for home in self.homes)


def assemble(policy_name: str, shape: RunShape, driver: DriverCapabilities,
             estimates: EstimatesProvider = NO_ESTIMATES, replanner: Replanner = NO_REPLANNING,
             resumed: Optional[Tuple[Sequence[Role], int]] = None) -> Assembly:
    """``resumed``: (homes, primary) to start from instead of the configured split."""
    if replanner is not NO_REPLANNING and not driver.rehomes:
        raise ValueError("this driver cannot move a device to another home pool at run time (Rehome)")
    policy = build_policy(policy_name, estimates, shape.batch_groups, replanner)
    if shape.devices < 2 and not policy.synchronous:  # (before the default split is asked of one device)
        raise ValueError(f"policy '{policy.label}' runs a rollout pool and a train pool: it needs 2 devices or more "
                         f"(whole instances where cluster.instance_devices > 1), got {shape.devices}")
    if resumed is None:
        homes = policy.homes(shape.devices, shape.rollout_devices or policy.default_rollout_devices(shape.devices))
        primary = None
    else:
        homes, primary = list(resumed[0]), resumed[1]
        if len(homes) != shape.devices or not 0 <= primary < len(homes) or homes[primary] is not Role.TRAIN:
            raise ValueError(f"the resumed partition {[h.value for h in homes]} (primary {primary}) does not fit "
                             f"{shape.devices} devices with the primary at home in the train pool")
    eta = policy.effective_eta(shape.staleness)
    check_staleness(eta, policy.deadlines, policy.label)
    u = shape.updates_per_sync
    if u != 1 and not driver.streams_updates:
        raise ValueError(f"algorithm.updates_per_sync={u}: streamed updates within a sync window are simulated "
                         "only (`bidirl simulate`); the runtime syncs after every update")
    u = 1 if policy.deadlines else u  # streamed local updates are veRL fully-async's (count-only) mechanism
    if shape.batch_groups % u:
        raise ValueError(f"algorithm.updates_per_sync={u} must divide train.prompts_per_step={shape.batch_groups}")
    cluster = Cluster(homes, shape.batch_groups // u, eta, shape.steps * u, shape.chunk_groups, primary=primary,
                      inflight_groups=driver.inflight_groups, interruptible=driver.interruptible,
                      deadlines=policy.deadlines, updates_per_sync=u, allows_join=driver.allows_join,
                      streams=policy.streams_gradients and driver.streams_gradients and policy.deadlines,
                      allows_migration=driver.migrates, migrates_into_batch=driver.migrates_into_batch,
                      tail_placement=policy.tail_placement if shape.tail_placement is TailPlacement.AUTO
                      else shape.tail_placement)
    return Assembly(policy, cluster)
