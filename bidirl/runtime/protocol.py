"""The runtime's typed messages: one dataclass per command (controller -> worker) and per reply.

Roles travel as the scheduler's :class:`~bidirl.sched.roles.Role` enum, samples as
:class:`~bidirl.samples.Sample`, so nothing is turned back from strings on either side.

Adding a command is one dataclass here, whose ``handler`` names the worker method that runs it, and
that method on :class:`~bidirl.runtime.worker.Worker`, returning a reply dataclass (a test checks
every command has its handler). The worker stamps each reply with its device and the seconds the
command took.

::

    controller                                      worker main thread        weight receiver thread
    Plan (published once) ───────────────────────►  reads it at start-up
    GenerateChunk  ──►  GroupsGenerated ...         generate, reward; each group as it ends (vLLM), then
                   ──►  ChunkGenerated              the groups not reported yet
    ComputeGrads   ──►  GradsComputed               one micro-batch's gradients, added to the step's (a step's
                                                    devices pull its micro-batches one at a time, so
                                                    one that joins mid-step takes a share of the rest)
    FinishStep     ──►  StepDone                    all-reduce, (home trainers) optimizer step
    PublishWeights ──►  WeightsStaged (primary's sender thread, once its broadcast is done)
    ReceiveWeights ─────────────────────────────────────────────────────────► join the broadcast
                                                                               ──► WeightsStaged
    LoadWeights    ──►  WeightsLoaded               apply a staged version
    SwitchRole     ──►  RoleSwitched                serve the other role
    ChangeHome     ──►  RoleSwitched                join the other pool for good (re-planning); into
                                                    the train pool it receives the primary's state
    ShareTrainState ──► TrainStateShared            (primary) send that state to the new trainer
    EvaluateSnapshots ──► Evaluated                 held-out accuracy of weight snapshots
    SaveCheckpoint ──►  CheckpointSaved
    Stop           ──►  Stopped
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from bidirl.samples import Sample, SamplingParams
from bidirl.sched.roles import Role


@dataclass(frozen=True)
class Plan:
    """Published by the controller before anything else: who is where."""

    primary: int  # the primary trainer: the only optimizer, the source of versions
    homes: Tuple[Role, ...]  # home pool per device
    run_path: str
    # may the policy move requests in flight (Migrate)? Then rollout devices generate interruptibly
    migrates: bool = False
    # may a chunk join a rollout device's batch in flight (launch.inflight_groups)? Then a generating
    # device takes the chunk commands that come meanwhile into its running batch
    joins: bool = False
    # a resumed run: the sealed checkpoint every device loads before it is Ready, and its version
    resume_from: str = ""
    resume_version: int = 0


# ---- commands (controller -> worker) ----------------------------------------------------------


class Command:
    handler: ClassVar[str]  # the Worker method that runs it


@dataclass(frozen=True)
class GenerateChunk(Command):
    handler = "generate"
    chunk: int
    first_group: int  # sequence number of the chunk's first prompt group
    prompts: Tuple[str, ...]
    answers: Tuple[str, ...]  # reference answers, for the reward
    params: SamplingParams


@dataclass(frozen=True)
class HandOverGroups(Command):
    """In-flight migration, to the source's *side* queue (its main thread is busy generating): stop
    ``groups`` prompt groups of ``chunk`` at the next decode step and hand them over
    (``GroupsHandedOver``). Ignored if the chunk is no longer generating: the controller then takes the
    groups out of the chunk's own ``ChunkGenerated``."""

    handler = "hand_over"
    chunk: int
    groups: int
    ask: int  # the controller's id for this ask, returned with the answer


@dataclass(frozen=True)
class ContinueGroups(Command):
    """In-flight migration, to the target: continue these samples (tokens so far kept, finished ones
    returned as they are) in one batch, reward them, and answer ``ChunkGenerated`` for ``chunk``. One
    ``Migrate`` is one command, though its groups may come from several chunks of the source (chunks that
    joined one batch there): ``chunk`` is the first, and the controller splits the answer by group."""

    handler = "continue_groups"
    chunk: int
    samples: Tuple[Sample, ...]  # whole groups; each sample's extra carries its group and reference answer
    params: SamplingParams


@dataclass(frozen=True)
class ComputeGrads(Command):
    """One micro-batch of a step's work, pulled by a device of the step (lazy pull): its gradients are
    added to those the device holds for the step."""

    handler = "compute_grads"
    step: int  # the batch (= the version it is trained from)
    samples: Tuple[Sample, ...]  # one micro-batch of the batch's informative samples
    # of the whole batch: every part scales its gradients by them, so they add up (1 and 1 in a streamed
    # step, whose totals are not known yet: unnormalised sums, scaled by FinishStep.grad_scale)
    total_tokens: int
    total_sequences: int


@dataclass(frozen=True)
class FinishStep(Command):
    """Every item of the step is computed: sum the gradients over the step's devices; home trainers step
    their optimizer replicas, lent devices drop theirs."""

    handler = "finish_step"
    step: int
    members: Tuple[int, ...]  # every device of the step, joiners included
    lent: Tuple[int, ...] = ()  # those of them lent by the rollout pool: they give gradients, step nothing
    snapshot: bool = False  # save a weight snapshot after the step (primary only)
    probe: Tuple[Sample, ...] = ()  # a few samples for the log-prob check, before the update (primary only)
    grad_scale: float = 1.0  # a streamed step's normaliser (1 / its tokens or sequences), known once all are in


@dataclass(frozen=True)
class PublishWeights(Command):
    handler = "publish"
    version: int
    members: Tuple[int, ...]


@dataclass(frozen=True)
class ReceiveWeights(Command):
    """For the weight receiver thread's own queue: join the broadcast of ``version``."""

    handler = "receive"
    version: int
    members: Tuple[int, ...]
    keep: bool = True  # stage it for a load; False: join the broadcast only (a trainer replica steps itself)


