"""Work in progress that outlives one event: a lease (a device away from its home pool) and a train
step's gradient work (shared by its devices, re-shared when one joins). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from bidirl.sched.roles import Role


@dataclass
class StepProgress:
    """The gradient work of a train step in progress, shared evenly by its devices: ``work_left``
    device-seconds as of ``since``. A device that joins takes a share of what is left. The simulator
    times steps with it; the bidirl policy keeps one as its estimate of the step in progress."""

    work_left: float
    devices: int
    since: float
    epoch: int = 0  # the simulator's: unique across steps, so a superseded finish never matches

    def seconds_left(self, now: float) -> float:
        return max(0.0, self.work_left - self.devices * (now - self.since)) / self.devices

    def finish(self, communication_s: float = 0.0) -> float:
        return self.since + self.work_left / self.devices + communication_s

    def join(self, now: float, epoch: int = 0) -> None:
        self.work_left = self.seconds_left(now) * self.devices
        self.devices, self.since, self.epoch = self.devices + 1, now, epoch


@dataclass
class Lease:
    """A device lent away from its home pool: opened when it starts switching away, ended when it is
    back home. ``epoch`` numbers leases cluster-wide, so a message about an ended lease is recognisable."""

    epoch: int
    device: int
    serves: Role  # the role it serves while lent
    start: float
    reason: str
    end: Optional[float] = None
