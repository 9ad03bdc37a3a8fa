"""The policy interface: events in, actions out (pure Python, shared by the runtime and the simulator).

Drivers (``bidirl.runtime.controller`` live, the simulator offline) own the clock and the physical work.
On every event they update the shared :class:`~bidirl.sched.cluster.Cluster` bookkeeping, ask the policy
for actions, apply the actions to the bookkeeping, then carry them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from bidirl.sched.roles import Role

# ---- events (driver -> policy) -------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    pass


@dataclass(frozen=True)
class ChunkDone:
    device: int
    chunk: int


@dataclass(frozen=True)
class TrainDone:
    version: int  # the new policy version


@dataclass(frozen=True)
class SyncDone:
    """The newest version is staged on every device (not yet loaded)."""

    version: int


@dataclass(frozen=True)
class LoadDone:
    device: int
    version: int


@dataclass(frozen=True)
class SwitchDone:
    device: int
    role: Role


Event = object  # any of the above

# ---- actions (policy -> driver) ------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    """Generate ``groups`` prompt groups on ``device`` with the weights it holds (admission checked)."""

    device: int
    groups: int


@dataclass(frozen=True)
class Train:
    """One optimizer step on the next batch; ``devices`` share the gradient work, the primary steps."""

    devices: Tuple[int, ...]


@dataclass(frozen=True)
class Join:
    """``device`` (serving train, holding the version being trained) joins the step in progress and takes
    part of the gradient work not yet done -- BiDiRL's lazy pulling of micro-batches. Simulated only: the
    live worker splits a step's batch when the step starts."""

    device: int


@dataclass(frozen=True)
class Sync:
    """Publish the newest weights: the primary sends them to ``devices``' staging buffers, in the background."""

    devices: Tuple[int, ...]


@dataclass(frozen=True)
class Load:
    """``device`` applies the staged newest weights, at once if idle, else at its next safe point."""

    device: int


@dataclass(frozen=True)
class Switch:
    device: int
    role: Role
    reason: str = ""


Action = object
