"""The controller's rule for groups reported as they end while another device asked for them (in-flight
migration): whichever order the replies come in, each group is done once, on the device the bookkeeping
gave it to. The live runs in ``test_runtime.py`` exercise it end to end; the orders that a timing race
produces rarely are written out here."""

import dataclasses
from collections import Counter

from bidirl.runtime import protocol as msg
from bidirl.runtime.controller import Controller, Move
from bidirl.samples import Sample
from bidirl.sched import events as ev

SOURCE, TARGET, CHUNK = 0, 1, 7


class Collected:
    """The rollout data's side of a reply: groups kept and device-seconds counted, per chunk."""

    def __init__(self):
        self.groups, self.seconds = Counter(), Counter()

    def collect(self, chunk, samples, seconds):
        self.groups[chunk] += len({s.prompt_index for s in samples})
        self.seconds[chunk] += seconds
        return len({s.prompt_index for s in samples})


def controller_after_a_migrate(holds: int, *asked: int) -> Controller:
    """The source held ``holds`` groups of the chunk; the bookkeeping moved ``asked`` of them to the
    target (one Migrate each, oldest first) and the asks are on their way to the source."""
    c = object.__new__(Controller)  # (only the migration bookkeeping: no run, no mailbox)
    c.held = {SOURCE: Counter({CHUNK: holds - sum(asked)}), TARGET: Counter({CHUNK: sum(asked)})}
    c.asked = {n: (SOURCE, CHUNK, TARGET, groups) for n, groups in enumerate(asked)}
    c.move_of = {n: Move(TARGET, {n}) for n in range(len(asked))}
    c.reported, c.reported_s, c.data = Counter(), {}, Collected()
    return c


def groups(*indices):
    return {i: [Sample(i, [1], [2, 3], "", [-0.1, -0.2], 0) for _ in range(2)] for i in indices}


def test_groups_a_source_reports_done_before_it_sees_the_ask_go_first_to_what_it_keeps():
    c = controller_after_a_migrate(4, 2)
    assert c.finished(SOURCE, CHUNK, groups(0), 1.0) == [ev.ChunkDone(SOURCE, CHUNK, 1)]
    assert c.asked == {0: (SOURCE, CHUNK, TARGET, 2)}  # the engine still has the two asked for


def test_groups_beyond_what_the_source_keeps_are_the_targets_and_the_ask_waits_for_the_rest():
    c = controller_after_a_migrate(3, 2)
    events = c.finished(SOURCE, CHUNK, groups(0, 1), 1.5)
    assert events == [ev.ChunkDone(SOURCE, CHUNK, 1), ev.ChunkDone(TARGET, CHUNK, 1)]
    assert c.asked == {0: (SOURCE, CHUNK, TARGET, 1)}  # the engine, asked for 2, has 1 left to hand over
    assert c.held[SOURCE][CHUNK] == 0 and c.held[TARGET][CHUNK] == 1


def test_with_two_asks_out_the_shortfall_falls_on_the_newest_as_the_engine_answers_oldest_first():
    # the engine, holding 1 group when it sees both asks, gives the first ask that group and the second none
    c = controller_after_a_migrate(4, 1, 1)
    events = c.finished(SOURCE, CHUNK, groups(0, 1, 2), 1.0)
    assert events == [ev.ChunkDone(SOURCE, CHUNK, 2), ev.ChunkDone(TARGET, CHUNK, 1)]
    assert c.asked == {0: (SOURCE, CHUNK, TARGET, 1)}
    assert c._groups_handed_over(msg.GroupsHandedOver(device=SOURCE, chunk=CHUNK, samples=[], ask=1)) is None


def test_an_ask_settled_wholly_from_groups_reported_done_takes_the_engines_empty_answer_as_nothing():
    c = controller_after_a_migrate(2, 2)
    assert c.finished(SOURCE, CHUNK, groups(0, 1), 2.0) == [ev.ChunkDone(TARGET, CHUNK, 2)]
    assert c.asked == {}
    assert c._groups_handed_over(msg.GroupsHandedOver(device=SOURCE, chunk=CHUNK, samples=[], ask=0)) is None


def test_a_chunks_device_seconds_are_counted_once_however_its_groups_were_reported():
    c = controller_after_a_migrate(3)  # (no ask out)
    c.finished(SOURCE, CHUNK, groups(0), 1.0)
    c.finished(SOURCE, CHUNK, groups(1), 2.5)
    c.finished(SOURCE, CHUNK, groups(2), 4.0)
    assert c.data.seconds[CHUNK] == 4.0 and c.reported[(SOURCE, CHUNK)] == 3


