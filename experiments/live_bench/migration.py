"""Live, 2 CPU devices: what in-flight migration adds, side by side in one run.

    .venv/bin/python experiments/live_bench/migration.py                   # 3 rounds, 20 steps (~9 min)

The planner's *medium* fidelity setting (``pipelines/cpu-long.yaml``, responses capped at 40 tokens),
eta 1, 1 rollout / 1 train device, where rollout and training take turns as the bottleneck. When the
trainer publishes a version, the rollout device is still decoding older groups and can load the new
weights only once they end (the live runtime does not interrupt generation for a load); ``bidirl``
lends the idle trainer and moves those groups onto it mid-generation, so the rollout device loads and
starts new groups at once. Each round runs every policy once, in turn (this machine drifts by up to
~30% over tens of minutes):

  async             fixed split, staleness-bounded (AReaL-style)
  bidirl-nomigrate  both lending directions and streamed steps, no request moved
  bidirl            the same plus in-flight migration

Reported per policy: samples/s (mean over rounds, and each round), the ratio to async and to
bidirl-nomigrate within each round, migrations and the requests they stopped mid-generation, leases,
and each pool's busy share. Writes ``migration.json`` next to this file unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from streaming import live

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

PIPELINE = str(PIPELINES / "cpu-long.yaml")
SETTING = ("cluster.devices=2", "rollout.max_new_tokens=40", "logging.eval_every=0", "logging.wandb_mode=disabled",
           "logging.progress=false")
POLICIES = ("async", "bidirl-nomigrate", "bidirl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eta", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).with_name("migration.json")))
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            rounds.append({p: live(Path(scratch) / f"round{r}", p, args.eta, args.steps, PIPELINE, SETTING)
                           for p in POLICIES})
            print(f"round {r}: " + ", ".join(f"{p} {s['samples_per_s']:.1f}" for p, s in rounds[-1].items()), flush=True)
    rows = []
    for p in POLICIES:
        runs = [one[p] for one in rounds]
        rows.append({
            "eta": args.eta, "policy": p, "samples_per_s": round(statistics.mean(s["samples_per_s"] for s in runs), 2),
            "rounds_samples_per_s": [s["samples_per_s"] for s in runs],
            "vs_async": [round(one[p]["samples_per_s"] / one["async"]["samples_per_s"], 3) for one in rounds],
            "vs_nomigrate": [round(one[p]["samples_per_s"] / one["bidirl-nomigrate"]["samples_per_s"], 3)
                             for one in rounds],
            "migrations": [len(s["migrations"]) for s in runs],
            "stopped_mid_generation": [sum(1 for h in s["handovers"] if h["unfinished"]) for s in runs],
            "leases": [{k: v["leases"] for k, v in s["leases"].items()} for s in runs],
            "staleness": [s["staleness_histogram"] for s in runs],
            "busy": {pool: round(statistics.mean(s["time_breakdown"][pool]["busy"] for s in runs), 3)
                     for pool in runs[0]["time_breakdown"]}})
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")

    def fmt(xs):
        return ", ".join(f"{x:g}" for x in xs)

    print("\n| policy | samples/s (rounds) | / async (rounds) | / bidirl-nomigrate (rounds) | migrations "
          "(stopped mid-generation) | busy share per pool |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        busy = " / ".join(f"{pool} {100 * share:.0f}%" for pool, share in sorted(row["busy"].items()))
        moved = ", ".join(f"{m} ({s})" for m, s in zip(row["migrations"], row["stopped_mid_generation"]))
        print(f"| {row['policy']} | {row['samples_per_s']} ({fmt(row['rounds_samples_per_s'])}) | "
              f"{statistics.mean(row['vs_async']):.2f} ({fmt(row['vs_async'])}) | "
              f"{statistics.mean(row['vs_nomigrate']):.2f} ({fmt(row['vs_nomigrate'])}) | {moved} | {busy} |")


if __name__ == "__main__":
    main()
