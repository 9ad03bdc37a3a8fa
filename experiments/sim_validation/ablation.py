"""What each bidirl mechanism adds: 32 simulated H100s, 7B, the results table's rows, at bidirl's split.

    .venv/bin/python experiments/sim_validation/ablation.py [steps] [processes]

Per (workload, eta) row, bidirl's split from the planner (as ``sweep.py`` finds it), then at that
split, mean samples/s over seeds 0-2 at chunk 8 of:
  areal            the static split: no streaming, no lending, AReaL's trainer (recomputes log-probs)
  areal-own        the same with bidirl's own trainer (no log-prob recompute): what the trainer alone adds
  bidirl-none      + streamed steps only (no lending, no request moved)
  bidirl-nostream  + both lending directions and in-flight migration (every step waits for its whole batch)
  bidirl-rot       streamed steps + Rollout-on-TrainPool + migration
  bidirl-tor       streamed steps + Trainer-on-RollPool + migration (tails merge within the rollout pool)
  bidirl-nomigrate streamed steps + both directions, no in-flight migration
  bidirl-due       everything, with the baselines' older-tail placement (launch.tail_placement=due: new
                   groups kept off a due tail) instead of bidirl's own (none)
  bidirl           everything
  areal-own-none   areal-own with bidirl's placement (none): what the placement does without streamed steps
each with its ratio to ``areal-own`` at the same split: every bidirl arm trains as bidirl's own trainer does
(``Policy.recomputes_logprob``), so the ratios are the scheduling mechanisms' alone. Every arm with streamed
steps runs bidirl's older-tail placement (none); areal, areal-own and bidirl-nostream run the baselines' (due),
so bidirl-none over areal-own is streamed steps with the placement they make pay. Nothing here is tuned
toward a ratio.
"""

from __future__ import annotations

import statistics
import sys
from multiprocessing import Pool
from typing import List

from sweep import SEARCH_CHUNK, SEEDS, WORKLOADS, best_split, config

from bidirl.sim.run import simulate

ARMS = ["areal", "areal-own", "bidirl-none", "bidirl-nostream", "bidirl-rot", "bidirl-tor", "bidirl-nomigrate",
        "bidirl-due", "bidirl", "areal-own-none"]
VARIANTS = {"areal-own": ("areal", ["sim.recompute_logprob=false"]),  # label -> (policy, overrides)
            "areal-own-none": ("areal", ["sim.recompute_logprob=false", "launch.tail_placement=none"]),
            "bidirl-due": ("bidirl", ["launch.tail_placement=due"])}


def row(args) -> str:
    workload, eta, steps = args
    split = best_split(workload, eta, steps, "bidirl")
    mean = {}
    for arm in ARMS:
        policy, extra = VARIANTS.get(arm, (arm, []))
        mean[arm] = statistics.mean(simulate(config(workload, eta, steps, seed, SEARCH_CHUNK, policy, extra), policy,
                                             rollout_devices=split, with_bound=False).samples_per_s for seed in SEEDS)
    cells = [f"{mean[arm]:.2f} ({mean[arm] / mean['areal-own']:.2f})" for arm in ARMS]
    return f"| {workload} | {eta} | {split}/{32 - split} | " + " | ".join(cells) + " |"


def main(argv: List[str]) -> None:
    steps = int(argv[0]) if argv else 60
    processes = int(argv[1]) if len(argv) > 1 else 2
    print("| workload | eta | bidirl split | " + " | ".join(ARMS) + " |  (samples/s, ratio to areal-own)")
    print("|" + "---|" * (3 + len(ARMS)), flush=True)
    jobs = [(workload, eta, steps) for workload in WORKLOADS for eta in (0, 1, 2, 4)]
    with Pool(processes) as pool:
        for line in pool.imap(row, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
