"""The discrete-event driver: a heap of (time, seq, event); policies decide, cost models time the work.

    push Started at t=0
    while heap:                                   # vidur-style
        t, _, event = pop()
        if event is an instance tick: event -> the ChunkDone of every chunk whose last sequence ended
        for each public event:
            cluster.complete(event)                # shared bookkeeping (skipped for Started)
            for action in policy.decide(event, cluster):
                start it: a chunk joins its device's instance, a train step / transfer is timed
            loads and switches begin when a device enters SYNCING / SWITCHING
        re-schedule the next finish of every instance that changed

A train step is timed as gradient work (device-seconds) shared by its devices, plus an all-reduce
among the home trainers, plus the gradients of every lent device (Trainer-on-RollPool) returned to
the primary one after another; a device that joins it (``Join``) takes a share of the work left and
adds its gradient return, and the step's finish is re-timed (its end adds the cost model's per-step
overhead, and each pulled micro-batch its round trip). With ``pull_samples`` (the live
runtime's micro-batch) the work comes in equal micro-batches that the step's devices pull one at a
time (:class:`PulledStep`): a joiner takes only micro-batches nobody has started, and once the last
one has started the step accepts no joiners (``Cluster.close_step``), as in the live controller.
A streamed step (``Cluster.stream_plan``) starts on the groups of its batch already done; each
group that finishes later adds its work (queued behind the rest), and the step is timed to its end
only once every group is in -- until then its devices may run out of work and wait (``waited``,
reported as the train pool's tail idle time).

Two rollout models: :class:`FixedCosts` times a chunk in isolation (tests, tiny examples); a cost model
with ``make_instance`` gets continuous batching per device (:mod:`bidirl.sim.instance`), where chunks
share the decode batch, a weight load pauses decoding instead of waiting for a chunk to end, and each
prompt group completes (``ChunkDone`` of part of a chunk) when its own last sequence ends -- or, where
the driver's engine call returns groups together (the live HF engine's chunks, live continuations of
moved groups), when that call would return (``reported_when_idle``). Where the
performance model says devices share a host (CPU processes), every instance not in the train step
decodes slower for exactly as long as the step runs, and every instance decodes slower for exactly as
long as another one decodes too (the larger factor where both). A device's first chunk and first train
work of the run also take the cost model's warm-up (a fresh engine's first call, measured by the
profile), once.
Deterministic: ties break by sequence number, and cost models draw from their own seeded RNG.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Protocol, Tuple

from bidirl.sched import events as ev
from bidirl.sched.cluster import Chunk, Cluster
from bidirl.sched.estimates import StepProgress, lease_timeout_s, pulled_items
from bidirl.sched.roles import DeviceState, Role


class CostModel(Protocol):
    def train_work(self, batch: List[Tuple[Chunk, int]]) -> float: ...  # device-seconds, split over trainers

    def allreduce(self, devices: int) -> float: ...

    def micro_batch_overhead(self) -> float: ...  # seconds each pulled micro-batch adds (its round trip)

    def step_overhead(self) -> float: ...  # seconds a step's finish adds beyond its all-reduce

    def gradient_return(self, lent: int) -> float: ...

    def sync(self, devices: Tuple[int, ...]) -> float: ...

    def load(self, device: int) -> float: ...

    def switch(self, device: int, to: str = "") -> float: ...

    def adopt(self, device: int) -> float: ...

    def warmup(self, stage: str) -> float: ...  # extra seconds of a device's first use of a stage


@dataclass
class FixedCosts:
    """Constant durations: per prompt group generated, per train step (split over devices), sync, switch."""

    generate_per_group: float = 1.0
    train_step: float = 4.0
    sync_s: float = 0.1
    switch_s: float = 0.01
    gradient_return_s: float = 0.0  # per lent device, serialised at the primary
    samples_per_group: int = 4  # (what a pulled step cuts into micro-batches)
    warmup_s: Tuple[float, float] = (0.0, 0.0)  # (rollout, train): a device's first chunk / train work
    micro_batch_overhead_s: float = 0.0
    step_overhead_s: float = 0.0

    def warmup(self, stage: str) -> float:
        return self.warmup_s[0] if stage == "rollout" else self.warmup_s[1]

    def generate(self, chunk: Chunk) -> float:
        return self.generate_per_group * chunk.groups

    def train_work(self, batch: List[Tuple[Chunk, int]]) -> float:
        return self.train_step

    def trained_samples(self, batch: List[Tuple[Chunk, int]]) -> float:
        return sum(groups for _, groups in batch) * self.samples_per_group

    def allreduce(self, devices: int) -> float:
        return 0.0

    def micro_batch_overhead(self) -> float:
        return self.micro_batch_overhead_s

    def step_overhead(self) -> float:
        return self.step_overhead_s

    def gradient_return(self, lent: int) -> float:
        return lent * self.gradient_return_s

    def sync(self, devices: Tuple[int, ...]) -> float:
        return self.sync_s

    def load(self, device: int) -> float:
        return self.switch_s

    def switch(self, device: int, to: str = "") -> float:
        return self.switch_s

    def adopt(self, device: int) -> float:
        return self.switch_s


@dataclass(frozen=True)
class StepTick:
    """Internal: the step in progress ends now, unless a device joined it since (epoch changed)."""

    epoch: int


class PulledStep:
    """A train step whose work comes as micro-batches, pulled one at a time in order by the step's
    devices (the earliest free first); a device that joins at ``now`` takes micro-batches nobody has
    started, and micro-batches ``add``-ed later (a streamed step's groups as they finish) queue behind
    the rest. A device slot may stall (fault injection: its next micro-batch takes longer) and expire:
    everything it computed goes back to the front of the queue and it takes no more. The same interface
    as :class:`~bidirl.sched.estimates.StepProgress` for the driver."""

    def __init__(self, item_s: float, items: int, devices: int, now: float, epoch: int = 0):
        self.devices, self.epoch = devices, epoch
        self.starts: List[Tuple[float, int, float, float]] = []  # (start, slot, work, seconds) per micro-batch
        self.joined = [now] * devices  # when each device slot joined the step
        self.counted = [now] * devices  # per slot: the time it had nothing to compute is counted up to here
        self.waited = 0.0  # device-seconds its devices had nothing to compute, counted so far
        self.stalls: Dict[int, float] = {}  # slot -> extra seconds its next micro-batch takes
        self.dead: set = set()  # expired slots
        self._assign([now] * devices, [item_s] * items, now)

    def _assign(self, free: List[float], items: List[float], now: float) -> None:
        heap = [(max(t, now), slot) for slot, t in enumerate(free) if slot not in self.dead]
        heapq.heapify(heap)
        for work in items:
            t, slot = heapq.heappop(heap)
            seconds = work + self.stalls.pop(slot, 0.0)
            self.starts.append((t, slot, work, seconds))
            heapq.heappush(heap, (t + seconds, slot))

    def _free(self, starts) -> List[float]:
        free = list(self.joined)
        for start, slot, _, seconds in starts:
            free[slot] = max(free[slot], start + seconds)
        return free

    @property
    def last_start(self) -> float:
        return max((start for start, _, _, _ in self.starts), default=0.0)

    def finish(self, communication_s: float = 0.0) -> float:
        return max((start + seconds for start, _, _, seconds in self.starts), default=0.0) + communication_s

    def first_item(self, slot: int) -> Optional[Tuple[float, float]]:
        """(start, seconds) of the slot's first micro-batch, if it has one."""
        mine = [(start, seconds) for start, s, _, seconds in self.starts if s == slot]
        return min(mine) if mine else None

    def idle_until(self, now: float) -> Dict[int, float]:
        """Per slot still in the step, the seconds it has had nothing to compute up to ``now`` and not yet
        counted (each stretch is counted once): waiting for micro-batches still to come (a streamed step's
        groups), for a device to join, or for the step's last micro-batches on other slots."""
        out = {}
        for slot, free in enumerate(self._free(self.starts)):
            since = max(free, self.counted[slot])
            if slot not in self.dead and since < now:
                out[slot], self.counted[slot] = now - since, now
        self.waited += sum(out.values())
        return out

    def end_waits(self) -> Dict[int, float]:
        """:meth:`idle_until` the step's work ends: each slot's wait for the others' last micro-batches."""
        return self.idle_until(self.finish())

    def _replan(self, now: float, kept, requeued: List[float], epoch: int) -> None:
        waiting = [work for start, _, work, _ in self.starts if start >= now]  # not started: pulled anew
        for start, slot, work, seconds in self.starts:
            if start >= now and seconds > work:
                self.stalls[slot] = seconds - work  # a stall not begun yet stays with its slot
        self.starts, self.epoch = kept, epoch
        self._assign(self._free(kept), requeued + waiting, now)

    def join(self, now: float, epoch: int = 0, stall: float = 0.0) -> Dict[int, float]:
        """One more device at ``now`` (``stall``: its first micro-batch takes that much longer); returns
        :meth:`idle_until` ``now`` of the slots already there."""
        waits = self.idle_until(now)
        self.devices += 1
        self.joined.append(now)
        self.counted.append(now)
        if stall:
            self.stalls[self.devices - 1] = stall
        self._replan(now, [item for item in self.starts if item[0] < now], [], epoch)
        return waits

    def expire(self, now: float, slot: int, epoch: int = 0) -> Dict[int, float]:
        """The slot's lease expired: its micro-batches, computed or running, are computed again by the others.
        Returns :meth:`idle_until` ``now`` of the others (those out of work get the micro-batches back)."""
        self.dead.add(slot)
        waits = self.idle_until(now)
        requeued = [work for _, s, work, _ in sorted(self.starts) if s == slot]
        self.starts = [item for item in self.starts if item[1] != slot]
        self._replan(now, [item for item in self.starts if item[0] < now], requeued, epoch)
        return waits

    def add(self, now: float, items: List[float], epoch: int = 0) -> Dict[int, float]:
        """Micro-batches that arrived at ``now``, queued behind every one already there; returns
        :meth:`idle_until` ``now`` (the slots out of work until they came)."""
        self.epoch = epoch
        waits = self.idle_until(now)
        self._assign(self._free(self.starts), items, now)
        return waits


@dataclass(frozen=True)
class LeaseTick:
    """Internal: ``device``'s lease in the step in progress times out now (unless the step was re-planned)."""

    epoch: int
    device: int


@dataclass(frozen=True)
class CloseTick:
    """Internal: the last micro-batch of the step in progress has started (unless it was re-planned)."""

    epoch: int


class Tick(NamedTuple):
    """Internal: an instance's next sequence finish (ignored if the instance changed since). (A named
    tuple: about 100,000 are made in a 32-device simulation, and a frozen dataclass is slower to build.)"""

    device: int
    epoch: int


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, back as it was after it. A run allocates a
    tuple per sequence and per event, none of them in a reference cycle (reference counting frees them),
    yet each allocation burst triggers a collection, and every full one scans the whole heap: about 5-10%
    of a 200-step run (measured: `experiments/sim_validation/speed.py`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Simulator:
    def __init__(self, cluster: Cluster, policy: Any, costs: Any, max_events: int = 50_000_000,
                 pull_samples: int = 0, stalls: Optional[Dict[int, float]] = None, lease_timeout_s: float = 0.0,
                 whole_calls: bool = False):
        """``whole_calls``: the rollout engine reports a chunk's groups when the chunk ends, not each as its
        last sequence does (``DriverCapabilities.reports_groups``)."""
        self.cluster, self.policy, self.costs, self.max_events = cluster, policy, costs, max_events
        self.pull_samples = pull_samples  # samples per pulled micro-batch (0: work divides continuously)
        # fault injection: device -> seconds it hangs in its first micro-batch as a borrowed device; a lease
        # whose micro-batch runs past ``lease_timeout_s`` expires (LeaseExpired), as in the live controller
        # (0: the live controller's rule, 10 times the slowest micro-batch so far and at least 10 s)
        self.stalls = dict(stalls or {})
        if self.stalls and not pull_samples:
            raise ValueError("stalled devices need pulled micro-batches (pull_samples)")
        self.lease_timeout_given = lease_timeout_s
        self.slowest_item_s = 0.0
        self.slots: Dict[int, int] = {}  # device -> its slot in the pulled step in progress
        self.hung_until: Dict[int, float] = {}  # an expired device is busy until its stall ends
        self.heap: List[Tuple[float, int, Any]] = []
        self.seq = itertools.count()
        self.scheduled: set = set()  # (device, state) whose completion is already on the heap
        continuous = hasattr(costs, "make_instance")
        self.instances = {d.index: costs.make_instance() for d in cluster.devices} if continuous else None
        self.ticked: Dict[int, int] = {}
        self.trace_seen = 0
        self.dirty: set = set()
        self.step: Any = None  # StepProgress, or PulledStep when devices pull micro-batches
        self.stream_wait_s = 0.0  # of the step waits (``Cluster.step_wait_s``), those for groups still generating
        self.fed = 0  # parts of the step's batch turned into work (a streamed step gets more as they finish)
        self.step_epochs = itertools.count()
        self.unreported: Tuple[int, List[List[int]]] = (-1, [])  # (device, [chunk, groups]) finished, not yet reported
        # device -> groups ended there, not reported until its engine call returns (``reported_when_idle``)
        self.held_back: Dict[int, List[Tuple[int, int]]] = {}
        self.whole_calls = whole_calls
        self.warmed: set = set()  # (device, stage) that paid their engine's warm-up
        self.training_now: Any = ()  # devices of the train step in progress (their neighbours decode slower)
        # the host's decoding slows its other decoding down (1.0: devices do not share a host, or older
        # profiles), so each instance's speed follows who else decodes: checked after every event
        self.beside_decoding = costs.decode_slowdown_beside_decoding() if continuous else 1.0
        if cluster.allows_migration and self.instances is None:
            raise ValueError("moving requests in flight (Migrate) needs a cost model with continuous-batching instances")

    def push(self, time: float, event: Any) -> None:
        heapq.heappush(self.heap, (time, next(self.seq), event))

    def run(self) -> Cluster:
        with cyclic_gc_paused():
            return self._run()

    def _run(self) -> Cluster:
        self.push(0.0, ev.Started())
        for _ in range(self.max_events):
            if not self.heap:
                break
            now, _, event = heapq.heappop(self.heap)
            self.cluster.now = now
            if isinstance(event, Tick):
                instance = self.instances[event.device]
                if event.epoch != instance.epoch:
                    continue
                done = instance.finish_due(now)
                if self.whole_calls or event.device in self.cluster.continuing:
                    done = self.reported_when_idle(event.device, instance, done)
                # reported one chunk at a time; the policy may move groups off this device meanwhile
                self.unreported = (event.device, [[c, n] for c, n in self.completed_groups(done)])
                while self.unreported[1]:
                    chunk, groups = self.unreported[1].pop(0)
                    if groups:
                        self.handle(ev.ChunkDone(event.device, chunk, groups), now)
                self.dirty.add(event.device)
            elif isinstance(event, LeaseTick):
                if self.step is not None and event.epoch == self.step.epoch:
                    self.expire_lease(event.device, now)
            elif isinstance(event, CloseTick):
                if self.step is not None and event.epoch == self.step.epoch:
                    self.cluster.close_step()
            elif isinstance(event, StepTick):
                if self.step is not None and event.epoch == self.step.epoch and not self.cluster.trainers_away:
                    if self.pull_samples:  # (work shared continuously ends on every device at once)
                        self.count_slot_waits(self.step.end_waits(), streaming=False)
                    self.step = None
                    self.beside_training(now, ())
                    self.handle(ev.TrainDone(self.cluster.version + 1), now)
            else:
                self.handle(event, now)
            if self.beside_decoding != 1.0:
                self.set_speeds(now)
            self.reschedule_ticks()
        if not self.cluster.finished:
            if self.heap:  # (the events ran out of budget, not out of work)
                raise RuntimeError(f"simulation stopped after {self.max_events} events at t={self.cluster.now:.3f}, "
                                   f"version {self.cluster.version}/{self.cluster.steps}: events kept coming "
                                   "without the run finishing")
            raise RuntimeError(f"simulation stalled at t={self.cluster.now:.3f} after version "
                               f"{self.cluster.version}/{self.cluster.steps}: the policy started nothing")
        return self.cluster

    def completed_groups(self, done: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
        """(chunk, groups) for the groups an instance finished, each chunk once, in completion order."""
        counts: Dict[int, int] = {}
        for chunk, group in done:
            self.costs.group_done(chunk, group)
            counts[chunk] = counts.get(chunk, 0) + 1
        return list(counts.items())

    def expire_lease(self, device: int, now: float) -> None:
        """A borrowed device overran its lease: its micro-batches go back to the queue, it leaves the step
        (LeaseExpired), and it stays busy until its stall ends."""
        slot = self.slots[device]
        start, seconds = self.step.first_item(slot)
        self.hung_until[device] = start + seconds
        self.count_slot_waits(self.step.expire(now, slot, next(self.step_epochs)), self.cluster.streaming)
        self.handle(ev.LeaseExpired(device), now)
        self.retime_step()
        self.beside_training(now, self.cluster.training_devices)  # (decoding beside training: no longer it)

    def handle(self, event: Any, now: float) -> None:
        if isinstance(event, ev.SwitchDone):
            self.scheduled.discard((event.device, DeviceState.SWITCHING))
        elif isinstance(event, ev.LoadDone):
            self.scheduled.discard((event.device, DeviceState.SYNCING))
        self.cluster.complete(event)
        if isinstance(event, ev.ChunkDone) and self.cluster.training is not None:
            self.feed_stream(now)
        for action in self.policy.decide(event, self.cluster):
            self.start(action, now)
        self.start_transitions(now)
        self.cluster.settle()

    def start(self, action: ev.Action, now: float) -> None:
        self.START[type(action)](self, action, now)

    def _generate(self, action: ev.Generate, now: float) -> None:
        chunk = self.cluster.start_chunk(action)
        warmup = self.warmup(action.device, "rollout")  # (a device's first chunk of the run)
        if self.instances is None:
            self.push(now + warmup + self.costs.generate(chunk), ev.ChunkDone(action.device, chunk.index))
        else:
            if warmup:
                self.instances[action.device].warm_up(now, warmup)
            self.instances[action.device].admit(now, chunk.index, self.costs.lengths(chunk), self.costs.G)
            self.dirty.add(action.device)

    def _train(self, action: ev.Train, now: float) -> None:  # apply() composed the batch already
        cluster = self.cluster
        parts = cluster.batch_chunks(cluster.version)
        self.fed = len(parts)
        epoch = next(self.step_epochs)
        if self.pull_samples:
            self.step = PulledStep(0.0, 0, len(action.devices), now, epoch)
            self.slots = {device: slot for slot, device in enumerate(action.devices)}
            for device in action.devices:
                stall = self.stall_of(device) + self.warmup(device, "train")
                if stall:
                    self.step.stalls[self.slots[device]] = stall
            self.step.add(now, self.micro_batches(parts, len(action.devices), whole=not cluster.streaming), epoch)
        else:  # (work shared continuously: a device's warm-up is work the step's devices share)
            warmup = sum(self.warmup(device, "train") for device in action.devices)
            self.step = StepProgress(self.costs.train_work(parts) + warmup, len(action.devices), now, epoch)
        self.retime_step()
        self.beside_training(now, action.devices)

    def micro_batches(self, parts, devices: int, whole: bool) -> List[float]:
        """Seconds of each micro-batch the groups of ``parts`` are cut into (as the live runtime cuts
        them: ``pulled_items`` for a whole batch; what arrived, in micro-batches, for a streamed step)."""
        samples = math.ceil(self.costs.trained_samples(parts))
        work = self.costs.train_work(parts)
        items = pulled_items(samples, self.pull_samples, devices) if whole else max(1, -(-samples // self.pull_samples))
        self.slowest_item_s = max(self.slowest_item_s, work / items)  # (its compute: what the controller times)
        return [work / items + self.costs.micro_batch_overhead()] * items  # (each one's round trip too)

    @property
    def lease_timeout_s(self) -> float:
        return lease_timeout_s(self.lease_timeout_given, self.slowest_item_s)  # (the live controller's rule)

    def feed_stream(self, now: float) -> None:
        """Groups that finished into the streamed step in progress become gradient work."""
        if self.step is None:
            return
        parts = self.cluster.batch_chunks(self.cluster.version, self.fed)
        if not parts:
            return
        self.fed += len(parts)
        epoch = next(self.step_epochs)
        if self.pull_samples:
            self.count_slot_waits(self.step.add(now, self.micro_batches(parts, 0, whole=False), epoch), streaming=True)
        else:
            self.count_shared_wait(self.step.add(now, self.costs.train_work(parts), epoch),
                                   self.cluster.training_devices, streaming=True)
        self.retime_step()

    def warmup(self, device: int, stage: str) -> float:
        """The cost model's warm-up of ``stage`` on ``device``'s first use of it in the run, then 0."""
        if (device, stage) in self.warmed:
            return 0.0
        self.warmed.add((device, stage))
        return self.costs.warmup(stage)

    def stall_of(self, device: int) -> float:
        """Seconds ``device`` hangs now (fault injection: once, as a borrowed device)."""
        return self.stalls.pop(device, 0.0) if self.cluster.devices[device].lent else 0.0

    def retime_step(self) -> None:
        """(Re-)schedule the step's lease timeouts, its close (the last micro-batch has started) and its
        finish -- only once every group of its batch is in: a streamed step's devices wait for the groups
        still generating."""
        if self.pull_samples:
            for device in self.cluster.training_devices:
                first = self.step.first_item(self.slots[device]) if self.cluster.devices[device].lent else None
                if first is not None and first[1] > self.lease_timeout_s:  # it overruns its lease
                    self.push(first[0] + self.lease_timeout_s, LeaseTick(self.step.epoch, device))
        if self.cluster.streaming:
            return
        now = self.cluster.now  # (a home trainer joining after the work ran out: the step ends now)
        # no device joins once there is nothing left to share: the last micro-batch has started, or
        # (work shared continuously) the work has run out
        closes = self.step.last_start if self.pull_samples else self.step.finish()
        self.push(max(now, closes), CloseTick(self.step.epoch))
        self.push(max(now, self.step.finish()) + self.step_communication(self.cluster.training_devices),
                  StepTick(self.step.epoch))

    def _join(self, action: ev.Join, now: float) -> None:  # the rest of the step's work gets one more device
        warmup = self.warmup(action.device, "train")
        # (the step's devices that ran out of work before the join -- a home trainer back from a lease, or a
        # streamed step's groups still to come -- waited until now)
        streaming = self.cluster.streaming
        if self.pull_samples:
            waits = self.step.join(now, next(self.step_epochs), stall=self.stall_of(action.device) + warmup)
            self.slots[action.device] = self.step.devices - 1
            self.count_slot_waits(waits, streaming)
        else:
            before = [device for device in self.cluster.training_devices if device != action.device]
            self.count_shared_wait(self.step.join(now, next(self.step_epochs)), before, streaming)
            if warmup:
                self.step.add(now, warmup, self.step.epoch)
        self.retime_step()
        self.beside_training(now, self.cluster.training_devices)

    def count_wait(self, device: int, seconds: float, streaming: bool) -> None:
        """``device`` held the train step with nothing to compute for ``seconds`` (``streaming``: waiting
        for groups of its batch still generating)."""
        self.cluster.count_step_wait(device, seconds)
        self.stream_wait_s += seconds if streaming else 0.0

    def count_slot_waits(self, waits: Dict[int, float], streaming: bool) -> None:
        device_at = {slot: device for device, slot in self.slots.items()}
        for slot, seconds in waits.items():
            self.count_wait(device_at[slot], seconds, streaming)

    def count_shared_wait(self, seconds: float, devices: List[int], streaming: bool) -> None:
        """Work shared continuously runs out on every device of the step at once: each waited the same."""
        if seconds > 0 and devices:
            self.cluster.count_step_waits(devices, seconds / len(devices))
            self.stream_wait_s += seconds if streaming else 0.0

    def beside_training(self, now: float, training) -> None:
        """From now on ``training`` devices train (none: no step runs)."""
        self.training_now = training
        self.set_speeds(now)

    def set_speeds(self, now: float) -> None:
        """Each instance decodes at its own speed times its neighbours' effect: the decode-beside-training
        factor while a train step runs on other devices, the decode-beside-decoding one while another
        instance has sequences (running or waiting to join), the larger where both."""
        if self.instances is None:
            return
        training = self.training_now
        beside_training = self.costs.decode_slowdown_beside_training() if training else 1.0
        decoding = ([index for index, instance in self.instances.items() if instance.running or instance.waiting]
                    if self.beside_decoding != 1.0 else ())
        for index, instance in self.instances.items():
            factor = 1.0 if index in training else beside_training
            if len(decoding) > (index in decoding):  # another instance decodes
                factor = max(factor, self.beside_decoding)
            if instance.slow_down(now, factor):
                self.dirty.add(index)

    def step_communication(self, devices) -> float:
        """All-reduce among the home trainers, then each lent device's gradients to the primary, and the
        finish's own work."""
        lent = sum(1 for d in devices if self.cluster.devices[d].lent)
        return self.costs.allreduce(len(devices) - lent) + self.costs.gradient_return(lent) + self.costs.step_overhead()

    def _migrate(self, action: ev.Migrate, now: float) -> None:
        """The source's engine gives the groups' requests up; the target re-prefills and continues them."""
        source, target = self.instances[action.source], self.instances[action.device]
        warmup = self.warmup(action.device, "rollout")  # (a device whose first rollout work is moved requests)
        if warmup:
            target.warm_up(now, warmup)
        chunks = self.cluster.chunks
        # the groups the live runtime would hand over: oldest chunk first, the most requests left first
        groups = ev.groups_to_move({g: source.left[g] for g in source.groups_in_flight(now)
                                    if chunks[g[0]].version == action.version}, action.groups)
        target.admit_continued(now, source.take(now, groups))
        short = action.groups - len(groups)
        if short:  # groups that finished at this very instant and are not reported yet: they count as
            self.count_as_done_on(action, short)  # done on the target
        for device, instance in ((action.source, source), (action.device, target)):
            # groups that finished at this instant, other than those moved: reported now, whatever runs there;
            # and groups held back until an engine call returns, where that call has nothing left to run
            if instance.done or (self.held_back.get(device) and not instance.left):
                self.push(now, Tick(device, instance.epoch))
        self.dirty.update((action.source, action.device))

    def reported_when_idle(self, device: int, instance: Any, done: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
        """Groups that end on ``device`` while its engine call runs, held back until the call returns (its
        instance has nothing left), so a streamed step does not take them earlier than the runtime would:
          * the groups moved onto a device where moved requests do not join a running batch (the live
            runtime): one continuation, one engine call (``Worker.continue_groups``);
          * every chunk, where the engine returns a chunk whole (``whole_calls``: the live HF engine)."""
        held = self.held_back.setdefault(device, [])
        held += done
        if instance.left:
            return []
        del self.held_back[device]
        return held

    def count_as_done_on(self, action: ev.Migrate, short: int) -> None:
        """``short`` groups of the migration finished on the source before the bookkeeping heard of it:
          * at this instant (still in its instance's ``done``, or in the completions of the tick being
            reported): the target reports them done now, so every group is reported once;
          * earlier, held back until the source's engine call returns (``reported_when_idle``): they go over
            with the move, finished, and the target reports them with the rest of its continuation, as the
            live HF engine hands finished groups over and the target's ``ContinueGroups`` returns them."""
        chunks, source, now = self.cluster.chunks, self.instances[action.source], self.cluster.now
        finished = [g for g in source.done if chunks[g[0]].version == action.version][:short]
        for group in finished:
            source.done.remove(group)
        need = short - len(finished)
        held = self.held_back.get(action.source, [])
        moved = [g for g in held if chunks[g[0]].version == action.version][:need]
        for group in moved:
            held.remove(group)
        if moved:
            self.held_back.setdefault(action.device, []).extend(moved)
            need -= len(moved)
        reports = self.completed_groups(finished)
        device, pending = self.unreported
        for entry in pending if device == action.source else []:
            if need and entry[1] and chunks[entry[0]].version == action.version:
                take = min(entry[1], need)
                entry[1], need = entry[1] - take, need - take
                reports.append((entry[0], take))
        assert need == 0, "the bookkeeping moved groups the source does not hold"
        for chunk, n in reports:
            self.push(now, ev.ChunkDone(action.device, chunk, n))

    def _sync(self, action: ev.Sync, now: float) -> None:  # a background transfer: nobody waits for it
        self.push(now + self.costs.sync(action.devices), ev.SyncDone(self.cluster.syncing))

    def _on_transition(self, action: ev.Action, now: float) -> None:
        pass  # loads and switches start when the device enters SYNCING / SWITCHING (start_transitions)

    START = {ev.Generate: _generate, ev.Train: _train, ev.Join: _join, ev.Migrate: _migrate, ev.Sync: _sync,
             ev.Load: _on_transition, ev.Switch: _on_transition, ev.Rehome: _on_transition}

    def start_transitions(self, now: float) -> None:
        """Loads and switches start when a device enters SYNCING / SWITCHING (at once or after draining).

        Only devices whose state changed since the last call are looked at (new trace records)."""
        trace = self.cluster.trace
        if len(trace) == self.trace_seen:  # (no transition since: most events)
            return
        changed = {record["device"] for record in trace[self.trace_seen:]}
        self.trace_seen = len(trace)
        for index in sorted(changed):
            device = self.cluster.devices[index]
            key = (device.index, device.state)
            if device.state is DeviceState.SWITCHING and key not in self.scheduled:
                self.scheduled.add(key)
                seconds = self.costs.switch(device.index, device.role.value)
                seconds += max(0.0, self.hung_until.pop(device.index, now) - now)  # (an expired device still hangs)
                if device.index in self.cluster.rehoming and device.role is Role.TRAIN:
                    seconds += self.costs.adopt(device.index)  # a new replica: the primary's training state
                self.push(now + seconds, ev.SwitchDone(device.index, device.role))
            elif device.state is DeviceState.SYNCING and key not in self.scheduled:
                self.scheduled.add(key)
                seconds = self.costs.load(device.index)
                if self.instances is not None and self.cluster.inflight[device.index]:
                    self.instances[device.index].pause(now, seconds)  # interrupted mid-generation
                    self.dirty.add(device.index)
                self.push(now + seconds, ev.LoadDone(device.index, device.loading))
            for state in (DeviceState.SWITCHING, DeviceState.SYNCING):
                if device.state is not state:
                    self.scheduled.discard((device.index, state))

    def reschedule_ticks(self) -> None:
        for index in self.dirty:
            instance = self.instances[index]
            if self.ticked.get(index) == instance.epoch:
                continue  # its tick for this epoch is in the heap already
            when: Optional[float] = instance.next_finish()
            if when is not None:
                self.ticked[index] = instance.epoch
                self.push(when, Tick(index, instance.epoch))
        self.dirty.clear()
