"""Live, 2 CPU devices: the scheduler issue's live targets, side by side in one run.

    .venv/bin/python experiments/live_bench/targets.py                          # both workloads, 3 rounds
    .venv/bin/python experiments/live_bench/targets.py --workloads default --rounds 1 --steps 10
    .venv/bin/python experiments/live_bench/targets.py --set launch.inflight_groups=64   # every policy's devices

Targets (eta 1, the same 1 rollout / 1 train split for the disaggregated policies):
  bidirl >= 1.3x async                  on both workloads
  bidirl >= 1.0x sync                   on the default workload
  bidirl >= 1.15x sync                  on the long-tail workload

Workloads, both the project-built tiny model on reasoning-gym arithmetic:
  default    the CPU default (``pipelines/cpu-tiny.yaml``) cut so a batch is several chunks: 64 prompt
             groups per step, chunks of 16, answers of 2-8 tokens
  long-tail  ``pipelines/cpu-long.yaml``: worked chains of 2-16 terms, answers of ~12 to 160 tokens
             (the spread is measured and reported: shortest and longest answer per run)

Policies: ``sync`` (colocated, on-policy, both devices; veRL-style), ``async`` (fixed split,
staleness-bounded; AReaL-style), ``bidirl`` (both lending directions, streamed steps, in-flight
migration), its cost estimates starting from a profile of these devices as in ``make demo`` (one
``bidirl profile`` per workload, before the rounds and outside every run's clock), and
``bidirl-noprofile``, the same starting from no estimates (it lends no trainer before it has measured a
chunk, and no rollout device before it has measured a step). Each round runs every policy once, in
turn, since this machine drifts by up to ~30% over tens of minutes; ratios are taken within a round. Per
run: samples/s, each pool's device time by category (busy, waiting for data / weights / admission,
switching, ...), leases, migrations, streamed steps, and the Gantt chart of the last round, copied to
``figures/``. Writes ``targets.json``.
Nothing here is tuned toward a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from streaming import BIDIRL, last_line, live
from streaming import SETTING as DEFAULT_SETTING

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

HERE = Path(__file__).parent
COMMON = ("cluster.devices=2", "logging.eval_every=0", "logging.wandb_mode=disabled", "logging.progress=false")
WORKLOADS = {
    "default": (str(PIPELINES / "cpu-tiny.yaml"), tuple(DEFAULT_SETTING)),
    "long-tail": (str(PIPELINES / "cpu-long.yaml"), COMMON),
}
POLICIES = ("sync", "async", "bidirl", "bidirl-noprofile")
# bidirl as ``make demo`` runs it: its cost estimates start from a profile of these devices (``sim.profile``,
# taken once per workload before the rounds, outside every run's clock); ``bidirl-noprofile`` starts with
# none: no trainer is lent before a chunk is measured, no rollout device before a step is. The other
# policies use no estimates.
UNPROFILED = {"bidirl-noprofile": "bidirl"}
TARGETS = {("default", "async"): 1.3, ("default", "sync"): 1.0, ("long-tail", "async"): 1.3, ("long-tail", "sync"): 1.15}


def machine() -> dict:
    """What ran the bench, kept with its rows: rates move with the machine (the runs of 2026-12-06 read
    0.4-0.6x the rates of 2026-12-05's, with generation dearer against training, and no run had recorded
    its CPU)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "avx512": "avx512f" in info, "amx": "amx_tile" in info}


