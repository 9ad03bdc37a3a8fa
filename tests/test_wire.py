"""Control messages travel as data: every command and reply round-trips through the JSON encoding, and
nothing but bidirl's own message types can be decoded (no unpickling of what the store holds)."""

import dataclasses
import json
import typing

import pytest

from bidirl.runtime import protocol as msg
from bidirl.runtime.wire import WireError, decode, encode
from bidirl.samples import Sample, SamplingParams
from bidirl.sched.roles import Role


def a_sample():
    return Sample(prompt_index=1, prompt_ids=[5, 6], completion_ids=[7, 8, 9], text=" 17", logprobs=[-0.1, -1e-9, -2.5],
                  version=3, finished=False, reward=1.0, advantage=-0.7071067811865476,
                  extra={"group": 12, "answer": "17"}, token_versions=[3, 3, 4])


def value_of(hint):
    """A value of type ``hint`` with something in it (a builder for every field of every message)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is int:
        return 7
    if hint is float:
        return 0.1 + 0.2  # not a short decimal: must come back bit for bit
    if hint is str:
        return "a/b"
    if hint is bool:
        return True
    if hint is Role:
        return Role.ROLLOUT
    if hint is Sample:
        return a_sample()
    if hint is SamplingParams:
        return SamplingParams(n=4, max_new_tokens=8, temperature=0.9, seed=3)
    if hint is typing.Any:
        return {"loss": 0.25, "steps": [1, 2]}
    if origin is typing.Union:
        return value_of(next(a for a in args if a is not type(None)))
    if origin is tuple:
        return tuple(value_of(args[0]) for _ in range(2)) if args[-1] is Ellipsis else tuple(value_of(a) for a in args)
    if origin is list:
        return [value_of(args[0])]
    if origin is dict:
        return {value_of(args[0]): value_of(args[1])}
    raise AssertionError(f"no builder for {hint}")


def a_message(cls):
    hints = typing.get_type_hints(cls, vars(msg))
    return cls(**{f.name: value_of(hints[f.name]) for f in dataclasses.fields(cls) if f.init})


@pytest.mark.parametrize("cls", [msg.Plan, *msg.COMMANDS, *msg.REPLIES], ids=lambda c: c.__name__)
def test_every_control_message_round_trips_exactly_through_the_data_only_encoding(cls):
    message = a_message(cls)
    assert decode(encode(message)) == message


def test_a_message_naming_any_other_type_is_refused_not_built():
    crafted = json.dumps({"$t": "system", "f": {"command": "touch /tmp/pwned"}}).encode()
    with pytest.raises(WireError, match="unknown message type 'system'"):
        decode(crafted)
    with pytest.raises(WireError, match="not a control message"):
        decode(b"\x80\x04\x95 pickled bytes")
    with pytest.raises(WireError, match="unknown fields"):
        decode(json.dumps({"$t": "Stop", "f": {"__class__": 1}}).encode())


def test_the_mailbox_carries_messages_through_a_real_store_without_pickle():
    import torch.distributed as dist

    from bidirl.runtime.mailbox import PREFIX, Mailbox

    store = dist.HashStore()
    controller, worker = Mailbox(store), Mailbox(store)
    command = msg.FinishStep(step=2, members=(0, 1), lent=(1,), probe=(a_sample(),), grad_scale=1 / 3)
    controller.send(1, command)
    assert worker.next_command(1) == command
    worker.post(msg.StepDone(version=3, reduce_s=0.5, device=1))
    assert controller.next_event(timeout=1).version == 3
    controller.publish("plan", msg.Plan(0, (Role.TRAIN, Role.ROLLOUT), "/tmp/run"))
    assert json.loads(store.get(PREFIX + "plan"))["$t"] == "Plan"  # what the store holds is JSON


def test_the_controllers_mailbox_waits_in_slices_yet_still_fails_a_wait_past_the_stores_timeout():
    import datetime

    import torch.distributed as dist

    from bidirl.runtime.mailbox import Mailbox

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=1.5))
    controller = Mailbox(store, interruptible=True)  # (one-second slices, so that a Ctrl-C reaches it)
    assert controller.next_event(timeout=0.2) is None  # nothing within a timeout given: no message
    with pytest.raises(dist.DistStoreError, match="within the store's timeout"):
        controller.next_event()  # no timeout given: the store's own still ends a wait nothing ends
    Mailbox(store).post(msg.StepDone(version=1, reduce_s=0.0, device=0))
    assert controller.next_event().version == 1