@dataclass(frozen=True)
class LoadWeights(Command):
    handler = "load"
    version: int


@dataclass(frozen=True)
class SwitchRole(Command):
    handler = "switch"
    role: Role


@dataclass(frozen=True)
class ChangeHome(Command):
    """Re-partitioning: serve ``home`` from now on, as a member of that pool. Into the train pool the
    device receives the primary's whole training state (weights, optimizer, schedule, version), so it
    steps an identical optimizer replica from the next step on."""

    handler = "change_home"
    home: Role


@dataclass(frozen=True)
class ShareTrainState(Command):
    """Primary: send the training state to ``device``, which is joining the train pool (``ChangeHome``)."""

    handler = "share_train_state"
    device: int


@dataclass(frozen=True)
class EvaluateSnapshots(Command):
    handler = "evaluate"
    snapshots: Tuple[Tuple[int, str], ...]  # (version, path)


@dataclass(frozen=True)
class SaveCheckpoint(Command):
    handler = "checkpoint"
    path: str


@dataclass(frozen=True)
class Stop(Command):
    handler = "stop"


COMMANDS: Tuple[type, ...] = (GenerateChunk, HandOverGroups, ContinueGroups, ComputeGrads, FinishStep, PublishWeights,
                              ReceiveWeights, LoadWeights, SwitchRole, ChangeHome, ShareTrainState, EvaluateSnapshots,
                              SaveCheckpoint, Stop)

# ---- replies (worker -> controller) ------------------------------------------------------------


@dataclass(kw_only=True)
class Reply:
    device: int = -1  # stamped by the worker
    seconds: float = 0.0  # how long the command took on the worker


@dataclass
class Ready(Reply):
    startup_s: float
    groups_s: float
    placement: str = ""  # where the worker runs: host, rank, accelerator (the start-up mapping table)
    warm_up_s: float = 0.0  # the rollout engine's first call, made at start-up (part of ``startup_s``)


@dataclass
class ChunkGenerated(Reply):
    """``chunk`` is over on this device: the samples of the groups it has not reported yet (none, if an
    engine reported every group as it finished: ``GroupsGenerated``)."""

    chunk: int
    samples: List[Sample]  # rewarded, in prompt order
    version: int
    joined: bool = False  # it joined the engine's batch while another chunk generated there (Plan.joins)
    shared: bool = False  # it shared decode steps with another chunk: its seconds are not its own cost
    # the last chunk of an engine batch that chunks shared: the batch's seconds, from its start to this
    # chunk's end, and the groups it finished and kept (not those handed over): the batch is timed whole
    batch_s: float = 0.0
    batch_groups: int = 0


@dataclass
class GroupsGenerated(Reply):
    """Groups of ``chunk`` whose last sample just finished, while the rest of the chunk still generates
    (an engine that can tell: vLLM); ``seconds`` is the time since the chunk started here. The simulator's
    instances report each group as it finishes too, so a step streams from the groups already done (for
    an engine that returns a chunk whole, HF, they hold them back as it does: ``reports_groups``)."""

    chunk: int
    samples: List[Sample]  # rewarded, whole groups


@dataclass
class GroupsHandedOver(Reply):
    """Groups of ``chunk`` stopped mid-generation on this device (``HandOverGroups``), their samples so far."""

    chunk: int
    samples: List[Sample]
    ask: int  # the HandOverGroups it answers


@dataclass
class GradsComputed(Reply):
    step: int
    compute_s: float  # gradient work of the micro-batch (device-seconds)


@dataclass
class ReduceEntered(Reply):
    """A member of a step with a collective has computed its last micro-batch and enters the reduce: posted
    just before it, so a finish held up past its deadline can name the members that never got there (one
    stalled before the reduce holds every other member in it)."""

    step: int


@dataclass
class StepDone(Reply):
    version: Optional[int]  # the new version on a home trainer; None on a lent device (gradients only)
    reduce_s: float
    stats: Dict[str, float] = field(default_factory=dict)
    # home trainers: (sum, sum of squares) of the weights after the step, in float64; optimizer
    # replicas that stepped identically agree, which the controller checks
    checksum: Optional[Tuple[float, float]] = None


@dataclass
class WeightsStaged(Reply):
    version: int
    transfer_s: float


@dataclass
class WeightsLoaded(Reply):
    version: int
    copy_s: float  # into the training model
    load_s: float  # into the rollout engine (0 if not serving rollout)


@dataclass
class RoleSwitched(Reply):
    role: Role
    load_s: float  # weights loaded into the rollout engine on the way in
    join_s: float  # looking up the pre-built gradient group on the way into training
    switch_s: float
    version: int
    adopt_s: float = 0.0  # receiving the primary's training state (ChangeHome into the train pool)
    home: Optional[Role] = None  # the new home pool (ChangeHome)


@dataclass
class TrainStateShared(Reply):
    to: int
    bytes: int
    version: int


@dataclass
class Evaluated(Reply):
    results: List[Tuple[int, float]]  # (version, held-out accuracy)
    problems: int  # held-out problems each snapshot was scored on


@dataclass
class CheckpointSaved(Reply):
    path: str
    version: int
    error: str = ""  # why the trainer's files could not be written (disk full, unwritable folder)


@dataclass
class Stopped(Reply):
    pass


REPLIES: Tuple[type, ...] = (Ready, ChunkGenerated, GroupsGenerated, GroupsHandedOver, GradsComputed, ReduceEntered,
                             StepDone, WeightsStaged, WeightsLoaded, RoleSwitched, TrainStateShared, Evaluated,
                             CheckpointSaved, Stopped)

Message = Any  # a Plan, a Command or a Reply