def answer_spread(run_dir: Path) -> tuple:
    """Shortest and longest answer of the run, from its per-step metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lo = [r["completion_tokens_min"] for r in rows if "completion_tokens_min" in r]
    hi = [r["completion_tokens_max"] for r in rows if "completion_tokens_max" in r]
    return (min(lo), max(hi)) if lo else (None, None)


def profile(pipeline: str, setting: tuple, scratch: Path) -> Path:
    """``bidirl profile`` of the workload's devices and engines; the path of its profile.json."""
    start = time.perf_counter()
    out = subprocess.run([BIDIRL, "profile", pipeline, *setting, f"output_dir={scratch}"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"profile of {pipeline} failed: {last_line(out.stderr)}")
    found = list(scratch.glob("*/profile.json"))
    if len(found) != 1:
        raise SystemExit(f"profile of {pipeline}: expected one profile.json under {scratch}, found {len(found)}")
    print(f"{pipeline}: profiled in {time.perf_counter() - start:.0f} s", flush=True)
    return found[0]


def one_run(root: Path, policy: str, eta: int, steps: int, pipeline: str, setting: tuple, profiled: Path) -> dict:
    if policy in UNPROFILED:  # (its own folder: live() names a run's folder by the mode it launches)
        return live(root / policy, UNPROFILED[policy], eta, steps, pipeline, setting)
    return live(root, policy, eta, steps, pipeline, (*setting, f"sim.profile={profiled}"))


def one_workload(name: str, rounds: int, steps: int, eta: int, scratch: Path, extra: tuple = ()) -> list:
    pipeline, setting = WORKLOADS[name]
    setting = (*setting, *extra)
    profiled = profile(pipeline, setting, scratch / name / "profile")
    results = []
    for r in range(rounds):
        results.append({p: one_run(scratch / name / f"round{r}", p, eta, steps, pipeline, setting, profiled)
                        for p in POLICIES})
        print(f"{name} round {r}: " + ", ".join(f"{p} {s['samples_per_s']:.1f}" for p, s in results[-1].items()),
              flush=True)
    figures = HERE / "figures"
    figures.mkdir(exist_ok=True)
    rows = []
    for p in POLICIES:
        runs = [one[p] for one in results]
        run_dir = Path(runs[-1]["gantt"]).parent
        shutil.copy(run_dir / "gantt.png", figures / f"targets-{name}-{p}.png")
        spreads = [answer_spread(Path(s["gantt"]).parent) for s in runs]
        rows.append({
            "workload": name, "eta": eta, "policy": p,
            "samples_per_s": round(statistics.mean(s["samples_per_s"] for s in runs), 2),
            "rounds_samples_per_s": [s["samples_per_s"] for s in runs],
            "vs_async": [round(one[p]["samples_per_s"] / one["async"]["samples_per_s"], 3) for one in results],
            "vs_sync": [round(one[p]["samples_per_s"] / one["sync"]["samples_per_s"], 3) for one in results],
            "answer_tokens_min_max": [min(lo for lo, _ in spreads), max(hi for _, hi in spreads)],
            "migrations": [len(s["migrations"]) for s in runs],
            "joined_chunks": [len(s.get("joined_chunks", [])) for s in runs],
            "streamed_steps": [s["streamed_steps"] for s in runs],
            "leases": [{k: v["leases"] for k, v in s["leases"].items()} for s in runs],
            "staleness": [s["staleness_histogram"] for s in runs],
            "time_breakdown": {pool: {c: round(statistics.mean(s["time_breakdown"][pool][c] for s in runs), 3)
                                      for c in runs[0]["time_breakdown"][pool]}
                               for pool in runs[0]["time_breakdown"]},
            "gantt": f"figures/targets-{name}-{p}.png", "machine": machine()})
    return rows


def print_tables(rows: list) -> None:
    fmt = lambda xs: ", ".join(f"{x:g}" for x in xs)  # noqa: E731
    print("\n| workload | policy | samples/s (rounds) | / async (rounds) | / sync (rounds) | answer tokens | "
          "migrations | streamed steps | device time per pool |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        parts = []
        for pool, shares in sorted(row["time_breakdown"].items()):
            top = sorted(((v, c) for c, v in shares.items() if v >= 0.02), reverse=True)
            parts.append(f"{pool}: " + ", ".join(f"{c} {100 * v:.0f}%" for v, c in top))
        lo, hi = row["answer_tokens_min_max"]
        print(f"| {row['workload']} | {row['policy']} | {row['samples_per_s']} ({fmt(row['rounds_samples_per_s'])}) | "
              f"{statistics.mean(row['vs_async']):.2f} ({fmt(row['vs_async'])}) | "
              f"{statistics.mean(row['vs_sync']):.2f} ({fmt(row['vs_sync'])}) | {lo}-{hi} | "
              f"{fmt(row['migrations'])} | {fmt(row['streamed_steps'])} | {'; '.join(parts)} |")
    print("\n| target | reached (mean of rounds) | met |")
    print("|---|---|---|")
    for (workload, reference), goal in TARGETS.items():
        bidirl = next((r for r in rows if r["workload"] == workload and r["policy"] == "bidirl"), None)
        if bidirl:
            reached = statistics.mean(bidirl[f"vs_{reference}"])
            print(f"| {workload}: bidirl >= {goal}x {reference} | {reached:.2f}x | {'yes' if reached >= goal else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="default,long-tail")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eta", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "targets.json"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run of every policy (repeatable), e.g. launch.inflight_groups=64")
    args = parser.parse_args()
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:  # before anything runs, as argparse reports its own errors: one line, exit 2
        parser.error(f"--workloads: unknown workload {unknown[0]!r} (known: {', '.join(WORKLOADS)})")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            rows += one_workload(name, args.rounds, args.steps, args.eta, Path(scratch), tuple(args.set))
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")  # each workload's rows kept as it ends
    print_tables(rows)


if __name__ == "__main__":
    main()
