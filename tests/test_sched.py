"""The scheduling core as pure Python: state machine, bookkeeping invariants, policies under simulation."""

import itertools
from collections import Counter
import subprocess
import sys

import pytest

from bidirl.sched import events as ev
from bidirl.sched.assembly import LIVE, RunShape, assemble
from bidirl.sched.cluster import Cluster, TailPlacement
from bidirl.sched.policy import build_policy
from bidirl.sched.roles import LEGAL_TRANSITIONS, Device, DeviceState, IllegalTransition, Role
from bidirl.sched.trace import intervals, pool_idle_ratio, switch_overheads, time_breakdown
from bidirl.sim.simulator import FixedCosts, Simulator

S = DeviceState


def simulate(policy_name, devices=2, rollout_devices=1, eta=1, steps=6, batch=8, chunk=4, costs=None):
    policy = build_policy(policy_name)
    cluster = Cluster(policy.homes(devices, rollout_devices), batch, eta, steps, chunk)
    Simulator(cluster, policy, costs or FixedCosts(generate_per_group=0.1, train_step=1.6)).run()
    return cluster


@pytest.mark.parametrize("old,new", list(itertools.product(DeviceState, DeviceState)))
def test_transition_table_is_enforced(old, new):
    role = Role.TRAIN if new is S.TRAINING else Role.ROLLOUT
    if old is S.SWITCHING:
        role = role.other()  # entering SWITCHING flipped the role; put it back so only the table decides
    device = Device(0, role, state=old)
    if new in LEGAL_TRANSITIONS[old]:
        device.transition(new, 0.0, "test")
        assert device.state is new
    else:
        with pytest.raises(IllegalTransition):
            device.transition(new, 0.0, "test")


def test_a_device_generates_only_while_serving_rollout():
    with pytest.raises(IllegalTransition, match="while serving train"):
        Device(0, Role.TRAIN).transition(S.GENERATING, 0.0, "test")


def test_switching_flips_the_served_role_and_traces_it():
    trace = []
    device = Device(3, Role.ROLLOUT)
    device.transition(S.SWITCHING, 1.0, "lend", trace.append)
    assert device.role is Role.TRAIN and device.lent
    assert trace == [{"t": 1.0, "device": 3, "from": "idle", "to": "switching", "role": "train",
                      "home": "rollout", "version": 0, "reason": "lend"}]


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_async_staleness_never_exceeds_eta_and_every_group_is_trained_once(eta):
    cluster = simulate("async", eta=eta, steps=8)
    assert max(cluster.staleness) <= eta
    assert cluster.trained_groups == cluster.admitted == 8 * 8
    assert sorted(c.first for c in cluster.chunks) == list(range(0, 64, 4))  # no group lost or repeated


def test_a_resumed_cluster_numbers_new_groups_after_every_group_drawn_before_its_checkpoint():
    # eta 1, B 4: at the checkpoint (version 1) groups 0-7 had been drawn and batch 0 may have trained 4-7
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=3, chunk_groups=4)
    cluster.resume_at(1, {"1": 4}, next_group=8)
    assert cluster.admitted == cluster.trained_groups == 4  # the untrained ones are generated again...
    cluster.apply(ev.Generate(0, 4))
    assert cluster.chunks[0].first == 8  # ...under new numbers, never a trained group's


def test_a_cluster_resumed_from_a_checkpoint_without_the_next_group_numbers_on_from_the_trained_ones():
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=3, chunk_groups=4)
    cluster.resume_at(1)
    cluster.apply(ev.Generate(0, 4))
    assert cluster.chunks[0].first == 4


def test_a_migration_moves_groups_in_flight_between_rollout_devices_and_keeps_their_version():
    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=2, chunk_groups=4,
                      allows_migration=True)
    cluster.apply(ev.Generate(0, 4))
    cluster.apply(ev.Migrate(0, 1, 3, version=0))
    assert cluster.inflight == {0: 1, 1: 3, 2: 0} and cluster.devices[1].state is S.GENERATING
    cluster.complete(ev.ChunkDone(1, chunk=0, groups=3))  # the device that finished them reports them
    assert cluster.devices[1].idle and cluster.completed_by_version[0] == 3 and cluster.chunks[0].finished == 3
    cluster.apply(ev.Migrate(0, 1, 1, version=0))
    assert cluster.devices[0].idle and cluster.inflight[0] == 0  # its last group left: it is free
    with pytest.raises(AssertionError, match="fewer than"):
        cluster.apply(ev.Migrate(0, 1, 1, version=0))


def test_a_move_takes_the_oldest_chunks_groups_first_and_within_a_chunk_those_with_the_most_requests_left():
    # both drivers pick so: the live controller asks chunk by chunk, the engines answer with choose_groups,
    # and the simulator calls groups_to_move on its instances' sequences left
    running = {(4, 0): 3, (3, 0): 1, (3, 1): 0, (3, 2): 4}  # (chunk, group) -> requests still running
    assert ev.groups_to_move(running, 1) == [(3, 2)]
    assert ev.groups_to_move(running, 2) == [(3, 0), (3, 2)]
    assert ev.groups_to_move(running, 4) == [(3, 0), (3, 1), (3, 2), (4, 0)]
    assert ev.choose_groups({0: 1, 2: 4}, [0, 1, 2], 2) == [0, 2]
    assert ev.per_chunk({4: 1, 3: 2, 5: 0}, 3) == [(3, 2), (4, 1)]  # the controller's asks, chunk by chunk


def test_a_migration_needs_a_driver_that_can_move_requests_and_weights_no_older_than_the_groups():
    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=2, chunk_groups=4)
    cluster.apply(ev.Generate(0, 2))
    with pytest.raises(AssertionError, match="cannot move requests"):
        cluster.apply(ev.Migrate(0, 1, 1, version=0))
    cluster.allows_migration = True
    cluster.devices[0].version = 1  # (as if device 0 had loaded v1 before starting a chunk)
    cluster.chunks[0].version = 1
    cluster.inflight_by_version[0] = Counter({1: 2})
    with pytest.raises(AssertionError, match="older weights"):
        cluster.apply(ev.Migrate(0, 1, 1, version=1))


def tails_on(sizes, trainers=2, eta=1, tail_placement=TailPlacement.DUE, migrates_into_batch=True):
    """Rollout devices decoding older tails of ``sizes`` groups (started at v0) while holding v1 weights."""
    cluster = Cluster([Role.ROLLOUT] * len(sizes) + [Role.TRAIN] * trainers, batch_groups=8, eta=eta, steps=4,
                      chunk_groups=8, inflight_groups=16, allows_migration=True, tail_placement=tail_placement,
                      migrates_into_batch=migrates_into_batch)
    for device, groups in enumerate(sizes):
        cluster.apply(ev.Generate(device, groups))
    cluster.version = cluster.published = 1
    for device in cluster.devices:
        device.version = 1
    return cluster