def controller_timing_chunks() -> Controller:
    from bidirl.sched.estimates import MeasuredEstimates

    c = controller_after_a_migrate(0)
    c.held = {SOURCE: Counter(), TARGET: Counter()}
    c.chunks_open, c.generated_on, c.split_chunks, c.measured, c.continued = 0, set(), set(), MeasuredEstimates(), {}
    c.first_batch = set()
    return c


def chunk_generated(device, chunk, indices, seconds):
    samples = [s for group in groups(*indices).values() for s in group]
    return msg.ChunkGenerated(device=device, seconds=seconds, chunk=chunk, samples=samples, version=0)


def test_a_devices_first_chunk_is_timed_as_its_warm_up_once_with_every_group_it_reported_as_they_ended():
    c = controller_timing_chunks()
    c.held[SOURCE][CHUNK], c.chunks_open = 3, 1
    c._groups_generated(msg.GroupsGenerated(device=SOURCE, seconds=1.0, chunk=CHUNK,
                                            samples=[s for g in groups(0, 1).values() for s in g]))
    c._chunk_generated(chunk_generated(SOURCE, CHUNK, (2,), 2.5))
    assert c.measured.first_chunks == [(2.5, 3)] and c.chunks_open == 0
    c.held[SOURCE][CHUNK + 1], c.chunks_open = 3, 1
    c._chunk_generated(chunk_generated(SOURCE, CHUNK + 1, (0, 1, 2), 1.2))  # (its second: not a warm-up)
    assert c.measured.first_chunks == [(2.5, 3)] and c.measured.current().chunk_s == 1.2


def test_a_first_chunk_split_by_a_migration_times_nothing_but_still_marks_its_device_warm():
    c = controller_timing_chunks()
    c.held[SOURCE][CHUNK], c.chunks_open = 2, 1
    c.split_chunks.add(CHUNK)  # (some of its groups went to another device: neither times the chunk)
    c._chunk_generated(chunk_generated(SOURCE, CHUNK, (0, 1), 3.0))
    assert c.measured.first_chunks == [] and SOURCE in c.generated_on


class Sent:
    """The mailbox's side: every command sent, main and side queues alike."""

    def __init__(self):
        self.commands = []

    def send(self, device, command):
        self.commands.append((device, command))

    send_weights = send


def controller_with_two_joined_chunks_on_the_source() -> Controller:
    """The source runs chunks 0 and 1 of version 0 in one batch (chunks that joined a batch in flight),
    two groups each; the target is idle."""
    from types import SimpleNamespace

    from bidirl.sched.cluster import Chunk

    c = controller_timing_chunks()
    c.held = {SOURCE: Counter({0: 2, 1: 2}), TARGET: Counter()}
    c.cluster = SimpleNamespace(primary=TARGET, chunks=[Chunk(0, SOURCE, 0, 2, 0), Chunk(1, SOURCE, 2, 2, 0)])
    c.mailbox, c.asked, c.move_of, c.next_ask, c.continued = Sent(), {}, {}, 0, {}
    c.data.params = SimpleNamespace(max_new_tokens=8)
    c.report = SimpleNamespace(handovers=[], elapsed=lambda: 1.0)
    return c


def unfinished(chunk_first, *indices):
    """Samples of a chunk's groups stopped mid-generation, labelled with their groups as the worker does."""
    samples = []
    for i in indices:
        for _ in range(2):
            sample = Sample(i, [1], [2], "", [-0.1], 0, finished=False)
            sample.extra["group"] = chunk_first + i
            samples.append(sample)
    return samples


def test_a_tail_of_two_joined_chunks_moves_as_one_continuation_whose_answer_is_done_chunk_by_chunk():
    c = controller_with_two_joined_chunks_on_the_source()
    c._migrate(ev.Migrate(SOURCE, TARGET, 4, 0))
    assert [type(command) for _, command in c.mailbox.commands] == [msg.HandOverGroups, msg.HandOverGroups]

    c._groups_handed_over(msg.GroupsHandedOver(device=SOURCE, chunk=0, samples=unfinished(0, 0, 1), ask=0))
    assert len(c.mailbox.commands) == 2  # the target waits for the rest of the tail: one batch, as counted
    c._groups_handed_over(msg.GroupsHandedOver(device=SOURCE, chunk=1, samples=unfinished(2, 0, 1), ask=1))
    (device, continuation), = c.mailbox.commands[2:]
    assert device == TARGET and isinstance(continuation, msg.ContinueGroups) and len(continuation.samples) == 8

    continued = [dataclasses.replace(s, completion_ids=[2, 3], finished=True) for s in continuation.samples]
    events = c._chunk_generated(msg.ChunkGenerated(device=TARGET, seconds=2.0, chunk=continuation.chunk,
                                                   samples=continued, version=0))
    assert events == [ev.ChunkDone(TARGET, 0, 2), ev.ChunkDone(TARGET, 1, 2)]
    assert c.data.seconds == Counter({0: 1.0, 1: 1.0}) and c.chunks_open == 0 and c.continued == {}
    assert c.reported == Counter() and c.reported_s == {}


