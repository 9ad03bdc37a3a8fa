"""Re-planning when response lengths drift, in the simulator: a static planned split against one that
is re-planned on the lengths measured while the job runs.

    .venv/bin/python experiments/planner/drift.py [steps]     # ~5 min on 2 cores

32 simulated H100s, a 7B model, the ``math-drift`` workload (mean response 400 -> 3,200 tokens over
the run), 256 prompts x 8 per step, eta 1. For each policy, mean of 3 seeds:
  * static, planned at launch: the planner's split for the lengths a job knows when it starts (the
    workload as measured at launch: mean 400 tokens, no drift) -- what a job that never re-plans runs;
  * re-planned: from that split, every 10 steps the planner is asked again with the mean response
    length measured on the batches trained since the last re-plan (``bidirl.sched.replanning``), and
    devices change home pool at step boundaries;
  * static, oracle: the planner's split chosen up front on the whole run's workload, drift included
    (its horizon sees the whole drift, so this is the best single split: a job cannot know it), and
    re-planned from that split.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import dataclasses

from bidirl.config import load_config
from bidirl.planner import plan, replanner
from bidirl.sched.policy import POLICIES as POLICY_CLASSES
from bidirl.sim.run import sim_workload, simulate

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

POLICIES, SEEDS = ("areal", "bidirl"), (0, 1, 2)


def config(policy: str, steps: int, seed: int = 0):
    return load_config(str(PIPELINES / "sim-32gpu.yaml"), [
        "sim.workload=math-drift", f"train.steps={steps}", "train.prompts_per_step=256", "rollout.group_size=8",
        "algorithm.staleness=1", "launch.chunk_groups=8", f"seed={seed}", f"launch.mode={policy}",
        f"launch.tail_placement={POLICY_CLASSES[policy].tail_placement.value}",
        "algorithm.plan_staleness=false"])  # (the split alone is studied)


def compare(policy: str, steps: int, split: int):
    """Mean samples/s of the static split and of re-planning from it, per-seed ratios, seed 0's path."""
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
    ratios = [b / a for a, b in zip(static, replanned)]
    return statistics.mean(static), statistics.mean(replanned), ratios, paths[0]


def main(argv) -> None:
    steps = int(argv[0]) if argv else 60
    print("| policy | planned on | static split | static samples/s | re-planned samples/s | re-planned / static "
          "[seeds] | splits over the run (seed 0) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for policy in POLICIES:
        cfg = config(policy, steps)
        at_launch = dataclasses.replace(sim_workload(cfg), drift=0.0)  # what the job knows when it starts
        for name, split in (("lengths at launch", plan(cfg, policy, workload=at_launch).rollout_devices),
                            ("the whole run (oracle)", plan(cfg, policy).rollout_devices)):
            s, r, ratios, path = compare(policy, steps, split)
            print(f"| {policy} | {name} | {split}/{32 - split} | {s:.2f} | {r:.2f} | {r / s:.3f} "
                  f"[{min(ratios):.3f}-{max(ratios):.3f}] | {path} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
