"""The policy interface: events in, actions out (pure Python, shared by the runtime and the simulator).

Drivers (:mod:`bidirl.runtime.controller` live, :mod:`bidirl.sim.simulator` offline) own the clock
and the physical work. On every event they update the shared :class:`~bidirl.sched.cluster.Cluster`
bookkeeping, ask the policy for actions, and carry the actions out (the policy has already applied
them to the bookkeeping).

Both kinds are closed sets: every event subclasses :class:`Event`, every action :class:`Action`, and
``EVENTS``/``ACTIONS`` list them all. Each driver and the bookkeeping handle actions through a table
keyed by type, and a test checks every table covers ``ACTIONS`` exactly -- so an action added here
that some driver forgets fails a test, instead of being ignored at run time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from bidirl.sched.roles import Role


class Event:
    """Something that happened (driver -> policy)."""


class Action:
    """Something a policy starts (policy -> driver)."""


# ---- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started(Event):
    pass


@dataclass(frozen=True)
class ChunkDone(Event):
    """Prompt groups of ``chunk`` are done: ``groups`` of them (0: all the chunk has left). Each group is
    reported as its last sequence ends, except where the engine call returns them together: a chunk on
    an engine that does not batch continuously (live HF), and moved groups continued live in one call
    (``DriverCapabilities.reports_groups``, ``migrates_into_batch``)."""

    device: int
    chunk: int
    groups: int = 0


@dataclass(frozen=True)
class TrainDone(Event):
    version: int  # the new policy version


@dataclass(frozen=True)
class SyncDone(Event):
    """The newest version is staged on every device (not yet loaded)."""

    version: int


@dataclass(frozen=True)
class LoadDone(Event):
    device: int
    version: int


@dataclass(frozen=True)
class SwitchDone(Event):
    device: int
    role: Role


@dataclass(frozen=True)
class LeaseExpired(Event):
    """``device``, lent to the train step in progress, did not finish its micro-batch within the lease
    timeout: it leaves the step and every gradient it computed for it is discarded (the driver puts its
    micro-batches back in the step's queue), so a borrowed device's gradients count once or not at all."""

    device: int


# ---- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generate(Action):
    """Generate ``groups`` prompt groups on ``device`` with the weights it holds (admission checked)."""

    device: int
    groups: int


@dataclass(frozen=True)
class Train(Action):
    """One optimizer step on the next batch; ``devices`` share the gradient work, the primary steps."""

    devices: Tuple[int, ...]


@dataclass(frozen=True)
class Join(Action):
    """``device`` (serving train, holding the version being trained) joins the step in progress and takes
    part of the gradient work not yet done -- BiDiRL's lazy pulling of micro-batches: the simulator
    splits the work left, the live devices of a step pull its micro-batches one at a time. Only while
    the step has work left to share (``Cluster.accepting_joins``)."""

    device: int


@dataclass(frozen=True)
class Migrate(Action):
    """In-flight request migration: ``groups`` prompt groups of ``version`` still generating on ``source``
    move to ``device`` (serving rollout), which re-prefills each request's prompt and the tokens
    generated so far and continues it with the weights it holds. A moved group keeps its chunk and its
    start version (its staleness counts its oldest token), and its tokens keep their behaviour
    log-probs and versions (decoupled PPO trains them as generated). veRL's dynamic scheduling
    rebalances in-flight requests onto a lent replica the same way (abort, then resume elsewhere with
    the generated tokens kept). Only where the driver can move requests (``Cluster.allows_migration``)."""

    source: int
    device: int
    groups: int
    version: int


def choose_groups(running: Dict[int, int], available: Sequence[int], groups: int) -> List[int]:
    """Which of a chunk's groups a move takes: those with the most requests still running first (the
    tail), then finished ones, ``groups`` in all, from ``available`` (prompt indices still held). The
    live engines answer a hand-over with it; the simulator picks with it too (``groups_to_move``)."""
    order = sorted(available, key=lambda i: (-running.get(i, 0), i))
    return sorted(order[:groups])


def per_chunk(held: Dict[int, int], groups: int) -> List[Tuple[int, int]]:
    """How a ``Migrate`` of ``groups`` splits over the source's chunks (``held``: chunk -> groups of the
    move's version it still holds): (chunk, groups) pairs, the oldest chunk first, as many of each as it
    holds. The live controller asks the source so; the simulator picks so (``groups_to_move``)."""
    split: List[Tuple[int, int]] = []
    for chunk in sorted(held):
        take = min(groups, held[chunk])
        if take:
            split.append((chunk, take))
            groups -= take
    return split


def groups_to_move(running: Dict[Tuple[int, int], int], groups: int) -> List[Tuple[int, int]]:
    """The (chunk, group) pairs a ``Migrate`` of ``groups`` takes from a source's groups of its version in
    flight (``running``: their requests still running): split over chunks by ``per_chunk``, and within a
    chunk by ``choose_groups``, as the live controller asks and the engines answer."""
    chosen: List[Tuple[int, int]] = []
    for chunk, take in per_chunk(Counter(c for c, _ in running), groups):
        held = sorted(i for c, i in running if c == chunk)
        chosen += [(chunk, i) for i in choose_groups({i: running[(chunk, i)] for i in held}, held, take)]
    return chosen


@dataclass(frozen=True)
class Sync(Action):
    """Publish the newest weights: the primary sends them to ``devices``' staging buffers, in the background."""

    devices: Tuple[int, ...]


@dataclass(frozen=True)
class Load(Action):
    """``device`` applies the staged newest weights, at once if idle, else at its next safe point."""

    device: int


@dataclass(frozen=True)
class Switch(Action):
    device: int
    role: Role
    reason: str = ""


@dataclass(frozen=True)
class Rehome(Action):
    """Re-partition: ``device`` moves to the ``home`` pool for good and switches into that role (no lease).
    Only at a step boundary, for a device idle at home, never the primary. Into the train pool it adopts
    the primary's training state (weights and optimizer moments), so it steps an identical replica."""

    device: int
    home: Role
    reason: str = ""


EVENTS: Tuple[type, ...] = (Started, ChunkDone, TrainDone, SyncDone, LoadDone, SwitchDone, LeaseExpired)
ACTIONS: Tuple[type, ...] = (Generate, Train, Join, Migrate, Sync, Load, Switch, Rehome)

