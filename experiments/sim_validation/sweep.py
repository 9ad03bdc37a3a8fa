"""The scheduler issue's results table: 32 simulated H100s, a 7B model, three workloads, eta in {0,1,2,4}.

    .venv/bin/python experiments/sim_validation/sweep.py [steps] [processes] [seeds]

For each (workload, eta): throughput of every baseline at its own split, the best *tuned* static split
(areal over every split, searched on seed 0), the bidirl ablation started from that tuned split (no
borrowing / one direction / both: the partition is an input to the scheduler, chosen by the planner),
and bidirl from its own estimate-balanced split. Every cell is the mean over ``seeds`` workload draws
(a single draw moves a policy's throughput by a few percent: long tails land differently). Nothing
here is tuned toward a ratio: the simulator is calibrated on case A and checked on case B (validate.py).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from multiprocessing import Pool

from bidirl.config import load_config
from bidirl.sim.run import best_static_split, simulate

WORKLOADS = {"gsm8k": ["train.prompts_per_step=512", "rollout.group_size=8"],
             "math": ["train.prompts_per_step=256", "rollout.group_size=8"],
             "reasoning": ["train.prompts_per_step=128", "rollout.group_size=8"]}
BASELINES = ["verl", "areal", "roll", "streamrl", "verl-dynamic", "verl-async"]
ABLATION = ["bidirl-none", "bidirl-rot", "bidirl-tor", "bidirl"]


@dataclass
class Mean:
    """A policy's results averaged over seeds (same fields the table needs)."""

    policy: str
    samples_per_s: float
    efficiency: float
    rollout_devices: int
    devices: int


def mean_over_seeds(configs, policy: str, rollout_devices=None) -> Mean:
    results = [simulate(cfg, policy, rollout_devices=rollout_devices) for cfg in configs]
    return Mean(policy, statistics.mean(r.samples_per_s for r in results),
                statistics.mean(r.efficiency for r in results), results[0].rollout_devices, results[0].devices)


def row(args) -> str:
    workload, eta, steps, seeds = args
    configs = [load_config("pipelines/sim-32gpu.yaml", [f"sim.workload={workload}", f"train.steps={steps}",
                                                        f"algorithm.staleness={eta}", "launch.chunk_groups=8",
                                                        f"seed={seed}", *WORKLOADS[workload]]) for seed in range(seeds)]
    baselines = {p: mean_over_seeds(configs, p) for p in BASELINES}
    split = best_static_split(configs[0], eta).rollout_devices
    tuned = mean_over_seeds(configs, "areal", split)
    ablation = {p: mean_over_seeds(configs, p, split) for p in ABLATION}
    own = mean_over_seeds(configs, "bidirl")
    cell = lambda r: f"{r.samples_per_s:.2f} ({r.efficiency:.2f})"  # noqa: E731
    best = max([*baselines.values(), tuned], key=lambda r: r.samples_per_s)
    best_name = "tuned split" if best is tuned else best.policy
    bidirl = ablation["bidirl"].samples_per_s
    cells = [cell(baselines[p]) for p in BASELINES]
    cells.append(f"{cell(tuned)} {tuned.rollout_devices}/{tuned.devices - tuned.rollout_devices}")
    cells += [cell(ablation[p]) for p in ABLATION]
    cells.append(f"{cell(own)} {own.rollout_devices}/{own.devices - own.rollout_devices}")
    line = (f"| {workload} | {eta} | " + " | ".join(cells) +
            f" | {bidirl / best.samples_per_s:.2f} ({best_name}) | {bidirl / tuned.samples_per_s:.2f} |")
    ratios = [bidirl / r.samples_per_s for r in [*baselines.values(), tuned]]
    return line, f"| {workload} | {eta} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |"


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    processes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    seeds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    header = ["workload", "eta", *BASELINES, "areal tuned split", *(f"{p} @ tuned" for p in ABLATION),
              "bidirl @ own split", "bidirl @ tuned / best baseline", "bidirl @ tuned / tuned split"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    jobs = [(workload, eta, steps, seeds) for workload in WORKLOADS for eta in (0, 1, 2, 4)]
    ratio_lines = []
    with Pool(processes) as pool:
        for line, ratios in pool.imap(row, jobs):
            print(line, flush=True)
            ratio_lines.append(ratios)
    print("\nbidirl @ tuned split / each baseline:\n")
    print("| workload | eta | " + " | ".join(f"x {p}" for p in [*BASELINES, "tuned split"]) + " |")
    print("|" + "---|" * (len(BASELINES) + 3))
    print("\n".join(ratio_lines))