@pytest.mark.parametrize("per_group_s,merges", [(0.0001, True), (0.01, False)])
def test_older_tails_merge_onto_one_device_only_while_the_merge_barely_slows_their_decode(per_group_s, merges):
    from bidirl.sched.estimates import Estimates

    cluster = tails_on([1, 3])
    policy = build_policy("bidirl", Estimates(1.0, 1.0, 0.1, decode_step_s=0.01, decode_group_s=per_group_s), 8)
    actions = []
    policy.consolidate_tail(cluster, actions)
    if merges:  # weight-bound: the smaller tail joins the bigger one, and its device is free for new groups
        assert actions == [ev.Migrate(0, 1, 1, version=0)] and cluster.devices[0].idle and cluster.inflight[1] == 4
    else:  # 4 groups would step 2.5x slower than the 1 alone: both tails stay
        assert actions == [] and cluster.inflight == {0: 1, 1: 3, 2: 0, 3: 0}


def test_where_moved_requests_wait_for_the_running_batch_tails_go_only_to_an_idle_lent_trainer():
    # the live runtime: a ContinueGroups waits in a generating device's queue until its batch ends, so a
    # tail merged onto it would not decode beside its own groups, as the bookkeeping would count
    from bidirl.sched.estimates import Estimates

    cluster = tails_on([1, 3], migrates_into_batch=False)
    policy = build_policy("bidirl", Estimates(1.0, 1.0, 0.1, decode_step_s=0.01, decode_group_s=0.0001), 8)
    actions = []
    policy.consolidate_tail(cluster, actions)
    assert actions == [] and cluster.inflight == {0: 1, 1: 3, 2: 0, 3: 0}  # (it merges where batches join)
    with pytest.raises(AssertionError, match="cannot take requests now"):
        cluster.apply(ev.Migrate(0, 1, 1, version=0))
    for trainer in (3, 2):  # lent one after the other: idle, each takes one device's tail, the smallest first
        cluster.apply(ev.Switch(trainer, Role.ROLLOUT, "lent"))
        cluster.complete(ev.SwitchDone(trainer, Role.ROLLOUT))
        assert policy.lent_to_rollout(cluster) == [cluster.devices[trainer]]  # (one generating takes no more)
        policy.consolidate_tail(cluster, actions)
    assert actions == [ev.Migrate(0, 3, 1, version=0), ev.Migrate(1, 2, 3, version=0)]
    assert cluster.inflight == {0: 0, 1: 0, 2: 3, 3: 1}
    # room for chunks to join (16 groups in flight), but not beside moved requests, which no chunk joins
    assert not cluster.has_room(cluster.devices[3], 1)
    cluster.complete(ev.ChunkDone(3, chunk=0, groups=1))
    assert cluster.devices[3].idle and cluster.has_room(cluster.devices[3], 1)


@pytest.mark.parametrize("into_batch,moves", [(True, [(0, 1), (1, 1)]), (False, [(0, 1)])])
def test_a_lent_trainer_rebalances_from_one_source_where_moved_requests_wait_for_the_running_batch(into_batch, moves):
    from bidirl.sched.estimates import Estimates

    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN, Role.TRAIN], batch_groups=8, eta=1, steps=6,
                      chunk_groups=1, inflight_groups=16, allows_migration=True, migrates_into_batch=into_batch)
    for _ in range(3):
        cluster.apply(ev.Generate(0, 1))
        cluster.apply(ev.Generate(1, 1))
    cluster.apply(ev.Switch(3, Role.ROLLOUT, "lent"))
    cluster.complete(ev.SwitchDone(3, Role.ROLLOUT))
    actions = []
    build_policy("verl-dynamic", Estimates(1.0, 1.0, 0.1), 8).rebalance(cluster, actions)
    assert [(a.source, a.groups) for a in actions] == moves and {a.device for a in actions} == {3}  # mean load: 2


@pytest.mark.parametrize("per_group_s,step_period,lent", [(0.0001, 100.0, 1), (0.01, 100.0, 2), (0.0001, 0.0, 1),
                                                          (0.01, 0.0, 0)])
def test_idle_trainers_take_the_older_tails_over_one_per_tail_that_cannot_merge_where_the_pool_idles_longer_than_a_tail(
        per_group_s, step_period, lent):
    from bidirl.sched.estimates import Estimates

    cluster = tails_on([1, 3], trainers=3)
    policy = build_policy("bidirl", Estimates(1.0, 1.0, 0.1, decode_step_s=0.01, decode_group_s=per_group_s), 8)
    policy.step_period = step_period  # steps start this many seconds apart; each takes 1 s of 3 trainers' work
    actions = []
    policy.lend_for_tail(cluster, actions)
    trainers = [a.device for a in actions if isinstance(a, ev.Switch)]
    assert len(trainers) == lent and cluster.primary not in trainers  # the primary stays for the next step
    if not lent:  # a busy train pool lends one trainer only for tails that merge onto it, and these do not
        return
    for trainer in trainers:
        cluster.complete(ev.SwitchDone(trainer, Role.ROLLOUT))
    policy.consolidate_tail(cluster, [])
    # both rollout devices are free for new groups; the lent trainers decode the tails
    assert cluster.inflight[0] == cluster.inflight[1] == 0 and all(cluster.inflight[t] for t in trainers)
    assert sum(cluster.inflight[t] for t in trainers) == 4


@pytest.mark.parametrize("trainers,step_period,lent", [(3, 0.0, 0), (3, 100.0, 2), (1, 100.0, 0)])
def test_trainers_to_spare_also_take_tails_the_next_batch_does_not_await_yet_but_a_lone_primary_never_does(
        trainers, step_period, lent):
    from bidirl.sched.estimates import Estimates

    cluster = tails_on([1, 3], trainers=trainers, eta=2)  # v0 groups at v1: due only for batch 2
    policy = build_policy("bidirl", Estimates(1.0, 1.0, 0.1, decode_step_s=0.01, decode_group_s=0.01), 8)
    policy.step_period = step_period
    actions = []
    policy.lend_for_tail(cluster, actions)
    trainers = [a.device for a in actions if isinstance(a, ev.Switch)]
    assert len(trainers) == lent
    for trainer in trainers:
        cluster.complete(ev.SwitchDone(trainer, Role.ROLLOUT))
    policy.consolidate_tail(cluster, [])
    assert sum(cluster.inflight[t] for t in trainers) == (4 if lent else 0)


