"""Shared bookkeeping of a cluster run: device states, prompt groups in flight, batches, versions.

Both drivers apply the same actions and completions to a :class:`Cluster`, so the trace, the staleness
accounting and the invariants are the same whether the work was real or simulated.

Batches and staleness. Batch ``k`` is trained from version ``k`` and produces version ``k+1``. A chunk
of ``n`` prompt groups started with weights of version ``v`` is admitted only if
``admitted + n <= (v + eta + 1) * B`` (AReaL's admission rule), so at most ``(D + 1) * B`` groups ever
have deadline (``v + eta``) ``<= D``. Batch ``k`` takes ``B`` *completed* groups, earliest deadline first
(so one slow sequence does not hold up the rest), and starts only if every group left behind can still
meet its deadline (see ``batch_ready``): **staleness k - v never exceeds eta**; eta = 0 is on-policy.
(A chunk whose device loads newer weights mid-way is counted at its start version: conservative.)

Count-only staleness (``deadlines=False``, veRL fully-async's ``staleness_threshold``): admission is the
same rule with a possibly fractional eta, ``admitted + n <= floor((v + eta + 1) * B)``, counted in sync
windows of ``updates_per_sync`` batches when weights are published only every u-th update, but batches
take completed groups in the order they finished and never wait for a group: a long sequence is
trained whenever it ends, so its staleness is recorded, not bounded (veRL reports it as
``max_partial_span``). Only the number of groups generated ahead of training is bounded.

Weights move in two phases, so the trainers never wait for a rollout device's safe point:
  1. ``Sync`` -- the primary trainer publishes the newest version; it is transferred in the background
     to a staging buffer on every other device. ``SyncDone`` = every copy has arrived.
  2. ``Load`` -- a device applies the staged version (``SYNCING`` state). Idle devices load at once; a
     generating device loads at its next safe point: the end of the chunk in flight in the live
     runtime, or at once, pausing its decode batch, where the driver can interrupt (``interruptible``,
     the simulator's AReaL-style rollout).

Invariants (asserted here and by tests):
  * a device has one role and one state at a time; transitions follow ``roles.LEGAL_TRANSITIONS``;
  * a device away from its home pool holds exactly one :class:`Lease`, and every lease ends (a run
    finishes only with every device home);
  * staleness never exceeds eta (with deadlines); at most floor((v + eta + 1) * B) groups are admitted
    before version v + 1 exists (always); every admitted group is trained exactly once;
  * only the train pool creates versions (home trainers step identical optimizer replicas; a lent
    rollout device only contributes gradients); no device computes gradients on stale weights;
  * one train step at a time, and a batch's optimizer step comes only when all its B groups are done;
  * a streamed step (``streams``) starts on the groups of its batch already done and takes the rest as
    they finish. It waits only for groups batch k must contain anyway, so its membership is fixed before
    it is complete: at eta 0 the B groups of version k; at eta >= 1 the *due* groups still generating
    (deadline k, once no device can start more of them) plus completed ones, earliest deadline first --
    the very groups the trainers would otherwise wait for. Staleness is bounded exactly as before;
  * a borrowed device's gradients count once, for the version being trained, or not at all: a lease that
    expires mid-step (``LeaseExpired``) takes the device out of the step, and the driver discards what it
    computed (its micro-batches are computed again by the others);
  * re-partitioning (``Rehome``) moves only idle, unlent devices other than the primary, only between
    steps; a device joining the train pool this way holds the primary's version when it arrives;
  * in-flight migration (``Migrate``) moves groups still generating from one rollout-serving device to
    another holding weights at least as new as theirs: groups in flight are conserved, a moved group
    keeps its chunk and start version (so staleness, admission and deadlines are unchanged), and is
    reported done by the device that finishes it;
  * a train step's optimizer step needs every home trainer: one away on a lease when the step starts
    (``trainers_away``) joins it when back -- it may always join -- and the step cannot finish before.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Optional, Sequence, Tuple

from bidirl.sched import events as ev
from bidirl.sched.roles import Device, DeviceState, Role
from bidirl.sched.trace import ADMISSION, NO_REASON, TAIL

S = DeviceState


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


@dataclass
class Chunk:
    index: int
    device: int
    first: int  # sequence number of its first group
    groups: int
    version: int
    done: bool = False
    finished: int = 0  # groups done so far


class TailPlacement(str, Enum):
    """Which older tails keep new groups off the rollout device decoding them (``fill_rollout``).

    An *older tail* is what a device still decodes of groups started with weights older than those it
    now holds. New groups beside it share its decode batch: they use capacity the tail leaves idle, and
    they slow the tail's decode steps."""

    AUTO = "auto"  # the policy's own (Policy.tail_placement)
    DUE = "due"  # a due tail (``Cluster.due_version``: the trainers wait for it) keeps them off; any other takes them
    NONE = "none"  # none does: continuous batching, as a serving engine admits requests


def check_staleness(eta: float, deadlines: bool, policy: str = "") -> None:
    """A staleness bound a policy (named, where the caller knows it) can keep: whole versions with deadlines,
    any fraction >= 0 without."""
    if eta < 0:
        raise ValueError(f"algorithm.staleness must be >= 0, got {eta}")
    if deadlines and eta != int(eta):
        raise ValueError(f"algorithm.staleness={eta}: a fractional bound needs count-only staleness "
                         f"(policy verl-async); {f'policy {policy!r}' if policy else 'this policy'} bounds "
                         "staleness in whole versions")


