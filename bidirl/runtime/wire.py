"""The control messages' data-only encoding: JSON of the typed protocol, never pickle.

Anything that can write to the c10d store could otherwise make every rank unpickle -- run -- what it
wrote. Here a message is plain JSON, and decoding builds only the types this module names (the
protocol's dataclasses, :class:`~bidirl.samples.Sample`, :class:`~bidirl.samples.SamplingParams`, the
:class:`~bidirl.sched.roles.Role` enum) from fields that are themselves data; any other type name is
refused with :class:`WireError`. Floats round-trip exactly (JSON keeps ``repr``), so behaviour
log-probs arrive bit for bit.

Encoding: a dataclass is ``{"$t": name, "f": {field: value}}``, an enum ``{"$e": name, "v": value}``, a
tuple ``{"$tu": [...]}``, a dict ``{"$d": [[key, value], ...]}`` (its keys need not be strings); lists,
strings, numbers, booleans and None are themselves.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any, Dict

from bidirl.runtime import protocol as msg
from bidirl.samples import Sample, SamplingParams
from bidirl.sched.roles import Role

TYPES: Dict[str, type] = {cls.__name__: cls for cls in (msg.Plan, *msg.COMMANDS, *msg.REPLIES, Sample, SamplingParams)}
ENUMS: Dict[str, type] = {"Role": Role}


class WireError(ValueError):
    """A control message that is not one of bidirl's own."""


def encode(message: Any) -> bytes:
    return json.dumps(_to_data(message), separators=(",", ":")).encode()


def decode(payload: bytes) -> Any:
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"not a control message ({type(exc).__name__})") from None
    return _from_data(data)


def _to_data(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if TYPES.get(name) is not type(value):
            raise WireError(f"{name} is not a control message type")
        return {"$t": name, "f": {f.name: _to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, enum.Enum):
        return {"$e": type(value).__name__, "v": value.value}
    if isinstance(value, tuple):
        return {"$tu": [_to_data(v) for v in value]}
    if isinstance(value, list):
        return [_to_data(v) for v in value]
    if isinstance(value, dict):
        return {"$d": [[_to_data(k), _to_data(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise WireError(f"a {type(value).__name__} cannot travel in a control message")


def _from_data(data: Any) -> Any:
    if isinstance(data, list):
        return [_from_data(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "$t" in data:
        cls = TYPES.get(data["$t"])
        if cls is None:
            raise WireError(f"unknown message type {data['$t']!r}: refused")
        fields = {k: _from_data(v) for k, v in data.get("f", {}).items()}
        known = {f.name: f for f in dataclasses.fields(cls)}
        if set(fields) - set(known):
            raise WireError(f"{cls.__name__}: unknown fields {sorted(set(fields) - set(known))}")
        made = cls(**{k: v for k, v in fields.items() if known[k].init})
        for k, v in fields.items():
            if not known[k].init:
                object.__setattr__(made, k, v)
        return made
    if "$e" in data:
        cls = ENUMS.get(data["$e"])
        if cls is None:
            raise WireError(f"unknown enum {data['$e']!r}: refused")
        return cls(data["v"])
    if "$tu" in data:
        return tuple(_from_data(v) for v in data["$tu"])
    if "$d" in data:
        return {_hashable(_from_data(k)): _from_data(v) for k, v in data["$d"]}
    raise WireError("a control message holds only tagged objects")


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