@pytest.mark.parametrize("step_period,lent", [(0.0, 0), (100.0, 1)])
def test_a_streamed_step_that_would_only_wait_for_its_due_tail_lets_trainers_to_spare_take_that_tail_first(
        step_period, lent):
    from bidirl.sched.estimates import Estimates

    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT] + [Role.TRAIN] * 3, batch_groups=4, eta=1, steps=3, chunk_groups=4,
                      inflight_groups=8, streams=True, allows_migration=True)
    cluster.apply(ev.Generate(0, 4))
    cluster.apply(ev.Generate(1, 4))
    cluster.complete(ev.ChunkDone(0, 0))
    cluster.apply(ev.Train((2, 3, 4)))
    cluster.complete(ev.TrainDone(1))
    cluster.complete(ev.ChunkDone(1, 1, groups=2))  # device 1 still decodes 2 groups batch 1 must contain
    for device in cluster.devices:
        device.version = 1
    assert not cluster.batch_ready() and cluster.stream_plan() == {0: 2}  # a streamed step could start now
    policy = build_policy("bidirl", Estimates(1.0, 1.0, 0.1, decode_step_s=0.01, decode_group_s=0.01), 4)
    policy.step_period = step_period
    actions = []
    policy.lend_for_tail(cluster, actions)
    trainers = [a.device for a in actions if isinstance(a, ev.Switch)]
    assert len(trainers) == lent and cluster.primary not in trainers  # the rest start the step; the lent join later
    if lent:
        cluster.complete(ev.SwitchDone(trainers[0], Role.ROLLOUT))
        policy.consolidate_tail(cluster, [])
        assert cluster.inflight[trainers[0]] == 2 and cluster.inflight[1] == 0  # it took the due tail over


def test_where_no_trainer_is_to_spare_only_one_lent_trainer_takes_older_tails_as_before():
    from bidirl.sched.estimates import Estimates

    cluster = tails_on([1, 3], trainers=3)
    for trainer in (3, 4):  # lent for some other reason (the next batch's new groups)
        cluster.apply(ev.Switch(trainer, Role.ROLLOUT, "lent"))
        cluster.complete(ev.SwitchDone(trainer, Role.ROLLOUT))
    policy = build_policy("bidirl", Estimates(1.0, 1.0, 0.1, decode_step_s=0.01, decode_group_s=0.01), 8)
    policy.consolidate_tail(cluster, [])
    assert cluster.inflight[3] == 1 and cluster.inflight[4] == 0 and cluster.inflight[1] == 3


def test_admission_blocks_work_that_would_exceed_the_staleness_bound():
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=8, eta=0, steps=4, chunk_groups=8)
    rollout = cluster.devices[0]
    cluster.apply(ev.Generate(0, 8))
    cluster.complete(ev.ChunkDone(0, 0))
    assert not cluster.can_admit(rollout, 8)  # batch 1 at version 0 would be stale by 1
    with pytest.raises(AssertionError, match="exceed eta"):
        cluster.apply(ev.Generate(0, 8))


def test_count_only_admission_allows_a_fraction_of_a_batch_ahead_and_batches_stream_in_finish_order():
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=8, eta=0.5, steps=4, chunk_groups=4,
                      inflight_groups=16, deadlines=False)
    assert cluster.admissible(cluster.devices[0]) == 12  # floor((0 + 0.5 + 1) * 8)
    for _ in range(3):
        cluster.apply(ev.Generate(0, 4))
    assert not cluster.can_admit(cluster.devices[0], 1)
    cluster.complete(ev.ChunkDone(0, 2))  # the last chunk finishes first ...
    cluster.complete(ev.ChunkDone(0, 1))
    assert cluster.batch_ready()  # ... and nobody waits for chunk 0 (its long sequences)
    cluster.apply(ev.Train((1,)))
    assert [c.index for c, _ in cluster.batch_chunks(0)] == [2, 1]


@pytest.mark.parametrize("eta, batch, version, limit", [(0.1, 50, 3, 205), (0.1, 50, 4, 255), (0.3, 100, 1, 230)])
def test_a_fractional_staleness_bound_admits_its_whole_window_despite_binary_rounding(eta, batch, version, limit):
    # floor((version + eta + 1) * B): 4.1 * 50 is 204.99999999999997 in floating point, one group short
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=batch, eta=eta, steps=10, chunk_groups=4,
                      deadlines=False)
    assert cluster.admission_limit(version) == limit


def test_a_fractional_staleness_bound_needs_count_only_staleness():
    with pytest.raises(ValueError, match="fractional bound needs count-only staleness"):
        Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=8, eta=0.5, steps=4, chunk_groups=4)


class ScriptedJoin:
    """Trains batch 0 on device 1 while rollout device 2 switches in and joins; then batch 1 alone."""

    synchronous, deadlines = False, True

    def decide(self, event, cluster):
        if isinstance(event, ev.Started):
            actions = [ev.Generate(0, 2)]
        elif isinstance(event, ev.ChunkDone):
            actions = [ev.Train((1,)), ev.Switch(2, Role.TRAIN, "lent")]
        elif isinstance(event, ev.SwitchDone) and event.role is Role.TRAIN:
            actions = [ev.Join(2)]
        elif isinstance(event, ev.TrainDone) and event.version == 1:
            actions = [ev.Switch(2, Role.ROLLOUT, "lease ends"), ev.Train((1,))]
        else:
            actions = []
        for action in actions:
            cluster.apply(action)
        return actions


def test_a_device_joining_a_step_shares_the_work_left_and_the_next_step_is_timed_afresh():
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT], batch_groups=1, eta=1, steps=2, chunk_groups=2,
                      inflight_groups=2)
    Simulator(cluster, ScriptedJoin(), FixedCosts(generate_per_group=0.0, train_step=4.0, switch_s=1.0)).run()
    steps = [(r["t"], r["reason"]) for r in cluster.trace if r["device"] == 1 and r["to"] == "idle" != r["from"]]
    # alone for 1 s (3 device-seconds left), then shared by two: 1 + 3/2; the second step runs alone for
    # 4 s -- the first step's superseded finish at t=4 must not end it
    assert steps == [(2.5, "step -> v1"), (6.5, "step -> v2")]
    joined = [r for r in cluster.trace if r["device"] == 2 and r["to"] == "training"]
    assert [(r["t"], r["reason"]) for r in joined] == [(1.0, "joins batch 0")]


@pytest.mark.parametrize("policy", ["verl-dynamic", "bidirl"])
def test_trainers_lent_to_rollout_take_only_groups_of_the_batch_the_train_pool_needs_next(policy):
    # eta 1 allows 16 groups ahead; the next batch is 8. Each lent trainer's chunks were capped, their total
    # was not: they took chunk after chunk up to the fair share, into the batch after, and the step that
    # needs them home waited for groups nobody needed yet
    from bidirl.sched.estimates import Estimates

    lender = build_policy(policy, Estimates(1.0, 4.0, 0.01))
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN, Role.TRAIN], batch_groups=8, eta=1, steps=4, chunk_groups=4,
                      inflight_groups=16)
    for trainer in (1, 2):
        cluster.apply(ev.Switch(trainer, Role.ROLLOUT, "lent"))
        cluster.complete(ev.SwitchDone(trainer, Role.ROLLOUT))
    actions = []
    lender.fill(cluster, actions)
    lent_took = sum(a.groups for a in actions if isinstance(a, ev.Generate) and a.device in (1, 2))
    assert cluster.admitted == 8 and lent_took == 8 - cluster.inflight[0]  # the next batch, and no more


