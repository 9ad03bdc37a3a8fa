"""The simulator: continuous-batching instances, determinism, invariants under every policy, the CLI."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bidirl.config import load_config
from bidirl.sched.policy import policy_names
from bidirl.sim.instance import Instance
from bidirl.sched.assembly import LIVE
from bidirl.sched.trace import time_breakdown
from bidirl.sim.run import best_static_split, simulate

SMALL_CLUSTER = ["cluster.devices=8", "train.prompts_per_step=64", "rollout.group_size=4", "train.steps=6",
                 "launch.chunk_groups=8"]


def small(*overrides):
    return load_config("pipelines/sim-32gpu.yaml", [*SMALL_CLUSTER, *overrides])


def drain(instance):
    finished = []
    while instance.next_finish() is not None:
        finished += instance.finish_due(instance.next_finish())
    return finished


def test_instance_finishes_short_sequences_first_and_the_tail_runs_alone():
    instance = Instance(step_a=0.01, step_b=0.001, capacity=100, prefill_s_per_seq=0.0)
    instance.admit(0.0, chunk=0, lengths=[10])
    instance.admit(0.0, chunk=1, lengths=[100])
    assert drain(instance) == [(0, 0), (1, 0)]  # (chunk, group)
    # 10 steps at batch 2, then 90 steps alone
    assert instance.clock == pytest.approx(10 * (0.01 + 0.002) + 90 * (0.01 + 0.001))


def test_an_instance_reports_the_decode_batch_it_ran_at_averaged_over_its_decoding_time():
    instance = Instance(step_a=0.01, step_b=0.001, capacity=100, prefill_s_per_seq=0.0)
    instance.admit(0.0, chunk=0, lengths=[10, 100])
    drain(instance)
    two, alone = 10 * (0.01 + 0.002), 90 * (0.01 + 0.001)  # 10 steps at batch 2, then 90 alone
    assert instance.busy_s == pytest.approx(two + alone)
    assert instance.batch_s / instance.busy_s == pytest.approx((2 * two + alone) / (two + alone))


def test_instance_queues_beyond_kv_capacity_and_a_pause_delays_everything():
    free = Instance(0.01, 0.0, capacity=1, prefill_s_per_seq=0.0)
    free.admit(0.0, 0, [10, 10])
    drain(free)
    assert free.clock == pytest.approx(0.2)  # one at a time
    paused = Instance(0.01, 0.0, capacity=1, prefill_s_per_seq=0.0)
    paused.admit(0.0, 0, [10, 10])
    paused.pause(0.05, 1.0)
    drain(paused)
    assert paused.clock == pytest.approx(1.2)


def test_an_engines_warm_up_delays_its_work_without_recomputing_what_already_runs_there():
    # a pause (a weight load) recomputes the running contexts; a warm-up only waits (their prefill is paid)
    warmed, paused = (Instance(0.01, 0.0, capacity=4, prefill_s_per_seq=0.5) for _ in range(2))
    for instance in (warmed, paused):
        instance.admit(0.0, 0, [10, 10])  # 2 prefills: decoding starts at 1.0
    warmed.warm_up(0.0, 2.0)
    paused.pause(0.0, 2.0)
    drain(warmed), drain(paused)
    assert warmed.clock == pytest.approx(1.0 + 2.0 + 0.1)
    assert paused.clock == pytest.approx(1.0 + 2.0 + 2 * 0.5 + 0.1)  # (the recompute of both contexts)


def test_an_instance_slowed_down_for_a_while_decodes_slower_for_exactly_that_while():
    instance = Instance(step_a=0.01, step_b=0.0, capacity=100, prefill_s_per_seq=0.0)
    instance.admit(0.0, chunk=0, lengths=[100])
    assert instance.slow_down(0.5, 2.0) and not instance.slow_down(0.6, 2.0)  # 50 steps done alone
    assert instance.slow_down(1.0, 1.0)  # 25 steps at half speed
    assert drain(instance) == [(0, 0)] and instance.clock == pytest.approx(1.25)  # the last 25 alone again


def test_groups_finished_by_a_change_of_speed_at_their_instant_are_reported_then_not_lost():
    # (a neighbour stops decoding at the instant this instance's last group ends, and its speed change is
    # handled first: the tick for that instant is stale; the simulation used to stall with the group unreported)
    instance = Instance(step_a=0.01, step_b=0.0, capacity=100, prefill_s_per_seq=0.0)
    instance.admit(0.0, chunk=0, lengths=[5, 5], group_size=2)
    end = instance.next_finish()
    assert instance.slow_down(end, 1.5)
    assert instance.next_finish() == end  # due at once, though nothing is left to decode
    assert instance.finish_due(end) == [(0, 0)] and instance.next_finish() is None


def test_a_finish_closer_to_the_clock_than_its_rounding_step_completes_at_the_clock_not_never():
    # (its tick comes at the clock itself; an advance that only ran while the clock was behind made no
    # progress there, and the simulation ticked at that instant until its event limit)
    instance = Instance(step_a=0.1, step_b=0.0, capacity=10, prefill_s_per_seq=0.0)
    instance.admit(1e6, chunk=0, lengths=[1])
    instance.slow_down(math.nextafter(instance.next_finish(), 0.0), 0.4)  # one rounding step before it ends
    assert instance.next_finish() == instance.clock
    assert instance.finish_due(instance.clock) == [(0, 0)] and instance.next_finish() is None


def test_a_group_completes_when_its_own_last_sequence_ends_not_when_its_chunk_does():
    instance = Instance(step_a=0.01, step_b=0.0, capacity=100, prefill_s_per_seq=0.0)
    instance.admit(0.0, chunk=7, lengths=[5, 5, 50, 50], group_size=2)  # two groups of two
    first = instance.next_finish()
    assert instance.finish_due(first) == [(7, 0)] and first == pytest.approx(0.05)
    assert drain(instance) == [(7, 1)]


def test_an_interrupting_load_recomputes_the_whole_context_so_it_costs_more_the_more_was_generated():
    def finish_after_pause_at(t):
        instance = Instance(step_a=0.01, step_b=0.0, capacity=10, prefill_s_per_seq=0.1, recompute_s_per_token=0.01)
        instance.admit(0.0, 0, [100, 100])
        instance.pause(t, seconds=0.5)
        return drain(instance) and instance.clock

    # prefill until 0.2 s, then 100 tokens at 0.01 s; a pause adds the load (0.5 s) and recomputes both
    # prompts (0.1 s each) and every token generated so far (0.01 s each)
    assert finish_after_pause_at(0.6) == pytest.approx(0.6 + 0.5 + 2 * 0.1 + 2 * 40 * 0.01 + 0.6)
    assert finish_after_pause_at(1.0) == pytest.approx(1.0 + 0.5 + 2 * 0.1 + 2 * 80 * 0.01 + 0.2)


def test_a_migrated_request_keeps_its_tokens_and_pays_the_re_prefill_of_its_whole_context():
    source = Instance(step_a=0.01, step_b=0.01, capacity=10, prefill_s_per_seq=0.025, recompute_s_per_token=0.001)
    source.admit(0.0, chunk=3, lengths=[60, 60, 20, 20], group_size=2)  # group (3, 0) long, (3, 1) short
    moved = source.take(0.5, [(3, 0)])  # 0.5 s = 4 x 0.025 prefill + 8 decode steps at batch 4 (0.05 s each)
    assert [(g, round(left, 6), round(done, 6)) for g, left, done in moved] == [((3, 0), 52, 8)] * 2
    assert source.groups_in_flight(0.5) == [(3, 1)] and drain(source) == [(3, 1)]
    target = Instance(step_a=0.01, step_b=0.01, capacity=10, prefill_s_per_seq=0.025, recompute_s_per_token=0.001)
    target.admit_continued(0.5, moved)
    assert drain(target) == [(3, 0)]  # nothing lost, nothing twice
    # re-prefill: two prompts and 2 x 8 generated tokens, then the 52 tokens left at batch 2
    assert target.clock == pytest.approx(0.5 + 2 * 0.025 + 16 * 0.001 + 52 * 0.03)


def test_short_older_tails_are_consolidated_so_the_devices_they_leave_generate_again():
    # gsm8k: short, weight-bound tails; under the "due" placement, which keeps new groups off them (bidirl's
    # own, none, gives them new groups instead: there tails form where trainers are to spare, below)
    cfg = small("algorithm.staleness=1", "train.steps=12", "launch.tail_placement=due")
    moved = simulate(cfg, "bidirl", rollout_devices=5, keep_trace=True)
    cluster = moved.cluster
    assert moved.migrated_groups == sum(groups for _, _, _, groups, _ in cluster.migrations) > 0
    assert all(cluster.devices[source].home.value == "rollout" for _, source, _, _, _ in cluster.migrations)
    assert any("takes over" in r["reason"] for r in cluster.trace)
    assert max(moved.staleness) <= 1 and cluster.trained_groups == cluster.admitted == 12 * 64
    assert all(d.role is d.home and d.idle for d in cluster.devices)
    unmoved = simulate(cfg, "bidirl-nomigrate", rollout_devices=5)
    assert unmoved.migrated_groups == 0 and moved.samples_per_s > unmoved.samples_per_s



def test_on_policy_the_batchs_tails_merge_so_the_devices_they_leave_train_where_much_training_follows_the_batch():
    # math at eta 0 on 32 devices: every device decodes a long sequence or two until near the batch's end, and
    # ~9 s of the step's training came after its last group; merged, the devices left join the step
    cfg = load_config("pipelines/sim-32gpu.yaml", ["sim.workload=math", "train.prompts_per_step=256",
                                                   "rollout.group_size=8", "algorithm.staleness=0", "train.steps=10"])
    merged = simulate(cfg, "bidirl", rollout_devices=2, keep_trace=True)
    cluster = merged.cluster
    assert merged.migrated_groups > 0 and set(merged.staleness) == {0}
    assert cluster.trained_groups == cluster.admitted == 10 * 256
    ends = cluster.version_times
    for when, source, _, _, version in cluster.migrations:  # each source trains in the step its groups are of
        assert when < ends[version + 1]
        assert any(r["device"] == source and r["to"] == "training" and when <= r["t"] <= ends[version + 1]
                   for r in cluster.trace)
    unmerged = simulate(cfg, "bidirl-nomigrate", rollout_devices=2)  # (at eta 0 no other request moves)
    assert merged.samples_per_s > 1.03 * unmerged.samples_per_s


def test_on_policy_tails_stay_where_they_are_where_little_training_follows_the_batch():
    # gsm8k on 8 devices: 0.1 s of training after the last group, so a merge would only slow the tails
    result = simulate(small("algorithm.staleness=0", "train.steps=8"), "bidirl", rollout_devices=2, keep_trace=True)
    assert result.migrated_groups == 0
    assert result.samples_per_s == simulate(small("algorithm.staleness=0", "train.steps=8"), "bidirl-nomigrate",
                                            rollout_devices=2).samples_per_s


def test_under_the_live_runtimes_constraints_a_tail_waiting_for_its_load_is_moved_onto_a_lent_trainer():
    # the live runtime loads new weights into a generating device only once its chunk ends: a device
    # decoding older groups with a load queued is a tail holder there; the same policy, driven with the
    # live driver's capabilities, moves such tails (and the invariants hold). 30 steps: since idle trainers
    # are also lent ahead of the next batch (they find work without migration too), what migration adds
    # is a few percent, and over 12 steps one step's timing could outweigh it (0.98x at seed 0, 1.06x at 1)
    cfg = small("algorithm.staleness=1", "train.steps=30")
    live = simulate(cfg, "bidirl", rollout_devices=5, driver=LIVE, keep_trace=True)
    cluster = live.cluster
    assert live.migrated_groups > 0 and max(cluster.staleness) <= 1
    assert all(cluster.devices[target].home.value == "train" for _, _, target, _, _ in cluster.migrations)
    assert cluster.trained_groups == cluster.admitted == 30 * 64 and all(d.role is d.home and d.idle
                                                                         for d in cluster.devices)
    assert live.samples_per_s > simulate(cfg, "bidirl-nomigrate", rollout_devices=5, driver=LIVE).samples_per_s


def test_under_the_live_runtimes_constraints_groups_moved_onto_a_device_are_reported_together_when_they_all_end(
        monkeypatch):
    # a live target continues the groups moved to it in one engine call and reports them when it returns;
    # simulated with the live driver's capabilities, the groups that end first are held back until then
    from bidirl.sched import events as ev
    from bidirl.sim.simulator import Simulator

    reports, handle = [], Simulator.handle

    def recording(self, event, now):
        if isinstance(event, ev.ChunkDone) and event.device in self.cluster.continuing:
            reports.append((event.device, now, event.groups, self.cluster.inflight[event.device]))
        return handle(self, event, now)

    monkeypatch.setattr(Simulator, "handle", recording)
    live = simulate(small("algorithm.staleness=1", "train.steps=30"), "bidirl", rollout_devices=5, driver=LIVE)
    assert live.migrated_groups > 0
    continuations, open_at = [], {}  # one per move: the times its groups were reported
    for device, now, groups, inflight in reports:
        open_at.setdefault(device, []).append((now, groups))
        if groups == inflight:  # its last groups: the continuation is over
            continuations.append(open_at.pop(device))
    assert continuations and not open_at
    assert any(sum(g for _, g in c) > 1 for c in continuations)  # moves of several groups ...
    assert all(len({now for now, _ in c}) == 1 for c in continuations)  # ... each reported at one instant


def test_on_an_engine_that_returns_a_chunk_whole_the_simulator_reports_its_groups_together_at_its_end(monkeypatch):
    # the live HF engine runs a chunk as one static batch and returns it whole; the live driver's
    # capabilities for it say so, and the simulator then reports no group of a chunk before the rest
    import dataclasses

    from bidirl.sched import events as ev
    from bidirl.sim.simulator import Simulator

    reports, handle = {}, Simulator.handle

    def recording(self, event, now):
        if isinstance(event, ev.ChunkDone) and self.cluster.chunks[event.chunk].device == event.device:
            reports.setdefault(event.chunk, set()).add(now)  # (groups moved elsewhere are the target's)
        return handle(self, event, now)

    monkeypatch.setattr(Simulator, "handle", recording)
    cfg = small("algorithm.staleness=1", "train.steps=20")
    whole = simulate(cfg, "bidirl", rollout_devices=5, driver=dataclasses.replace(LIVE, reports_groups=False),
                     keep_trace=True)
    assert reports and all(len(times) == 1 for times in reports.values())
    assert whole.cluster.trained_groups == whole.cluster.admitted == 20 * 64 and max(whole.staleness) <= 1
    reports.clear()
    simulate(cfg, "bidirl", rollout_devices=5, driver=LIVE)  # vLLM: each group as it ends
    assert any(len(times) > 1 for times in reports.values())


class ScriptedHandOverOfFinishedGroups:
    """Device 0 generates one chunk of 4 groups (two end at once, two run long) on an engine that returns a
    chunk whole; the trainer, lent to rollout, takes 3 groups over while the two short ones are held back:
    the two still running and one of those that ended. Then it trains the batch."""

    synchronous, deadlines = False, True

    def decide(self, event, cluster):
        from bidirl.sched import events as ev
        from bidirl.sched.roles import Role

        if isinstance(event, ev.Started):
            actions = [ev.Generate(0, 4), ev.Switch(2, Role.ROLLOUT, "lent")]
        elif isinstance(event, ev.SwitchDone) and event.role is Role.ROLLOUT:
            actions = [ev.Migrate(0, 2, 3, version=0)]
        elif isinstance(event, ev.ChunkDone) and cluster.batch_ready():
            actions = [ev.Switch(2, Role.TRAIN, "lease ends")]
        elif isinstance(event, ev.SwitchDone) and event.role is Role.TRAIN:
            actions = [ev.Train((2,))]
        else:
            actions = []
        for action in actions:
            cluster.apply(action)
        return actions


def test_groups_an_engine_held_back_and_then_handed_over_are_reported_with_the_targets_continuation(monkeypatch):
    # (live HF: a hand-over may take groups that ended but were not returned yet; the target reports them
    # when its continuation returns, and the source reports the ones it kept when it has nothing left)
    from dataclasses import dataclass

    from bidirl.sched import events as ev
    from bidirl.sched.cluster import Cluster
    from bidirl.sched.roles import Role
    from bidirl.sim.simulator import FixedCosts, Simulator

    @dataclass
    class OneChunkCosts(FixedCosts):
        G = 2

        def make_instance(self):
            return Instance(step_a=0.01, step_b=0.0, capacity=100, prefill_s_per_seq=0.0)

        def lengths(self, chunk):
            return [1, 1, 1, 1, 50, 50, 50, 50]  # groups 0 and 1 end at 0.01 s, 2 and 3 at 0.5 s

        def group_done(self, chunk, group):
            pass

        def decode_slowdown_beside_training(self):
            return 1.0

        def decode_slowdown_beside_decoding(self):
            return 1.0

    reports, handle = [], Simulator.handle

    def recording(self, event, now):
        if isinstance(event, ev.ChunkDone):
            reports.append((event.device, round(now, 6), event.groups))
        return handle(self, event, now)

    monkeypatch.setattr(Simulator, "handle", recording)
    cluster = Cluster([Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=1, chunk_groups=4,
                      allows_migration=True, migrates_into_batch=False)
    Simulator(cluster, ScriptedHandOverOfFinishedGroups(), OneChunkCosts(switch_s=0.1), whole_calls=True).run()
    # device 0 keeps one finished group and reports it once it holds nothing else (at the move, 0.1 s);
    # device 2 reports the two it continued (40 tokens left each) and the finished one together at 0.5 s
    assert reports == [(0, 0.1, 1), (2, 0.5, 3)]
    assert cluster.trained_groups == 4 and cluster.version == 1


def test_results_do_not_depend_on_the_chunk_size_a_real_system_would_not_care_about():
    for policy in ("verl", "areal", "bidirl"):
        throughputs = [simulate(small(f"launch.chunk_groups={chunk}", "algorithm.staleness=1"), policy).samples_per_s
                       for chunk in (4, 8, 16)]
        # (bidirl's tail merges go device by device, and a lent trainer's expected lease is a chunk's
        # time: within 2.5%; 2.05% since shares are as even as whole groups go, 1.4% before)
        assert max(throughputs) / min(throughputs) < (1.025 if policy == "bidirl" else 1.01), (policy, throughputs)


def test_every_policy_that_switches_pays_the_same_switch_the_performance_model_gives():
    from bidirl.sched.trace import switch_overheads
    from bidirl.sim.run import perf_model

    cfg = small("algorithm.staleness=0")
    expected = perf_model(cfg).switch_seconds()
    for policy in ("verl", "async-lend", "verl-dynamic", "bidirl-nostream"):  # (bidirl streams at eta 0 here)
        switches = switch_overheads(simulate(cfg, policy, keep_trace=True).cluster.trace)
        assert switches and [s["switch_s"] for s in switches] == pytest.approx([expected] * len(switches)), policy
    bigger = perf_model(small("sim.model=32B")).switch_seconds()
    assert expected == pytest.approx(0.6, abs=0.01) and bigger > 2 * expected  # more bytes to release and reload


def test_a_simulated_trainer_is_charged_the_log_prob_recompute_its_system_runs():
    from bidirl.sim.run import perf_model

    charged = {p: perf_model(small(), p).recompute_logprob
               for p in ("verl", "areal", "roll", "streamrl", "verl-dynamic", "verl-async", "async-lend",
                         "bidirl", "bidirl-none")}
    assert charged == {"verl": True, "areal": True, "roll": True, "streamrl": True, "verl-dynamic": True,
                       "verl-async": False, "async-lend": False, "bidirl": False, "bidirl-none": False}
    assert perf_model(small("sim.recompute_logprob=true"), "bidirl").recompute_logprob  # a setting rules all
    assert not perf_model(small("sim.recompute_logprob=false"), "areal").recompute_logprob
    # and the run is timed so: bidirl as if told not to recompute, areal as if told to
    for policy, same_as in (("bidirl", "false"), ("areal", "true")):
        own = simulate(small("algorithm.staleness=1"), policy)
        told = simulate(small("algorithm.staleness=1", f"sim.recompute_logprob={same_as}"), policy).samples_per_s
        other = simulate(small("algorithm.staleness=1",
                               f"sim.recompute_logprob={'true' if same_as == 'false' else 'false'}"), policy)
        assert own.samples_per_s == told and other.samples_per_s != told, policy
        assert own.row()["recomputed_logprob"] is (same_as == "true")  # and the results say which it was


def test_the_bound_is_the_same_for_every_policy_and_no_policy_beats_it():
    results = [simulate(small("algorithm.staleness=0"), p) for p in ("verl", "areal", "roll", "bidirl")]
    assert len({r.bound_step_s for r in results}) == 1
    assert all(r.bound_step_s < r.step_s for r in results)


def test_a_wider_staleness_window_decodes_at_a_fuller_batch_whose_tokens_cost_less():
    runs = [simulate(small(f"algorithm.staleness={eta}"), "areal") for eta in (0, 1, 4)]
    batches = [r.decode_batch for r in runs]
    assert batches == sorted(batches) and batches[0] < batches[2]
    assert all(1 <= r.decode_batch <= r.decode_capacity for r in runs)
    assert runs[0].decode_token_cost > runs[2].decode_token_cost > 1  # against the bound's saturated decode


def test_new_groups_beside_older_tails_fill_the_decode_batch_and_a_streamed_policy_finishes_sooner():
    def run(placement):
        return simulate(small("sim.workload=math", "algorithm.staleness=1", f"launch.tail_placement={placement}"),
                        "bidirl-none")

    due, none = run("due"), run("none")  # at eta 1 every older tail is due: "due" keeps new groups off all of them
    assert none.decode_batch > due.decode_batch
    assert none.samples_per_s > due.samples_per_s  # its steps train while the tails decode (bidirl's own: none)
    assert run("auto").samples_per_s == none.samples_per_s


def test_on_lengths_that_do_not_drift_every_policy_does_the_same_gradient_work_but_for_its_recompute():
    runs = {p: simulate(small("algorithm.staleness=1"), p) for p in ("verl", "areal", "bidirl", "verl-async")}
    assert runs["verl"].train_work_s == pytest.approx(runs["areal"].train_work_s)  # both recompute
    assert runs["bidirl"].train_work_s == pytest.approx(runs["verl-async"].train_work_s)  # neither does
    assert runs["areal"].train_work_s == pytest.approx(runs["bidirl"].train_work_s * 8 / 6)  # + a 2N forward on 6N


def test_trainer_on_rollpool_adds_no_more_than_speeding_up_every_train_step_could_in_the_rfc_ablation():
    # (validate.tor_ceiling's premise: if a Trainer-on-RollPool change ever beats it, the change does more
    # than speed up train steps, and the README's reading of case C must be redone)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "sim_validation"))
    from validate import tor_ceiling

    cfg = load_config("pipelines/sim-32gpu.yaml", [
        "cluster.devices=16", "sim.workload=math", "train.prompts_per_step=60", "rollout.group_size=8",
        "train.steps=30", "algorithm.staleness=0", "launch.chunk_groups=4", "sim.recompute_logprob=true"])
    rot = simulate(cfg, "bidirl-rot", rollout_devices=4, keep_trace=True)
    both = simulate(cfg, "bidirl", rollout_devices=4)
    ceiling = tor_ceiling(rot, lendable=4)
    assert 1 < both.samples_per_s / rot.samples_per_s <= ceiling


def test_the_window_bound_decodes_every_token_at_the_fullest_batch_the_window_allows():
    from bidirl.sim.costs import window_bound

    instance = Instance(step_a=0.01, step_b=0.001, capacity=50, prefill_s_per_seq=0.0)
    tokens = [(1000.0, 0.0, 0.0, 0.0, 0.0)]  # one step: 1000 tokens, no prefill, no training
    assert window_bound(instance, tokens, devices=1, sequences=1) == pytest.approx(1000 * 0.011)  # one at a time
    assert window_bound(instance, tokens, devices=2, sequences=2) == pytest.approx(1000 * 0.011 / 2)  # one each
    assert window_bound(instance, tokens, devices=1, sequences=10**6) == pytest.approx(1000 * (0.01 + 0.05) / 50)
    trained = [(1000.0, 0.0, 5.0, 0.0, 0.0)]  # 5 device-seconds of training take that long from decoding
    assert window_bound(instance, trained, devices=1, sequences=1) == pytest.approx(1000 * 0.011 + 5.0)


@pytest.mark.parametrize("workload", ["gsm8k", "math", "reasoning"])
def test_no_policy_beats_the_bound_of_its_admission_window_which_is_the_same_for_all(workload):
    runs = [simulate(small("algorithm.staleness=1", f"sim.workload={workload}", *extra), p)
            for p, extra in (("areal", ()), ("roll", ()), ("verl-dynamic", ()), ("verl-async", ()),
                             ("verl-async", ("algorithm.updates_per_sync=4",)), ("bidirl", ()))]
    assert len({r.window_bound_s for r in runs}) == 1  # (eta + 1) B groups in flight, whoever schedules them
    assert all(r.window_bound_s < r.step_s for r in runs)
    if workload != "gsm8k":  # long answers: the window, not saturated decoding, bounds them
        assert all(r.bound_step_s < r.window_bound_s for r in runs)


def test_the_bound_reads_the_groups_a_simulation_drew_and_gets_what_drawing_them_again_gives():
    from bidirl.perf.workload import preset
    from bidirl.sched.cluster import Chunk
    from bidirl.sim.costs import CalibratedCosts, step_bound
    from bidirl.sim.run import perf_model

    perf, steps, batch = perf_model(small()), 6, 8
    for name, eta in (("gsm8k", 0), ("gsm8k", 1), ("math-drift", 1)):  # (drift: other means, drawn again)
        costs = CalibratedCosts(perf, preset(name), 4, steps, seed=3)
        for step in range(steps):  # each batch generated at its own version, as on-policy steps are
            costs.lengths(Chunk(step, 0, step * batch, batch, step))
        drawn_again = step_bound(perf, preset(name), 4, batch, steps, 4, 3, eta)
        assert step_bound(perf, preset(name), 4, batch, steps, 4, 3, eta, costs.drawn) == drawn_again, (name, eta)
    assert costs.drawn.get(0, preset("math-drift").mean_at(0, steps)) is not None  # read where the mean matches
    assert costs.drawn.get(batch, preset("math-drift").mean_at(0, steps)) is None  # not where it drifted


def test_device_time_is_accounted_by_cause_in_the_same_categories_for_every_policy():
    from bidirl.sched.trace import CATEGORIES

    for policy in ("verl", "areal", "bidirl"):
        result = simulate(small("algorithm.staleness=1", "sim.workload=reasoning"), policy)
        for pool, parts in result.time_breakdown.items():
            assert set(parts) == set(CATEGORIES) and sum(parts.values()) == pytest.approx(1.0, abs=1e-3)
            assert parts["busy"] == pytest.approx(1 - result.idle_ratio[pool] - parts["switching"] - parts["draining"]
                                                  - parts["syncing"], abs=2e-3)


def test_simulation_is_deterministic_for_a_seed():
    first, second = simulate(small(), "bidirl"), simulate(small(), "bidirl")
    assert first.row() | {"sim_seconds": 0} == second.row() | {"sim_seconds": 0}
    other = simulate(small("seed=1"), "bidirl")
    assert other.makespan_s != first.makespan_s


def test_a_run_pauses_the_cyclic_garbage_collector_and_leaves_it_as_it_found_it(monkeypatch):
    import gc

    from bidirl.sched.policies import AsyncPolicy

    seen, was = [], gc.isenabled()
    decide = AsyncPolicy.decide
    monkeypatch.setattr(AsyncPolicy, "decide", lambda self, event, cluster: seen.append(gc.isenabled())
                        or decide(self, event, cluster))
    try:
        gc.enable()
        simulate(small(), "areal")
        assert seen and not any(seen)  # off while the events run (a result never depends on it: it frees nothing)
        assert gc.isenabled()
        gc.disable()
        simulate(small(), "areal")
        assert not gc.isenabled()  # a caller's choice stands
    finally:
        (gc.enable if was else gc.disable)()  # (the rest of the session as it was, even if this failed)


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("workload,eta", [("gsm8k", 0), ("gsm8k", 1), ("reasoning", 1), ("math", 4)])
def test_every_policy_trains_every_group_once_within_the_staleness_bound(policy, workload, eta):
    # math at eta=4 once trained a group 5 versions late: completion-order batches must respect deadlines
    result = simulate(small(f"sim.workload={workload}", f"algorithm.staleness={eta}", "train.steps=12"), policy,
                      keep_trace=True)
    cluster = result.cluster
    assert cluster.trained_groups == cluster.admitted == 12 * 64
    if cluster.deadlines:
        assert max(result.staleness) <= result.eta
    else:  # verl-async bounds how far generation runs ahead instead: no group starts more than eta batches
        # past the weights it is generated with (``chunk N: groups a-b at vV``)
        starts = [re.fullmatch(r"chunk \d+: groups (\d+)-(\d+) at v(\d+)", r["reason"]) for r in cluster.trace]
        starts = [(int(m[2]), int(m[3])) for m in starts if m]
        assert len(starts) >= 12 and all(last < v * cluster.B + math.floor((eta + 1) * cluster.B) for last, v in starts)
    assert all(d.role is d.home and d.idle for d in cluster.devices)  # every lease ended
    assert 0 < result.efficiency <= 1.0 + 1e-9


def test_colocated_sync_is_on_policy_whatever_the_configured_staleness():
    result = simulate(small("algorithm.staleness=4"), "verl")
    assert result.eta == 0 and set(result.staleness) == {0}


def test_the_tuned_static_split_is_the_best_areal_split():
    best = best_static_split(small(), 1)
    for rollout in range(1, 8):
        assert simulate(small(), "areal", 1, rollout).samples_per_s <= best.samples_per_s + 1e-9


def test_simulate_cli_prints_a_table_and_writes_gantts_and_a_bar_chart(tmp_path):
    bidirl = str(Path(sys.executable).with_name("bidirl"))
    result = subprocess.run([bidirl, "simulate", "pipelines/sim-32gpu.yaml", "--policies", "verl,areal,bidirl",
                             *SMALL_CLUSTER, f"output_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "samples/s" in result.stdout and "efficiency" in result.stdout and "busy / tail / admission" in result.stdout
    (run,) = tmp_path.iterdir()
    for name in ("gantt-verl.png", "gantt-areal.png", "gantt-bidirl.png", "throughput.png", "trace-bidirl.jsonl"):
        assert (run / name).stat().st_size > 0, name
    rows = json.loads((run / "results.json").read_text())
    assert [r["policy"] for r in rows] == ["verl", "areal", "bidirl"]


def test_an_unknown_policy_is_one_line_and_leaves_no_run_directory(tmp_path):
    bidirl = str(Path(sys.executable).with_name("bidirl"))
    result = subprocess.run([bidirl, "simulate", "pipelines/sim-32gpu.yaml", "--policies", "verl,nope",
                             f"output_dir={tmp_path}/out"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().startswith("error: unknown policy 'nope'")
    assert not (tmp_path / "out").exists()


def test_case_a_calibration_stays_within_fifteen_percent_of_the_published_step():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "sim_validation"))
    from validate import case_a

    for line in case_a()[2:]:
        error = float(line.split("|")[4].strip().rstrip("%"))
        assert abs(error) <= 15.0, line


def test_fully_async_streams_updates_and_publishes_weights_once_per_sync_window():
    result = simulate(small("algorithm.staleness=0.5", "algorithm.updates_per_sync=4", "sim.workload=math"),
                      "verl-async", keep_trace=True)
    cluster = result.cluster
    assert cluster.B == 16 and cluster.version == 6 * 4  # 64 prompts per step = 4 streamed updates of 16
    assert cluster.trained_groups == cluster.admitted == 6 * 64
    loaded = {int(r["reason"].split(" v")[1].split()[0]) for r in cluster.trace if r["reason"].startswith("load v")}
    assert loaded and all(v % 4 == 0 for v in loaded)  # rollout sees only every 4th version
    assert max(result.staleness) > 0
    # a step is 4 updates: its steady time is of the same order as the mean step (it read 4x too short)
    assert 0.5 * result.step_s < result.steady_step_s < 1.5 * result.step_s


def test_a_fractional_staleness_bound_is_one_line_for_policies_that_bound_it_in_versions(tmp_path):
    bidirl = str(Path(sys.executable).with_name("bidirl"))
    result = subprocess.run([bidirl, "simulate", "pipelines/sim-32gpu.yaml", "--policies", "verl-async,areal",
                             *SMALL_CLUSTER, "algorithm.staleness=0.5", f"output_dir={tmp_path}/out"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: simulate: algorithm.staleness=0.5: a fractional bound needs count-only staleness "
        "(policy verl-async); policy 'areal' bounds staleness in whole versions"]
    assert not (tmp_path / "out").exists()


def test_case_b_fully_async_beats_colocated_and_the_published_split_ranking_holds():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "sim_validation"))
    from validate import case_b

    ratios = [float(line.split("|")[-2]) for line in case_b() if "x colocated" in line]
    eight, sixteen, twentyfour = ratios
    assert eight > sixteen > 1.0 > twentyfour


QWEN3_32B = dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, intermediate_size=25600, vocab_size=151936)
LLAMA_70B = dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, intermediate_size=28672, vocab_size=128256)


@pytest.mark.parametrize("architecture,k,context,intercept_ms,slope_ms,slope_tolerance", [
    (QWEN3_32B, 2, 500, 14.36, 0.119, 0.05),  # calibration.md, ML.ENERGY fits of vLLM on H100
    (QWEN3_32B, 2, 4000, 15.08, 0.278, 0.05),
    (LLAMA_70B, 4, 500, 14.94, 0.107, 0.30),  # the one row the split slope fits badly: +26%
])
def test_tensor_parallel_instances_follow_the_published_tp_decode_fits(architecture, k, context, intercept_ms,
                                                                       slope_ms, slope_tolerance):
    from bidirl.models.footprint import config_from_fields, count_model
    from bidirl.perf.analytic import HARDWARE, PerfModel

    perf = PerfModel(HARDWARE["H100"], count_model(config_from_fields(architecture), "published"))
    a, b = perf.decode_line(context, instance_devices=k)
    assert 1e3 * a == pytest.approx(intercept_ms, rel=0.06)
    assert 1e3 * b == pytest.approx(slope_ms, rel=slope_tolerance)
    one_a, one_b = perf.decode_line(context)
    assert a < one_a / (k - 0.5) and b < one_b  # k devices decode faster than one, not k times
    assert perf.max_concurrency(context, k) > k * perf.max_concurrency(context)  # weights leave more room


def test_a_unit_of_k_devices_is_timed_from_the_one_device_model():
    from bidirl.perf.instances import InstanceModel
    from bidirl.sim.run import perf_model

    one = perf_model(small())
    four = InstanceModel(one, 4)
    assert four.decode_line(500.0) == one.decode_line(500.0, instance_devices=4)
    assert four.max_concurrency(500.0) == one.max_concurrency(500.0, instance_devices=4) > one.max_concurrency(500.0)
    assert four.train_compute_seconds(1e5) == pytest.approx(one.train_compute_seconds(1e5) / 4)
    assert four.allreduce_seconds(2) == one.allreduce_seconds(8)  # two train groups of four: a ring of eight
    assert four.gradient_return_seconds(1) == pytest.approx(one.gradient_return_seconds(1) / 4)  # shards in parallel
    assert one.switch_seconds("rollout") > four.switch_seconds("rollout") > one.switch_fixed_s


def test_coarse_instances_lend_whole_instances_and_report_devices():
    cfg = small("cluster.devices=16", "cluster.instance_devices=4", "algorithm.staleness=0")
    result = simulate(cfg, "bidirl", rollout_devices=8, keep_trace=True)
    assert (result.devices, result.rollout_devices) == (16, 8)
    assert len(result.cluster.devices) == 4  # four scheduling units of four devices
    assert result.cluster.leases and result.bound_step_s <= result.step_s
    with pytest.raises(ValueError, match="not whole instances of 4 devices"):
        simulate(cfg, "areal", rollout_devices=6)


def test_a_pulled_step_gives_a_joiner_only_micro_batches_nobody_has_started():
    from bidirl.sim.simulator import PulledStep

    step = PulledStep(item_s=1.0, items=4, devices=1, now=0.0)
    assert step.finish() == 4.0 and step.last_start == 3.0
    step.join(0.5)  # the first micro-batch runs on; the joiner takes the second at once
    assert step.finish() == pytest.approx(2.5) and step.last_start == 1.5  # 0-1, 0.5-1.5, 1-2, 1.5-2.5
    late = PulledStep(item_s=1.0, items=4, devices=1, now=0.0)
    late.join(3.5)  # everything has started: joining saves nothing
    assert late.finish() == 4.0


def test_a_device_with_no_micro_batch_left_waits_for_the_others_last_one_and_that_wait_is_counted():
    from bidirl.sim.simulator import PulledStep

    step = PulledStep(item_s=1.0, items=4, devices=1, now=0.0)
    assert step.join(0.5) == {}  # 0-1, 0.5-1.5, 1-2, 1.5-2.5: the first device is out of work from 2 to 2.5
    assert step.end_waits() == {0: pytest.approx(0.5)}
    assert step.join(3.0) == {0: pytest.approx(0.5), 1: pytest.approx(0.5)}  # a home trainer back at 3: both waited
    assert step.end_waits() == {}  # (each stretch once)


def test_each_stretch_a_pulled_steps_device_waits_is_counted_once_however_it_ends():
    from bidirl.sim.simulator import PulledStep

    streamed = PulledStep(item_s=1.0, items=0, devices=2, now=0.0)
    streamed.add(0.0, [1.0])  # one slot computes 0-1, the other has nothing
    streamed.add(2.0, [1.0])  # the next group's work at 2: both were out of work since 0 and 1
    assert streamed.end_waits() == {1: pytest.approx(1.0)}  # 2-3 on slot 0; slot 1 out of work 2-3
    assert streamed.waited == pytest.approx(2.0 + 1.0 + 1.0)
    expiring = PulledStep(item_s=1.0, items=0, devices=2, now=0.0)
    expiring.stalls[1] = 5.0  # slot 1 hangs in its micro-batch: 0-6
    expiring.add(0.0, [1.0, 1.0])  # slot 0 computes 0-1, then has nothing
    assert expiring.expire(3.0, 1) == {0: pytest.approx(2.0)}  # slot 1's lease expires at 3: slot 0 waited 1-3
    assert expiring.end_waits() == {} and expiring.finish() == pytest.approx(4.0)  # then computes it again, 3-4


def test_a_device_out_of_micro_batches_while_another_finishes_the_step_is_idle_time_of_its_pool_not_busy():
    cfg = small("cluster.devices=2", "train.prompts_per_step=16", "rollout.group_size=4", "launch.chunk_groups=4",
                "algorithm.staleness=0", "train.micro_batch_size=8")
    result = simulate(cfg, "bidirl-nostream", rollout_devices=1, driver=LIVE, keep_trace=True)  # joins after the batch
    assert any(r["reason"].startswith("joins") for r in result.cluster.trace)
    traced = time_breakdown(result.cluster.trace, result.makespan_s, result.cluster.homes_at_start())
    # here the joiner (home: rollout) ends first and waits for the trainer's last micro-batch
    moved = result.time_breakdown["rollout"]["tail"] - traced["rollout"]["tail"]
    assert moved > 0 and traced["rollout"]["busy"] - result.time_breakdown["rollout"]["busy"] == pytest.approx(moved)


def test_the_live_prediction_joins_in_whole_micro_batches_and_coarser_ones_share_less():
    steps = {}
    for micro in (8, 64):
        cfg = small("cluster.devices=2", "train.prompts_per_step=16", "rollout.group_size=4", "launch.chunk_groups=4",
                    "algorithm.staleness=0", f"train.micro_batch_size={micro}")
        result = simulate(cfg, "bidirl-nostream", rollout_devices=1, driver=LIVE, keep_trace=True)  # joins after the batch
        steps[micro] = (result.step_s, sum(r["reason"].startswith("joins") for r in result.cluster.trace))
    assert steps[8][1] > 0 and steps[8][0] < steps[64][0]  # 64 informative samples at most: one micro-batch


def test_pulled_micro_batches_that_arrive_later_queue_behind_the_rest_and_waiting_is_counted():
    from bidirl.sim.simulator import PulledStep

    step = PulledStep(item_s=1.0, items=2, devices=2, now=0.0)  # both devices busy 0-1
    step.add(3.0, [0.5, 0.5, 0.5])  # both were out of work from 1 to 3
    assert step.waited == pytest.approx(4.0) and step.finish() == pytest.approx(4.0)  # 3-3.5-4, 3-3.5


def test_a_streamed_step_finishes_soon_after_its_last_group_and_beats_waiting_for_the_whole_batch():
    cfg = small("algorithm.staleness=0")
    for rollout_devices in (3, 4, 5, 6):
        streamed = simulate(cfg, "bidirl", rollout_devices=rollout_devices, keep_trace=True)
        whole = simulate(cfg, "bidirl-nostream", rollout_devices=rollout_devices)
        assert max(streamed.staleness) == 0  # still exactly on-policy
        assert streamed.samples_per_s >= 0.99 * whole.samples_per_s
        if rollout_devices >= 5:  # a rollout-heavy split: the trainers are home while the batch generates
            starts = [r for r in streamed.cluster.trace if r["to"] == "training" and "streamed" in r["reason"]]
            assert starts and streamed.samples_per_s > 1.2 * whole.samples_per_s
            assert 0 < streamed.time_breakdown["train"]["tail"] < 1  # waiting for groups inside a step is idle time


def test_where_steps_stream_the_primary_stays_home_and_starts_each_on_policy_step_on_its_first_group_done():
    # lent to generate, the primary would be back only once its chunk's longest sequence ended, and no step
    # starts without it: the batch generated whole, then trained whole
    result = simulate(small("algorithm.staleness=0"), "bidirl", rollout_devices=2, keep_trace=True)
    cluster = result.cluster
    lent = {r["device"] for r in cluster.trace if r["role"] == "rollout" and r["home"] == "train"}
    assert lent and cluster.primary not in lent  # the other trainers generate
    starts = [r["reason"] for r in cluster.trace if r["to"] == "training" and r["device"] == cluster.primary]
    assert len(starts) == 6 and all("streamed: 1/64 groups done" in reason for reason in starts)


def test_workload_draws_are_the_standard_library_gaussians_bit_for_bit():
    import random

    from bidirl.perf.workload import GroupDraws, standard_normals

    for seed, n in ((0, 9), (12345, 2304), (7, 1)):
        gauss = random.Random(seed).gauss
        assert standard_normals(seed, n) == [gauss(0.0, 1.0) for _ in range(n)]
    draws, gauss = GroupDraws(3, 8), random.Random(3 * 1_000_003 + 1).gauss  # group 256 opens block 1
    assert draws.draws(256) == (gauss(0.0, 1.0), [gauss(0.0, 1.0) for _ in range(8)])


def test_with_instances_of_several_devices_switches_and_lent_time_are_counted_in_devices():
    cfg = small("cluster.devices=16", "cluster.instance_devices=2", "cluster.rollout_devices=6", "algorithm.staleness=0")
    result = simulate(cfg, "bidirl", keep_trace=True)
    switched = [r for r in result.cluster.trace if r["to"] == "switching"]  # (the cluster's trace counts units)
    assert switched and result.switches == 2 * len(switched)
    leases = result.cluster.lease_summary()
    for direction, entry in result.leases.items():
        assert entry["leases"] == leases[direction]["leases"]
        assert entry["device_s"] == pytest.approx(2 * leases[direction]["device_s"], abs=2e-3)
