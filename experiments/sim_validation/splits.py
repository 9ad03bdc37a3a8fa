"""What borrowing recovers at a split that is not the best one: 32 simulated H100s, 7B, the results table's
workloads, every fourth rollout/train split.

    .venv/bin/python experiments/sim_validation/splits.py [steps] [processes] [--etas 1,4]

A planner can miss, lengths drift, and a user may fix the split by hand. Per (workload, eta, split),
mean samples/s over seeds 0-2 at chunk 8 of:
  areal-own    the static split with bidirl's own trainer (no log-prob recompute, no streaming, no lending)
  bidirl-none  + streamed steps (no lending, no request moved)
  bidirl       + both lending directions and in-flight migration
and each one's share of its own best over the splits run (the column "of best"). A scheduler that
lends well keeps more of its best where the split is wrong. Nothing here is tuned toward a ratio.
"""

from __future__ import annotations

import statistics
import sys
from multiprocessing import Pool
from typing import Dict, List, Tuple

from sweep import SEARCH_CHUNK, SEEDS, WORKLOADS, config

from bidirl.sim.run import simulate

ARMS = {"areal-own": ("areal", ["sim.recompute_logprob=false"]), "bidirl-none": ("bidirl-none", []),
        "bidirl": ("bidirl", [])}
SPLITS = (4, 8, 12, 16, 20, 24, 28)  # rollout devices of 32


def cell(args) -> Tuple[Tuple[str, float, int, str], float]:
    workload, eta, split, arm, steps = args
    policy, extra = ARMS[arm]
    runs = [simulate(config(workload, eta, steps, seed, SEARCH_CHUNK, policy, extra), policy, rollout_devices=split,
                     with_bound=False).samples_per_s for seed in SEEDS]
    return (workload, eta, split, arm), statistics.mean(runs)


USAGE = "usage: splits.py [steps] [processes] [--etas 1,4]"


def bad_input(why: str) -> None:
    print(f"splits.py: {why}; {USAGE}", file=sys.stderr)
    sys.exit(2)


def main(argv: List[str]) -> None:
    etas: List[float] = [1, 4]
    try:
        if "--etas" in argv:
            at = argv.index("--etas")
            etas = [float(e) if "." in e else int(e) for e in argv[at + 1].split(",")]
            argv = argv[:at] + argv[at + 2:]
        steps = int(argv[0]) if argv else 60
        processes = int(argv[1]) if len(argv) > 1 else 2
    except (IndexError, ValueError):
        bad_input(f"cannot read the arguments {' '.join(sys.argv[1:])!r}")
    if steps < 1 or processes < 1 or any(eta < 0 for eta in etas):
        bad_input("steps and processes must be at least 1 and every eta at least 0")
    jobs = [(w, eta, split, arm, steps) for w in WORKLOADS for eta in etas for split in SPLITS for arm in ARMS]
    with Pool(processes) as pool:
        mean: Dict[Tuple[str, float, int, str], float] = dict(pool.imap(cell, jobs))
    print("| workload | eta | split | " + " | ".join(f"{arm} (of best)" for arm in ARMS) + " | bidirl / areal-own |")
    print("|" + "---|" * (4 + len(ARMS)))
    for w in WORKLOADS:
        for eta in etas:
            best = {arm: max(mean[(w, eta, split, arm)] for split in SPLITS) for arm in ARMS}
            for split in SPLITS:
                cells = [f"{mean[(w, eta, split, arm)]:.2f} ({mean[(w, eta, split, arm)] / best[arm]:.2f})"
                         for arm in ARMS]
                ratio = mean[(w, eta, split, "bidirl")] / mean[(w, eta, split, "areal-own")]
                print(f"| {w} | {eta} | {split}/{32 - split} | " + " | ".join(cells) + f" | {ratio:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