def test_a_device_re_planning_moves_is_charged_to_each_pool_for_the_time_it_belonged_there():
    # device 2 generates at home in the rollout pool for 5 s, then moves to the train pool and trains
    def record(t, frm, to, home):
        return {"t": t, "device": 2, "from": frm, "to": to, "role": home, "home": home, "version": 0, "reason": ""}

    trace = [record(0.0, "idle", "generating", "rollout"), record(5.0, "generating", "switching", "train"),
             record(6.0, "switching", "training", "train")]
    at_start = {0: "rollout", 1: "train", 2: "rollout"}  # devices 0 and 1 stay idle throughout
    breakdown = time_breakdown(trace, 10.0, at_start)
    assert breakdown["rollout"]["busy"] == 0.3333 and breakdown["rollout"]["switching"] == 0.0
    assert breakdown["train"]["busy"] == 0.2667 and breakdown["train"]["switching"] == 0.0667
    assert pool_idle_ratio(trace, 10.0, at_start) == {"rollout": 0.6667, "train": 0.6667}


def test_a_cluster_knows_each_devices_home_at_the_start_after_re_planning_moved_it_twice():
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=2,
                      chunk_groups=4)
    for device, home in ((2, Role.TRAIN), (2, Role.ROLLOUT), (3, Role.ROLLOUT)):
        cluster.apply(ev.Rehome(device, home, "re-planned"))
        cluster.complete(ev.SwitchDone(device, home))
    assert [d.home.value for d in cluster.devices] == ["rollout", "train", "rollout", "rollout"]
    assert cluster.homes_at_start() == {0: "rollout", 1: "train", 2: "rollout", 3: "train"}


def test_a_lent_devices_gradient_return_to_the_primary_shows_in_the_step_time():
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT], batch_groups=1, eta=1, steps=2, chunk_groups=2,
                      inflight_groups=2)
    costs = FixedCosts(generate_per_group=0.0, train_step=4.0, switch_s=1.0, gradient_return_s=0.5)
    Simulator(cluster, ScriptedJoin(), costs).run()
    steps = [(r["t"], r["reason"]) for r in cluster.trace if r["device"] == 1 and r["to"] == "idle" != r["from"]]
    assert steps == [(3.0, "step -> v1"), (7.0, "step -> v2")]  # 2.5 as before, + 0.5 for the joiner's gradients


def test_when_the_batch_is_smaller_than_a_chunk_per_device_every_rollout_device_still_generates():
    policy = build_policy("areal")
    cluster = Cluster(policy.homes(10, 8), batch_groups=16, eta=0, steps=2, chunk_groups=8, inflight_groups=64)
    actions = policy.decide(ev.Started(), cluster)
    assert sorted(a.device for a in actions) == list(range(8)) and {a.groups for a in actions} == {2}


@pytest.mark.parametrize("units, per_group_s, train_batch_s, stays_home", [
    (32, 4.47, 468.5, True),  # math eta 0, 7B on one-device units: T (U - 1) = 14,524 against 2 B g = 2,289
    (4, 803.5 / 256, 255.1, False),  # math eta 0, 32B on instances of 8: 765 against 1,607 (home, it cost 10%)
    (32, 4.47, 0.0, False),  # nothing measured yet
])
def test_the_primary_stays_home_only_where_the_training_it_overlaps_beats_the_generation_it_leaves_to_others(
        units, per_group_s, train_batch_s, stays_home):
    from bidirl.sched.estimates import Estimates

    policy = build_policy("bidirl", Estimates(per_group_s, train_batch_s, 0.5), 256)
    cluster = Cluster(policy.homes(units, 2), batch_groups=256, eta=0, steps=2, chunk_groups=8, streams=True)
    primary, other = cluster.devices[cluster.primary], cluster.at_home(Role.TRAIN)[-1]
    assert policy.may_lend(cluster, primary) is not stays_home
    assert policy.may_lend(cluster, other)  # any other trainer may go


def test_a_batch_that_does_not_divide_evenly_is_shared_by_every_rollout_device_as_evenly_as_whole_groups_go():
    # 20 groups on 8 devices: four of 3 and four of 2 (shares of ceil(20 / 8) = 3 left the last two devices idle)
    policy = build_policy("areal")
    cluster = Cluster(policy.homes(10, 8), batch_groups=20, eta=0, steps=2, chunk_groups=8, inflight_groups=64)
    actions = policy.decide(ev.Started(), cluster)
    assert sorted(a.device for a in actions) == list(range(8))
    assert sorted(a.groups for a in actions) == [2, 2, 2, 2, 3, 3, 3, 3]


@pytest.mark.parametrize("eta, takers", [(1, {1}), (2, {0, 1})])
def test_no_new_groups_go_to_a_device_still_decoding_an_older_versions_tail_the_next_step_needs(eta, takers):
    from bidirl.sched.policies import fill_rollout

    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=eta, steps=6, chunk_groups=2,
                      inflight_groups=8, interruptible=True, tail_placement=TailPlacement.DUE)
    cluster.apply(ev.Generate(0, 2))
    cluster.devices[0].version = cluster.devices[1].version = 1  # a load arrived mid-generation
    cluster.version = cluster.published = 1
    actions = []
    fill_rollout(cluster, actions)
    # eta 1: the v0 tail is due (batch 1 must contain it), so device 0 finishes it first; eta 2: it is not
    # due yet, and device 0 takes new groups beside it
    assert actions and {a.device for a in actions} == takers


@pytest.mark.parametrize("deadlines", [True, False])
@pytest.mark.parametrize("eta", [1, 2])
def test_under_tail_placement_none_every_older_tail_takes_new_groups_beside_it(eta, deadlines):
    from bidirl.sched.policies import fill_rollout

    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=eta, steps=6, chunk_groups=2,
                      inflight_groups=8, interruptible=True, deadlines=deadlines, tail_placement=TailPlacement.NONE)
    cluster.apply(ev.Generate(0, 2))
    cluster.devices[0].version = cluster.devices[1].version = 1
    cluster.version = cluster.published = 1
    actions = []
    fill_rollout(cluster, actions)
    assert {a.device for a in actions} == {0, 1}  # due (eta 1) or not, counted only or not: continuous batching