def test_an_ask_of_a_move_settled_from_groups_the_source_finished_leaves_the_rest_to_continue_alone():
    c = controller_with_two_joined_chunks_on_the_source()
    c._migrate(ev.Migrate(SOURCE, TARGET, 4, 0))
    finished_first = {i: [dataclasses.replace(s, finished=True) for s in unfinished(0, i)] for i in (0, 1)}
    assert c.finished(SOURCE, 0, finished_first, 1.0) == [ev.ChunkDone(TARGET, 0, 2)]  # chunk 0 ended first
    assert len(c.mailbox.commands) == 2
    c._groups_handed_over(msg.GroupsHandedOver(device=SOURCE, chunk=1, samples=unfinished(2, 0, 1), ask=1))
    (device, continuation), = c.mailbox.commands[2:]
    assert continuation.chunk == 1 and len(continuation.samples) == 4


def test_a_move_whose_last_ask_is_settled_from_groups_reported_done_then_sends_what_was_handed_over():
    c = controller_with_two_joined_chunks_on_the_source()
    c._migrate(ev.Migrate(SOURCE, TARGET, 4, 0))
    c._groups_handed_over(msg.GroupsHandedOver(device=SOURCE, chunk=0, samples=unfinished(0, 0, 1), ask=0))
    finished_before_the_ask = {i: [dataclasses.replace(s, finished=True) for s in unfinished(2, i)] for i in (0, 1)}
    assert c.finished(SOURCE, 1, finished_before_the_ask, 2.0) == [ev.ChunkDone(TARGET, 1, 2)]
    (device, continuation), = c.mailbox.commands[2:]  # (sent from inside finished: the move is answered)
    assert device == TARGET and continuation.chunk == 0 and len(continuation.samples) == 4
    assert c.move_of == {} and c.asked == {}


def test_chunks_that_share_the_engines_batch_are_timed_as_one_batch_with_its_last_chunk():
    c = controller_with_two_joined_chunks_on_the_source()
    c.cluster.chunk_groups, c.chunks_open = 2, 2
    c.generated_on.add(SOURCE)  # (not its first batch: that one is held as the warm-up)
    c._groups_generated(msg.GroupsGenerated(device=SOURCE, seconds=3.0, chunk=0, samples=unfinished(0, 0)))
    shared = dict(version=0, shared=True)
    c._chunk_generated(msg.ChunkGenerated(device=SOURCE, seconds=4.0, chunk=0, samples=unfinished(0, 1), **shared))
    assert c.measured.seen == set()  # (chunk 1 still runs in the batch: no time is this chunk's own)
    c._chunk_generated(msg.ChunkGenerated(device=SOURCE, seconds=5.5, chunk=1, samples=unfinished(2, 0, 1),
                                          batch_s=6.0, batch_groups=4, **shared))
    assert c.measured.current().generate_group_s == 1.5 and c.measured.current().chunk_s == 3.0  # 4 groups in 6 s


def test_a_shared_batch_holding_a_devices_first_chunk_is_timed_as_its_warm_up():
    c = controller_with_two_joined_chunks_on_the_source()
    c.cluster.chunk_groups, c.chunks_open = 2, 2
    shared = dict(version=0, shared=True)
    c._chunk_generated(msg.ChunkGenerated(device=SOURCE, seconds=4.0, chunk=0, samples=unfinished(0, 0, 1), **shared))
    c._chunk_generated(msg.ChunkGenerated(device=SOURCE, seconds=5.0, chunk=1, samples=unfinished(2, 0, 1),
                                          batch_s=5.0, batch_groups=4, **shared))
    assert c.measured.first_chunks == [(2.5, 2)] and c.first_batch == set()


def test_a_shared_batch_whose_groups_all_went_elsewhere_times_nothing_and_the_next_is_not_a_warm_up():
    c = controller_with_two_joined_chunks_on_the_source()
    c.cluster.chunk_groups, c.chunks_open = 2, 1
    c.held = {SOURCE: Counter({0: 2}), TARGET: Counter()}
    c._chunk_generated(msg.ChunkGenerated(device=SOURCE, seconds=1.0, chunk=0, samples=[], version=0, shared=True,
                                          batch_s=1.0, batch_groups=0))  # (its device's first batch)
    assert c.measured.seen == set() and c.measured.first_chunks == [] and c.first_batch == set()


