"""The controller: turns worker messages into scheduler events and policy actions into commands.

::

    controller (rank 0)                                  device workers (ranks 1..N)
    ───────────────────                                  ───────────────────────────
    publish plan; wait for N "ready"          <────────  build groups + both engines, post ready
    decide(Started) -> actions -> commands    ────────>  run commands in order (FIFO queue each)
    loop until the last version exists:
        wait for the next message             <────────  chunk_done | train_done | sync_done | switch_done
        message -> event (a train step or sync is done when every member reported)
        cluster.complete(event); decide(event, cluster) -> actions -> commands
    evaluate snapshots on device 0; stop workers; write trace, metrics, Gantt, summary

The controller *waits for* messages only; it is *unblocked by* a worker finishing a command. All
scheduling decisions come from the policy (:mod:`bidirl.sched.policies`) through the same Cluster
bookkeeping the simulator uses. Interrupted generation: a weight sync or a switch sent to a busy
rollout device runs after its chunk in flight (``launch.chunk_groups`` prompt groups), the safe point;
that chunk keeps the version it started with, and the staleness bound counts it so.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Tuple

from bidirl.config import PipelineConfig
from bidirl.data import PromptSampler, load_problems
from bidirl.errors import BidirlError
from bidirl.grpo import assign_advantages
from bidirl.prompts import format_prompt
from bidirl.rundir import RunDir
from bidirl.sched import events as ev
from bidirl.sched.borrowing import MeasuredEstimates
from bidirl.sched.cluster import Cluster
from bidirl.sched.policies import NEEDS_ESTIMATES, build_policy, partition
from bidirl.sched.roles import Role
from bidirl.sched.trace import median, pool_idle_ratio, switch_overheads
from bidirl.ui import progress_bar, say


class Controller:
    def __init__(self, cfg: PipelineConfig, mailbox: Any, run: RunDir, devices: int, tokenizer: Any):
        self.cfg, self.devices, self.tokenizer, self.run = cfg, devices, tokenizer, run
        # cost-aware policies (bidirl) get their estimates from this run's own measurements
        self.measured = MeasuredEstimates() if cfg.launch.mode in NEEDS_ESTIMATES else None
        self.policy = build_policy(cfg.launch.mode, self.measured and self.measured.current(),
                                   cfg.train.prompts_per_step)
        homes = partition(self.policy, devices, cfg.cluster.rollout_devices)
        eta = 0 if self.policy.synchronous else cfg.algorithm.staleness
        self.cluster = Cluster(homes, cfg.train.prompts_per_step, eta, cfg.train.steps, cfg.launch.chunk_groups,
                               deadlines=self.policy.deadlines, allows_join=False)
        self.mailbox = mailbox
        self.mailbox.publish("plan", {"primary": self.cluster.primary, "roles": [h.value for h in homes],
                                      "run_path": str(self.run.path)})
        self.sampler = PromptSampler(load_problems(cfg.data, "train"), cfg.seed)
        self.params = {"n": cfg.rollout.group_size, "max_new_tokens": cfg.rollout.max_new_tokens,
                       "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p}
        self.chunk_samples: Dict[int, list] = {}
        self.chunk_seconds: Dict[int, float] = {}
        self.pending: Dict[str, set] = {"train": set(), "sync": set()}
        self.reports: Dict[str, list] = {"train": [], "sync": [], "switch": [], "load": []}
        self.batch_info: Dict[str, Any] = {}
        self.snapshots: List[Tuple[int, str]] = [(0, str(self.run.path / "snapshots" / "v00000.pt"))]
        self.version_seconds: Dict[int, float] = {0: 0.0}  # RL time at which each version existed
        self.sync_seconds: List[float] = []  # issue -> last member done, as the controller saw it
        self.consumed_samples = 0
        self.consumed_tokens = 0

    # ---- main loop -------------------------------------------------------------------------------
    def run_all(self) -> Dict[str, Any]:
        """Runs training to the last version, evaluates, stops the workers; returns the summary.

        The caller owns the run directory (and finishes it); on failure workers are told to stop."""
        try:
            ready = [self.mailbox.next_event() for _ in range(self.devices)]
            say(f"{self.devices} devices ready (start-up median {median(r['startup_s'] for r in ready):.1f} s): "
                f"homes {[d.home.value for d in self.cluster.devices]}, policy {self.policy.name}, "
                f"eta={self.cluster.eta}")
            self.t0 = time.perf_counter()
            self.run.started = time.time()
            self.dispatch(ev.Started())
            with progress_bar(f"GRPO ({self.policy.name})", self.cfg.train.steps, self.cfg.logging.progress) as bar:
                self.bar = bar
                while not self.cluster.finished:
                    event = self.translate(self.mailbox.next_event())
                    if event is not None:
                        self.cluster.now = time.perf_counter() - self.t0
                        self.cluster.complete(event)
                        self.dispatch(event)
            self.rl_seconds = time.perf_counter() - self.t0
            checkpoint = self.save_checkpoint()
            summary = {**self.finish(self.evaluate()), "checkpoint": checkpoint, "final_version": self.cluster.version}
        finally:
            self.stop_workers()
        return summary

    def dispatch(self, event: ev.Event) -> None:
        actions = self.policy.decide(event, self.cluster)
        for action in actions:
            self.execute(action)
        waiting = self.pending["train"] or self.pending["sync"]
        if not actions and not waiting and self.idle_everywhere() and not self.cluster.finished:
            raise BidirlError(f"policy '{self.policy.name}' stalled at version {self.cluster.version}: "
                              "every device is idle and it started nothing")

    def idle_everywhere(self) -> bool:
        return all(d.idle and not d.after_work for d in self.cluster.devices)

    # ---- messages -> events ----------------------------------------------------------------------
    def translate(self, message: Dict[str, Any]) -> Optional[ev.Event]:
        op, device = message["op"], message["device"]
        if op == "chunk_done":
            groups: Dict[int, list] = {}
            for sample in message["samples"]:  # one list per prompt group, in prompt order
                groups.setdefault(sample.prompt_index, []).append(sample)
            self.chunk_samples[message["chunk"]] = [groups[i] for i in sorted(groups)]
            self.chunk_seconds[message["chunk"]] = message["seconds"]
            self.measure("chunk", message["seconds"], len(groups))
            return ev.ChunkDone(device, message["chunk"])
        if op == "switch_done":
            self.reports["switch"].append(message)
            self.measure("switch", message["switch_s"])
            return ev.SwitchDone(device, Role(message["role"]))
        if op == "load_done":
            self.reports["load"].append(message)
            return ev.LoadDone(device, message["version"])
        kind = {"train_done": "train", "staged": "sync"}.get(op)
        if kind is None:
            raise BidirlError(f"device {device} sent an unexpected message '{op}'")
        self.pending[kind].discard(device)
        self.reports[kind].append(message)
        if self.pending[kind]:
            return None  # a collective is done when every member reported
        if kind == "sync":
            self.sync_seconds.append(time.perf_counter() - self.sync_started)
            return ev.SyncDone(self.cluster.syncing)
        primary = next(m for m in reversed(self.reports["train"]) if m["device"] == self.cluster.primary)
        self.measure("step", primary["seconds"], len(self.cluster.training_devices), primary["reduce_s"])
        self.log_step(primary)
        self.version_seconds[primary["version"]] = time.perf_counter() - self.t0
        return ev.TrainDone(primary["version"])

    def measure(self, kind: str, *values: float) -> None:
        """Feeds a cost-aware policy the costs this run measures (a chunk, a step, a switch)."""
        if self.measured is not None:
            getattr(self.measured, kind)(*values)
            self.policy.estimates = self.measured.current()

    # ---- actions -> commands ---------------------------------------------------------------------
    def execute(self, action: ev.Action) -> None:
        if isinstance(action, ev.Generate):
            self.send_chunk(action)
        elif isinstance(action, ev.Train):
            self.send_train(action)
        elif isinstance(action, ev.Sync):  # primary publishes; receiver threads stage it in the background
            self.sync_started = time.perf_counter()
            primary, version = self.cluster.primary, self.cluster.version
            members = sorted({primary, *action.devices})
            self.pending["sync"] = set(members)
            self.mailbox.send(primary, {"op": "publish", "version": version, "members": members})
            for device in action.devices:
                self.mailbox.send_weights(device, {"op": "receive", "version": version, "members": members})
        elif isinstance(action, ev.Load):
            self.mailbox.send(action.device, {"op": "load", "version": self.cluster.devices[action.device].loading})
        elif isinstance(action, ev.Switch):
            self.mailbox.send(action.device, {"op": "switch", "role": action.role.value})

    def send_chunk(self, action: ev.Generate) -> None:
        chunk = self.cluster.start_chunk(action)
        problems = self.sampler.next(chunk.groups)
        self.mailbox.send(action.device, {
            "op": "generate", "chunk": chunk.index, "first_group": chunk.first, "params": self.params,
            "prompts": [format_prompt(p, self.cfg.data.prompt_style, self.tokenizer) for p in problems],
            "answers": [p.answer for p in problems]})

    def send_train(self, action: ev.Train) -> None:
        k = self.cluster.version
        samples, rollout_s = [], 0.0
        for chunk, groups in self.cluster.batch_chunks(k):  # composed by the cluster: B groups, oldest first
            for _ in range(groups):
                group = self.chunk_samples[chunk.index].pop(0)
                assign_advantages(group, self.cfg.algorithm.std_normalize)
                samples += group
            rollout_s += self.chunk_seconds[chunk.index] * groups / chunk.groups  # device-seconds
        informative = [s for s in samples if s.advantage != 0.0]  # all-equal groups teach nothing
        total_tokens = max(1, sum(len(s.completion_ids) for s in informative))
        members = list(action.devices)
        slices = [informative[i :: len(members)] for i in range(len(members))]
        snapshot = (k + 1) % max(1, self.cfg.logging.eval_every) == 0 or k + 1 == self.cfg.train.steps
        if snapshot:
            self.snapshots.append((k + 1, str(self.run.path / "snapshots" / f"v{k + 1:05d}.pt")))
        for device, part in zip(members, slices):
            self.mailbox.send(device, {"op": "train", "step": k, "samples": part, "members": members,
                                       "total_tokens": total_tokens, "total_sequences": max(1, len(informative)),
                                       "snapshot": snapshot and device == self.cluster.primary,
                                       "probe": samples[:8] if device == self.cluster.primary else []})
        self.pending["train"] = set(members)
        self.batch_info = {
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "completion_tokens_mean": sum(len(s.completion_ids) for s in samples) / len(samples),
            "informative_ratio": len(informative) / len(samples),
            "staleness_mean": sum((k - s.version) for s in samples) / len(samples),
            "staleness_max": max(k - s.version for s in samples),
            "rollout_s": round(rollout_s, 4),
            "train_devices": len(members), "samples": len(samples),
            "tokens": sum(len(s.completion_ids) for s in samples)}

    # ---- telemetry -------------------------------------------------------------------------------
    def log_step(self, primary: Dict[str, Any]) -> None:
        info = self.batch_info
        self.consumed_samples += info["samples"]
        self.consumed_tokens += info["tokens"]
        elapsed = time.perf_counter() - self.t0
        last_sync = self.sync_seconds[-1] if self.sync_seconds else 0.0
        stats = {k: v for k, v in primary["stats"].items() if isinstance(v, (int, float))}
        self.run.log(primary["version"], **{k: v for k, v in info.items() if k not in ("samples", "tokens")},
                     **stats, train_s=round(primary["seconds"], 4), reduce_s=round(primary["reduce_s"], 4),
                     sync_s=round(last_sync, 4), samples_consumed=self.consumed_samples,
                     samples_per_s=self.consumed_samples / elapsed, tokens_per_s=self.consumed_tokens / elapsed)
        self.bar(reward=info["reward_mean"], stale=info["staleness_mean"])

    def save_checkpoint(self) -> str:
        """The primary trainer (the only optimizer) writes the final weights and optimizer state."""
        path = str(self.run.path / "checkpoint")
        self.mailbox.send(self.cluster.primary, {"op": "checkpoint", "path": path})
        reply = self.mailbox.next_event()
        if reply["op"] != "checkpoint_done":
            raise BidirlError(f"device {reply['device']} answered '{reply['op']}' to a checkpoint request")
        return path

    def evaluate(self) -> List[Dict[str, Any]]:
        if self.cfg.logging.eval_every <= 0:
            return []
        say(f"evaluating {len(self.snapshots)} weight snapshots on device 0")
        self.mailbox.send(0, {"op": "evaluate", "snapshots": self.snapshots})
        reply = self.mailbox.next_event()
        per_step = self.cfg.train.prompts_per_step * self.cfg.rollout.group_size
        curve = []
        for version, accuracy in reply["results"]:
            curve.append({"step": version, "samples": version * per_step, "accuracy": accuracy,
                          "minutes": round(self.version_seconds.get(version, 0.0) / 60, 2)})
            self.run.log(version, eval_accuracy=accuracy, samples_consumed=version * per_step)
        return curve

    def finish(self, curve: List[Dict[str, Any]]) -> Dict[str, Any]:
        from bidirl.plots import plot_gantt, plot_learning_curves

        cluster, path = self.cluster, self.run.path
        with open(path / "trace.jsonl", "w") as out:
            for record in cluster.trace:
                out.write(json.dumps(record) + "\n")
        homes = {d.index: d.home.value for d in cluster.devices}
        switches = self.switch_figures()
        syncs = self.reports["sync"]
        summary = {
            "status": "ok", "policy": self.policy.name, "devices": self.devices, "homes": list(homes.values()),
            "eta": cluster.eta, "steps": cluster.version, "rl_seconds": round(self.rl_seconds, 2),
            "samples_per_s": round(self.consumed_samples / self.rl_seconds, 2),
            "tokens_per_s": round(self.consumed_tokens / self.rl_seconds, 2),
            "idle_ratio": pool_idle_ratio(cluster.trace, cluster.now, homes),
            "staleness_histogram": {str(k): v for k, v in sorted(cluster.staleness.items())},
            "syncs": len(self.sync_seconds), "sync_median_s": round(median(self.sync_seconds), 4),
            "sync_transfer_median_s": round(median(m["transfer_s"] for m in syncs), 4),
            "loads": len(self.reports["load"]),
            "load_median_ms": round(1000 * median(m["seconds"] for m in self.reports["load"]), 2),
            "switches": switches, "leases": cluster.lease_summary(), "curve": curve,
            "gantt": str(plot_gantt(cluster.trace, cluster.now, path / "gantt.png", f"{path.name}")),
        }
        if curve:
            summary["learning_curve"] = str(plot_learning_curves(path / "metrics.jsonl", path / "learning_curve.png"))
            summary["accuracy_start"], summary["accuracy_end"] = curve[0]["accuracy"], curve[-1]["accuracy"]
        say(f"{self.policy.name}: {summary['samples_per_s']} samples/s over {summary['rl_seconds']} s, "
            f"idle {summary['idle_ratio']}, staleness {summary['staleness_histogram']}, "
            f"switches {switches.get('count', 0)} (median {switches.get('total_median_ms', 0)} ms)")
        return summary

    def switch_figures(self) -> Dict[str, Any]:
        observed = switch_overheads(self.cluster.trace)
        reports = self.reports["switch"]
        if not reports:
            return {"count": 0}
        ms = lambda values: round(1000 * median(list(values)), 2)  # noqa: E731
        figures: Dict[str, Any] = {"count": len(reports)}
        for role in ("rollout", "train"):  # into rollout a switch loads weights; into training it joins groups
            mine = [r for r in reports if r["role"] == role]
            seen = [o for o in observed if o["to"] == role]
            if mine:
                figures[f"to_{role}"] = {
                    "count": len(mine), "drain_median_ms": ms(o["drain_s"] for o in seen),
                    "weight_load_median_ms": ms(r["load_s"] for r in mine),
                    "group_join_median_ms": ms(r["join_s"] for r in mine),
                    "worker_median_ms": ms(r["seconds"] for r in mine),
                    "observed_median_ms": ms(o["switch_s"] for o in seen),
                    "first_work_median_ms": ms(o["first_work_s"] for o in seen)}
        figures["total_median_ms"] = ms(o["switch_s"] for o in observed)
        return figures

    def stop_workers(self) -> None:
        for device in range(self.devices):
            if self.devices > 1 and device != self.cluster.primary:
                self.mailbox.send_weights(device, {"op": "stop"})
            self.mailbox.send(device, {"op": "stop"})
