"""The controller: worker replies in, scheduler events and worker commands out. It only drives.

::

    controller (rank 0)                                    device workers (ranks 1..N)
    ───────────────────                                    ───────────────────────────
    publish the Plan; wait for N Ready        <────────    build groups + both engines, post Ready
    decide(Started) -> actions -> commands    ────────>    run commands in order (a FIFO queue each)
    loop until the last version exists:
        wait for the next reply               <────────    GroupsGenerated | ChunkGenerated |
                                                           GradsComputed | StepDone |
                                                           WeightsStaged | WeightsLoaded | RoleSwitched
        GradsComputed -> that device pulls the step's next micro-batch; when none is left and none
                         is being computed, FinishStep to every device of the step
        (no reply before a borrowed device's lease runs out -> LeaseExpired)
        reply -> event (a train step or a weight publish is done when every member reported)
        cluster.complete(event); policy.decide(event, cluster) -> actions -> commands
    SaveCheckpoint to the primary; EvaluateSnapshots to device 0; Stop everyone; report

The controller *waits for* replies only; it is *unblocked by* a worker finishing a command. Every
scheduling decision comes from the policy (:mod:`bidirl.sched`) through the same Cluster bookkeeping
the simulator uses; the RL data (prompts, groups, advantages, micro-batches) comes from
:mod:`bidirl.runtime.batches`; what is logged and plotted from :mod:`bidirl.runtime.reporting`.

Interrupted generation: a load or a switch sent to a busy rollout device runs after its chunk in
flight (``launch.chunk_groups`` prompt groups), the safe point; that chunk keeps the version it
started with, and the staleness bound counts it so.

Lazy pull: a train step is a queue of micro-batches (:mod:`bidirl.runtime.batches`); each device of
the step is sent one, and the next when it reports it done, so a device that joins mid-step (``Join``,
e.g. a rollout device the staleness bound blocks) takes a share of what is left. Once the last
micro-batch is handed out the step accepts no more joiners (``Cluster.close_step``); once all are
computed every device of the step gets ``FinishStep``: one all-reduce over exactly those devices, then
the home trainers' optimizer step.

Chunks that join a batch in flight (``launch.inflight_groups`` above ``launch.chunk_groups``): the
bookkeeping may start a chunk on a device still generating, as the simulator's instances batch
continuously; its command goes to the device's queue as any other, and the worker's engine takes it
into its running batch between two decode steps (or runs it next, if the batch ended first). Each chunk
replies for itself when its last request ends; as no such chunk's seconds are its own, the engine's
batch is timed whole instead, with its last chunk (``time_shared``).

Groups as they end: an engine that can tell (vLLM's continuous batching) reports each group the
moment its last sample ends (``GroupsGenerated``), as the simulator's instances do, and the chunk's own
reply brings the rest; so a step streams from a chunk still generating, even one chunk a batch.

Streamed steps (``Cluster.stream_plan``): the step starts on the groups of its batch already done
while those it must contain still generate (at eta 0 the rest of version k, at eta >= 1 the due tail);
each chunk that finishes later is turned into micro-batches at once (``feed_stream``) and pulled by the
step's devices, which wait meanwhile; ``FinishStep`` comes only once every group is in and computed.

In-flight migration (``Migrate``): the bookkeeping moves the groups at once; the controller asks the
source on its *side* queue (``HandOverGroups``: its main thread is generating, its receiver thread is
free), the source's engine stops that many groups between two decode steps and posts their samples so
far (``GroupsHandedOver``), and the target continues them (``ContinueGroups``: the tokens and
behaviour log-probs so far unchanged, the new ones with the target's version) and reports them done
itself. One ``Migrate`` is one continuation (none if the source finished every group first), sent once
every ask it made is answered: where chunks join a batch in flight, a source's tail of one version can
span several chunks, which the bookkeeping counts as decoding together on the target, and so they do.
Asks carry ids, so an answer always meets its own ask. An ask for a chunk the source has not started
waits on the worker for it; one that arrives after the source finished those groups is
settled from the source's own ``ChunkGenerated``: the groups are reported done on the target at once,
as the bookkeeping expects. A target is idle when the groups move (``LIVE.migrates_into_batch`` is
False): a ``ContinueGroups`` would wait in a generating device's queue until its batch ended, not decode
beside it, so the bookkeeping moves requests only onto idle devices, one source's at a time -- in
practice a lent trainer, which is never a source itself.

Leases expire: a borrowed device that has not answered its micro-batch within the lease timeout leaves
the step (``LeaseExpired``); what it computed goes back to the queue and its late reply is discarded.
The controller then waits for replies with a timeout (``lease_wait``) instead of blocking. The reduce
after the last micro-batch is one collective, which no lease can cut short: one held up that long is
said, naming the members that never reached it (each member says when it enters: ``ReduceEntered``;
``say_if_the_reduce_waits``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections import Counter, deque
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError, Unrecoverable
from bidirl.prompts import PromptBuilder
from bidirl.rundir import RunDir
from bidirl.runtime import checkpoints
from bidirl.runtime import protocol as msg
from bidirl.runtime.batches import Batch, RolloutData, StreamedBatch, by_group
from bidirl.runtime.checkpoints import Checkpoint
from bidirl.runtime.placement import mapping_table
from bidirl.runtime.reporting import RunReport
from bidirl.sched import events as ev
from bidirl.sched.assembly import assemble
from bidirl.sched.estimates import NO_ESTIMATES, Estimates, MeasuredEstimates, lease_timeout_s
from bidirl.sched.replanning import NO_REPLANNING, LengthReplanner, Replanner, ResponseLengths
from bidirl.sched.roles import Role
from bidirl.sched.trace import median
from bidirl.ui import progress_bar, say


@dataclass
class Move:
    """One ``Migrate`` under way: its asks to the source not yet answered, and the samples handed over so
    far. The target continues them all in one ``ContinueGroups``, as the bookkeeping counts them: where
    chunks join a batch in flight, one source's tail of one version can span several chunks, and one
    command per chunk would run them one after the other."""

    target: int
    waiting: Set[int]  # asks
    samples: Dict[int, List[Any]] = field(default_factory=dict)  # chunk -> the samples handed over of it


BLOCKED_BY = {"sync": ("train", "pair"), "train": ("sync", "pair"), "pair": ("sync",)}  # (Controller.exclusive)


@dataclass
class StepInProgress:
    """The train step being computed: its micro-batches not yet handed out, the devices computing one,
    every device taking part (joiners included), and the gradient work done so far."""

    batch: Optional[Batch]  # None while a streamed step's batch is still generating
    snapshot: bool
    members: List[int]
    started: float
    left: deque = field(default_factory=deque)
    computing: Set[int] = field(default_factory=set)
    work_s: float = 0.0  # device-seconds of gradient work reported
    finishing: bool = False
    stream: Optional[StreamedBatch] = None  # a streamed step's batch, being built as its groups finish
    fed: int = 0  # parts of the batch turned into micro-batches so far
    current: Dict[int, Tuple[msg.ComputeGrads, float]] = field(default_factory=dict)  # device -> (item, sent at)
    computed: Dict[int, List[msg.ComputeGrads]] = field(default_factory=dict)  # device -> items it has computed
    waiting: Dict[int, float] = field(default_factory=dict)  # device -> since when it has had nothing to pull
    waited_s: float = 0.0  # device-seconds spent so (streamed steps: groups still generating)
    # device -> since when it has had nothing left to compute while the step goes on: another device's last
    # micro-batches, or a home trainer back from a lease (counted per home pool when that ends)
    idle_since: Dict[int, float] = field(default_factory=dict)
    # where a step's wall time goes besides gradient work: each micro-batch's round trip to its device
    # (sent -> GradsComputed, less its compute), and the finish (FinishStep sent -> last StepDone)
    round_trip_s: float = 0.0
    finish_sent: float = 0.0
    slow_finish_said: bool = False  # (a finish held up past its deadline, Controller.finish_deadline, is said once)
    in_reduce: Set[int] = field(default_factory=set)  # members that said they entered the reduce (ReduceEntered)


    def batch_step(self) -> int:
        return self.batch.step if self.batch is not None else self.stream.k


class Controller:
    def __init__(self, cfg: PipelineConfig, mailbox: Any, run: RunDir, devices: int, tokenizer: Any,
                 prior: Tuple[Optional[Estimates], str] = (None, "none"),
                 choose: Optional[Callable[[float], int]] = None, resume: Optional[Checkpoint] = None,
                 restart: int = 0, stop_restarts: Callable[[str], None] = lambda why: None):
        """``prior``: the cost estimates to start from and their source. ``choose``: mean response
        length -> rollout devices (the planner, from the layer above), for ``cluster.replan_every``.
        ``resume``: the sealed checkpoint this run continues from (``restart``: torchrun's restart count).
        ``stop_restarts``: called first thing on an :class:`Unrecoverable` error, before the workers stop."""
        self.stop_restarts = stop_restarts
        self.cfg, self.mailbox, self.devices = cfg, mailbox, devices
        # what the cost-aware policies decide with: the prior (a profile of these devices), then what this run measures
        self.prior, self.prior_source = prior
        self.measured = MeasuredEstimates(prior=self.prior or NO_ESTIMATES)
        # devices that have replied with a chunk: their first one holds what is left of the engine's warm-up
        # after the worker's own at start-up. (The cluster's
        # ``warmed`` is what the policy sees, applied with the events; this is when a reply is timed.)
        self.generated_on: set = set()
        # devices whose engine batch in progress, shared by several chunks, holds their first chunk (its
        # warm-up: ``time_shared``)
        self.first_batch: set = set()
        self.trained_lengths = ResponseLengths()  # what the re-planner reads
        self.replanner: Replanner = NO_REPLANNING
        if cfg.cluster.replan_every:
            if choose is None:
                raise BidirlError("cluster.replan_every needs the planner: start the runtime with `bidirl launch`")
            self.replanner = LengthReplanner(cfg.cluster.replan_every, self.trained_lengths.mean_since_last_asked,
                                             choose)
        # a resumed run starts where its checkpoint was: re-planning may have moved devices from the configured split
        try:
            resumed = checkpoints.partition(resume, cfg.launch.mode, devices) if resume is not None else None
            assembly = assemble(cfg.launch.mode, cfg.run_shape(), cfg.live_driver(), self.measured, self.replanner,
                                resumed=resumed)
        except ValueError as exc:  # (only a resumed partition can fail here: launch checked the configured one)
            raise BidirlError(f"{resume.path if resume else 'the run'}: {exc}") from None
        self.policy, self.cluster = assembly.policy, assembly.cluster
        self.on_checkpoints_partition = resumed is not None
        self.data = RolloutData(cfg, PromptBuilder.for_run(cfg.data, tokenizer))
        self.data.sampler  # reads the problems now, before the run's clock starts
        self.report = RunReport(cfg, run)
        self.checkpoints_due: Dict[int, Dict[str, Any]] = {}  # version -> controller state, trainer saving
        if resume is not None:
            self.resume_from(resume, restart)
        elif restart:  # a process died before the first checkpoint: the run starts over, and says so
            self.report.resumed = {"from_version": 0, "checkpoint": None, "discarded_groups": None, "restart": restart}
            run.log(0, event="resumed", **self.report.resumed)
        self.write_devices()
        self.mailbox.publish("plan", msg.Plan(self.cluster.primary, tuple(assembly.homes), str(run.path),
                                              migrates=self.cluster.allows_migration and self.policy.migrates
                                              and devices > 1,
                                              joins=self.cluster.joins_running_batch
                                              and devices > 1,  # (one device runs its commands in turn: local.py)
                                              resume_from=str(resume.path) if resume else "",
                                              resume_version=resume.version if resume else 0))
        # transfers not yet reported done by every member: a step's reduction ("train"), a weight broadcast
        # ("sync"), a joining trainer's state ("pair"); and sends held so the two communicator families
        # never run at once (exclusive)
        self.pending: Dict[str, Set[int]] = {"train": set(), "sync": set(), "pair": set()}
        self.deferred: Deque[Tuple[str, Callable[[], None]]] = deque()
        self.primary_done: Optional[msg.StepDone] = None
        self.step: Optional[StepInProgress] = None
        self.checksums: Dict[int, Tuple[float, float]] = {}  # home trainers' weights after the step in progress
        self.sync_started = 0.0
        self.shared_states: List[msg.TrainStateShared] = []
        self.slowest_item_s = 0.0  # the slowest micro-batch measured so far (the lease timeout follows it)
        self.slowest_finish_s = 0.0  # the slowest step finish so far: reduce, optimizer step, snapshot, checksum
        # in-flight migration: groups each device holds per chunk (as the bookkeeping counts them), asks
        # sent to a source not yet answered, chunks split so far
        self.held: Dict[int, Counter] = {d: Counter() for d in range(devices)}
        self.asked: Dict[int, Tuple[int, int, int, int]] = {}  # ask -> (source, chunk, target, groups)
        self.move_of: Dict[int, Move] = {}  # ask not yet answered -> the Migrate it is part of
        # the chunks of each continuation sent, per (target, the command's chunk), in the order sent (a
        # target is never the device of the chunks it continues: its own chunks' replies never meet these)
        self.continued: Dict[Tuple[int, int], Deque[Tuple[int, ...]]] = {}
        self.next_ask = 0
        self.split_chunks: Set[int] = set()
        # groups a device reported done of a chunk still generating there (GroupsGenerated), and the
        # seconds into that chunk they were reported at: the chunk's own reply times the rest
        self.reported: Counter = Counter()  # (device, chunk) -> groups
        self.reported_s: Dict[Tuple[int, int], float] = {}
        # chunks sent (GenerateChunk, ContinueGroups) whose own reply has not come yet: a device whose groups
        # were all reported as they ended is idle by the bookkeeping before it replies, and the run ends
        # only once that reply is in (the next thing awaited after the loop is a checkpoint's)
        self.chunks_open = 0

    # ---- main loop -------------------------------------------------------------------------------
    def run_all(self) -> Dict[str, Any]:
        """Runs training to the last version, evaluates, stops the workers; returns the summary.

        The caller owns the run directory (and finishes it); on failure workers are told to stop."""
        try:
            ready: List[msg.Ready] = sorted((self.mailbox.next_event() for _ in range(self.devices)),
                                            key=lambda r: r.device)
            say(mapping_table([r.placement for r in ready]))
            say(f"{self.devices} devices ready (start-up median {median(r.startup_s for r in ready):.1f} s, of "
                f"which the rollout engine's warm-up {median(r.warm_up_s for r in ready):.1f} s): "
                f"homes {[d.home.value for d in self.cluster.devices]}, policy {self.policy.label}, "
                f"eta={self.cluster.eta:g}")
            say(f"cost estimates start from: {self.prior_source}")
            self.report.start()
            self.dispatch(ev.Started())
            with progress_bar(f"GRPO ({self.policy.label})", self.cfg.train.steps, self.cfg.logging.progress) as bar:
                self.bar = bar
                bar(self.cluster.version)  # (a resumed run starts part way)
                while not self.cluster.finished or self.checkpoints_due or self.chunks_open:
                    reply = self.mailbox.next_event(timeout=self.lease_wait())
                    events = [] if reply is None else self.translate(reply)
                    if self.lease_wait() == 0.0:  # a deadline passed: checked even while replies kept coming (a
                        # large cluster's rollout devices may never leave the mailbox empty for long)
                        self.say_if_the_reduce_waits()
                        events.append(self.expire_overdue_lease())
                    for event in filter(None, events):
                        self.cluster.now = self.report.elapsed()
                        self.cluster.complete(event)
                        if isinstance(event, ev.ChunkDone) and self.step is not None and self.step.stream:
                            self.feed_stream()
                        if isinstance(event, ev.TrainDone):
                            self.checkpoint_if_due()  # before the policy sends the primary anything new
                        self.dispatch(event)
            # the run's RL work ended with its last event, where its trace, Gantt chart and device-time
            # breakdown end too (and a simulated run's makespan): the loop then waited only for the last
            # version's checkpoint to be saved and sealed, which is not RL time (0.3 s of a 20-step CPU run)
            rl_seconds = self.report.rl_seconds(at=self.cluster.now)
            checkpoint = self.ask(self.cluster.primary, msg.SaveCheckpoint(str(self.report.run.path / "checkpoint")),
                                  msg.CheckpointSaved)
            if checkpoint.error:  # the trained weights are not saved: never a run reported ok without them
                raise Unrecoverable(f"the final checkpoint: the primary trainer could not write {checkpoint.path} "
                                    f"({checkpoint.error}); free space or fix the run directory"
                                    + self.resumable_from())
            curve = self.evaluate()
            summary = {**self.report.summary(self.cluster, self.policy.label, rl_seconds, curve),
                       "checkpoint": checkpoint.path, "final_version": self.cluster.version,
                       "estimates": self.estimates_summary(), "replanning": self.replanning_summary()}
        except BaseException as failure:
            if isinstance(failure, Unrecoverable):  # marked before anything else can fail (a full disk) or kill us
                with contextlib.suppress(Exception):
                    self.stop_restarts(str(failure))
            with contextlib.suppress(Exception):  # (after Ctrl-C torchrun may have closed the store: the failure
                self.stop_workers()  # is the news, not that)
            raise
        self.stop_workers()
        return summary

    def dispatch(self, event: ev.Event) -> None:
        actions = self.policy.decide(event, self.cluster)
        for action in actions:
            self.EXECUTE[type(action)](self, action)
        self.cluster.settle()  # record why idle devices are idle, as the simulator does
        waiting = any(self.pending.values()) or self.deferred
        idle_everywhere = all(d.idle and not d.after_work for d in self.cluster.devices)
        if not actions and not waiting and idle_everywhere and not self.cluster.finished:
            raise BidirlError(f"policy '{self.policy.label}' stalled at version {self.cluster.version}: "
                              "every device is idle and it started nothing")

    def ask(self, device: int, command: msg.Command, expect: type) -> Any:
        """A command whose reply is awaited at once (outside the scheduling loop)."""
        self.mailbox.send(device, command)
        reply = self.mailbox.next_event()
        if not isinstance(reply, expect):
            raise BidirlError(f"device {reply.device} answered {type(reply).__name__} to {type(command).__name__}")
        return reply

    # ---- replies -> events -----------------------------------------------------------------------
    def translate(self, reply: msg.Reply) -> List[ev.Event]:
        """The events a reply means: usually one or none (a collective not yet complete); a chunk's
        result may also complete groups asked of it for another device."""
        handler = self.TRANSLATE.get(type(reply))
        if handler is None:
            raise BidirlError(f"device {reply.device} sent an unexpected {type(reply).__name__}")
        events = handler(self, reply)
        return events if isinstance(events, list) else [events] if events is not None else []

    def _chunk_generated(self, reply: msg.ChunkGenerated) -> List[ev.Event]:
        """A chunk, or the part of one this device holds, is over: the groups it had not reported yet."""
        key = (reply.device, reply.chunk)
        self.chunks_open -= 1
        first = reply.device not in self.generated_on  # (its engine ran, whichever groups it keeps)
        self.generated_on.add(reply.device)
        if reply.joined:
            self.report.joined_chunks.append({"t": round(self.report.elapsed(), 4), "device": reply.device,
                                              "chunk": reply.chunk, "seconds": round(reply.seconds, 4)})
        if key in self.continued:  # (groups moved here, of one chunk or several: each chunk's are done)
            return self.continuation_over(reply)
        events = self.finished(reply.device, reply.chunk, by_group(reply.samples), reply.seconds)
        groups = self.reported.pop(key, 0)  # (every group this device finished of the chunk and kept)
        rest = reply.seconds - self.reported_s.pop(key, reply.seconds)
        if rest > 0:  # (every group it kept was reported before the chunk ended: the time since is the chunk's too)
            self.data.collect(reply.chunk, [], rest)
        if reply.shared:  # (its seconds are not its own: the engine's batch is timed whole instead)
            self.time_shared(reply, first)
        elif groups and reply.chunk not in self.split_chunks:  # (a chunk split between devices times neither)
            self.measured.chunk(reply.seconds, groups, first)
        return events

    def time_shared(self, reply: msg.ChunkGenerated, first: bool) -> None:
        """Chunks that shared the engine's batch: none's seconds are its own, so the batch is timed whole --
        its seconds over the groups it finished and kept, as the worker reports them with its last chunk
        (``batch_s``, ``batch_groups``) -- and observed as a chunk's worth of groups at that rate; a batch
        that holds the device's first chunk as that chunk would be (the warm-up). Without it, a run whose
        chunks join one batch would never time generation, and a policy that lends by cost estimates,
        started without a profile, would never lend. (Groups handed over mid-way count none of the time
        spent on them: moves come early, and the batch reads a little dear for it.)"""
        if first:
            self.first_batch.add(reply.device)
        if not reply.batch_s:
            return  # (the batch runs on)
        if reply.batch_groups:  # (none, if every group of it was handed over)
            chunk = self.cluster.chunk_groups
            self.measured.chunk(reply.batch_s / reply.batch_groups * chunk, chunk, reply.device in self.first_batch)
        self.first_batch.discard(reply.device)

    def _groups_generated(self, reply: msg.GroupsGenerated) -> List[ev.Event]:
        """Groups of a chunk still generating finished (an engine that reports each group as it ends): done
        now, as the simulator's instances report them, so that a streamed step takes them at once."""
        return self.finished(reply.device, reply.chunk, by_group(reply.samples), reply.seconds)

    def continuation_over(self, reply: msg.ChunkGenerated) -> List[ev.Event]:
        """A continuation (``ContinueGroups``) is over: the groups of each chunk it continued are done on this
        device, each chunk with its share of the seconds (by samples)."""
        key = (reply.device, reply.chunk)
        chunks = self.continued[key].popleft()
        if not self.continued[key]:
            del self.continued[key]
        parts, events = self.by_chunk(chunks, reply.samples), []
        for chunk in chunks:
            events += self.finished(reply.device, chunk, by_group(parts[chunk]),
                                    reply.seconds * len(parts[chunk]) / len(reply.samples))
            self.reported.pop((reply.device, chunk), None)  # (what finished counted: this part is over)
            self.reported_s.pop((reply.device, chunk), None)
        return events

    def by_chunk(self, chunks: Sequence[int], samples: Sequence[Any]) -> Dict[int, List[Any]]:
        """``samples`` by the chunk of ``chunks`` whose groups hold theirs (``extra["group"]``)."""
        parts: Dict[int, List[Any]] = {chunk: [] for chunk in chunks}
        for sample in samples:
            group = sample.extra["group"]
            chunk = next(c for c in chunks if 0 <= group - self.cluster.chunks[c].first < self.cluster.chunks[c].groups)
            parts[chunk].append(sample)
        return parts

    def finished(self, device: int, chunk: int, samples: Dict[int, List[Any]], seconds: float) -> List[ev.Event]:
        """Groups ``device`` finished of ``chunk`` (``samples`` by prompt), ``seconds`` into it. Those beyond
        what it holds by the bookkeeping were moved to a target (``Migrate``) before the device saw the ask:
        they are the target's, done there at once, and that ask waits for that many fewer. The newest ask
        first: the engine answers asks oldest first, each with what it still has, so a shortfall falls on
        the newest; what the controller expects is then exactly what it hands over. The others are done
        here."""
        events = []
        for ask in reversed([a for a, (source, c, _, _) in self.asked.items() if (source, c) == (device, chunk)]):
            excess = len(samples) - self.held[device][chunk]
            if excess <= 0:
                break
            _, _, target, groups = self.asked[ask]
            moved = sorted(samples)[-min(excess, groups):]
            if len(moved) == groups:
                del self.asked[ask]
                self.answered(ask, chunk, [])  # (the engine's answer to it will be empty)
            else:
                self.asked[ask] = (device, chunk, target, groups - len(moved))
            events.append(self.groups_done(target, chunk, [s for i in moved for s in samples.pop(i)], 0.0))
        if samples:  # (none: every group it held went elsewhere, which the bookkeeping knows)
            key = (device, chunk)
            so_far = self.reported_s.get(key, 0.0)  # (the device-seconds of a chunk are counted once)
            self.reported_s[key] = max(so_far, seconds)
            self.reported[key] += len(samples)
            kept = [s for i in sorted(samples) for s in samples[i]]
            events.insert(0, self.groups_done(device, chunk, kept, max(0.0, seconds - so_far)))
        return events

    def groups_done(self, device: int, chunk: int, samples: List[Any], seconds: float) -> ev.ChunkDone:
        held = self.held[device]
        groups = self.data.collect(chunk, samples, seconds) if samples else 0
        assert groups <= held[chunk], f"device {device} returned {groups} groups of chunk {chunk}, holds {held[chunk]}"
        held[chunk] -= groups  # (a device may continue two parts of one chunk, one reply each)
        if not held[chunk]:
            del held[chunk]
        return ev.ChunkDone(device, chunk, groups)

    def _groups_handed_over(self, reply: msg.GroupsHandedOver) -> Optional[ev.Event]:
        """A source stopped groups mid-generation (answering one ask): the target continues them."""
        if reply.ask not in self.asked:  # (settled from the groups it reported done before it saw the ask)
            assert not reply.samples, f"device {reply.device} answered ask {reply.ask}, settled, with groups"
            return None
        _, chunk, target, groups = self.asked.pop(reply.ask)
        assert len(by_group(reply.samples)) == groups, f"asked device {reply.device} for {groups} groups"
        self.answered(reply.ask, chunk, reply.samples)
        self.report.handovers.append({"t": round(self.report.elapsed(), 4), "source": reply.device, "device": target,
                                      "chunk": chunk, "groups": groups,
                                      "unfinished": sum(1 for s in reply.samples
                                                        if s.budget_left(self.data.params.max_new_tokens)),
                                      "tokens_so_far": sum(len(s.completion_ids) for s in reply.samples)})
        return None

    def answered(self, ask: int, chunk: int, samples: List[Any]) -> None:
        """An ask of a ``Move`` is answered (by the source, or settled from groups it reported done): once
        all of them are, the target continues what was handed over. Groups handed over wait meanwhile for
        the move's other asks: about a decode step where the source's chunks share its batch, but an ask for
        a chunk still queued behind another command waits for that chunk to start."""
        move = self.move_of.pop(ask)
        move.waiting.discard(ask)
        if samples:
            move.samples.setdefault(chunk, []).extend(samples)
        if not move.waiting and move.samples:
            self.continue_on(move.target, move.samples)

    def continue_on(self, target: int, parts: Dict[int, List[Any]]) -> None:
        """One command for the target, however many chunks the samples come from (its reply is split)."""
        chunks = tuple(sorted(parts))
        self.continued.setdefault((target, chunks[0]), deque()).append(chunks)
        samples = tuple(s for chunk in chunks for s in parts[chunk])
        self.mailbox.send(target, msg.ContinueGroups(chunks[0], samples, self.data.params))
        self.chunks_open += 1

    def _role_switched(self, reply: msg.RoleSwitched) -> ev.Event:
        if reply.home is Role.TRAIN:
            self.collective_done("pair", reply.device)  # it has the primary's training state
        self.report.switches.append(reply)
        self.measured.switch(reply.switch_s)
        return ev.SwitchDone(reply.device, reply.role)

    def _weights_loaded(self, reply: msg.WeightsLoaded) -> ev.Event:
        self.report.loads.append(reply)
        return ev.LoadDone(reply.device, reply.version)

    def _weights_staged(self, reply: msg.WeightsStaged) -> Optional[ev.Event]:
        self.report.staged.append(reply)
        if not self.collective_done("sync", reply.device):
            return None
        self.report.sync_seconds.append(time.perf_counter() - self.sync_started)
        return ev.SyncDone(self.cluster.syncing)

    def _grads_computed(self, reply: msg.GradsComputed) -> None:
        step = self.step
        if step is None or reply.device not in step.current or step.batch_step() != reply.step:
            self.report.discarded_grads.append({"device": reply.device, "batch": reply.step})
            return None  # a late reply of an expired lease: those gradients were discarded
        item, sent = step.current.pop(reply.device)
        step.computed.setdefault(reply.device, []).append(item)
        step.computing.discard(reply.device)
        step.work_s += reply.compute_s
        step.round_trip_s += max(0.0, time.perf_counter() - sent - reply.compute_s)
        self.slowest_item_s = max(self.slowest_item_s, reply.compute_s)
        self.pull(reply.device)
        return None  # the step is done when every device has finished it (StepDone)

    # ---- leases that expire mid-step -------------------------------------------------------------
    def lease_timeout_s(self) -> float:
        return lease_timeout_s(self.cfg.launch.lease_timeout_s, self.slowest_item_s)

    def lease_wait(self) -> Optional[float]:
        """Seconds until the first borrowed device computing a micro-batch overruns its lease, or the step's
        finish passes its deadline (:meth:`finish_deadline`); None: neither can happen."""
        step = self.step
        lent = [sent for device, (_, sent) in step.current.items() if self.cluster.devices[device].lent] if step else []
        deadlines = [sent + self.lease_timeout_s() for sent in lent]
        finish = self.finish_deadline(step) if step is not None else None
        if finish is not None:
            deadlines.append(finish)
        return max(0.0, min(deadlines) - time.perf_counter()) if deadlines else None

    def finish_deadline(self, step: "StepInProgress") -> Optional[float]:
        """When the step's finish counts as held up, if it is sent, has a collective (two members or more)
        and no wait of it was said yet: after the lease timeout, or ten times the slowest finish so far (a
        finish is the reduce, then the optimizer step, a snapshot on evaluation steps, the checksum)."""
        if not step.finish_sent or len(step.members) < 2 or step.slow_finish_said:
            return None
        return step.finish_sent + max(self.lease_timeout_s(), 10 * self.slowest_finish_s)

    def say_if_the_reduce_waits(self) -> None:
        """A lease covers a borrowed device's micro-batches, not the reduce after its last one: there every
        member takes part in one collective, which no device can leave half way. A member that stalls there
        (a lent device frozen after its last micro-batch, say) holds the step until it answers or the
        communicators time out. So the wait is said, once, naming whom it waits for; a device that answers
        late still counts (the step waited for it)."""
        step, now = self.step, time.perf_counter()
        deadline = self.finish_deadline(step) if step is not None else None
        if deadline is None or now < deadline:
            return
        step.slow_finish_said = True
        waiting = sorted(self.pending["train"])
        outside = [d for d in waiting if d not in step.in_reduce]  # (never said it entered: the stalled ones)
        self.report.slow_reduces.append({"t": round(self.report.elapsed(), 3), "batch": step.batch_step(),
                                         "waiting_for": waiting, "not_in_reduce": outside})
        if outside:  # (a member that never got to the reduce holds every other member in it)
            held = [d for d in waiting if d in step.in_reduce]
            where = (f"device(s) {self.named(outside)} had not said it reached the reduce"
                     + (f", which holds device(s) {self.named(held)} in it" if held else ""))
        else:  # (every member got there: the collective itself is slow, or a member's optimizer step after it)
            where = f"device(s) {self.named(waiting)} are in the reduce or the optimizer step after it, and slow there"
        say(f"batch {step.batch_step()}: its finish (gradient reduce, then the optimizer step) has waited "
            f"{now - step.finish_sent:.1f} s: {where}. It waits until they answer; a device stalled there fails "
            f"the attempt after launch.collective_timeout_s={self.cfg.launch.collective_timeout_s:g} s")

    def expire_overdue_lease(self) -> Optional[ev.Event]:
        """A borrowed device overran its micro-batch: it leaves the step, and everything it computed for
        it goes back to the queue (FinishStep will not include it, so its gradients count for nothing)."""
        step, now = self.step, time.perf_counter()
        overdue = [d for d, (_, sent) in step.current.items()
                   if self.cluster.devices[d].lent and now - sent >= self.lease_timeout_s()]
        if not overdue:
            return None
        device = min(overdue, key=lambda d: step.current[d][1])
        item, _ = step.current.pop(device)
        step.left.extendleft(reversed([*step.computed.pop(device, []), item]))
        step.computing.discard(device)
        step.waiting.pop(device, None)
        step.members.remove(device)
        say(f"device {device}'s lease expired in batch {step.batch_step()} (no answer in {self.lease_timeout_s():.1f} s): "
            "its gradients are discarded and its micro-batches recomputed")
        for member in sorted(set(step.members) - step.computing):
            self.pull(member)
        return ev.LeaseExpired(device)

    def member_role(self, device: int) -> str:
        if self.cluster.devices[device].lent:
            return "lent"
        return "the primary trainer" if device == self.cluster.primary else "home trainer"

    def named(self, devices: List[int]) -> str:
        return ", ".join(f"{d} ({self.member_role(d)})" for d in devices)

    def _step_done(self, reply: msg.StepDone) -> Optional[ev.Event]:
        if reply.device == self.cluster.primary:
            self.primary_done = reply
        if reply.checksum is not None:
            self.checksums[reply.device] = reply.checksum
        if not self.collective_done("train", reply.device):
            return None
        self.check_replicas_agree()
        primary, step = self.primary_done, self.step
        self.measured.step(step.work_s, primary.reduce_s,
                           lent=sum(1 for d in step.members if self.cluster.devices[d].home is Role.ROLLOUT))
        self.report.stream_wait_s += step.waited_s
        finish_s = time.perf_counter() - step.finish_sent
        self.slowest_finish_s = max(self.slowest_finish_s, finish_s)
        stats = {**step.batch.stats, "train_devices": len(step.members), "train_work_s": round(step.work_s, 4),
                 "round_trip_s": round(step.round_trip_s, 4), "finish_s": round(finish_s, 4)}
        self.bar(**self.report.step_done(primary, stats, time.perf_counter() - step.started))
        self.step = None
        return ev.TrainDone(primary.version)

    def _reduce_entered(self, reply: msg.ReduceEntered) -> None:
        if self.step is not None and self.step.batch_step() == reply.step:
            self.step.in_reduce.add(reply.device)
        return None

    def _train_state_shared(self, reply: msg.TrainStateShared) -> None:
        self.shared_states.append(reply)  # the new trainer's RoleSwitched is the event
        self.collective_done("pair", -1 - reply.to)
        return None

    def _checkpoint_saved(self, reply: msg.CheckpointSaved) -> None:
        """The primary wrote a periodic checkpoint's weights and optimizer: seal it (checksums, fsync,
        rename) with the controller's state at that version, and drop the oldest beyond the last K."""
        state = self.checkpoints_due.pop(reply.version)
        if reply.error:
            raise Unrecoverable(f"checkpoint {checkpoints.name_of(reply.version)}: the primary trainer could not write "
                              f"{reply.path} ({reply.error}); free space or fix the run directory, then resume "
                              f"with --resume {self.report.run.path}")
        try:
            sealed = checkpoints.seal(Path(reply.path), state, self.cfg.train.keep_checkpoints)
        except BidirlError as exc:  # the controller's own write failed (a full disk): a restart meets it again
            raise Unrecoverable(str(exc)) from None
        self.report.checkpoints.append({"version": reply.version, "t": round(self.report.rl_seconds(), 3),
                                        "path": str(sealed), "seconds": round(reply.seconds, 3)})
        return None

    TRANSLATE = {msg.ChunkGenerated: _chunk_generated, msg.GroupsGenerated: _groups_generated,
                 msg.GroupsHandedOver: _groups_handed_over,
                 msg.RoleSwitched: _role_switched,
                 msg.WeightsLoaded: _weights_loaded, msg.WeightsStaged: _weights_staged, msg.StepDone: _step_done,
                 msg.GradsComputed: _grads_computed, msg.ReduceEntered: _reduce_entered,
                 msg.TrainStateShared: _train_state_shared, msg.CheckpointSaved: _checkpoint_saved}

    # ---- checkpoints and resume --------------------------------------------------------------------
    def checkpoint_if_due(self) -> None:
        """Every ``train.checkpoint_every`` versions and at the last one (so a finished run can be
        extended: ``--resume`` with more ``train.steps``): the primary saves its state first, before any
        later command can change it (its queue is FIFO)."""
        version, every = self.cluster.version, self.cfg.train.checkpoint_every
        if not every or (version % every and version < self.cfg.train.steps):
            return
        self.checkpoints_due[version] = self.checkpoint_state()
        self.mailbox.send(self.cluster.primary,
                          msg.SaveCheckpoint(str(checkpoints.partial_path(self.report.run.path, version))))

    def resumable_from(self) -> str:
        """The end of an error line about the final checkpoint: what a resume would start from."""
        if not self.report.checkpoints:
            return "; no checkpoint was sealed during the run (train.checkpoint_every), so its weights are lost"
        last = self.report.checkpoints[-1]
        return (f"; checkpoint {Path(last['path']).name} keeps version {last['version']}: --resume "
                f"{self.report.run.path} continues from it")

    def checkpoint_state(self) -> Dict[str, Any]:
        """The controller's half of a checkpoint at the version just made. Groups admitted but not yet
        trained are not kept: a resume regenerates them with the checkpoint's weights (the stated rule;
        their count is logged as ``discarded_groups``). The data cursor (``prompts``) keeps how far the
        seeded prompt stream was drawn and the positions of those groups' problems, drawn again first on
        resume: at eta >= 1 the groups trained are not the first ``version * B`` drawn, and resuming the
        stream at ``version * B`` trained some problems twice and skipped others."""
        cluster = self.cluster
        return {"version": cluster.version, "seed": self.cfg.seed, "groups_per_step": cluster.B,
                "prompts": self.data.cursor(), "untrained_groups": cluster.admitted - cluster.trained_groups,
                "next_group": cluster.next_group,
                "staleness": {str(k): v for k, v in cluster.staleness.items()},
                "homes": [d.home.value for d in cluster.devices], "primary": cluster.primary,
                "leaving": sorted(cluster.leaving),  # (re-planning's moves still pending: made on resume)
                "policy": self.policy.label, "report": self.report.checkpoint_state(cluster.version)}

    def resume_from(self, resume: Checkpoint, restart: int) -> None:
        state = resume.state
        # (at the last version: the run died after training -- a restart, or --resume of a run that did not
        # finish -- and it only has its final checkpoint and its evaluation left to do)
        checkpoints.check_compatible(resume, self.cfg, finishing=True)
        self.cluster.resume_at(resume.version, state["staleness"], state.get("next_group"))
        if "prompts" in state:
            try:
                self.data.resume(state["prompts"])
            except (ValueError, KeyError, TypeError) as exc:  # (a manifest re-sealed over an edited controller.json)
                raise BidirlError(f"{resume.path}: its data cursor ('prompts') cannot be resumed ({exc})") from None
        else:  # (a checkpoint written before the cursor kept positions: the stream resumes at version * B)
            self.data.sampler.skip(state["drawn_groups"])
        homes = [d.home.value for d in self.cluster.devices]
        moved = list(state.get("leaving", ())) if self.on_checkpoints_partition else []
        self.report.resume(state, {"from_version": resume.version, "checkpoint": str(resume.path),
                                   "discarded_groups": state["untrained_groups"], "restart": restart,
                                   "homes": homes, "primary": self.cluster.primary, "moved_on_resume": moved})
        say(f"resuming from {resume.path} (version {resume.version}; {state['untrained_groups']} groups generated "
            f"but not trained there are generated again), homes {homes}, primary trainer {self.cluster.primary}"
            + (f" (device(s) {moved} moved to the train pool, as re-planning was draining them to)" if moved else ""))

    def check_replicas_agree(self) -> None:
        """Every home trainer stepped the same update on the same state: their weights agree (a device
        that joined the train pool with a wrong optimizer state would drift from the primary)."""
        primary = self.checksums[self.cluster.primary]
        for device, checksum in self.checksums.items():
            if any(abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(checksum, primary)):
                raise BidirlError(f"optimizer replicas diverged at version {self.cluster.version + 1}: device {device}'s "
                                  f"weights {checksum} differ from the primary's {primary}")
        self.report.replica_checks += 1
        self.checksums = {}

    def collective_done(self, kind: str, device: int) -> bool:
        """A train step or a weight publish is done when every member has reported."""
        self.pending[kind].discard(device)
        if self.pending[kind]:
            return False
        self.flush_deferred()
        return True

    def exclusive(self, kind: str, send: Callable[[], None]) -> None:
        """Sends ``send`` now, or once the other communicator family is done everywhere: a weight broadcast
        ("sync": the receiver threads' communicator) never runs while a main-thread transfer ("train",
        "pair") does, on any device (:mod:`bidirl.runtime.groups`). First come, first sent. A step's
        reduction also waits for a joining trainer's state, so no version is made while a publish waits:
        the version a deferred publish names is still the primary's."""
        self.deferred.append((kind, send))
        self.flush_deferred()

    def flush_deferred(self) -> None:
        while self.deferred:
            kind, send = self.deferred[0]
            if any(self.pending[k] for k in BLOCKED_BY[kind]):
                return
            self.deferred.popleft()
            send()

    # ---- actions -> commands ---------------------------------------------------------------------
    def _generate(self, action: ev.Generate) -> None:
        chunk = self.cluster.start_chunk(action)
        self.held[action.device][chunk.index] += chunk.groups
        self.mailbox.send(action.device, self.data.request(chunk))
        self.chunks_open += 1

    def _train(self, action: ev.Train) -> None:
        k = self.cluster.version  # the cluster composed the batch: B groups, oldest version first
        parts = self.cluster.batch_chunks(k)  # (streamed: the groups done so far)
        step = StepInProgress(None, self.report.wants_snapshot(k + 1), list(action.devices), time.perf_counter(),
                              fed=len(parts))
        if self.cluster.streaming:
            step.stream = self.data.stream(k)
            step.left.extend(step.stream.add(parts))
        else:
            step.batch = self.data.batch(k, parts, len(action.devices))
            step.left.extend(step.batch.items)
            self.trained_lengths.trained(step.batch.stats["tokens"], step.batch.stats["samples"])
        self.step = step
        for device in action.devices:
            self.pull(device)

    def feed_stream(self) -> None:
        """Groups that finished into the streamed step become micro-batches; the step's devices that were
        waiting for work pull them. The last group closes the batch (its normaliser is known now)."""
        step = self.step
        parts = self.cluster.batch_chunks(self.cluster.version, step.fed)
        step.fed += len(parts)
        step.left.extend(step.stream.add(parts))
        now = time.perf_counter()
        for device, since in step.waiting.items():
            step.waited_s += now - since
            self.cluster.count_step_wait(device, now - since)
        step.waiting.clear()
        if not self.cluster.streaming:
            step.batch, step.stream = step.stream.close(), None
            self.trained_lengths.trained(step.batch.stats["tokens"], step.batch.stats["samples"])
        for device in sorted(set(step.members) - step.computing):
            self.pull(device)
        if not step.left:
            self.cluster.close_step()  # (kept open by the bookkeeping until the last group is in)

    def pull(self, device: int) -> None:
        """``device`` is free for the step: it gets the next micro-batch, or, once every micro-batch is
        computed (and, streamed, every group is in), the step finishes on all its devices. A device of a
        streamed step with nothing to pull waits for the next group to finish (``feed_stream``)."""
        step = self.step
        if step.left:
            self.stop_waiting(step, device)
            item = step.left.popleft()
            self.mailbox.send(device, item)
            step.current[device] = (item, time.perf_counter())
            step.computing.add(device)
            if not step.left:
                self.cluster.close_step()  # nothing left to share: a device joining now would only wait
        elif not step.computing and not step.finishing and step.stream is None and not self.cluster.trainers_away:
            self.cluster.close_step()  # (a home trainer away on a lease joins first: it steps its replica too)
            for waiter in list(step.idle_since):
                self.stop_waiting(step, waiter)
            step.finishing = True
            self.exclusive("train", lambda: self.finish(step))
        elif step.stream is not None and device not in step.computing:
            step.waiting.setdefault(device, time.perf_counter())  # until the next group of the batch finishes
        elif device not in step.computing and not step.finishing:
            step.idle_since.setdefault(device, time.perf_counter())  # until the step's work is over

    def stop_waiting(self, step: StepInProgress, device: int) -> None:
        """``device`` has work again, or the step it waited on is over: its wait is counted (a streamed
        step's device waiting for groups gets work back this way from a lease that expired)."""
        now = time.perf_counter()
        since = step.idle_since.pop(device, None)
        if since is not None:
            self.cluster.count_step_wait(device, now - since)
        since = step.waiting.pop(device, None)
        if since is not None:
            step.waited_s += now - since
            self.cluster.count_step_wait(device, now - since)

    def finish(self, step: "StepInProgress") -> None:
        """Every device of the step sums its gradients (lent devices give theirs to the primary)."""
        members, primary, batch = tuple(sorted(step.members)), self.cluster.primary, step.batch
        lent = tuple(d for d in members if self.cluster.devices[d].home is Role.ROLLOUT)
        self.report.record_batch(batch, members, lent, step.computed)
        self.data.trained(batch)
        self.pending["train"] = set(members)
        step.finish_sent = time.perf_counter()
        for member in members:
            mine = member == primary
            self.mailbox.send(member, msg.FinishStep(step=batch.step, members=members, lent=lent,
                                                     grad_scale=batch.grad_scale, snapshot=step.snapshot and mine,
                                                     probe=batch.probe if mine else ()))

    def _sync(self, action: ev.Sync) -> None:  # the primary publishes; receiver threads stage it in the background
        version = self.cluster.version
        self.exclusive("sync", lambda: self.publish(version, set(action.devices)))

    def publish(self, version: int, loading: Set[int]) -> None:
        """Every device joins the broadcast (one communicator); those that will load the version keep it."""
        self.sync_started = time.perf_counter()
        members = tuple(range(self.devices))
        self.pending["sync"] = set(members)
        self.mailbox.send(self.cluster.primary, msg.PublishWeights(version, members))
        for device in members:
            if device != self.cluster.primary:
                self.mailbox.send_weights(device, msg.ReceiveWeights(version, members, keep=device in loading))

    def _load(self, action: ev.Load) -> None:
        self.mailbox.send(action.device, msg.LoadWeights(self.cluster.devices[action.device].loading))

    def _switch(self, action: ev.Switch) -> None:
        self.mailbox.send(action.device, msg.SwitchRole(action.role))

    def _join(self, action: ev.Join) -> None:  # the bookkeeping checked there is work left to share
        self.step.members.append(action.device)
        self.pull(action.device)

    def _migrate(self, action: ev.Migrate) -> None:
        """Ask the source (on its side queue: its main thread is generating) to stop ``action.groups`` groups
        of that version and hand them over; the target continues them (``_groups_handed_over``), or, if the
        source finished them first, they are done on the target from the source's ``ChunkGenerated``."""
        assert action.source != self.cluster.primary, "the primary has no side queue (it never hands groups over)"
        move = Move(action.device, set())
        held = {chunk: n for chunk, n in self.held[action.source].items()
                if self.cluster.chunks[chunk].version == action.version}
        split = ev.per_chunk(held, action.groups)
        assert sum(n for _, n in split) == action.groups, \
            f"device {action.source} holds fewer than {action.groups} groups of v{action.version}"
        for chunk, groups in split:
            # (live, only a device's own chunk moves: a target is a lent trainer, which is never a source)
            assert self.cluster.chunks[chunk].device == action.source, \
                f"device {action.source} would hand over groups of chunk {chunk}, which it continues for another"
            self.held[action.source][chunk] -= groups
            self.held[action.device][chunk] += groups
            self.split_chunks.add(chunk)
            self.asked[self.next_ask] = (action.source, chunk, action.device, groups)
            self.move_of[self.next_ask] = move
            move.waiting.add(self.next_ask)
            self.mailbox.send_weights(action.source, msg.HandOverGroups(chunk, groups, self.next_ask))
            self.next_ask += 1

    def write_devices(self) -> None:
        """Who is where, for whoever reads the run while it runs (:mod:`bidirl.runtime.elastic` names a dead
        rank's role from it): written at the start, and again whenever re-planning moves a device."""
        (self.report.run.path / "devices.json").write_text(json.dumps(
            [{"device": d.index, "rank": d.index + 1, "home": d.home.value, "primary": d.index == self.cluster.primary}
             for d in self.cluster.devices]))

    def _rehome(self, action: ev.Rehome) -> None:
        # at a step boundary (the bookkeeping asserts it) and before any next step is sent: the primary
        # shares the state of the current version, which the bookkeeping gives the new trainer
        self.write_devices()  # (the bookkeeping has moved it)
        if action.home is not Role.TRAIN:
            self.mailbox.send(action.device, msg.ChangeHome(action.home))
            return

        def share() -> None:  # over the primary's pair with the device (main threads)
            self.pending["pair"] |= {action.device, -1 - action.device}
            self.mailbox.send(self.cluster.primary, msg.ShareTrainState(action.device))
            self.mailbox.send(action.device, msg.ChangeHome(action.home))

        self.exclusive("pair", share)

    EXECUTE = {ev.Generate: _generate, ev.Train: _train, ev.Join: _join, ev.Migrate: _migrate, ev.Sync: _sync,
               ev.Load: _load, ev.Switch: _switch, ev.Rehome: _rehome}

    # ---- after training --------------------------------------------------------------------------
    def evaluate(self) -> List[Dict[str, Any]]:
        if self.cfg.logging.eval_every <= 0:
            return []
        say(f"evaluating {len(self.report.snapshots)} weight snapshots on device 0")
        reply = self.ask(0, msg.EvaluateSnapshots(tuple(self.report.snapshots)), msg.Evaluated)
        return self.report.curve(reply.results, reply.problems)

    def estimates_summary(self) -> Dict[str, Any]:
        """The cost estimates the policy started from and those it ended with (what the run measured)."""
        def rounded(e):
            return {k: round(v, 4) for k, v in dataclasses.asdict(e).items()}

        return {"prior_source": self.prior_source, "prior": rounded(self.prior) if self.prior else None,
                "final": rounded(self.measured.current()), "measured": sorted(self.measured.measured_names())}

    def replanning_summary(self) -> Dict[str, Any]:
        history = getattr(self.replanner, "history", [])
        return {"every": self.cfg.cluster.replan_every,
                "asked": [{"version": v, "mean_response_tokens": m, "rollout_devices": r} for v, m, r in history],
                "rehomes": [{"t": round(t, 4), "device": d, "home": h} for t, d, h in self.cluster.rehomes],
                "train_state_bytes": [s.bytes for s in self.shared_states]}

    def stop_workers(self) -> None:
        for device in range(self.devices):
            if self.devices > 1 and device != self.cluster.primary:
                self.mailbox.send_weights(device, msg.Stop())
            self.mailbox.send(device, msg.Stop())