def test_a_step_device_is_idle_only_while_it_has_nothing_to_compute_even_when_an_expired_lease_gives_it_work_back(
        monkeypatch):
    from types import SimpleNamespace

    import bidirl.runtime.controller as controller
    from bidirl.runtime.controller import StepInProgress
    from bidirl.sched.cluster import Cluster
    from bidirl.sched.roles import Role

    clock = [10.0]
    monkeypatch.setattr(controller.time, "perf_counter", lambda: clock[0])
    c = object.__new__(Controller)  # (only the step's work handed out: no run, no engines)
    c.cluster = Cluster([Role.TRAIN, Role.ROLLOUT], batch_groups=4, eta=0, steps=1, chunk_groups=4)
    c.mailbox = Sent()
    step = c.step = StepInProgress(None, False, [0, 1], started=10.0, stream=SimpleNamespace(k=0))
    c.pull(1)  # a streamed step: nothing to pull yet, its groups are still generating
    clock[0] = 12.0
    step.left.append("micro-batch back from an expired lease")
    c.pull(1)  # computes from 12 ...
    clock[0] = 15.0
    step.computing.discard(1)
    c.pull(1)  # ... to 15, then waits for groups again
    assert step.waited_s == 2.0 and c.cluster.step_wait_s == {"rollout": 2.0} and step.waiting == {1: 15.0}
    step.stream = None  # the batch is in: device 0 computes its last micro-batch, device 1 has nothing left
    step.waiting.clear()
    step.computing.add(0)
    c.pull(1)
    clock[0] = 15.5
    c.exclusive = lambda name, then: None  # (the finish itself is not this test's)
    step.computing.discard(0)
    c.pull(0)  # nothing computing, nothing left: the step finishes, device 1's wait ends
    assert c.cluster.step_wait_s == {"rollout": 2.5}


def controller_with_a_finish_held_up(monkeypatch, entered: set) -> tuple:
    """A two-member step (device 0 lent by the rollout pool, device 1 the primary) whose FinishStep went
    out at t=10 and which neither has answered at t=40; ``entered``: those that said they entered the
    reduce. Returns the controller and what it says."""
    from types import SimpleNamespace

    import bidirl.runtime.controller as controller
    from bidirl.runtime.controller import StepInProgress

    said = []
    monkeypatch.setattr(controller.time, "perf_counter", lambda: 40.0)
    monkeypatch.setattr(controller, "say", said.append)
    c = object.__new__(Controller)  # (only the finish's watch: no run, no engines)
    c.cluster = SimpleNamespace(devices=[SimpleNamespace(lent=True), SimpleNamespace(lent=False)], primary=1)
    c.cfg = SimpleNamespace(launch=SimpleNamespace(lease_timeout_s=0.0, collective_timeout_s=600.0))
    c.slowest_item_s, c.slowest_finish_s = 0.5, 0.2
    c.report = SimpleNamespace(slow_reduces=[], elapsed=lambda: 30.0)
    c.pending = {"train": {0, 1}}
    c.step = StepInProgress(SimpleNamespace(step=3), False, [0, 1], started=5.0, finish_sent=10.0)
    for device in entered:
        c._reduce_entered(msg.ReduceEntered(device=device, step=3))
    c._reduce_entered(msg.ReduceEntered(device=0, step=2))  # (a late word of an earlier step counts for nothing)
    return c, said


def test_a_finish_held_up_by_a_member_that_never_reached_the_reduce_names_it_and_those_it_holds(monkeypatch):
    c, said = controller_with_a_finish_held_up(monkeypatch, entered={1})
    assert c.lease_wait() == 0.0  # (the deadline: 10 s, the lease timeout the run derives, passed at t=20)
    c.say_if_the_reduce_waits()
    (line,) = said
    assert "has waited 30.0 s: device(s) 0 (lent) had not said it reached the reduce, which holds device(s) 1 " \
           "(the primary trainer) in it" in line
    assert c.report.slow_reduces == [{"t": 30.0, "batch": 3, "waiting_for": [0, 1], "not_in_reduce": [0]}]
    c.say_if_the_reduce_waits()
    assert len(said) == 1 and c.lease_wait() is None  # said once; nothing else to wait for


def test_a_finish_whose_members_all_reached_the_reduce_says_the_reduce_itself_is_slow(monkeypatch):
    c, said = controller_with_a_finish_held_up(monkeypatch, entered={0, 1})
    c.say_if_the_reduce_waits()
    (line,) = said
    assert "device(s) 0 (lent), 1 (the primary trainer) are in the reduce or the optimizer step after it" in line
    assert c.report.slow_reduces[0]["not_in_reduce"] == []
