"""The scheduler issue's results table: 32 simulated H100s, a 7B model, three workloads, eta in {0,1,2,4}.

    .venv/bin/python experiments/sim_validation/sweep.py [steps] [processes]

For each (workload, eta): throughput of every baseline at its own split, the best *tuned* static split
(areal over every split), the bidirl ablation started from that tuned split (no borrowing / one
direction / both: the partition is an input to the scheduler, chosen by the planner), and bidirl from
its own estimate-balanced split. Nothing here is tuned toward a ratio: the simulator is calibrated on
case A and checked on case B (validate.py).
"""

from __future__ import annotations

import sys
from multiprocessing import Pool

from bidirl.config import load_config
from bidirl.sim.run import best_static_split, simulate

WORKLOADS = {"gsm8k": ["train.prompts_per_step=512", "rollout.group_size=8"],
             "math": ["train.prompts_per_step=256", "rollout.group_size=8"],
             "reasoning": ["train.prompts_per_step=128", "rollout.group_size=8"]}
BASELINES = ["verl", "areal", "roll", "streamrl", "verl-dynamic", "verl-async"]
ABLATION = ["bidirl-none", "bidirl-rot", "bidirl-tor", "bidirl"]


def row(args) -> str:
    workload, eta, steps = args
    cfg = load_config("pipelines/sim-32gpu.yaml", [f"sim.workload={workload}", f"train.steps={steps}",
                                                   f"algorithm.staleness={eta}", "launch.chunk_groups=8",
                                                   *WORKLOADS[workload]])
    baselines = {p: simulate(cfg, p) for p in BASELINES}
    tuned = best_static_split(cfg, eta)
    ablation = {p: simulate(cfg, p, rollout_devices=tuned.rollout_devices) for p in ABLATION}
    own = simulate(cfg, "bidirl")
    cell = lambda r: f"{r.samples_per_s:.2f} ({r.efficiency:.2f})"  # noqa: E731
    best = max([*baselines.values(), tuned], key=lambda r: r.samples_per_s)
    best_name = "tuned split" if best is tuned else best.policy
    bidirl = ablation["bidirl"].samples_per_s
    cells = [cell(baselines[p]) for p in BASELINES]
    cells.append(f"{cell(tuned)} {tuned.rollout_devices}/{tuned.devices - tuned.rollout_devices}")
    cells += [cell(ablation[p]) for p in ABLATION]
    cells.append(f"{cell(own)} {own.rollout_devices}/{own.devices - own.rollout_devices}")
    return (f"| {workload} | {eta} | " + " | ".join(cells) +
            f" | {bidirl / best.samples_per_s:.2f} ({best_name}) | {bidirl / tuned.samples_per_s:.2f} |")


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    processes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    header = ["workload", "eta", *BASELINES, "areal tuned split", *(f"{p} @ tuned" for p in ABLATION),
              "bidirl @ own split", "bidirl @ tuned / best baseline", "bidirl @ tuned / tuned split"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    jobs = [(workload, eta, steps) for workload in WORKLOADS for eta in (0, 1, 2, 4)]
    with Pool(processes) as pool:
        for line in pool.imap(row, jobs):
            print(line, flush=True)
