"""Re-planning when response lengths drift, in the simulator: a static planned split against one that
is re-planned on the lengths measured while the job runs.

    .venv/bin/python experiments/planner/drift.py [steps]     # ~5 min on 2 cores

32 simulated H100s, a 7B model, the ``math-drift`` workload (mean response 400 -> 3,200 tokens over
the run), 256 prompts x 8 per step, eta 1. For each policy, mean of 3 seeds:
  * static: the planner's split for the whole run, chosen up front on the pipeline's workload (its
    horizon sees the whole drift, so this is the best single split, not a strawman);
  * re-planned: from that split, every 10 steps the planner is asked again with the mean response
    length measured on the batches trained since the last re-plan (``bidirl.sched.replanning``), and
    devices change home pool at step boundaries.
"""

from __future__ import annotations

import statistics
import sys

from bidirl.config import load_config
from bidirl.planner import plan, replanner
from bidirl.sim.run import simulate

POLICIES, SEEDS = ("areal", "bidirl"), (0, 1, 2)


def config(policy: str, steps: int, seed: int = 0):
    return load_config("pipelines/sim-32gpu.yaml", [
        "sim.workload=math-drift", f"train.steps={steps}", "train.prompts_per_step=256", "rollout.group_size=8",
        "algorithm.staleness=1", "launch.chunk_groups=8", f"seed={seed}", f"launch.mode={policy}"])


def main(argv) -> None:
    steps = int(argv[0]) if argv else 60
    print("| policy | static split | static samples/s | re-planned samples/s | re-planned / static | splits over the run |")
    print("|---|---|---|---|---|---|", flush=True)
    for policy in POLICIES:
        split = plan(config(policy, steps), policy).rollout_devices
        static, replanned, paths = [], [], []
        for seed in SEEDS:
            cfg = config(policy, steps, seed)
            static.append(simulate(cfg, policy, rollout_devices=split).samples_per_s)
            result = simulate(cfg, policy, rollout_devices=split, keep_trace=True, replan=replanner(cfg, policy))
            replanned.append(result.samples_per_s)
            rollout = split
            path = [str(split)]
            for _, _, home in result.cluster.rehomes:
                rollout += 1 if home == "rollout" else -1
                path.append(str(rollout))
            paths.append("->".join(p for i, p in enumerate(path) if i == 0 or p != path[i - 1]))
        s, r = statistics.mean(static), statistics.mean(replanned)
        print(f"| {policy} | {split}/{32 - split} | {s:.2f} | {r:.2f} | {r / s:.3f} "
              f"[{min(b / a for a, b in zip(static, replanned)):.3f}-{max(b / a for a, b in zip(static, replanned)):.3f}] | "
              f"seed 0: {paths[0]} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
