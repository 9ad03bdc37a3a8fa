"""How long a horizon the planner needs: per-split scores on the planner's objective at several
horizons (seed 0) against the quality benchmark's re-score (60 steps, mean of 3 seeds).

    .venv/bin/python experiments/planner/horizon.py reasoning 1 bidirl 22,23,24,25,26,27 12,24,48

(the cell the flat 12-step horizon missed; any row of ``quality.py``'s table works)
"""

from __future__ import annotations

import sys

from quality import config, seed_mean

from bidirl.sim.run import simulate


def main(workload: str, eta: str, policy: str, splits: str, horizons: str) -> None:
    chosen = [int(x) for x in splits.split(",")]
    print("| horizon | " + " | ".join(f"{x}/{32 - x}" for x in chosen) + " |")
    print("|---|" + "---|" * len(chosen))
    for steps in (int(h) for h in horizons.split(",")):
        short = config(workload, float(eta), policy, steps=steps)
        scores = [simulate(short, policy, rollout_devices=x, with_bound=False).samples_per_s for x in chosen]
        print(f"| {steps} steps, seed 0 | " + " | ".join(f"{s:.3f}" for s in scores) + " |", flush=True)
    rescored = [seed_mean(workload, float(eta), policy, x) for x in chosen]
    print("| 60 steps, 3 seeds | " + " | ".join(f"{s:.3f}" for s in rescored) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:])