def test_each_policy_brings_its_own_tail_placement_and_the_run_may_override_it():
    from bidirl.sched.estimates import Estimates

    def placement(policy, **shape):
        run = RunShape(devices=4, rollout_devices=2, batch_groups=8, steps=2, chunk_groups=4, staleness=1, **shape)
        return assemble(policy, run, LIVE, Estimates(1.0, 1.0, 0.1)).cluster.tail_placement

    assert placement("areal") is placement("verl-async") is TailPlacement.DUE
    assert placement("bidirl") is placement("bidirl-none") is TailPlacement.NONE  # they stream their steps
    assert placement("bidirl", tail_placement=TailPlacement.DUE) is TailPlacement.DUE
    assert placement("areal", tail_placement=TailPlacement.NONE) is TailPlacement.NONE
    with pytest.raises(ValueError, match="tail placement"):
        Cluster([Role.ROLLOUT, Role.TRAIN], 4, 1, 2, 2, tail_placement=TailPlacement.AUTO)


@pytest.mark.parametrize("eta", [1, 2])
@pytest.mark.parametrize("step_period,switch_s,beside_the_tail", [(100.0, 0.1, False), (0.0, 0.1, True),
                                                                   (100.0, 100.0, True)])
def test_bidirl_keeps_new_groups_from_an_older_tail_only_where_trainers_are_to_spare_to_take_it(
        step_period, switch_s, beside_the_tail, eta):
    from bidirl.sched.estimates import Estimates

    # device 0: a v0 tail, due for batch 1 at eta 1 and not yet at eta 2; bidirl's own placement (none)
    cluster = tails_on([2], trainers=3, eta=eta, tail_placement=TailPlacement.NONE)
    costs = Estimates(1.0, 1.0, switch_s, decode_step_s=0.01, decode_group_s=0.01)
    policy = build_policy("bidirl", costs, 8)
    # 100 s apart: the pool idles longer than a tail lasts; 0: unmeasured. A 100 s switch: no tail lease pays,
    # so no trainer would take the tail, and new groups go beside it
    policy.step_period = step_period
    actions = []
    policy.fill(cluster, actions)
    tail_device_starts = any(isinstance(a, ev.Generate) and a.device == 0 for a in actions)
    assert tail_device_starts is beside_the_tail  # (to spare: a lent trainer takes the tail over first)


def test_under_count_only_staleness_every_older_tail_keeps_new_groups_away():
    from bidirl.sched.policies import fill_rollout

    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=2, steps=6, chunk_groups=2,
                      inflight_groups=8, interruptible=True, deadlines=False)
    cluster.apply(ev.Generate(0, 2))
    cluster.devices[0].version = cluster.devices[1].version = 1
    cluster.version = cluster.published = 1
    actions = []
    fill_rollout(cluster, actions)
    assert actions and {a.device for a in actions} == {1}  # no group is ever "due" without deadlines


def test_idle_rollout_devices_blocked_by_staleness_and_trainers_waiting_for_a_tail_say_so():
    cluster = simulate("async", eta=0, steps=4, costs=FixedCosts(generate_per_group=0.1, train_step=3.0))
    causes = {(r["home"], r["cause"]) for r in cluster.trace if r["to"] == "idle"}
    assert ("rollout", "admission") in causes and ("train", "tail") in causes


def test_each_device_pays_its_engines_warm_up_once_on_its_first_chunk_and_its_first_train_work():
    def run(warmup_s):
        return simulate("async", eta=0, steps=3, costs=FixedCosts(generate_per_group=0.1, train_step=1.6,
                                                                   warmup_s=warmup_s))

    steady, warming = run((0.0, 0.0)), run((2.0, 1.0))
    chunks = [[r["t"] for r in cluster.trace if r["device"] == 0 and r["reason"].endswith(" done")]
              for cluster in (steady, warming)]
    assert chunks[1][0] == pytest.approx(chunks[0][0] + 2.0)  # the rollout device's first chunk only
    assert chunks[1][1] - chunks[1][0] == pytest.approx(chunks[0][1] - chunks[0][0])
    # at eta 0 the stages take turns, so the run is longer by exactly both warm-ups, paid once each
    assert warming.now == pytest.approx(steady.now + 3.0)


def test_a_pulled_step_pays_each_micro_batchs_round_trip_and_its_finish_beyond_the_gradient_work():
    policy = build_policy("async")
    cluster = Cluster(policy.homes(2, 1), batch_groups=8, eta=0, steps=2, chunk_groups=8)
    costs = FixedCosts(generate_per_group=0.1, train_step=4.0,  # 32 samples: 4 micro-batches of 8, 1 s each
                       micro_batch_overhead_s=0.1, step_overhead_s=0.5)
    Simulator(cluster, policy, costs, pull_samples=8).run()
    start = next(r["t"] for r in cluster.trace if r["device"] == 1 and r["to"] == "training")
    done = next(r["t"] for r in cluster.trace if r["device"] == 1 and r["reason"] == "step -> v1")
    assert done - start == pytest.approx(4 * (1.0 + 0.1) + 0.5)


def test_sync_policy_is_on_policy_and_switches_every_device_twice_per_step():
    cluster = simulate("sync", devices=2, eta=0, steps=3)
    assert set(cluster.staleness) == {0}
    switches = [r for r in cluster.trace if r["to"] == "switching"]
    assert len(switches) == 2 * 2 * 3  # per step and device: into rollout, then into training


def test_async_overlaps_generation_with_training():
    sync, asynchronous = simulate("sync", eta=0, steps=6), simulate("async", eta=1, steps=6)
    training = [i for i in intervals(asynchronous.trace, asynchronous.now) if i[1] == "training"]
    generating = [i for i in intervals(asynchronous.trace, asynchronous.now) if i[1] == "generating"]
    assert any(g[3] < t[4] and t[3] < g[4] for g in generating for t in training)
    assert pool_idle_ratio(asynchronous.trace, asynchronous.now, {0: "rollout", 1: "train"})["train"] < 0.2
    assert sync.version == asynchronous.version == 6


def test_borrowed_rollout_device_returns_home_before_its_pool_needs_it():
    cluster = simulate("async-lend", eta=0, steps=6)
    lent = [r for r in cluster.trace if r["to"] == "switching" and r["role"] == "train"]
    returned = [r for r in cluster.trace if r["to"] == "switching" and r["role"] == "rollout"]
    assert lent and len(returned) == len(lent)  # every lease ends
    assert [lease.epoch for lease in cluster.leases] == list(range(len(lent)))
    assert not cluster.open_leases and all(lease.start < lease.end <= cluster.now for lease in cluster.leases)
    summary = cluster.lease_summary()
    assert set(summary) == {"rollout->train"} and summary["rollout->train"]["leases"] == len(lent)
    for chunk in cluster.chunks:  # and the device always generated while serving rollout
        starts = [r for r in cluster.trace if r["reason"].startswith(f"chunk {chunk.index}:")]
        assert starts[0]["role"] == "rollout"
    assert all(s["first_work_s"] >= 0 for s in switch_overheads(cluster.trace))


