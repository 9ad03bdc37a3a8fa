"""The invariants a live run's record must keep (``replay.check_record``), on records written out here:
a sample is known by its group and its draw number, not by its tokens, since a short answer is often
drawn twice."""

from bidirl.runtime.replay import RecordedItem, RecordedStep, check_record
from bidirl.samples import Sample

GROUP_SIZE = 4


def sample(group: int, draw=None, tokens=(7, 2), version: int = 0) -> Sample:
    extra = {"group": group} if draw is None else {"group": group, "draw": draw}
    return Sample(0, [1], list(tokens), "", [-0.5] * len(tokens), version, extra=extra)


def step(k: int, *samples: Sample, groups=None) -> RecordedStep:
    groups = groups if groups is not None else sorted({s.extra["group"] for s in samples})
    return RecordedStep(k, groups, 1.0, [0], [], [RecordedItem(0, tuple(samples), 8, len(samples))])


def test_two_draws_of_a_group_that_came_out_alike_are_two_samples():
    assert check_record([step(0, *(sample(3, draw) for draw in range(GROUP_SIZE)))], GROUP_SIZE, 0) == []


def test_a_draw_trained_twice_in_its_step_is_named_even_when_the_counts_add_up():
    record = [step(0, sample(3, 0), sample(3, 1), sample(3, 1, tokens=(9,)), sample(3, 3))]
    assert check_record(record, GROUP_SIZE, 0) == ["step 0 trained a sample of group 3 twice"]


def test_a_draw_number_beyond_the_group_size_is_named():
    assert check_record([step(0, sample(3, 4))], GROUP_SIZE, 0) == ["step 0 trained draw 4 of group 3 (groups of 4)"]


def test_a_record_from_before_draw_numbers_still_tells_samples_apart_by_their_tokens():
    assert check_record([step(0, sample(3), sample(3, tokens=(9,)))], GROUP_SIZE, 0) == []
    assert check_record([step(0, sample(3), sample(3))], GROUP_SIZE, 0) == ["step 0 trained a sample of group 3 twice"]


def test_a_group_in_two_steps_and_a_token_older_than_eta_are_named():
    record = [step(0, sample(3, 0)), step(1, sample(3, 1), sample(5, 0, version=-1))]
    assert check_record(record, GROUP_SIZE, 1) == ["group 3 trained in steps 0 and 1",
                                                   "step 1 trained a token of version -1 (staleness above 1)"]