class Cluster:
    def __init__(self, homes: Sequence[Role], batch_groups: int, eta: float, steps: int, chunk_groups: int,
                 primary: Optional[int] = None, inflight_groups: int = 0, interruptible: bool = False,
                 deadlines: bool = True, updates_per_sync: int = 1, allows_join: bool = True,
                 streams: bool = False, allows_migration: bool = False, migrates_into_batch: bool = True,
                 tail_placement: TailPlacement = TailPlacement.DUE):
        if Role.TRAIN not in homes:
            raise ValueError("the partition needs at least one device in the train pool")
        check_staleness(eta, deadlines)
        if updates_per_sync != 1 and deadlines:
            raise ValueError("several optimizer updates per weight sync need count-only staleness (verl-async)")
        self.updates_per_sync = updates_per_sync  # u: batches (optimizer updates) per published version
        if tail_placement is TailPlacement.AUTO:
            raise ValueError("the cluster needs a tail placement resolved for its policy (assemble does it)")
        self.tail_placement = tail_placement
        self._limits: Dict[int, int] = {}
        self.devices = [Device(i, home) for i, home in enumerate(homes)]
        self.primary = primary if primary is not None else list(homes).index(Role.TRAIN)
        self.B, self.eta, self.steps, self.chunk_groups = batch_groups, eta, steps, chunk_groups
        # groups one rollout device may hold in flight: one chunk in the live runtime, a KV cache's worth
        # of continuous batching in the simulator
        self.inflight_groups = inflight_groups or chunk_groups
        # may a chunk start on a device still generating, joining its running batch?
        self.joins_running_batch = self.inflight_groups > chunk_groups
        self.interruptible = interruptible
        # can the driver add a device to a train step in progress (``Join``)? Both can: the simulator
        # splits the work left, the live workers pull micro-batches. ``accepting_joins``: the step in
        # progress still has work to share (the live driver closes it once every micro-batch is out)
        self.allows_join = allows_join
        self.accepting_joins = False
        # can the driver move requests in flight from one device to another (``Migrate``)?
        self.allows_migration = allows_migration
        # do moved requests join a target's running batch? If not, only an idle device takes requests over
        # (``can_take_requests``)
        self.migrates_into_batch = migrates_into_batch
        # devices continuing moved requests where those do not join batches: a chunk started there would
        # wait for them (the live worker runs its commands in turn), so none is (``has_room``)
        self.continuing: set = set()
        self.migrations: List[Tuple[float, int, int, int, int]] = []  # (time, source, device, groups, version)
        self.deadlines = deadlines
        if streams and not deadlines:
            raise ValueError("streamed gradient work needs per-group deadlines: they say which groups a batch "
                             "must wait for (count-only staleness waits for none)")
        # may a train step start on part of its batch and take the rest as it finishes (``stream_ready``)?
        self.streams = streams
        self.reserved: Counter = Counter()  # version -> groups the streamed step in progress still waits for
        # borrowed devices whose lease expired mid-step (they go home; they may not rejoin that step)
        self.expired: set = set()
        self.expired_leases: List[Tuple[float, int, int]] = []  # (time, device, batch)
        self.version = 0  # newest version, held by the primary trainer
        self.published = 0  # newest version staged on every device
        self.syncing: Optional[int] = None  # version being transferred
        self.admitted = 0
        # the next group's sequence number: ``admitted`` until a resume, after which it goes on from the
        # checkpoint's (the groups regenerated there get new numbers, never a trained group's)
        self.next_group = 0
        self.chunks: List[Chunk] = []
        self.unstarted: deque = deque()  # chunks applied but not yet handed to the driver, in order
        self.completed: List[List[int]] = []  # [chunk, groups not yet trained, version], oldest first
        self.completed_groups = 0  # groups done and not yet trained
        self.completed_by_version: Counter = Counter()  # version -> groups done and not yet trained
        self.untrained: Counter = Counter()  # version -> admitted groups of that version not yet trained
        self.batch_parts: Dict[int, List[Tuple[int, int]]] = {}  # batch -> [(chunk, groups)]
        self.inflight: Dict[int, int] = {d.index: 0 for d in self.devices}  # groups in flight per device
        self.inflight_by_version: Dict[int, Counter] = {d.index: Counter() for d in self.devices}
        self.warmed: set = set()  # devices whose rollout engine finished work this run (paid its warm-up)
        self.training: Optional[ev.Train] = None
        self.training_devices: List[int] = []  # the step's devices, including any that joined it
        self.trace: List[dict] = []
        # device-seconds, per home pool, that a train step's devices held it with nothing to compute: waiting
        # for its groups still generating, for another device's last micro-batches, or for a home trainer back
        # from a lease. The trace cannot tell (the TRAINING state), so each driver measures and counts them
        self.step_wait_s: Dict[str, float] = {}
        self.leases: List[Lease] = []
        self.open_leases: Dict[int, Lease] = {}  # device -> its lease in force
        # re-partitioning: devices switching to a new home pool, and rollout devices that will move to the
        # train pool at the next step boundary (they take no new groups meanwhile)
        self.rehoming: set = set()
        self.leaving: set = set()
        self.rehomes: List[Tuple[float, int, str]] = []  # (time, device, new home)
        self.version_times: List[float] = [0.0]  # when each version came to exist (steady-state step times)
        # idle devices per served role, kept up to date from every traced transition (O(1) lookups)
        self.idle_sets: Dict[Role, set] = {Role.ROLLOUT: set(), Role.TRAIN: set()}
        for d in self.devices:
            self.idle_sets[d.role].add(d.index)
        self.generating: set = set()  # devices in GENERATING
        self.switching: set = set()  # devices in SWITCHING
        # devices per (role served, home pool), kept the same way: who is lent, who serves rollout, which
        # devices a pool holds -- questions every decision asks, answered at the cost of the answer
        # rather than of the cluster's size (a 1,024-device simulation asks them on every event)
        self.serving: Dict[Tuple[Role, Role], set] = {(role, home): set() for role in Role for home in Role}
        for d in self.devices:
            self.serving[(d.role, d.home)].add(d.index)
        # rollout-pool devices decoding only an older version's tail (``older_tails``), re-examined only
        # for devices an action, a completion or a transition touched since the last question
        self._tails: set = set()
        self._tails_dirty: set = set(range(len(self.devices)))
        self.idle_causes: Dict[int, str] = {}  # idle device -> why it is idle (see idle_cause)
        self._settled = (None, None, None)
        self.staleness: Counter = Counter()  # staleness (in versions) -> groups trained
        self.trained_groups = 0
        self.now = 0.0

    def resume_at(self, version: int, staleness: Optional[Dict[int, int]] = None,
                  next_group: Optional[int] = None) -> None:
        """Starts the bookkeeping at ``version`` instead of 0 (a run resumed from a checkpoint): every
        device holds that version, the first ``version * B`` groups count as admitted and trained, and
        nothing is in flight -- groups generated but not trained before the checkpoint are regenerated.
        ``staleness``: the histogram trained so far, carried on. ``next_group``: the checkpoint's next
        group number (at eta >= 1 groups numbered past ``version * B`` were trained before it; a checkpoint
        without it numbers on from ``version * B``)."""
        assert not self.chunks and self.version == 0, "resume a cluster before it starts"
        self._tails_dirty.update(range(len(self.devices)))
        self.version = self.published = version
        self.admitted = self.trained_groups = version * self.B
        self.next_group = max(self.admitted, next_group or 0)
        for device in self.devices:
            device.version = version
        self.staleness.update({int(k): v for k, v in (staleness or {}).items()})

    # ---- queries the policies use ------------------------------------------------------------
    def idle(self, role: Role) -> List[Device]:
        return [self.devices[i] for i in sorted(self.idle_sets[role])]

    def pool(self, home: Role) -> List[Device]:
        """The devices whose home is ``home``, lent or not, in index order."""
        return [self.devices[i] for i in sorted(self.serving[(Role.ROLLOUT, home)] | self.serving[(Role.TRAIN, home)])]

    def pool_size(self, home: Role) -> int:
        return len(self.serving[(Role.ROLLOUT, home)]) + len(self.serving[(Role.TRAIN, home)])

    def serving_role(self, role: Role) -> set:
        """Indices of the devices serving ``role`` now, at home or lent."""
        return self.serving[(role, Role.ROLLOUT)] | self.serving[(role, Role.TRAIN)]

    def homes_at_start(self) -> Dict[int, str]:
        """Each device's home pool when the run started (re-planning may have moved some since)."""
        homes = {d.index: d.home.value for d in self.devices}
        for _, index, home in reversed(self.rehomes):  # undo the moves, the last first
            homes[index] = Role(home).other().value
        return homes

    def lent_to(self, role: Role) -> List[Device]:
        """Devices lent away from their home pool to serve ``role``, in index order."""
        return [self.devices[i] for i in sorted(self.serving[(role, role.other())])]

    def at_home(self, role: Role) -> List[Device]:
        """Devices serving ``role`` in their own home pool (not lent), in index order."""
        return [self.devices[i] for i in sorted(self.serving[(role, role)])]

    @property
    def finished(self) -> bool:
        """The last version exists and every device is idle at home (every lease has ended)."""
        return (self.version >= self.steps and self.training is None and self.syncing is None
                and not self.open_leases and all(d.idle and not d.lent and not d.after_work for d in self.devices))

    def admission_limit(self, version: int) -> int:
        """Groups that may have been admitted in all while the newest weights anywhere are ``version``.

        With u updates per sync the window is u batches: ``floor((version / u + eta + 1) * u * B)``, that
        is ``version * B + floor((eta + 1) * u * B)`` -- computed so, and a rounding step past the floor:
        a fractional eta is inexact in binary (1.1 * 50 is 55.000000000000007, and 4.1 * 50 is
        204.99999999999997, which floored one group short)."""
        limit = self._limits.get(version)
        if limit is None:  # memoised: admission is asked millions of times in a 1024-device simulation
            window = math.floor((self.eta + 1) * self.updates_per_sync * self.B + 1e-9)
            limit = self._limits[version] = min(version * self.B + window, self.steps * self.B)
        return limit

    def next_chunk_size(self, limit: int = 0) -> int:
        """Groups of the next chunk: at most ``limit`` (default ``chunk_groups``) and what is left to admit."""
        return min(limit or self.chunk_groups, self.steps * self.B - self.admitted)

    def admissible(self, device: Device) -> int:
        """Groups ``device`` may still start with the weights it holds without breaking the bound."""
        return self.admission_limit(device.version) - self.admitted

    def can_admit(self, device: Device, groups: int) -> bool:
        return 0 < groups <= self.admissible(device)

    def has_room(self, device: Device, groups: int) -> bool:
        """May ``device`` take ``groups`` more groups now (serving rollout, nothing queued, capacity left)?"""
        working = device.state is S.IDLE or (device.state is S.GENERATING and self.joins_running_batch
                                             and device.index not in self.continuing)
        return (working and self._open_to_rollout(device)
                and self.inflight[device.index] + groups <= self.inflight_groups)

    def can_take_requests(self, device: Device) -> bool:
        """May ``device`` take requests in flight over from another (``Migrate``) now: serving rollout with
        nothing queued, and idle unless the driver adds moved requests to a running batch
        (``migrates_into_batch``)?"""
        working = device.state is S.IDLE or (device.state is S.GENERATING and self.migrates_into_batch)
        return working and self._open_to_rollout(device)

    def _open_to_rollout(self, device: Device) -> bool:
        """Serving rollout, nothing queued behind its work, not leaving its pool: it may be given groups."""
        return device.role is Role.ROLLOUT and not device.after_work and device.index not in self.leaving

    def weights_next(self, device: Device) -> int:
        """The version ``device`` will generate with next: the one it holds, or the one it loads once its
        work in flight ends (a driver that cannot interrupt generation queues the load behind it)."""
        return device.loading if "load" in device.after_work else device.version

    def keeps_new_groups_off(self, device: Device, every_older_tail: bool = False) -> bool:
        """Does the older-tail placement rule (``tail_placement``) keep new groups off ``device``? Only while
        it still decodes groups started with weights older than those it now holds (the tail of an earlier
        version, after a load interrupted it): under ``TailPlacement.DUE`` if that tail is one the next step
        must contain -- with deadlines, only such *due* groups (``due_version``) are what the trainers wait
        for (count-only staleness has no due groups: there every older tail counts); given
        ``every_older_tail`` (a policy whose idle trainers take tails over), whatever the tail; under
        ``TailPlacement.NONE`` otherwise never."""
        if not every_older_tail and self.tail_placement is not TailPlacement.DUE:
            return False  # (the cheap test first: most calls under NONE end here)
        versions = self.inflight_by_version[device.index]
        if not versions:
            return False
        oldest = min(versions)
        due_only = self.deadlines and not every_older_tail
        return oldest < device.version and (not due_only or oldest <= self.due_version)

    def start_chunk(self, action: ev.Generate) -> Chunk:
        """The chunk a ``Generate`` action created: drivers carry actions out in the order applied."""
        chunk = self.unstarted.popleft()
        assert chunk.device == action.device, "Generate actions must be carried out in the order applied"
        return chunk

    def count_step_wait(self, device: int, seconds: float) -> None:
        """A train step's ``device`` had nothing to compute for ``seconds``: idle time of its home pool
        (``trace.time_breakdown``'s ``waits``)."""
        pool = self.devices[device].home.value
        self.step_wait_s[pool] = self.step_wait_s.get(pool, 0.0) + seconds

    def count_step_waits(self, devices: Sequence[int], seconds_each: float) -> None:
        """Each of a train step's ``devices`` had nothing to compute for ``seconds_each``: per home pool at once
        (a simulated step's shared work runs out on hundreds of devices together, at every group it is fed)."""
        for home, n in Counter(self.devices[i].home for i in devices).items():  # (an enum's .value is slow)
            self.step_wait_s[home.value] = self.step_wait_s.get(home.value, 0.0) + n * seconds_each

    def close_step(self) -> None:
        """The driver has handed out all the work of the step in progress: no device may join it now.
        (Not while a streamed step's groups are still generating: their work is still to come.)"""
        if not self.streaming:
            self.accepting_joins = False

    @property
    def streaming(self) -> int:
        """Groups of the (streamed) step in progress still generating."""
        return sum(self.reserved.values())

    @property
    def trainers_away(self) -> List[int]:
        """Home trainers not in the step in progress (lent away when it started): it waits for them to
        join before its optimizer step, since every home trainer steps an identical replica."""
        if self.training is None:
            return []
        return [d.index for d in self.pool(Role.TRAIN) if d.index not in self.training_devices]

    @property
    def due_version(self) -> float:
        """Groups started with weights this old or older are *due*: batch k = ``version`` must contain
        them (k - eta). Between steps that is the next batch, so due groups still generating are what the
        idle trainers wait for; while batch k trains it has taken them, so then the only due tails are a
        streamed step's groups still generating (the step waits for them).
        Two wider readings were measured and not kept (2026-12-06, ``splits.py``-style runs): also
        counting, during a step, the groups the batch after it must contain, and any later version whose
        groups the deadline check (``_deadlines_met``) forces into batch k. Both keep new groups off more
        tails, and cost ``areal`` up to 30% at eta 2-4 (gsm8k eta 4, 12/20: 252 -> 176 samples/s)."""
        return self.version - self.eta

    def due_groups(self, device: int) -> int:
        """Due groups (``due_version``: batch ``version`` must contain them) still generating on ``device``."""
        due = self.due_version
        return sum(n for version, n in self.inflight_by_version[device].items() if version <= due)

    def stream_ready(self) -> bool:
        """A streamed step may start now (``batch_ready`` is not yet true, see ``stream_plan``)."""
        return self.stream_plan() is not None

    def stream_plan(self) -> Optional[Counter]:
        """The groups per version a streamed step starting now would wait for, or None if none may start.

        It waits only for groups batch k must contain whatever happens: at eta 0 all B of version k
        (some perhaps not admitted yet); at eta >= 1 the due ones (version <= k - eta) still generating,
        once no device can start more of them. The rest of the batch is completed groups, earliest
        deadline first, and every group left behind must still meet its deadline (as in ``batch_ready``)."""
        k = self.version
        if not self.streams or self.training is not None or k >= self.steps or self.batch_ready():
            return None
        if self.eta == 0:
            done = self.completed_by_version.get(k, 0)
            return Counter({k: self.B - done}) if done else None
        due = k - self.eta
        devices = self.devices
        if self.admitted < self.admission_limit(int(due)) and any(
                devices[i].version <= due and self.admissible(devices[i]) > 0 for i in self.serving_role(Role.ROLLOUT)):
            return None  # a device could still start due groups: batch k's membership is not known yet
        waiting = Counter({v: n - self.completed_by_version.get(v, 0) for v, n in self.untrained.items() if v <= due})
        waiting = +waiting  # (drops zeros)
        need = self.B - sum(waiting.values())
        if not waiting or need <= 0 or self.completed_groups < need:
            return None
        taken = self._earliest_first(need)
        for v, n in waiting.items():
            taken[v] = taken.get(v, 0) + n
        return waiting if self._deadlines_met(taken) else None

    def batch_chunks(self, k: int, start: int = 0) -> List[Tuple[Chunk, int]]:
        """The chunks batch ``k`` took groups from, with how many groups each (from its ``start``-th part:
        a streamed step asks after every event for the parts it has not fed yet)."""
        return [(self.chunks[c], n) for c, n in self.batch_parts.get(k, [])[start:]]

    def batch_ready(self) -> bool:
        """B completed groups can be taken now without making any group miss its deadline later.

        A group of version v must be trained by batch v + eta (its deadline). Taking completed groups
        earliest-deadline-first, batch k is ready only if afterwards, for every deadline D, the groups
        still untrained with deadline <= D fit in the batches k+1..D: at most (D - k) * B of them.
        (For D = k this says every group due now is done and taken.)"""
        k = self.version
        if k >= self.steps or self.training is not None or self.completed_groups < self.B:
            return False
        if not self.deadlines:
            return True
        taken = self._earliest_first(self.B)
        return sum(taken.values()) == self.B and self._deadlines_met(taken)

    def _deadlines_met(self, taken: Dict[int, int]) -> bool:
        """Batch k taking ``taken`` groups per version leaves, for every deadline D, at most (D - k) * B
        untrained groups due by D (they fit in batches k+1..D)."""
        left_by_deadline = 0
        for version in sorted(self.untrained):
            left_by_deadline += self.untrained[version] - taken.get(version, 0)
            if left_by_deadline > (version + self.eta - self.version) * self.B:
                return False
        return True

    def _earliest_first(self, need: int) -> Dict[int, int]:
        """Groups per version that ``need`` completed groups, oldest version first, would take."""
        taken: Dict[int, int] = {}
        for version in sorted(self.completed_by_version):
            take = min(need, self.completed_by_version[version])
            taken[version] = take
            need -= take
            if need == 0:
                break
        return taken

    def needs_load(self, device: Device) -> bool:
        return device.version < self.published and "load" not in device.after_work

    # ---- applying actions --------------------------------------------------------------------
    def apply(self, action: ev.Action) -> None:
        """Books ``action`` (the policy calls this as it decides, so later choices see it)."""
        handler = self.APPLY.get(type(action))
        if handler is None:
            raise TypeError(f"the cluster bookkeeping has no rule for action {action!r}")
        handler(self, action)
        self._touched(action)

    def _start_chunk(self, action: ev.Generate) -> None:
        device, groups = self.devices[action.device], action.groups
        assert self.can_admit(device, groups), f"admission would exceed eta={self.eta} on device {device.index}"
        assert self.has_room(device, groups), f"device {device.index} cannot take {groups} more groups now"
        chunk = Chunk(len(self.chunks), device.index, self.next_group, groups, device.version)
        self.chunks.append(chunk)
        self.unstarted.append(chunk)
        self.untrained[chunk.version] += groups
        self.admitted += groups
        self.next_group += groups
        self.inflight[device.index] += groups
        self.inflight_by_version[device.index][chunk.version] += groups
        if device.state is S.IDLE:
            device.transition(S.GENERATING, self.now,
                              f"chunk {chunk.index}: groups {chunk.first}-{chunk.first + groups - 1} at v{device.version}",
                              self._log)

    def _start_train(self, action: ev.Train) -> None:
        plan = None if self.batch_ready() else self.stream_plan()
        streamed = plan is not None
        assert self.batch_ready() or streamed, \
            "a batch is trained only when B groups are done and none is overdue (or streamed: stream_plan)"
        assert self.primary in action.devices, "the primary trainer always takes part: it owns the optimizer"
        self.training = action
        self.training_devices = list(action.devices)
        self.accepting_joins = self.allows_join
        parts = self._compose_batch(self.version, self.B - sum(plan.values()) if streamed else self.B)
        self.reserved = plan or Counter()
        low, high = min(self.chunks[c].version for c, _ in parts), max(self.chunks[c].version for c, _ in parts)
        done = f", streamed: {self.B - self.streaming}/{self.B} groups done" if streamed else ""
        for index in action.devices:
            device = self.devices[index]
            assert device.version == self.version, f"device {index} would compute gradients on stale weights"
            device.transition(S.TRAINING, self.now, f"batch {self.version} (versions {low}-{high}{done})", self._log)

    def _join_train(self, action: ev.Join) -> None:
        device = self.devices[action.device]
        assert device.index not in self.expired, f"device {device.index}'s lease expired in this step"
        assert self.training is not None, "a device can only join a step in progress"
        home = device.home is Role.TRAIN  # a home trainer back from a lease: it must step its replica
        assert self.allows_join or home, "this driver cannot add a device to a step in progress"
        assert self.accepting_joins or home, "the step in progress has no work left to share"
        assert device.role is Role.TRAIN and device.idle and device.index not in self.training_devices
        assert device.version == self.version, f"device {device.index} would compute gradients on stale weights"
        self.training_devices.append(device.index)
        device.transition(S.TRAINING, self.now, f"joins batch {self.version}", self._log)

    def _compose_batch(self, k: int, need: int) -> List[Tuple[int, int]]:
        """Takes ``need`` completed groups (B; fewer for a streamed step): oldest version first (all
        overdue ones are among them) with deadlines, else in the order they finished."""
        if self.deadlines:
            self.completed.sort(key=lambda entry: (entry[2], entry[0]))
        parts, taken, used, completed, by_version = [], need, 0, self.completed, self.completed_by_version
        while need:
            entry = completed[used]
            take = min(need, entry[1])
            parts.append((entry[0], take))
            by_version[entry[2]] -= take
            if not by_version[entry[2]]:
                del by_version[entry[2]]
            entry[1] -= take
            need -= take
            if entry[1] == 0:
                used += 1
        del completed[:used]  # (the entries taken whole, at once: not one pop from the front each)
        self.batch_parts[k] = parts
        self.completed_groups -= taken
        return parts

    def _migrate(self, action: ev.Migrate) -> None:
        source, target, groups, version = (self.devices[action.source], self.devices[action.device],
                                           action.groups, action.version)
        assert self.allows_migration, "this driver cannot move requests in flight"
        assert source.index != target.index and groups > 0
        assert self.inflight_by_version[source.index].get(version, 0) >= groups, \
            f"device {source.index} has fewer than {groups} groups of v{version} in flight"
        assert self.can_take_requests(target), \
            f"device {target.index} cannot take requests now ({target.role.value}, {target.state.value})"
        assert self.inflight[target.index] + groups <= self.inflight_groups, f"device {target.index} has no room"
        assert target.version >= max(version, source.version), \
            f"device {target.index} would continue v{version} groups with older weights than they were decoded with"
        for index, change in ((source.index, -groups), (target.index, groups)):
            self.inflight[index] += change
            self.inflight_by_version[index][version] += change
            if not self.inflight_by_version[index][version]:
                del self.inflight_by_version[index][version]
        self.migrations.append((self.now, source.index, target.index, groups, version))
        if not self.migrates_into_batch:
            self.continuing.add(target.index)
        reason = f"takes over {groups} groups of v{version} from device {source.index}"
        if target.idle:
            target.transition(S.GENERATING, self.now, reason, self._log)
        else:
            self._log_unchanged(target, reason)
        if not self.inflight[source.index] and source.state in (S.GENERATING, S.DRAINING):
            self._work_finished(source, f"{groups} groups of v{version} moved to device {target.index}")

    def _start_sync(self, action: ev.Sync) -> None:
        assert self.syncing is None and self.published < self.version, "one transfer of a new version at a time"
        self.syncing = self.version

    def _start_load(self, action: ev.Load) -> None:
        device = self.devices[action.device]
        assert device.version < self.published, f"device {device.index} has nothing newer to load"
        if device.idle:
            device.transition(S.SYNCING, self.now, f"load v{self.published}", self._log)
        elif device.state is S.GENERATING and self.interruptible:
            device.transition(S.SYNCING, self.now, f"load v{self.published} (generation paused)", self._log)
        else:
            device.after_work.append("load")
        device.loading = self.published

    def _start_switch(self, action: ev.Switch) -> None:
        device = self.devices[action.device]
        assert device.role is not action.role, f"device {device.index} already serves {action.role.value}"
        assert not device.after_work, f"device {device.index} has queued work; switch it after that"
        if action.role is not device.home:
            assert device.index not in self.open_leases, f"device {device.index} is already lent"
            lease = Lease(len(self.leases), device.index, action.role, self.now, action.reason)
            self.leases.append(lease)
            self.open_leases[device.index] = lease
        if device.idle:
            device.transition(S.SWITCHING, self.now, action.reason or f"to {action.role.value}", self._log)
        else:
            device.transition(S.DRAINING, self.now, action.reason or f"to {action.role.value}", self._log)
            device.after_work.append("switch")

    def _rehome(self, action: ev.Rehome) -> None:
        device = self.devices[action.device]
        assert device.index != self.primary, "the primary trainer owns the optimizer and the versions: it stays"
        assert device.idle and not device.lent and not device.after_work, f"device {device.index} is busy or lent"
        assert self.training is None, "re-partitioning happens at a step boundary"
        assert action.home is not device.home, f"device {device.index} is already at home in {action.home.value}"
        device.home = action.home
        self.leaving.discard(device.index)
        self.rehoming.add(device.index)
        self.rehomes.append((self.now, device.index, action.home.value))
        self._start_switch(ev.Switch(device.index, action.home, action.reason or f"rehome to {action.home.value}"))

    APPLY = {ev.Generate: _start_chunk, ev.Train: _start_train, ev.Join: _join_train, ev.Migrate: _migrate,
             ev.Sync: _start_sync, ev.Load: _start_load, ev.Switch: _start_switch, ev.Rehome: _rehome}

    # ---- completions -------------------------------------------------------------------------
    def complete(self, event: ev.Event) -> None:
        """Books what a driver reports as done."""
        handler = self.COMPLETE.get(type(event))
        if handler is None:
            raise TypeError(f"the cluster bookkeeping has no rule for event {event!r}")
        handler(self, event)
        self._touched(event)

    def _touched(self, message) -> None:
        """The devices an action or a completion names: their work in flight or queue may have changed
        without a transition (a group done mid-chunk, groups moved, a load queued). Every other change
        of what ``older_tails`` reads comes with a transition, which ``_log`` marks."""
        for name in ("device", "source"):
            index = getattr(message, name, None)
            if index is not None:
                self._tails_dirty.add(index)

    def older_tails(self) -> List[int]:
        """Rollout-pool devices (at home there, generating) decoding only groups older than the weights
        they will generate with next (``weights_next``), in index order: tails the placement rule may keep
        new groups from until they end (due ones under ``TailPlacement.DUE``; every one where the policy
        has idle trainers take them over, ``fill_rollout``'s ``every_older_tail``)."""
        devices, inflight, by_version, tails = self.devices, self.inflight, self.inflight_by_version, self._tails
        for i in self._tails_dirty:
            d = devices[i]
            if (d.state is S.GENERATING and d.role is Role.ROLLOUT and d.home is Role.ROLLOUT and inflight[i]
                    and max(by_version[i]) < self.weights_next(d) and d.after_work in ([], ["load"])):
                tails.add(i)
            else:
                tails.discard(i)
        self._tails_dirty.clear()
        return sorted(tails)

    def _started(self, event: ev.Started) -> None:
        pass  # nothing has happened yet

    def _chunk_done(self, event: ev.ChunkDone) -> None:
        chunk = self.chunks[event.chunk]
        groups = event.groups or chunk.groups - chunk.finished
        assert 0 < groups <= chunk.groups - chunk.finished, f"chunk {chunk.index}: {groups} more groups done?"
        chunk.finished += groups
        chunk.done = chunk.finished == chunk.groups
        into_step = min(groups, self.reserved.get(chunk.version, 0))  # straight into the streamed step
        if into_step:
            self.batch_parts[self.version].append((chunk.index, into_step))
            self.reserved[chunk.version] -= into_step
            if not self.reserved[chunk.version]:  # (every count it holds stays positive: none drops below)
                del self.reserved[chunk.version]
        if groups > into_step:
            self.completed.append([chunk.index, groups - into_step, chunk.version])
            self.completed_groups += groups - into_step
            self.completed_by_version[chunk.version] += groups - into_step
        self.inflight[event.device] -= groups
        self.warmed.add(event.device)
        by_version = self.inflight_by_version[event.device]
        by_version[chunk.version] -= groups
        if not by_version[chunk.version]:
            del by_version[chunk.version]
        device = self.devices[event.device]
        if self.inflight[event.device] == 0:
            self.continuing.discard(event.device)
            if device.state is not S.SYNCING:
                self._work_finished(device, f"chunk {chunk.index} done")

    def _sync_done(self, event: ev.SyncDone) -> None:
        assert event.version == self.syncing
        self.published, self.syncing = event.version, None

    def _load_done(self, event: ev.LoadDone) -> None:
        device = self.devices[event.device]
        device.version = event.version
        if self.inflight[device.index]:
            device.transition(S.GENERATING, self.now, f"loaded v{event.version}, generation resumes", self._log)
        else:
            self._next_queued(device, f"loaded v{event.version}")

    def _switch_done(self, event: ev.SwitchDone) -> None:
        device = self.devices[event.device]
        assert device.role is event.role
        if device.index in self.rehoming:  # a new home: no lease; a new trainer adopted the primary's state
            self.rehoming.discard(device.index)
            if device.home is Role.TRAIN:
                device.version = self.version
        elif event.role is device.home:
            self.open_leases.pop(device.index).end = self.now
        self._next_queued(device, f"serves {event.role.value}")

    def _finish_train(self, event: ev.TrainDone) -> None:
        k = self.version
        assert event.version == k + 1, "versions advance by one per optimizer step"
        assert not self.streaming, f"batch {k} has {self.streaming} groups still generating: no optimizer step yet"
        assert not self.trainers_away, f"home trainers {self.trainers_away} have not joined batch {k}'s optimizer step"
        for chunk, groups in self.batch_chunks(k):
            assert 0 <= k - chunk.version and (k - chunk.version <= self.eta or not self.deadlines), \
                f"staleness {k - chunk.version} exceeds eta={self.eta}"
            self.staleness[k - chunk.version] += groups
            self.trained_groups += groups
            self.untrained[chunk.version] -= groups
            if not self.untrained[chunk.version]:
                del self.untrained[chunk.version]
        self.version = event.version
        self.version_times.append(self.now)
        trainers, self.training, self.training_devices = self.training_devices, None, []
        self.accepting_joins = False
        self.expired = set()
        for index in trainers:  # the train pool is data-parallel: every home trainer stepped its replica;
            if self.devices[index].home is Role.TRAIN:  # a lent rollout device only lent its gradients
                self.devices[index].version = event.version
        for index in trainers:
            self._work_finished(self.devices[index], f"step -> v{event.version}")

    def _lease_expired(self, event: ev.LeaseExpired) -> None:
        device = self.devices[event.device]
        assert self.training is not None and event.device in self.training_devices, "only a step's device expires"
        assert device.lent and device.role is Role.TRAIN, \
            "only a borrowed device's lease expires (home trainers hold replicas)"
        self.training_devices.remove(event.device)
        self.expired.add(event.device)
        self.expired_leases.append((self.now, event.device, self.version))
        device.transition(S.IDLE, self.now, f"lease expired in batch {self.version}: its gradients are discarded",
                          self._log)

    COMPLETE = {ev.Started: _started, ev.ChunkDone: _chunk_done, ev.TrainDone: _finish_train,
                ev.SyncDone: _sync_done, ev.LoadDone: _load_done, ev.SwitchDone: _switch_done,
                ev.LeaseExpired: _lease_expired}

    def _work_finished(self, device: Device, reason: str) -> None:
        if device.state is S.DRAINING:  # the switch was queued first (switches need an empty queue)
            device.after_work.remove("switch")
            device.transition(S.SWITCHING, self.now, reason, self._log)
        else:
            self._next_queued(device, reason)

    def _next_queued(self, device: Device, reason: str) -> None:
        """The device finished something: start what was queued behind it, in order, else go idle."""
        if device.after_work and device.after_work[0] == "load":
            device.after_work.pop(0)
            device.transition(S.SYNCING, self.now, reason, self._log)
        else:
            device.transition(S.IDLE, self.now, reason, self._log)

    def lease_summary(self) -> Dict[str, Dict[str, float]]:
        """Per direction (home -> served role): how many leases, device-seconds lent, longest lease."""
        out: Dict[str, Dict[str, float]] = {}
        for lease in self.leases:
            # (a lease serves the role its device's home pool does not: its home then, whatever a later
            # re-partition made it)
            entry = out.setdefault(f"{lease.serves.other().value}->{lease.serves.value}",
                                   {"leases": 0, "device_s": 0.0, "longest_s": 0.0})
            held = (lease.end if lease.end is not None else self.now) - lease.start
            entry["leases"] += 1
            entry["device_s"] = round(entry["device_s"] + held, 3)
            entry["longest_s"] = round(max(entry["longest_s"], held), 3)
        return out

    # ---- why idle devices are idle ---------------------------------------------------------------
    def idle_cause(self, device: Device) -> str:
        """Why an idle device is idle, in the categories both drivers report (:mod:`bidirl.sched.trace`):

        * ``tail``: waiting for work elsewhere to finish -- a trainer whose next batch is not complete
          (its tail is still generating), or a rollout device with nothing left to generate;
        * ``admission``: a rollout device the staleness bound blocks (its weights are too old to start
          more groups until a newer version exists);
        * ``no_reason``: it could work and the policy gave it nothing."""
        if device.role is Role.ROLLOUT:
            if self.admitted >= self.steps * self.B:
                return TAIL
            return ADMISSION if self.admissible(device) <= 0 else NO_REASON
        if self.training is None and self.version < self.steps and not self.batch_ready():
            return TAIL
        return NO_REASON

    def settle(self) -> None:
        """Drivers call this once a decision has been carried out: an idle device whose reason for idling
        changed gets a trace record saying so. Only what can change is re-examined: trainers when the next
        batch's readiness or the version changes, rollout devices when admission moved."""
        ready = self.training is None and self.batch_ready()
        trainers_changed = (self.version, ready) != self._settled[:2]
        rollout_changed = self.admitted != self._settled[2]
        self._settled = (self.version, ready, self.admitted)
        if not (trainers_changed or rollout_changed):
            return
        recheck = list(self.idle_sets[Role.TRAIN]) if trainers_changed else []
        if rollout_changed:
            recheck += [i for i in self.idle_sets[Role.ROLLOUT] if self.idle_causes.get(i) != TAIL]
        for index in sorted(recheck):
            device = self.devices[index]
            cause = self.idle_cause(device)
            if cause != self.idle_causes.get(index):
                self._log_unchanged(device, f"idle: {cause}")

    def _log_unchanged(self, device: Device, reason: str) -> None:
        """A trace record that keeps ``device``'s state and says why (a new idle cause, work taken over)."""
        self._log({"t": round(self.now, 6), "device": device.index, "from": device.state.value,
                   "to": device.state.value, "role": device.role.value, "home": device.home.value,
                   "version": device.version, "reason": reason})

    def _log(self, record: dict) -> None:
        index = record["device"]
        self._tails_dirty.add(index)
        device = self.devices[index]
        for members in self.serving.values():
            members.discard(index)
        # (a transition flips the role; a rehome changes the home before it)
        self.serving[(device.role, device.home)].add(index)
        self.idle_sets[Role.ROLLOUT].discard(index)
        self.idle_sets[Role.TRAIN].discard(index)
        self.generating.discard(index)
        self.switching.discard(index)
        if record["to"] == "idle":
            record["cause"] = self.idle_causes[index] = self.idle_cause(self.devices[index])
            self.idle_sets[Role(record["role"])].add(index)
        else:
            self.idle_causes.pop(index, None)
            if record["to"] == "generating":
                self.generating.add(index)
            elif record["to"] == "switching":
                self.switching.add(index)
        self.trace.append(record)
