"""A hot device worker: rollout engine and training engine both resident, role changed in place.

The worker is a loop over its command queue (see :mod:`bidirl.runtime.mailbox`)::

    loop:  wait for my next command             <- unblocked by the controller's send
           run it: the command's ``handler`` method (:mod:`bidirl.runtime.protocol`)
           post the reply (timings, samples, stats)

Its role and state are a :class:`~bidirl.sched.roles.Device`, the scheduler's own state machine: a
command moves it IDLE -> GENERATING / TRAINING / SYNCING / SWITCHING / EVALUATING -> IDLE, so an
illegal order (generating while serving train, say) fails here exactly as it would in the
scheduler's bookkeeping.

Continuous batching (``Plan.joins``: ``launch.inflight_groups`` above a chunk): while the engine
generates, it polls the worker between decode steps, and a chunk command already at the head of the
queue joins the running batch instead of waiting for it to end (``generate``).

Gradients. The devices of a train step pull its micro-batches one at a time (``ComputeGrads``: each
scaled by the whole batch's token count, so the parts add up, and added to the device's ``.grad``), so
a device that joins mid-step takes a share of the rest; then (``FinishStep``) they all-reduce over the
pre-built group of exactly those devices. A streamed step's micro-batches (sent while its batch is still
generating, before its token count is known) are unnormalised sums, and ``FinishStep`` carries the
normaliser (``grad_scale``), applied once, before the all-reduce and the clip. Every
*home* trainer then applies the same optimizer step to its replica (data parallelism: they stay
identical); a lent rollout device only contributed gradients and keeps no optimizer state, so the
train pool stays the one source of versions. A device that joins the train pool for good (re-planning,
``ChangeHome``) first receives the primary's whole training state over their pair group, so it is an
identical replica from its first step; every home trainer reports a checksum of its weights after
each step, which the controller compares.

Weights, in two phases so that trainers never wait for a rollout device's safe point:
  * ``publish`` (primary, main thread): snapshot the parameters and hand them to a sender thread that
    broadcasts them over a dedicated weights group; the main thread goes straight on training.
  * every other member's *receiver thread* takes part in that broadcast into a staging buffer, whatever
    the main thread is doing (generating, say), and reports ``staged``.
  * ``load`` (main thread, at the next safe point = between commands): copy the staged weights into
    the training model and, if serving rollout, into the rollout engine in place.
A device serving training reloads its rollout engine only when it switches back, and only if the
version changed. Switching never touches the disk, restarts nothing and creates no process group.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from bidirl.config import PipelineConfig
from bidirl.engines.build import build_rollout_engine, build_train_engine
from bidirl.engines.protocols import Generation, HandOver
from bidirl.reward import numeric_reward
from bidirl.runtime import protocol as msg
from bidirl.runtime.groups import MAIN_FAMILY, PAIR, WEIGHTS_FAMILY, Groups
from bidirl.samples import Sample, SamplingParams
from bidirl.sched.roles import Device, DeviceState, Role

S = DeviceState


SUMMED = ("loss", "kl")  # statistics that are parts of a batch-wide sum; the others are per-sample means


class Worker:
    def __init__(self, cfg: PipelineConfig, mailbox: Any, device: int, devices: int, model_path: str,
                 store: Any = None, rollout: Any = None, receiver_mailbox: Any = None, placement: str = ""):
        import torch

        self.torch, self.device, self.cfg = torch, device, cfg
        self.mailbox = mailbox
        plan: msg.Plan = self.mailbox.read("plan")
        self.primary, self.run_path = plan.primary, Path(plan.run_path)
        self.state = Device(device, plan.homes[device])  # role and state, by the scheduler's rules
        start = time.perf_counter()
        self.devices = devices
        self.train_homes = [d for d, home in enumerate(plan.homes) if home is Role.TRAIN]
        self.groups = Groups(store, device, devices, self.primary, self.train_homes, cfg.cluster.device_type,
                             cfg.launch.collective_timeout_s, MAIN_FAMILY)  # the main thread's own
        groups_s = time.perf_counter() - start
        # distinct sampling per device, and after a resume not the same draws as at the run's start
        own_seed = dataclasses.replace(cfg, seed=cfg.seed + 1000 * device + 1_000_003 * plan.resume_version)
        self.rollout = rollout or build_rollout_engine(own_seed, model_path)
        self.train = build_train_engine(cfg, model_path, private_group=store is not None)
        if plan.resume_from:  # every device holds the checkpoint's weights (and a trainer's whole state)
            self.train.load(plan.resume_from)
            self.load_rollout()
        self.params = self.train.parameters()
        warm_up_s = self.warm_up_rollout()
        self.staged: Dict[int, Any] = {}  # version -> flat weights received in the background
        self.staged_ready = threading.Condition()
        self.step_stats: Dict[int, Dict[str, Any]] = {}  # the step in progress -> this device's statistics so far
        self.stalled = False  # (fault injection: stall_if_told)
        # in-flight migration: the chunks generating interruptibly now, each with its hand-over window (the
        # side thread asks, the engine answers between decode steps)
        self.migrates = plan.migrates
        self.handover_lock = threading.Lock()
        self.handovers: Dict[int, HandOver] = {}  # chunk generating here -> its hand-over window
        self.started_chunk = -1  # the last chunk started here
        self.early_asks: Dict[int, List[msg.HandOverGroups]] = {}  # chunk not started yet -> asks for it
        self.joins = plan.joins  # chunks join the engine's batch in flight (continuous batching)
        if device == self.primary and not plan.resume_from:
            self.save_snapshot(0)  # the starting point of the learning curve
        self.side_mailbox = receiver_mailbox  # own store connection for the sender/receiver thread
        self.receiver: Any = None
        self.to_send: "queue.Queue[Tuple[Any, msg.Command]]" = queue.Queue()  # the primary's publishes, then Stop
        if devices > 1:  # the primary's sender thread, every other device's receiver thread
            loop = self.send_weights if device == self.primary else self.receive_weights
            self.receiver = threading.Thread(target=loop, args=(receiver_mailbox,), daemon=True)
            self.receiver.start()
        self.mailbox.post(msg.Ready(device=device, startup_s=time.perf_counter() - start, groups_s=groups_s,
                                    placement=placement or f"device {device}: {cfg.cluster.device_type}",
                                    warm_up_s=warm_up_s))

    def warm_up_rollout(self) -> float:
        """An engine's first call is slow (kernels chosen, buffers allocated: 1.4-2 s for the CPU default's
        vLLM, against 0.5 s for a warm 32-group chunk). Made here, at start-up, as a GPU engine's warm-up is
        (CUDA graphs at vLLM's start), so that no chunk of the run pays it: whichever device generates
        first, and a trainer lent to rollout for the first time mid-run. One short greedy request: measured
        on the cpu-long model, a cold 32-group chunk took 2.13 s and the same chunk after it 0.67 s (0.55 s
        once warm); greedy draws nothing from the engine's seeded sampler, so the run samples exactly what it
        would have without it (the same tokens, checked). Returns its seconds."""
        start = time.perf_counter()
        self.rollout.generate(["1 + 1 ="], SamplingParams(n=1, max_new_tokens=4, temperature=0.0))
        return time.perf_counter() - start

    def run(self) -> None:
        while self.serve_one(self.mailbox.next_command(self.device)):
            pass

    def serve_one(self, command: msg.Command) -> bool:
        """Runs one command and posts its reply; False after ``Stop``."""
        start = time.perf_counter()
        reply: Optional[msg.Reply] = getattr(self, command.handler)(command)
        if reply is not None:  # publish answers from its sender thread instead
            reply.device, reply.seconds = self.device, time.perf_counter() - start
            self.mailbox.post(reply)
        return not isinstance(command, msg.Stop)

    @contextmanager
    def doing(self, state: DeviceState, reason: str) -> Iterator[None]:
        """IDLE -> ``state`` for the command's duration -> IDLE, through the legal-transition table."""
        self.state.transition(state, time.perf_counter(), reason)
        yield
        self.state.transition(S.IDLE, time.perf_counter(), f"{reason} done")

    # ---- commands (one method per protocol command) -------------------------------------------
    def generate(self, command: msg.GenerateChunk) -> None:
        """The chunk, and -- where chunks may join a batch in flight (``Plan.joins``) -- every chunk command
        that comes while it generates, taken from the queue into the engine's running batch (a command of
        another kind at the head of the queue waits, and so do the chunks behind it). Each chunk's reply is
        posted when its last request ends (its ``over``), not when the engine stops."""
        first = [command]
        # the engine's batch, for chunks that share it (``ChunkGenerated.batch_s``): when it started, its
        # chunks still running, and the groups it has finished and kept
        batch: Dict[str, Any] = {"started": time.perf_counter(), "running": set(), "groups": 0}

        def joins() -> Optional[Generation]:  # (polled by the engine between decode steps)
            if first:
                return self.generation(first.pop(), batch)
            joining = self.mailbox.peek_command(self.device) if self.joins else None
            if not isinstance(joining, msg.GenerateChunk):  # (anything else waits for the engine to stop)
                return None
            self.mailbox.next_command(self.device)
            return self.generation(joining, batch)

        try:
            with self.doing(S.GENERATING, f"chunk {command.chunk}"):
                self.rollout.serve(joins)
        finally:
            with self.handover_lock:
                self.handovers.clear()
        return None

    def generation(self, command: msg.GenerateChunk, batch: Dict[str, Any]) -> Generation:
        """A chunk command as the engine runs it: its groups labelled and rewarded, each reported as it ends
        (``GroupsGenerated``) or is handed over (``GroupsHandedOver``), the rest in its ``ChunkGenerated``;
        ``batch``: the engine batch it joins (``generate``), timed whole by the last chunk to end in it."""
        def label(samples: List[Sample]) -> List[Sample]:
            drawn: Counter = Counter()
            for sample in samples:
                sample.extra["group"] = command.first_group + sample.prompt_index
                sample.extra["answer"] = command.answers[sample.prompt_index]
                # which of its group's n samples it is, for good: a short answer is often drawn twice, so only
                # this tells a sample trained twice from two alike (replay.check_record). The engines give a
                # group's samples together and in draw order; one moved mid-generation keeps its number
                sample.extra.setdefault("draw", drawn[sample.prompt_index])
                drawn[sample.prompt_index] += 1
            return samples

        def hand_over(ask: int, groups: List[int], samples: List[Sample]) -> None:  # (from inside the engine)
            self.mailbox.post(msg.GroupsHandedOver(device=self.device, chunk=command.chunk, samples=label(samples),
                                                   ask=ask))

        started = time.perf_counter()
        batch["running"].add(command.chunk)

        def group_done(samples: List[Sample]) -> None:  # (from inside the engine: a group's last sample ended)
            batch["groups"] += len({s.prompt_index for s in samples})
            self.mailbox.post(msg.GroupsGenerated(device=self.device, seconds=time.perf_counter() - started,
                                                  chunk=command.chunk, samples=self.rewarded(label(samples))))

        def over(samples: List[Sample]) -> None:  # (from inside the engine: its last request ended)
            with self.handover_lock:
                self.handovers.pop(command.chunk, None)
            now = time.perf_counter()
            batch["running"].discard(command.chunk)
            batch["groups"] += len({s.prompt_index for s in samples})
            # the last chunk of a batch that chunks shared times the batch whole (the engine stops after it)
            last_shared = generation.shared and not batch["running"]
            self.mailbox.post(msg.ChunkGenerated(device=self.device, seconds=now - started,
                                                 chunk=command.chunk, samples=self.rewarded(label(samples)),
                                                 version=self.rollout.version, joined=generation.joined,
                                                 shared=generation.shared,
                                                 batch_s=now - batch["started"] if last_shared else 0.0,
                                                 batch_groups=batch["groups"] if last_shared else 0))

        handover = HandOver(hand_over) if self.migrates else None
        with self.handover_lock:
            self.started_chunk = command.chunk
            if handover is not None:
                self.handovers[command.chunk] = handover
                for ask in self.early_asks.pop(command.chunk, []):
                    handover.ask(ask.groups, ask.ask)
            # (a device's chunks come in order: asks for earlier ones were for chunks already over)
            self.early_asks = {c: asks for c, asks in self.early_asks.items() if c > command.chunk}
        generation = Generation(command.prompts, command.params, over, handover, group_done)
        return generation

    def rewarded(self, samples: List[Sample]) -> List[Sample]:
        for sample in samples:
            sample.reward = numeric_reward(sample.text, sample.extra["answer"], self.cfg.algorithm.format_reward)
        return samples

    def hand_over(self, command: msg.HandOverGroups) -> None:
        """Side thread: ask the engine generating ``command.chunk`` for some of its groups (it answers
        between decode steps); an ask for a chunk still queued waits for it to start. A chunk no longer
        generating ignores it (see ``HandOverGroups``)."""
        with self.handover_lock:
            if command.chunk in self.handovers:
                self.handovers[command.chunk].ask(command.groups, command.ask)
            elif command.chunk > self.started_chunk:
                self.early_asks.setdefault(command.chunk, []).append(command)  # (its chunk has not started yet)
        return None

    def continue_groups(self, command: msg.ContinueGroups) -> msg.ChunkGenerated:
        """Groups moved here mid-generation: continued with the weights this device holds."""
        with self.doing(S.GENERATING, f"chunk {command.chunk}: {len(command.samples)} samples moved here"):
            samples = self.rollout.continue_samples(command.samples, command.params)
        return msg.ChunkGenerated(chunk=command.chunk, samples=self.rewarded(samples), version=self.rollout.version)

    def compute_grads(self, command: msg.ComputeGrads) -> msg.GradsComputed:
        """One pulled micro-batch: its gradients are added to the step's (the model's ``.grad``)."""
        self.stall_if_told("grads")
        with self.doing(S.TRAINING, f"batch {command.step}: {len(command.samples)} samples"):
            step = self.step_stats.setdefault(command.step, {"samples": 0, "sums": {}})
            start = time.perf_counter()
            stats = self.train.compute_grads(command.samples, command.total_tokens, command.total_sequences)
            compute_s = time.perf_counter() - start
            n = len(command.samples)
            step["samples"] += n
            for key, value in stats.items():  # loss and kl are parts of the batch's sum; the rest means
                step["sums"][key] = step["sums"].get(key, 0.0) + (value if key in SUMMED else value * n)
        return msg.GradsComputed(step=command.step, compute_s=compute_s)

    def finish_step(self, command: msg.FinishStep) -> msg.StepDone:
        """The step's gradients summed over its devices; home trainers step, lent devices drop theirs."""
        self.stall_if_told("finish")
        with self.doing(S.TRAINING, f"batch {command.step}: reduce"):
            torch = self.torch
            step = self.step_stats.pop(command.step, {"samples": 0, "sums": {}})
            stats = {key: value * command.grad_scale if key in SUMMED else value / max(1, step["samples"])
                     for key, value in step["sums"].items()}
            stats.update(self.logprob_gap(command.probe))  # the weights are still those trained from
            grads = flat_gradients(torch, self.params)
            if command.grad_scale != 1.0:  # a streamed step: unnormalised sums until its batch was complete
                grads.mul_(command.grad_scale)
            if len(command.members) > 1:  # (so a reduce held up by a member that never got here names it)
                self.mailbox.post(msg.ReduceEntered(device=self.device, step=command.step))
            reduce_start = time.perf_counter()
            self.groups.reduce_step(grads, command.members, command.lent)
            reduce_s = time.perf_counter() - reduce_start
            if self.state.home is not Role.TRAIN:  # a lent rollout device: gradients given, no optimizer to step
                self.train.zero_grads()
                return msg.StepDone(version=None, reduce_s=reduce_s)
            set_gradients(self.params, grads)
            stats.update(self.train.apply_grads())
            self.state.version = self.train.version
            if command.snapshot:
                self.save_snapshot(self.train.version)
        return msg.StepDone(version=self.train.version, reduce_s=reduce_s, stats=stats,
                            checksum=weights_checksum(self.torch, self.params))

    def publish(self, command: msg.PublishWeights) -> None:
        """Primary: a snapshot of the weights to the sender thread, which broadcasts it; return at once."""
        self.to_send.put((self.torch.nn.utils.parameters_to_vector(self.params).detach().clone(), command))
        return None

    def weight_groups(self, mailbox: Any) -> Groups:
        """The weights communicator, built and first used by the thread that uses it (its own store)."""
        return Groups(mailbox.store, self.device, self.devices, self.primary, self.train_homes,
                      self.cfg.cluster.device_type, self.cfg.launch.collective_timeout_s, WEIGHTS_FAMILY)

    def send_weights(self, mailbox: Any) -> None:
        """The primary's sender thread: one broadcast per published version, in order."""
        groups = self.weight_groups(mailbox)
        while True:
            flat, command = self.to_send.get()
            if isinstance(command, msg.Stop):
                return
            start = time.perf_counter()
            self.die_if_told("BIDIRL_FAULT_KILL_IN_PUBLISH", command.version)  # (before sending)
            groups.broadcast_weights(flat, self.devices)
            mailbox.post(msg.WeightsStaged(device=self.device, version=command.version,
                                           transfer_s=time.perf_counter() - start))

    def receive(self, command: msg.ReceiveWeights, groups: Groups) -> Optional[msg.WeightsStaged]:
        """Receiver thread: joins one weight broadcast (every device joins every one: one communicator)
        into a staging buffer, whatever the main thread does; kept only if this device will load it."""
        flat = self.torch.empty(sum(p.numel() for p in self.params), dtype=self.params[0].dtype,
                                device=self.params[0].device)
        start = time.perf_counter()
        groups.broadcast_weights(flat, self.devices)
        self.die_if_told("BIDIRL_FAULT_KILL_IN_PUBLISH", command.version)  # (received, not yet staged)
        if command.keep:
            with self.staged_ready:
                self.staged[command.version] = flat
                self.staged_ready.notify_all()
        return msg.WeightsStaged(device=self.device, version=command.version, transfer_s=time.perf_counter() - start)

    def receive_weights(self, mailbox: Any) -> None:
        """The receiver thread's loop over its own queue."""
        groups = self.weight_groups(mailbox)
        while True:
            command = mailbox.next_weights_command(self.device)
            if isinstance(command, msg.Stop):
                return
            reply = self.receive(command, groups) if isinstance(command, msg.ReceiveWeights) \
                else self.hand_over(command)  # (no reply)
            if reply is not None:
                mailbox.post(reply)

    def load(self, command: msg.LoadWeights) -> msg.WeightsLoaded:
        """Apply a staged version (the safe point is now: between commands)."""
        version = command.version
        with self.staged_ready:
            self.staged_ready.wait_for(lambda: version in self.staged, timeout=self.cfg.launch.collective_timeout_s)
            flat = self.staged.pop(version)
            for old in [v for v in self.staged if v < version]:
                del self.staged[old]
        with self.doing(S.SYNCING, f"load v{version}"):
            start = time.perf_counter()
            with self.torch.no_grad():
                self.torch.nn.utils.vector_to_parameters(flat, self.params)
            self.train.version = self.state.version = version
            rollout_s = self.load_rollout() if self.state.role is Role.ROLLOUT else 0.0
        return msg.WeightsLoaded(version=version, copy_s=time.perf_counter() - start - rollout_s, load_s=rollout_s)

    def switch(self, command: msg.SwitchRole, adopt: bool = False) -> msg.RoleSwitched:
        start = time.perf_counter()
        if command.role is self.state.role:
            raise RuntimeError(f"device {self.device} asked to switch to {command.role.value}, which it serves")
        if self.state.role is Role.TRAIN:  # leaving training: nothing computed for a step survives (an expired
            self.train.zero_grads()  # lease's gradients, say: the step finished without them)
            self.step_stats.clear()
        with self.doing(S.SWITCHING, f"to {command.role.value}"):  # entering SWITCHING flips the role
            load_s = self.load_rollout() if self.state.role is Role.ROLLOUT else 0.0
            join_start = time.perf_counter()
            if self.state.role is Role.TRAIN and self.device != self.primary:
                self.groups.get(PAIR, (self.primary, self.device))  # pre-built at start: joining is a lookup
            join_s = time.perf_counter() - join_start
            adopt_start = time.perf_counter()
            if adopt:  # a new optimizer replica: the primary's state, received over the pair's group
                state, _ = self.groups.broadcast_object(None, self.device, self.primary)
                self.train.adopt_training_state(state)
                self.state.version = self.train.version
            adopt_s = time.perf_counter() - adopt_start if adopt else 0.0
        return msg.RoleSwitched(role=self.state.role, load_s=load_s, join_s=join_s, adopt_s=adopt_s,
                                switch_s=time.perf_counter() - start, version=self.train.version)

    def change_home(self, command: msg.ChangeHome) -> msg.RoleSwitched:
        """Re-partitioning: this device belongs to the ``home`` pool from now on (its role follows)."""
        if self.device == self.primary:
            raise RuntimeError("the primary trainer owns the optimizer and the versions: it never changes pool")
        self.state.home = command.home
        reply = self.switch(msg.SwitchRole(command.home), adopt=command.home is Role.TRAIN)
        reply.home = command.home
        return reply

    def share_train_state(self, command: msg.ShareTrainState) -> msg.TrainStateShared:
        """Primary: the whole training state to a device joining the train pool (it waits in ``change_home``)."""
        _, size = self.groups.broadcast_object(self.train.training_state(), command.device, self.primary)
        return msg.TrainStateShared(to=command.device, bytes=size, version=self.train.version)

    def evaluate(self, command: msg.EvaluateSnapshots) -> msg.Evaluated:
        from bidirl.runtime.evaluation import evaluate_snapshots

        self.die_if_told("BIDIRL_FAULT_KILL_IN_EVALUATION", self.cfg.train.steps)  # (after the last step)
        with self.doing(S.EVALUATING, f"{len(command.snapshots)} snapshots"):
            results, problems = evaluate_snapshots(self.cfg, self.rollout, self.train, command.snapshots)
        return msg.Evaluated(results=results, problems=problems)

    def checkpoint(self, command: msg.SaveCheckpoint) -> msg.CheckpointSaved:
        from safetensors import SafetensorError

        try:
            self.fill_disk_if_told(self.train.version)
            self.train.save(command.path)  # HF weights + optimizer + version, written atomically
        except (OSError, SafetensorError, RuntimeError) as exc:  # disk full, folder not writable: the
            # controller says so in one line (safetensors' writer and torch.save's raise their own types)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[0]
            return msg.CheckpointSaved(path=command.path, version=self.train.version, error=reason)
        return msg.CheckpointSaved(path=command.path, version=self.train.version)

    def stop(self, command: msg.Stop) -> msg.Stopped:
        if self.receiver is not None:  # it got its own Stop (the primary's sender: here); a thread blocked in
            if self.device == self.primary:  # C++ at exit aborts
                self.to_send.put((None, msg.Stop()))
            self.receiver.join(timeout=self.cfg.launch.collective_timeout_s)
        return msg.Stopped()

    def stall_if_told(self, where: str = "grads") -> None:
        """Fault injection for tests (``BIDIRL_FAULT_STALL=device:seconds[:finish]``): this device, lent
        to a train step, is frozen by SIGSTOP in its first micro-batch (or, with ``:finish``, as its first
        reduce starts, after its last micro-batch) -- the whole process, every thread -- and a detached
        timer sends SIGCONT ``seconds`` later."""
        fault = os.environ.get("BIDIRL_FAULT_STALL", "")
        if fault and not self.stalled and self.state.lent:
            device, seconds, *rest = fault.split(":")
            position = rest[0] if rest else "grads"
            if rest[1:] or position not in ("grads", "finish"):
                raise ValueError(f"BIDIRL_FAULT_STALL={fault}: stall in 'grads' (the default) or 'finish'")
            if int(device) == self.device and position == where:
                import signal
                import subprocess

                self.stalled = True
                subprocess.Popen(["sh", "-c", f"sleep {float(seconds)}; kill -CONT {os.getpid()}"],
                                 start_new_session=True)
                os.kill(os.getpid(), signal.SIGSTOP)

    def die_if_told(self, variable: str, version: int) -> None:
        """Fault injection for tests (``BIDIRL_FAULT_KILL_IN_PUBLISH=device:version``): this device's
        process is killed by SIGKILL in the middle of publishing ``version`` -- the primary before it sends,
        a receiver after the transfer and before staging -- in the first attempt only (torchrun's restart
        then resumes the run). ``BIDIRL_FAULT_KILL_IN_EVALUATION=device:steps``: as the final evaluation
        starts on it (``steps``: the run's ``train.steps``)."""
        fault = os.environ.get(variable, "")
        if fault and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" \
                and fault == f"{self.device}:{version}":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def fill_disk_if_told(version: int) -> None:
        """Fault injection for tests (``BIDIRL_FAULT_DISK_FULL=version``): from the checkpoint of ``version``
        on, the kernel refuses this process every write that grows a file (RLIMIT_FSIZE 0: EFBIG, the way
        a full disk refuses with ENOSPC)."""
        fault = os.environ.get("BIDIRL_FAULT_DISK_FULL", "")
        if fault and int(fault) == version:
            import resource  # (Python ignores SIGXFSZ: the write fails, the process lives)

            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    # ---- checks -------------------------------------------------------------------------------
    def logprob_gap(self, probe: "tuple[Sample, ...]") -> Dict[str, float]:
        """Mean |trainer - behaviour| log-prob on a few samples of the batch, before the step.

        For samples generated with the weights being trained (staleness 0) it is zero up to numerics:
        a live check that weight syncs reach the rollout engines."""
        fresh: List[Sample] = [s for s in probe if s.version == self.train.version and s.completion_ids]
        return mean_logprob_gap(self.train, fresh) if fresh else {}

    # ---- helpers ------------------------------------------------------------------------------
    def load_rollout(self) -> float:
        """Loads the training model's weights into the rollout engine, in place, if they changed."""
        if self.rollout.version == self.train.version:
            return 0.0
        return self.rollout.update_weights(self.train.state_dict(), self.train.version)

    def save_snapshot(self, version: int) -> None:
        path = self.run_path / "snapshots" / f"v{version:05d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        self.torch.save({k: v.detach().to("cpu", copy=True) for k, v in self.train.state_dict().items()}, tmp)
        tmp.replace(path)


# ---- a step's finish, outside its gradient passes (also timed by ``bidirl profile``) ------------------
def flat_gradients(torch: Any, params: List[Any]) -> Any:
    """The parameters' gradients in one flat buffer (zeros where a parameter got none): what is reduced."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def set_gradients(params: List[Any], flat: Any) -> None:
    """The reduced flat buffer back into each parameter's gradient, for the optimizer step."""
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def weights_checksum(torch: Any, params: List[Any]) -> "tuple[float, float]":
    """(sum, sum of squares) of the weights, reduced in float64 parameter by parameter: no flattened
    or widened copy of the model on every step."""
    f64 = torch.float64
    with torch.no_grad():
        total = sum(float(torch.sum(p, dtype=f64)) for p in params)
        squares = sum(float(torch.linalg.vector_norm(p, dtype=f64)) ** 2 for p in params)
    return total, squares


def mean_logprob_gap(train: Any, samples: List[Sample]) -> Dict[str, float]:
    """Mean |trainer - behaviour| log-prob over the tokens of ``samples``, re-scored by ``train``."""
    recomputed = train.logprobs(samples)
    gaps = [abs(a - b) for s, lp in zip(samples, recomputed) for a, b in zip(lp, s.logprobs)]
    return {"fresh_logp_gap": sum(gaps) / len(gaps)}
