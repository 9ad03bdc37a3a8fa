"""Live, 2 CPU devices: what streamed steps and lending do to throughput, side by side in one run.

    .venv/bin/python experiments/live_bench/streaming.py                  # eta 0 and 1, 2 rounds, 30 steps
    .venv/bin/python experiments/live_bench/streaming.py --etas 0 --rounds 1 --steps 10

The CPU default's tiny model and task, cut so a batch is several chunks (64 prompt groups per step,
chunks of 16, micro-batches of at most 64 samples: the overlap streaming needs); 1 rollout / 1 train
device for the disaggregated policies. Per eta, each round runs every policy once, in turn (this
machine's speed drifts by up to ~30% over tens of minutes, so policies are compared within a round):

  sync             colocated synchronous GRPO (veRL-style; on-policy whatever eta)
  async            fixed split, staleness-bounded (AReaL-style)
  bidirl-nostream  both lending directions, every step waits for its whole batch
  bidirl           both directions + streamed steps

Reported per policy: samples/s (mean over rounds, and each round), its ratio to async and to sync
within each round, the steady-state step, streamed steps, the seconds the trainer waited inside
streamed steps, and each pool's busy share. Writes ``streaming.json`` (next to this file unless
``--out``) and prints a markdown table. Nothing here is tuned toward a ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bidirl.sched.trace import steady_step_s

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

BIDIRL = str(Path(sys.executable).with_name("bidirl"))
PIPELINE = str(PIPELINES / "cpu-tiny.yaml")
SETTING = ["cluster.devices=2", "train.prompts_per_step=64", "train.micro_batch_size=64", "launch.chunk_groups=16",
           "logging.eval_every=0", "logging.wandb_mode=disabled", "logging.progress=false"]
POLICIES = ("sync", "async", "bidirl-nostream", "bidirl")


def last_line(stderr: str) -> str:
    """What a failed command said last (its one-line error), or that it said nothing."""
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else "no message on stderr"


def live(root: Path, policy: str, eta: int, steps: int, pipeline: str = PIPELINE, setting=tuple(SETTING)) -> dict:
    """One ``bidirl launch`` of ``policy``; its summary, plus the number of streamed steps."""
    runs = root / f"{policy}-eta{eta}"
    split = [] if policy == "sync" else ["cluster.rollout_devices=1"]
    out = subprocess.run([BIDIRL, "launch", pipeline, *setting, *split, f"launch.mode={policy}",
                          f"algorithm.staleness={eta}", f"train.steps={steps}", f"output_dir={runs}"],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{policy} eta={eta} failed: {last_line(out.stderr)}")
    (summary_path,) = runs.glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    trace = [json.loads(line) for line in (summary_path.parent / "trace.jsonl").read_text().splitlines()]
    summary["streamed_steps"] = sum(1 for r in trace if r["to"] == "training" and r["device"] == 1
                                    and "streamed" in r["reason"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etas", default="0,1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).with_name("streaming.json")))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for eta in (int(e) for e in args.etas.split(",")):
            rounds = []
            for r in range(args.rounds):
                rounds.append({p: live(Path(scratch) / f"round{r}", p, eta, args.steps) for p in POLICIES})
                print(f"eta {eta} round {r}: " + ", ".join(f"{p} {s['samples_per_s']:.1f}" for p, s in rounds[-1].items()),
                      flush=True)
            for p in POLICIES:
                runs = [one[p] for one in rounds]
                rows.append({
                    "eta": eta, "policy": p, "samples_per_s": round(statistics.mean(s["samples_per_s"] for s in runs), 2),
                    "rounds_samples_per_s": [s["samples_per_s"] for s in runs],
                    "vs_async": [round(one[p]["samples_per_s"] / one["async"]["samples_per_s"], 3) for one in rounds],
                    "vs_sync": [round(one[p]["samples_per_s"] / one["sync"]["samples_per_s"], 3) for one in rounds],
                    "steady_step_s": round(statistics.mean(steady_step_s(s["version_times"]) for s in runs), 3),
                    "streamed_steps": [s["streamed_steps"] for s in runs],
                    "stream_wait_s": [s.get("stream_wait_s", 0.0) for s in runs],
                    "leases": [s["leases"] for s in runs],
                    "busy": {pool: round(statistics.mean(s["time_breakdown"][pool]["busy"] for s in runs), 3)
                             for pool in runs[0]["time_breakdown"]}})
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| eta | policy | samples/s (rounds) | / async (rounds) | / sync (rounds) | steady step s | "
          "streamed steps | trainer waited in streamed steps, s | busy share per pool |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        def fmt(xs):
            return ", ".join(f"{x:g}" for x in xs)

        busy = " / ".join(f"{pool} {100 * share:.0f}%" for pool, share in sorted(row["busy"].items()))
        print(f"| {row['eta']} | {row['policy']} | {row['samples_per_s']} ({fmt(row['rounds_samples_per_s'])}) | "
              f"{statistics.mean(row['vs_async']):.2f} ({fmt(row['vs_async'])}) | "
              f"{statistics.mean(row['vs_sync']):.2f} ({fmt(row['vs_sync'])}) | {row['steady_step_s']} | "
              f"{fmt(row['streamed_steps'])} | {fmt(row['stream_wait_s'])} | {busy} |")


if __name__ == "__main__":
    main()
