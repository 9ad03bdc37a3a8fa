"""Faults injected into live runs, and how long recovery takes.

    .venv/bin/python experiments/faults/recovery.py [--faults none,kill-primary,...] [--work DIR]

Each fault is one live 2-device run (1 rollout + 1 train device, the small test model of
``tests/test_faults.py``: 9 steps, a checkpoint every 3), with the fault injected for real:
``kill -9`` of a worker process from outside, a worker that kills itself in the middle of a weight
publish or freezes (SIGSTOP) in the middle of a lease (``BIDIRL_FAULT_*`` in ``bidirl.runtime.worker``),
or a disk that refuses the primary's writes from the second checkpoint on. The script watches the run
from outside (every 0.1 s: the device processes and ``metrics.jsonl``) and reports, per fault:

* the steps in ``metrics.jsonl`` (each should appear exactly once), the steps redone after the resume
  (rows moved to ``metrics.rolled-back.jsonl``: work lost with the crash), the checkpoint resumed from;
* **recovery**: seconds from the fault (the first device process gone, or frozen) to the first step
  trained after it -- torchrun noticing, stopping and restarting the group, every process building its
  engines and loading the checkpoint, and the first step;
* the run's wall time, and the extra time against the same run without a fault.

Results go to ``recovery.json`` beside this script (or ``--work``) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

ROOT = Path(__file__).resolve().parents[2]
BIDIRL = [sys.executable, "-m", "cli.main"]
STEPS, EVERY = 9, 3
SMALL = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=128", "model.tiny.sft_steps=2",
         "model.tiny.sft_batch_size=8", "model.tiny.sft_examples=32", "data.eval_size=8",
         "logging.wandb_mode=disabled", "logging.progress=false", "rollout.engine=hf", "train.lr=1e-3",
         "train.prompts_per_step=8", "launch.chunk_groups=4", "cluster.devices=2", f"train.steps={STEPS}",
         f"train.checkpoint_every={EVERY}", "logging.eval_every=3", "launch.max_restarts=1",
         "cluster.rollout_devices=1"]
ASYNC = ["launch.mode=async"]
ROLLOUT, PRIMARY = 0, 1


def after_a_checkpoint_and_a_later_step(watch: "Watch") -> bool:
    return bool(list((watch.run / "checkpoints").glob("v*"))) and any(s > EVERY for s, _ in watch.rows_seen)


# name -> (overrides, environment, when to kill (None: the fault is injected from inside), device)
FAULTS: Dict[str, tuple] = {
    "none": (ASYNC, {}, None, None),
    "kill-primary": (ASYNC, {}, after_a_checkpoint_and_a_later_step, PRIMARY),
    "kill-rollout": (ASYNC, {}, after_a_checkpoint_and_a_later_step, ROLLOUT),
    "publish-sender": (ASYNC, {"BIDIRL_FAULT_KILL_IN_PUBLISH": f"{PRIMARY}:5"}, None, None),
    "publish-receiver": (ASYNC, {"BIDIRL_FAULT_KILL_IN_PUBLISH": f"{ROLLOUT}:5"}, None, None),
    "stall-in-lease": (["launch.mode=async-lend", "algorithm.staleness=0", "train.prompts_per_step=32",
                        "train.micro_batch_size=8"], {"BIDIRL_FAULT_STALL": f"{ROLLOUT}:14"}, None, None),
    "disk-full": (ASYNC, {"BIDIRL_FAULT_DISK_FULL": "6"}, None, None),
}
DESCRIPTION = {
    "none": "no fault (reference)",
    "kill-primary": "`kill -9` of the primary trainer after checkpoint v3 and a later step",
    "kill-rollout": "`kill -9` of the rollout worker, same point",
    "publish-sender": "the primary killed (SIGKILL) as it starts publishing v5",
    "publish-receiver": "the rollout worker killed after receiving v5, before staging it",
    "stall-in-lease": "the rollout device, lent to a step, frozen (SIGSTOP) for 14 s",
    "disk-full": "the primary's writes refused (EFBIG) from the checkpoint of v6 on",
}


class Watch:
    """The run as seen from outside: its device processes and the step rows of its metrics, each with the
    wall time it was first seen."""

    def __init__(self, root: Path, launcher: subprocess.Popen):
        self.root, self.launcher, self.run = root, launcher, root / "runs"
        self.rows_seen: Dict[tuple, float] = {}  # (step, run time) of each step row -> when it first appeared
        self.resumed_at: Optional[float] = None  # when a restart's "resumed" row appeared
        self.pids: Dict[int, int] = {}  # attempt 0's device processes: pid -> device
        self.fault_at: Optional[float] = None

    def poll(self, processes: bool = True) -> None:
        runs = self.root / "runs"
        if self.run == runs and runs.is_dir():
            found = list(runs.iterdir())
            if found:
                self.run = found[0]
        metrics = self.run / "metrics.jsonl"
        if metrics.is_file():
            for line in metrics.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # (a line being written)
                if "reward_mean" in row:  # (a step redone after a resume has a later run time)
                    self.rows_seen.setdefault((row["step"], row.get("time_s")), time.time())
                elif row.get("event") == "resumed" and self.fault_at and self.resumed_at is None:
                    self.resumed_at = time.time()
        if not processes:  # (the run has ended: its processes are gone, and that is no fault)
            return
        alive = self.device_processes()
        if not self.pids and len(alive) == 2:
            self.pids = alive
        for pid in self.pids:
            if self.fault_at is None and (pid not in alive or _stopped(pid)):
                self.fault_at = time.time()

    @property
    def recovered_at(self) -> Optional[float]:
        """When the first step after the fault was trained: after the restart's resume, if there was one."""
        if self.fault_at is None:
            return None
        since = max(self.fault_at, self.resumed_at or 0.0)
        after = [t for t in self.rows_seen.values() if t > since]
        return min(after) if after else None

    def device_processes(self) -> Dict[int, int]:
        out = {}
        try:
            children = psutil.Process(self.launcher.pid).children(recursive=True)
        except psutil.Error:  # (the launcher ended between two polls)
            return out
        for child in children:
            try:
                rank = child.environ().get("RANK")
                if rank not in (None, "0") and "bidirl.torchrun_main" in " ".join(child.cmdline()) \
                        and child.status() != psutil.STATUS_ZOMBIE:
                    out[child.pid] = int(rank) - 1
            except psutil.Error:
                continue
        return out


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def read_jsonl(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_fault(name: str, work: Path, cache: Path, timeout_s: float = 900) -> Dict[str, Any]:
    overrides, env, when, device = FAULTS[name]
    root = work / name
    args = ["launch", str(PIPELINES / "cpu-tiny.yaml"), f"output_dir={root}/runs", f"model.cache_dir={cache}", *SMALL,
            *overrides]
    started = time.time()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "output.log"
    with log.open("w") as sink:
        launcher = subprocess.Popen(BIDIRL + args, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    watch, killed = Watch(root, launcher), False
    while launcher.poll() is None:
        watch.poll()
        if when is not None and not killed and watch.pids and when(watch):
            pid = next(p for p, d in watch.pids.items() if d == device)
            os.kill(pid, signal.SIGKILL)
            killed = True
        if time.time() - started > timeout_s:
            for process in psutil.Process(launcher.pid).children(recursive=True) + [psutil.Process(launcher.pid)]:
                process.kill()  # (the whole tree: orphaned workers would load the next runs)
            raise SystemExit(f"{name}: the run did not end within {timeout_s:.0f} s")
        time.sleep(0.1)
    watch.poll(processes=False)
    wall = time.time() - started
    run = watch.run
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "reward_mean" in r]
    redone = sorted(r["step"] for r in read_jsonl(run / "metrics.rolled-back.jsonl") if "reward_mean" in r)
    resumed = summary.get("resumed") or {}
    lines = [line for line in log.read_text().splitlines() if line.startswith("error")]
    return {"fault": name, "exit": launcher.returncode, "wall_s": round(wall, 1), "status": summary.get("status"),
            "steps": steps, "steps_expected": STEPS, "missing": sorted(set(range(1, STEPS + 1)) - set(steps)),
            "repeated": sorted({s for s in steps if steps.count(s) > 1}), "redone_after_resume": redone,
            "from_version": resumed.get("from_version"), "restart": resumed.get("restart"),
            "expired_leases": len(summary.get("expired_leases") or []),
            "checkpoints": sorted(p.name for p in (run / "checkpoints").glob("v*")) if run.is_dir() else [],
            "recovery_s": round(watch.recovered_at - watch.fault_at, 1) if watch.recovered_at else None,
            "error_lines": lines[-2:]}


def table(results: List[Dict[str, Any]]) -> str:
    reference = next((r["wall_s"] for r in results if r["fault"] == "none"), None)
    rows = ["| fault | exit | steps once each | steps redone (lost, then trained again) | resumed from | "
            "recovery s (fault -> next step) | wall s | extra s vs no fault |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        once = (f"{len(set(r['steps']))}/{r['steps_expected']}" + (" (none repeated)" if not r["repeated"] else
                                                             f" repeated {r['repeated']}"))
        resumed = f"v{r['from_version']} (restart {r['restart']})" if r["from_version"] is not None else "-"
        same_run = FAULTS[r["fault"]][0] == ASYNC and r["fault"] != "none"  # (the lease fault runs another setting)
        extra = round(r["wall_s"] - reference, 1) if reference is not None and same_run else "-"
        rows.append(f"| {DESCRIPTION[r['fault']]} | {r['exit']} | {once} | {r['redone_after_resume'] or '-'} | "
                    f"{resumed} | {r['recovery_s'] if r['recovery_s'] is not None else '-'} | {r['wall_s']} | {extra} |")
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)}")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("recovery.json"))
    parser.add_argument("--table", action="store_true", help="print the table of the results in --out, run nothing")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.out.read_text())["results"]))
        return 0
    names = [n for n in args.faults.split(",") if n]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        print(f"error: unknown fault(s) {', '.join(unknown)} (known: {', '.join(FAULTS)})", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="bidirl-faults-"))
    cache = work / "cache"  # the small model, built once here so that no run's time includes it
    subprocess.run(BIDIRL + ["prepare-model", str(PIPELINES / "cpu-tiny.yaml"), f"model.cache_dir={cache}", *SMALL],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    results = []
    for name in names:
        print(f"{name} ...", flush=True)
        results.append(run_fault(name, work, cache))
        print(json.dumps(results[-1]), flush=True)
    args.out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M"), "results": results}, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