def test_lending_an_idle_rollout_device_shortens_a_training_bound_run():
    plain, lending = simulate("async", eta=0, steps=6), simulate("async-lend", eta=0, steps=6)
    assert lending.now < plain.now
    assert set(lending.staleness) == {0}


def test_measured_estimates_are_zero_until_measured_and_then_follow_the_run():
    from bidirl.sched.estimates import MeasuredEstimates

    measured = MeasuredEstimates(weight=0.5)
    assert not measured.current().measured
    measured.chunk(seconds=2.0, groups=4)
    measured.step(work_s=5.0, reduce_s=0.5)  # 2.5 s of gradient work on each of 2 devices
    first = measured.current()
    assert first.measured and (first.generate_group_s, first.chunk_s, first.train_batch_s) == (0.5, 2.0, 5.0)
    measured.chunk(seconds=4.0, groups=4)
    assert measured.current().generate_group_s == 0.75  # a moving average, not the last value


def test_bidirl_lends_nothing_before_it_has_measured_any_cost():
    from bidirl.sched.estimates import MeasuredEstimates

    policy = build_policy("bidirl", MeasuredEstimates(), 8)
    cluster = Cluster(policy.homes(2, 1), 8, 0, 4, 4, allows_join=False)
    Simulator(cluster, policy, FixedCosts(generate_per_group=0.1, train_step=1.6)).run()
    assert not cluster.leases and cluster.version == 4


def test_measured_estimates_start_from_a_prior_and_each_first_measurement_replaces_it():
    from bidirl.sched.estimates import Estimates, MeasuredEstimates

    prior = Estimates(generate_group_s=0.2, train_batch_s=4.0, switch_s=0.1, grad_transfer_s=0.05, chunk_s=1.6)
    measured = MeasuredEstimates(weight=0.5, prior=prior)
    assert measured.current() == prior and measured.current().measured
    measured.chunk(seconds=2.0, groups=4)
    assert (measured.current().generate_group_s, measured.current().chunk_s) == (0.5, 2.0)  # the run beats the model
    assert measured.current().train_batch_s == 4.0  # not measured yet: still the prior
    measured.chunk(seconds=4.0, groups=4)
    assert measured.current().generate_group_s == 0.75


def test_a_devices_first_chunk_is_timed_as_its_engines_warm_up_not_as_generation():
    from bidirl.sched.estimates import Estimates, MeasuredEstimates

    measured = MeasuredEstimates(weight=0.5)
    measured.chunk(seconds=2.2, groups=4, first=True)  # a fresh engine's first chunk
    assert measured.current().rollout_warmup_s == 2.2 and measured.current().chunk_s == 0.0  # all of it, so far
    measured.chunk(seconds=0.2, groups=4)
    now = measured.current()
    assert (now.chunk_s, now.generate_group_s) == (0.2, 0.05)  # generation as it runs once warm
    assert now.rollout_warmup_s == pytest.approx(2.0)  # the first chunk beyond a warm one
    assert "rollout_warmup_s" in measured.measured_names()
    # with a prior's generation time, the warm-up is known from the first chunk on, whatever its size
    primed = MeasuredEstimates(prior=Estimates(generate_group_s=0.05, train_batch_s=1.0, switch_s=0.0))
    primed.chunk(seconds=2.1, groups=2, first=True)
    assert primed.current().rollout_warmup_s == pytest.approx(2.0)


@pytest.mark.parametrize("rollout_warmup_s,lent", [(0.0, True), (2.0, False)])
def test_an_idle_trainer_is_lent_to_rollout_only_if_the_wait_it_saves_beats_its_engines_warm_up(rollout_warmup_s,
                                                                                                  lent):
    from bidirl.sched.estimates import Estimates

    # the rollout device has finished its first chunk (warm) and has 3 more to go, 0.4 s each; the trainer's
    # engine has never generated: lent, it would first warm up
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=16, eta=0, steps=2, chunk_groups=4)
    cluster.apply(ev.Generate(0, 4))
    cluster.complete(ev.ChunkDone(0, chunk=0, groups=4))
    cluster.apply(ev.Generate(0, 4))
    est = Estimates(generate_group_s=0.1, train_batch_s=1.6, switch_s=0.0, chunk_s=0.4,
                    rollout_warmup_s=rollout_warmup_s)
    actions = []
    build_policy("verl-dynamic", est, 16).lend_idle_trainers(cluster, actions)
    assert actions == ([ev.Switch(1, Role.ROLLOUT, "trainer idle: lent to rollout")] if lent else [])


def test_a_cold_rollout_pool_counts_its_own_warm_up_in_the_wait_a_lent_trainer_would_shorten():
    from bidirl.sched.estimates import Estimates

    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=16, eta=0, steps=2, chunk_groups=4)
    cluster.apply(ev.Generate(0, 4))  # nothing finished yet: both engines are cold
    est = Estimates(generate_group_s=0.1, train_batch_s=1.6, switch_s=0.0, chunk_s=0.4, rollout_warmup_s=2.0)
    actions = []  # the pool's wait: 2 s + 12 groups x 0.1 s; the lease: 2 s + 0.4 s
    build_policy("verl-dynamic", est, 16).lend_idle_trainers(cluster, actions)
    assert actions == [ev.Switch(1, Role.ROLLOUT, "trainer idle: lent to rollout")]  # both warm up side by side


def test_bidirl_lends_a_rollout_device_with_nothing_left_to_generate_to_the_runs_last_steps():
    from bidirl.sched.estimates import Estimates

    policy = build_policy("bidirl", Estimates(generate_group_s=0.05, train_batch_s=1.6, switch_s=0.0, chunk_s=0.2), 8)
    cluster = Cluster(policy.homes(2, 1), batch_groups=8, eta=1, steps=6, chunk_groups=4)
    Simulator(cluster, policy, FixedCosts(generate_per_group=0.05, train_step=1.6)).run()
    last = [r for r in cluster.trace if r["reason"] == "every group admitted: lent to training"]
    assert last and all(r["device"] == 0 for r in last)
    assert any(r["reason"] == f"joins batch {cluster.steps - 1}" and r["device"] == 0 for r in cluster.trace)


def run_with_one_chunk_per_batch(policy_name, eta, estimates, lends_ahead=True):
    """1 rollout / 1 train device, a batch of 8 groups generated as one chunk of 8 (0.8 s), 0.4 s steps."""
    policy = build_policy(policy_name, estimates, 8)
    if not lends_ahead:
        policy.lend_ahead = lambda *args: None
    cluster = Cluster(policy.homes(2, 1), batch_groups=8, eta=eta, steps=6, chunk_groups=8, streams=True)
    Simulator(cluster, policy, FixedCosts(generate_per_group=0.1, train_step=0.4, switch_s=0.01)).run()
    return cluster


