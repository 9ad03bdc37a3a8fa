"""What a live run reports: per-step metrics, weight snapshots and their held-out accuracy, the
summary, the trace, the plots. The controller hands it what happened; it decides nothing.

Timeline. ``t0`` is when the workers are ready and the policy starts; every step row's ``time_s``
and every evaluation's ``time_s`` are seconds since then. Snapshots are evaluated after training (so
evaluation never perturbs the timeline), but each accuracy is logged at the training time its
version existed, so accuracy-against-time plots show when a model was that good.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Dict, List, Optional, Tuple

from bidirl.config import PipelineConfig
from bidirl.rundir import RunDir
from bidirl.runtime import protocol as msg
from bidirl.sched.cluster import Cluster
from bidirl.sched.trace import idle_and_breakdown, median, steady_step_s, switch_overheads
from bidirl.ui import say


class RunReport:
    def __init__(self, cfg: PipelineConfig, run: RunDir):
        self.cfg, self.run = cfg, run
        self.snapshots: List[Tuple[int, str]] = [(0, self.snapshot_path(0))]
        self.version_seconds: Dict[int, float] = {0: 0.0}  # RL time at which each version existed
        self.switches: List[msg.RoleSwitched] = []
        self.loads: List[msg.WeightsLoaded] = []
        self.staged: List[msg.WeightsStaged] = []
        self.sync_seconds: List[float] = []  # publish issued -> last member staged, as the controller saw it
        self.consumed_samples = 0
        self.consumed_tokens = 0
        self.replica_checks = 0  # steps after which every home trainer's weights agreed with the primary's
        self.stream_wait_s = 0.0  # of the step waits (``Cluster.step_wait_s``), those for groups still generating
        self.discarded_grads: List[Dict[str, int]] = []  # late micro-batches of expired leases, not counted
        self.slow_reduces: List[Dict[str, Any]] = []  # steps whose finish was held up past its deadline, for whom
        self.handovers: List[Dict[str, Any]] = []  # groups stopped mid-generation and moved (in-flight migration)
        self.joined_chunks: List[Dict[str, Any]] = []  # chunks that joined a device's batch in flight
        self.checkpoints: List[Dict[str, Any]] = []  # sealed during this run (or since its resume)
        self.resumed: Dict[str, Any] = {}  # the checkpoint a resumed run continued from
        self.eval_problems = 0  # held-out problems each snapshot was scored on
        self.before_s = 0.0  # RL seconds of the run before the checkpoint it resumed from
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.run.started = time.time() - self.before_s  # metrics' time_s continues the original run's

    def elapsed(self) -> float:
        """Seconds since this process started training (the scheduler's clock: the trace, the Gantt chart)."""
        return time.perf_counter() - self.t0

    def rl_seconds(self, at: Optional[float] = None) -> float:
        """Seconds of training since the run began, a resumed run's time before its checkpoint included: until
        now, or until ``at`` on this process's clock (:meth:`elapsed`)."""
        return self.before_s + (self.elapsed() if at is None else at)

    # ---- checkpoints -----------------------------------------------------------------------------
    def checkpoint_state(self, version: int) -> Dict[str, Any]:
        """What the learning curve and the throughput figures need to continue after a resume."""
        return {"snapshots": [[v, p] for v, p in self.snapshots if v <= version],
                "version_seconds": {str(v): t for v, t in self.version_seconds.items() if v <= version},
                "consumed_samples": self.consumed_samples, "consumed_tokens": self.consumed_tokens,
                "rl_seconds": round(self.rl_seconds(), 4), "replica_checks": self.replica_checks}

    def resume(self, state: Dict[str, Any], resumed: Dict[str, Any]) -> None:
        report = state["report"]
        # each snapshot where it is now: the run directory may have been moved or copied since the checkpoint
        # recorded its paths (the worker writes every snapshot into the run directory's snapshots/)
        self.snapshots = [(int(v), self.snapshot_path(int(v))) for v, _ in report["snapshots"]]
        self.version_seconds = {int(v): t for v, t in report["version_seconds"].items()}
        self.consumed_samples, self.consumed_tokens = report["consumed_samples"], report["consumed_tokens"]
        self.before_s, self.replica_checks = report["rl_seconds"], report["replica_checks"]
        self.resumed = resumed
        self.run.log(state["version"], event="resumed", **resumed)

    # ---- the record a replay checks -----------------------------------------------------------
    def record_batch(self, batch: Any, members: Tuple[int, ...], lent: Tuple[int, ...],
                     computed: Dict[int, List[msg.ComputeGrads]]) -> None:
        """One line of ``batches.jsonl`` (``logging.record_batches``): the step's groups, and every
        micro-batch it trained -- the samples as the trainer saw them, and the device that computed it."""
        if not self.cfg.logging.record_batches:
            return
        items = [{"device": device, "total_tokens": item.total_tokens, "total_sequences": item.total_sequences,
                  "samples": [dataclasses.asdict(s) for s in item.samples]}
                 for device in sorted(computed) for item in computed[device]]
        line = {"step": batch.step, "groups": list(batch.groups), "prompts": list(batch.prompts),
                "untrained": [list(draw) for draw in batch.untrained], "grad_scale": batch.grad_scale,
                "members": list(members), "lent": list(lent), "items": items}
        with open(self.run.path / "batches.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")

    # ---- snapshots ---------------------------------------------------------------------------
    def snapshot_path(self, version: int) -> str:
        return str(self.run.path / "snapshots" / f"v{version:05d}.pt")

    def wants_snapshot(self, version: int) -> bool:
        """Every ``logging.eval_every`` versions and the last one; recorded for evaluation after training."""
        every = max(1, self.cfg.logging.eval_every)
        if version % every == 0 or version == self.cfg.train.steps:
            self.snapshots.append((version, self.snapshot_path(version)))
            return True
        return False

    # ---- per step ----------------------------------------------------------------------------
    def step_done(self, primary: msg.StepDone, batch: Dict[str, Any], train_s: float) -> Dict[str, Any]:
        """``train_s``: the step's wall time, from its first micro-batch sent to its last device done."""
        self.consumed_samples += batch["samples"]
        self.consumed_tokens += batch["tokens"]
        elapsed = self.rl_seconds()
        self.version_seconds[primary.version] = elapsed
        last_sync = self.sync_seconds[-1] if self.sync_seconds else 0.0
        stats = {k: v for k, v in primary.stats.items() if isinstance(v, (int, float))}
        self.run.log(primary.version, time_s=round(elapsed, 3),  # (the clock the version is placed on in the curve)
                     **{k: v for k, v in batch.items() if k not in ("samples", "tokens")},
                     **stats, train_s=round(train_s, 4), reduce_s=round(primary.reduce_s, 4),
                     sync_s=round(last_sync, 4), samples_consumed=self.consumed_samples,
                     samples_per_s=self.consumed_samples / elapsed, tokens_per_s=self.consumed_tokens / elapsed)
        return {"reward": batch["reward_mean"], "stale": batch["staleness_mean"]}

    # ---- after training ------------------------------------------------------------------------
    def curve(self, results: List[Tuple[int, float]], problems: int) -> List[Dict[str, Any]]:
        """The learning curve of the snapshots' held-out accuracies, each scored on ``problems`` problems."""
        self.eval_problems = problems
        per_step = self.cfg.train.prompts_per_step * self.cfg.rollout.group_size
        curve = []
        for version, accuracy in results:
            seconds = self.version_seconds.get(version, 0.0)
            curve.append({"step": version, "samples": version * per_step, "accuracy": accuracy,
                          "minutes": round(seconds / 60, 2)})
            self.run.log(version, time_s=round(seconds, 3), eval_accuracy=accuracy, eval_problems=problems,
                         samples_consumed=version * per_step)
        return curve

    def summary(self, cluster: Cluster, policy: str, rl_seconds: float, curve: List[Dict[str, Any]]) -> Dict[str, Any]:
        from bidirl.plots import plot_gantt, plot_learning_curves

        path = self.run.path
        with open(path / "trace.jsonl", "w") as out:
            for record in cluster.trace:
                out.write(json.dumps(record) + "\n")
        homes = {d.index: d.home.value for d in cluster.devices}
        switches = self.switch_figures(cluster.trace)
        at_start = cluster.homes_at_start()  # (a device re-planning moved is charged to each pool in turn)
        idle, breakdown = idle_and_breakdown(cluster.trace, cluster.now, at_start, cluster.step_wait_s)
        summary = {
            "status": "ok", "policy": policy, "devices": len(cluster.devices), "homes": list(homes.values()),
            "eta": cluster.eta, "steps": cluster.version, "rl_seconds": round(rl_seconds, 2),
            "samples_per_s": round(self.consumed_samples / rl_seconds, 2),
            "tokens_per_s": round(self.consumed_tokens / rl_seconds, 2),
            "idle_ratio": idle, "time_breakdown": breakdown, "stream_wait_s": round(self.stream_wait_s, 3),
            "step_wait_s": {pool: round(seconds, 3) for pool, seconds in sorted(cluster.step_wait_s.items())},
            "expired_leases": [{"t": round(t, 3), "device": d, "batch": k} for t, d, k in cluster.expired_leases],
            "discarded_grads": self.discarded_grads, "slow_reduces": self.slow_reduces,
            "migrations": [{"t": round(t, 3), "source": a, "device": b, "groups": n, "version": v}
                           for t, a, b, n, v in cluster.migrations],
            "handovers": self.handovers,
            "joined_chunks": self.joined_chunks,
            "staleness_histogram": {str(k): v for k, v in sorted(cluster.staleness.items())},
            "syncs": len(self.sync_seconds), "sync_median_s": round(median(self.sync_seconds), 4),
            "sync_transfer_median_s": round(median(m.transfer_s for m in self.staged), 4),
            "loads": len(self.loads),
            "load_median_ms": round(1000 * median(m.seconds for m in self.loads), 2),
            "switches": switches, "leases": cluster.lease_summary(), "curve": curve,
            "replica_checks": self.replica_checks, "checkpoints": self.checkpoints,
            **({"resumed": self.resumed} if self.resumed else {}),
            "steady_step_s": round(steady_step_s(cluster.version_times, updates_per_step=cluster.updates_per_sync), 4),
            "version_times": [round(t, 3) for t in cluster.version_times],
            "gantt": str(plot_gantt(cluster.trace, cluster.now, path / "gantt.png", f"{path.name}")),
        }
        if curve:
            summary["learning_curve"] = str(plot_learning_curves(path / "metrics.jsonl", path / "learning_curve.png"))
            summary["accuracy_start"], summary["accuracy_end"] = curve[0]["accuracy"], curve[-1]["accuracy"]
            summary["eval_problems"] = self.eval_problems
        say(f"{policy}: {summary['samples_per_s']} samples/s over {summary['rl_seconds']} s, "
            f"idle {summary['idle_ratio']}, staleness {summary['staleness_histogram']}, "
            f"switches {switches.get('count', 0)} (median {switches.get('total_median_ms', 0)} ms)")
        return summary

    def switch_figures(self, trace: List[dict]) -> Dict[str, Any]:
        observed = switch_overheads(trace)
        if not self.switches:
            return {"count": 0}
        ms = lambda values: round(1000 * median(list(values)), 2)  # noqa: E731
        figures: Dict[str, Any] = {"count": len(self.switches)}
        for role in ("rollout", "train"):  # into rollout a switch loads weights; into training it joins groups
            mine = [r for r in self.switches if r.role.value == role]
            seen = [o for o in observed if o["to"] == role]
            if mine:
                figures[f"to_{role}"] = {
                    "count": len(mine), "drain_median_ms": ms(o["drain_s"] for o in seen),
                    "weight_load_median_ms": ms(r.load_s for r in mine),
                    "group_join_median_ms": ms(r.join_s for r in mine),
                    "worker_median_ms": ms(r.seconds for r in mine),
                    "observed_median_ms": ms(o["switch_s"] for o in seen),
                    "first_work_median_ms": ms(o["first_work_s"] for o in seen)}
        figures["total_median_ms"] = ms(o["switch_s"] for o in observed)
        return figures
