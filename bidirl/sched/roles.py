"""Device roles and the lifecycle state machine every driver (live runtime, simulator) enforces.

A device *serves* one :class:`Role` at a time (ROLLOUT or TRAIN); its *home* role is the pool the
partition put it in. Independently it is in one :class:`DeviceState`. Legal transitions::

    IDLE ──► GENERATING ──► IDLE            (a chunk of prompt groups, only while serving ROLLOUT)
    IDLE ──► TRAINING ───► IDLE             (gradients for one optimizer step, only while serving TRAIN)
    IDLE ──► SYNCING ────► IDLE             (load the staged newest weights into the engines)
    GENERATING | TRAINING | SWITCHING ──► SYNCING   (a load queued behind the work in flight: the safe point)
    GENERATING ──► SYNCING ──► GENERATING   (interruptible drivers: decoding paused for the load, then resumed)
    GENERATING | TRAINING ──► DRAINING ──► SWITCHING   (switch asked while busy: finish the work, then switch)
    IDLE ──► SWITCHING ──► IDLE             (the served role flips on entering SWITCHING)
    IDLE ──► EVALUATING ──► IDLE            (held-out evaluation; after training, never mid-run)

Worked example (async, device 1 lent to training for one step)::

    t=0.00 d1 IDLE->GENERATING      chunk 7 (8 groups, version 3)
    t=0.21 d1 GENERATING->DRAINING  policy: switch to TRAIN (batch 4 ready, admission blocked)
    t=0.30 d1 DRAINING->SWITCHING   chunk 7 done
    t=0.31 d1 SWITCHING->IDLE       serves TRAIN; weights already current, nothing to load
    t=0.31 d1 IDLE->TRAINING        half of batch 4; gradients reduced to the primary trainer
    ...
Anything else raises :class:`IllegalTransition`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional


class Role(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"

    def other(self) -> "Role":
        return Role.TRAIN if self is Role.ROLLOUT else Role.ROLLOUT


class DeviceState(str, enum.Enum):
    IDLE = "idle"
    GENERATING = "generating"
    TRAINING = "training"
    SYNCING = "syncing"
    DRAINING = "draining"
    SWITCHING = "switching"
    EVALUATING = "evaluating"


S = DeviceState
LEGAL_TRANSITIONS: Dict[DeviceState, FrozenSet[DeviceState]] = {
    S.IDLE: frozenset({S.GENERATING, S.TRAINING, S.SYNCING, S.SWITCHING, S.EVALUATING}),
    S.GENERATING: frozenset({S.IDLE, S.SYNCING, S.DRAINING}),
    S.TRAINING: frozenset({S.IDLE, S.SYNCING, S.DRAINING}),
    S.SYNCING: frozenset({S.IDLE, S.GENERATING}),
    S.DRAINING: frozenset({S.SWITCHING}),
    S.SWITCHING: frozenset({S.IDLE, S.SYNCING}),
    S.EVALUATING: frozenset({S.IDLE}),
}
# Work a device may only do while serving a given role.
REQUIRES_ROLE = {S.GENERATING: Role.ROLLOUT, S.TRAINING: Role.TRAIN}


class IllegalTransition(RuntimeError):
    pass


TraceSink = Callable[[dict], None]


@dataclass
class Device:
    index: int
    home: Role
    role: Role = None  # type: ignore[assignment]  # defaults to home
    state: DeviceState = DeviceState.IDLE
    version: int = 0  # policy version of the weights this device serves with
    after_work: List[str] = field(default_factory=list)  # "load" / "switch", queued behind the work in flight
    loading: int = 0  # version a pending or running load will bring

    def __post_init__(self) -> None:
        self.role = self.role or self.home

    @property
    def idle(self) -> bool:
        return self.state is DeviceState.IDLE

    @property
    def lent(self) -> bool:
        return self.role is not self.home

    def transition(self, new: DeviceState, now: float, reason: str, sink: Optional[TraceSink] = None) -> None:
        old = self.state
        if new not in LEGAL_TRANSITIONS[old]:
            raise IllegalTransition(f"device {self.index}: {old.value} -> {new.value} is not legal ({reason})")
        if new is DeviceState.SWITCHING:
            self.role = self.role.other()
        needed = REQUIRES_ROLE.get(new)
        if needed is not None and self.role is not needed:
            raise IllegalTransition(f"device {self.index}: {new.value} while serving {self.role.value} ({reason})")
        self.state = new
        if sink is not None:
            sink({"t": round(now, 6), "device": self.index, "from": old.value, "to": new.value,
                  "role": self.role.value, "home": self.home.value, "version": self.version, "reason": reason})
