"""The invariants a live run's record must keep (``replay.check_record``), on records written out here:
a sample is known by its group and its draw number, not by its tokens, since a short answer is often
drawn twice; every draw of a step's groups is trained or recorded as left out (zero advantage)."""

from bidirl.runtime.replay import RecordedItem, RecordedStep, check_record
from bidirl.samples import Sample

GROUP_SIZE = 4


def sample(group: int, draw=None, tokens=(7, 2), version: int = 0) -> Sample:
    extra = {"group": group} if draw is None else {"group": group, "draw": draw}
    return Sample(0, [1], list(tokens), "", [-0.5] * len(tokens), version, extra=extra)


def step(k: int, *samples: Sample, groups=None, untrained=None) -> RecordedStep:
    groups = groups if groups is not None else sorted({s.extra["group"] for s in samples})
    return RecordedStep(k, groups, 1.0, [0], [], [RecordedItem(0, tuple(samples), 8, len(samples))],
                        untrained=untrained)


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


def test_every_draw_is_trained_or_recorded_as_left_out():
    trained = [sample(3, 0), sample(3, 2)]
    assert check_record([step(0, *trained, untrained=[(3, 1), (3, 3)])], GROUP_SIZE, 0) == []


def test_a_draw_neither_trained_nor_left_out_is_named_lost():
    record = [step(0, sample(3, 0), sample(3, 2), groups=[3, 5], untrained=[(3, 3), (5, 0), (5, 1), (5, 2), (5, 3)])]
    assert check_record(record, GROUP_SIZE, 0) == ["step 0 lost draw [1] of group 3: neither trained nor left out"]


def test_a_group_of_the_step_with_nothing_recorded_is_named_lost_whole():
    record = [step(0, *(sample(3, d) for d in range(GROUP_SIZE)), groups=[3, 5], untrained=[])]
    assert check_record(record, GROUP_SIZE, 0) == ["step 0 lost draws [0, 1, 2, 3] of group 5: neither trained nor left out"]


def test_a_draw_both_trained_and_left_out_is_named():
    record = [step(0, *(sample(3, d) for d in range(GROUP_SIZE)), untrained=[(3, 2)])]
    assert check_record(record, GROUP_SIZE, 0) == ["step 0 both trained and left out draw 2 of group 3"]


def test_a_record_from_before_untrained_draws_is_not_checked_for_lost_ones():
    assert check_record([step(0, sample(3, 0))], GROUP_SIZE, 0) == []


def test_a_draw_left_out_twice_or_beyond_the_group_size_is_named():
    record = [step(0, sample(3, 0), sample(3, 1), untrained=[(3, 2), (3, 3), (3, 3), (3, 4)])]
    assert check_record(record, GROUP_SIZE, 0) == ["step 0 left out draw 3 of group 3 twice",
                                                   "step 0 left out draw 4 of group 3 (groups of 4)"]


def test_a_step_short_of_its_groups_is_named_when_the_batch_size_is_given():
    whole = [step(0, *(sample(g, d) for g in (3, 5) for d in range(GROUP_SIZE)), untrained=[])]
    assert check_record(whole, GROUP_SIZE, 0, groups_per_step=2) == []
    assert check_record(whole, GROUP_SIZE, 0, groups_per_step=3) == ["step 0 holds 2 groups, not 3"]