def test_a_trainer_idle_while_the_pool_starts_its_whole_next_batch_generates_one_chunk_of_the_batch_after():
    # the first batch is one chunk on the rollout device: before, the trainer waited for it, idle, every run
    from bidirl.sched.estimates import Estimates

    est = Estimates(generate_group_s=0.1, train_batch_s=0.4, switch_s=0.01, chunk_s=0.8)
    cluster = run_with_one_chunk_per_batch("bidirl", 1, est)
    ahead = [r for r in cluster.trace if r["reason"] == "trainer idle: lent ahead of the next batch"]
    assert [(r["t"], r["device"]) for r in ahead] == [(0.0, 1)]  # at the start only: later a step runs meanwhile
    assert cluster.chunks[1].device == 1 and (cluster.chunks[1].first, cluster.chunks[1].groups) == (8, 8)
    first_step = next(r for r in cluster.trace if r["device"] == 1 and r["to"] == "training")
    assert first_step["t"] == pytest.approx(0.82)  # its chunk ended with batch 0's, plus one switch home
    assert max(cluster.staleness) <= 1 and cluster.trained_groups == cluster.admitted == 6 * 8
    waited = run_with_one_chunk_per_batch("bidirl", 1, est, lends_ahead=False)
    assert cluster.now < waited.now - 0.4  # the run is shorter by about one step that no longer waits


def test_a_trainer_lent_ahead_goes_home_when_a_step_starts_without_it_instead_of_holding_up_that_step():
    # device 0 trains but is not the primary (as after re-planning moved a rollout device home to train), so
    # a step may start while it is away; its chunk was estimated 10x too long, so the pool is done first.
    # The lease was held open while no *next* step could start -- also while one ran, waiting for it to join
    from bidirl.sched.estimates import Estimates

    policy = build_policy("bidirl", Estimates(generate_group_s=0.1, train_batch_s=0.4, switch_s=0.2, chunk_s=0.8), 8)
    cluster = Cluster([Role.TRAIN, Role.TRAIN, Role.ROLLOUT], batch_groups=8, eta=1, steps=4, chunk_groups=8,
                      primary=1, streams=True)
    Simulator(cluster, policy, FixedCosts(generate_per_group=0.01, train_step=0.4, switch_s=0.2)).run()
    assert cluster.version == 4 and any(r["reason"] == "trainer idle: lent ahead of the next batch" and r["device"] == 0
                                        for r in cluster.trace)
    assert not policy.ahead and all(d.role is d.home and d.idle for d in cluster.devices)


@pytest.mark.parametrize("eta,estimates", [(0, "measured"), (1, "none")])
def test_no_trainer_is_lent_ahead_on_policy_or_before_anything_is_measured(eta, estimates):
    from bidirl.sched.estimates import Estimates, MeasuredEstimates

    est = Estimates(generate_group_s=0.1, train_batch_s=0.4, switch_s=0.01, chunk_s=0.8)
    cluster = run_with_one_chunk_per_batch("bidirl", eta, est if estimates == "measured" else MeasuredEstimates())
    assert not [r for r in cluster.trace if "ahead" in r["reason"]]  # eta 0 admits nothing past the next batch


def test_a_lent_devices_gradient_return_is_measured_per_device_and_only_on_steps_that_had_one():
    from bidirl.sched.estimates import Estimates, MeasuredEstimates

    measured = MeasuredEstimates(weight=0.5, prior=Estimates(0.1, 2.0, 0.1, grad_transfer_s=0.3))
    measured.step(work_s=2.0, reduce_s=0.0)  # one home trainer, nothing lent: no return to time
    assert measured.current().grad_transfer_s == 0.3
    measured.step(work_s=2.0, reduce_s=2.0, lent=4)  # four lent devices returned theirs one after another
    assert measured.current().grad_transfer_s == 0.5  # per device (the first measurement replaces the prior)


def test_bidirl_lends_from_the_first_step_when_it_starts_from_a_prior():
    from bidirl.sched.estimates import Estimates, MeasuredEstimates

    prior = Estimates(generate_group_s=0.1, train_batch_s=1.6, switch_s=0.0, chunk_s=0.4)
    policy = build_policy("bidirl", MeasuredEstimates(prior=prior), 8)
    cluster = Cluster(policy.homes(2, 1), 8, 0, 4, 4, allows_join=False)
    Simulator(cluster, policy, FixedCosts(generate_per_group=0.1, train_step=1.6)).run()
    assert cluster.leases and cluster.leases[0].start < 1.6 and cluster.version == 4


def test_the_scheduling_core_never_imports_torch():
    code = ("import sys, bidirl.sched.policies, bidirl.sched.trace, bidirl.sim.simulator; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_streamed_step_starts_on_the_groups_done_takes_the_rest_as_they_finish_and_steps_once_all_are_in():
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=8, eta=0, steps=2, chunk_groups=4, inflight_groups=8,
                      streams=True)
    cluster.apply(ev.Generate(0, 4))
    cluster.apply(ev.Generate(0, 4))
    cluster.complete(ev.ChunkDone(0, 0, groups=3))
    assert not cluster.batch_ready() and cluster.stream_ready()
    cluster.apply(ev.Train((1,)))
    assert cluster.streaming == 5 and cluster.accepting_joins
    cluster.close_step()  # every micro-batch handed out so far -- but more groups are coming
    assert cluster.accepting_joins
    with pytest.raises(AssertionError, match="still generating"):
        cluster.complete(ev.TrainDone(1))
    cluster.complete(ev.ChunkDone(0, 0))  # the last group of chunk 0 goes straight into the step
    cluster.complete(ev.ChunkDone(0, 1))
    assert cluster.streaming == 0 and [(c.index, n) for c, n in cluster.batch_chunks(0)] == [(0, 3), (0, 1), (1, 4)]
    cluster.complete(ev.TrainDone(1))
    assert cluster.trained_groups == 8 and cluster.staleness == {0: 8}


def test_streaming_needs_deadlines_that_say_which_groups_a_batch_waits_for():
    with pytest.raises(ValueError, match="per-group deadlines"):
        Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=8, eta=1, steps=2, chunk_groups=4, streams=True,
                deadlines=False)
    from bidirl.sched.estimates import Estimates

    def streams(policy, eta):
        return assemble(policy, RunShape(2, 1, 8, 2, 4, eta), LIVE, Estimates(1.0, 1.0, 0.1)).cluster.streams

    assert streams("bidirl", 0) and streams("bidirl", 1)
    assert not streams("async", 0) and not streams("bidirl-nostream", 0)  # baselines wait for the whole batch


def test_at_eta_1_a_streamed_step_waits_only_for_the_due_tail_it_must_contain_anyway():
    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=2, chunk_groups=4,
                      streams=True)
    cluster.apply(ev.Generate(0, 4))
    cluster.apply(ev.Generate(1, 4))  # 8 groups at v0: all that v0 may start (deadline 1 for chunk 1)
    cluster.complete(ev.ChunkDone(0, 0))
    cluster.apply(ev.Train((2,)))
    cluster.complete(ev.TrainDone(1))
    cluster.complete(ev.ChunkDone(1, 1, groups=2))  # two of chunk 1's groups are done, two (due now) are not
    assert not cluster.batch_ready() and cluster.stream_plan() == {0: 2}
    cluster.apply(ev.Train((2,)))
    assert cluster.streaming == 2
    cluster.complete(ev.ChunkDone(1, 1))
    cluster.complete(ev.TrainDone(2))
    assert cluster.staleness == {0: 4, 1: 4} and cluster.trained_groups == 8


def test_a_streamed_step_does_not_start_while_a_device_could_still_start_groups_it_would_have_to_wait_for():
    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=3, chunk_groups=2, inflight_groups=4,
                      streams=True)
    cluster.apply(ev.Generate(0, 2))
    cluster.apply(ev.Generate(0, 2))
    cluster.complete(ev.ChunkDone(0, 0))
    cluster.complete(ev.ChunkDone(0, 1))
    cluster.apply(ev.Train((1,)))
    cluster.apply(ev.Generate(0, 2))  # v0 may start 8 groups in all: 6 so far
    cluster.complete(ev.TrainDone(1))
    cluster.complete(ev.ChunkDone(0, 2, groups=1))
    assert cluster.admissible(cluster.devices[0]) == 2 and cluster.stream_plan() is None


def test_a_borrowed_device_whose_lease_expired_goes_home_at_once_even_when_the_next_batch_is_ready():
    # eta 1: the next batch is complete when the step ends, which used to keep the expired device lent --
    # idle, serving train, into the next step while it still hung, its discarded gradients still held
    policy = build_policy("async-lend")
    cluster = Cluster(policy.homes(2, 1), batch_groups=4, eta=1, steps=4, chunk_groups=8)
    costs = FixedCosts(generate_per_group=0.1, train_step=1.0)
    Simulator(cluster, policy, costs, pull_samples=2, stalls={0: 100.0}, lease_timeout_s=0.5).run()
    (expired,) = cluster.expired_leases
    expired_at = expired[0]
    home = next(r for r in cluster.trace if r["device"] == 0 and r["t"] >= expired_at and r["to"] == "switching")
    assert home["t"] == pytest.approx(expired_at) and home["role"] == "rollout" and home["reason"] == "lease expired"
    trained_again = [r["t"] for r in cluster.trace if r["device"] == 0 and r["to"] == "training" and r["t"] > expired_at]
    assert all(t > expired_at + 90 for t in trained_again)  # not before its stall is over (it did, at +0.6 s)
    assert cluster.trained_groups == 4 * 4 and cluster.finished


def test_a_simulated_borrowed_device_that_hangs_loses_its_lease_and_the_others_redo_its_micro_batches():
    policy = build_policy("async-lend")
    cluster = Cluster(policy.homes(2, 1), batch_groups=8, eta=0, steps=3, chunk_groups=8)
    costs = FixedCosts(generate_per_group=0.1, train_step=4.0)  # 32 samples: 4 micro-batches of 8, 1 s each
    Simulator(cluster, policy, costs, pull_samples=8, stalls={0: 100.0}, lease_timeout_s=2.0).run()
    start = next(r["t"] for r in cluster.trace if r["device"] == 1 and r["to"] == "training")
    done = next(r["t"] for r in cluster.trace if r["device"] == 1 and r["reason"] == "step -> v1")
    (expired,) = cluster.expired_leases
    assert expired == (pytest.approx(start + 2.0), 0, 0)  # the lent device's first micro-batch overran
    assert done == pytest.approx(start + 4.0)  # the trainer redid it: the whole batch alone, nothing counted twice
    assert cluster.trained_groups == 3 * 8 and cluster.finished  # and the hung device came home when it woke
    back = [r for r in cluster.trace if r["device"] == 0 and r["from"] == "switching" and r["role"] == "rollout"]
    assert back[0]["t"] > start + 100


@pytest.mark.parametrize("stall, expires_at", [(15.0, None), (100.0, 20.0)])
def test_without_a_given_timeout_a_simulated_lease_expires_by_the_live_controllers_rule(stall, expires_at):
    # micro-batches of 2 s: 10 times the slowest is 20 s (the live controller's floor is 10 s)
    policy = build_policy("async-lend")
    cluster = Cluster(policy.homes(2, 1), batch_groups=8, eta=0, steps=3, chunk_groups=8)
    Simulator(cluster, policy, FixedCosts(generate_per_group=0.1, train_step=8.0), pull_samples=8,
              stalls={0: stall}).run()
    start = next(r["t"] for r in cluster.trace if r["device"] == 1 and r["to"] == "training")
    if expires_at is None:
        assert cluster.expired_leases == []  # a 15 s stall is slow, not dead
    else:
        assert [t for t, _, _ in cluster.expired_leases] == [pytest.approx(start + expires_at)]
    assert cluster.trained_groups == 3 * 8 and cluster.finished


def test_a_step_counts_its_devices_wait_before_a_device_joins_it():
    from bidirl.sched.estimates import StepProgress

    step = StepProgress(2.0, 2, 0.0)  # two devices, 1 s of work each: out of work from t=1
    step.join(5.0)  # 4 s idle on each before the third arrives
    step.add(6.0, 1.0)  # and 1 s on all three before more work arrives
    assert step.waited == pytest.approx(2 * 4.0 + 3 * 1.0)


def test_a_device_cannot_join_a_step_whose_work_has_run_out():
    class LateJoin(ScriptedJoin):  # the lent device is switched in only after the step's work is done
        def decide(self, event, cluster):
            if isinstance(event, ev.SwitchDone) and event.role is Role.TRAIN:
                assert not cluster.accepting_joins  # (the work ran out at t=4; the step ends after its finish)
                actions = [ev.Switch(event.device, Role.ROLLOUT, "nothing left to share")]
            elif isinstance(event, ev.TrainDone) and event.version == 1:
                actions = [ev.Train((1,))]
            else:
                return super().decide(event, cluster)
            for action in actions:
                cluster.apply(action)
            return actions

    cluster = Cluster([Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT], batch_groups=1, eta=1, steps=2, chunk_groups=2,
                      inflight_groups=2)
    costs = FixedCosts(generate_per_group=0.0, train_step=4.0, switch_s=4.5, step_overhead_s=1.0)
    Simulator(cluster, LateJoin(), costs).run()
    steps = [(r["t"], r["reason"]) for r in cluster.trace if r["device"] == 1 and r["to"] == "idle" != r["from"]]
    assert steps[0] == (5.0, "step -> v1")  # its own work and finish, not delayed by a joiner
