"""The scheduler issue's results table: 32 simulated H100s, a 7B model, three workloads, eta in {0,1,2,4}.

    .venv/bin/python experiments/sim_validation/sweep.py [steps]

For each (workload, eta): throughput of every baseline, the best *tuned* static split (areal over
every split), bidirl, and the ablation (bidirl's partition with no borrowing / one direction / both).
Nothing here is tuned toward a ratio: the simulator is calibrated on case A (validate.py) only.
"""

from __future__ import annotations

import sys

from bidirl.config import load_config
from bidirl.sim.run import best_static_split, simulate

WORKLOADS = {"gsm8k": ["train.prompts_per_step=512", "rollout.group_size=8"],
             "math": ["train.prompts_per_step=256", "rollout.group_size=8"],
             "reasoning": ["train.prompts_per_step=128", "rollout.group_size=8"]}
POLICIES = ["verl", "areal", "roll", "streamrl", "verl-dynamic", "bidirl-none", "bidirl-rot", "bidirl-tor", "bidirl"]

if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    header = ["workload", "eta", *POLICIES, "areal best split", "bidirl / best baseline", "bidirl / best split"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for workload, sizes in WORKLOADS.items():
        for eta in (0, 1, 2, 4):
            cfg = load_config("pipelines/sim-32gpu.yaml", [f"sim.workload={workload}", f"train.steps={steps}",
                                                           f"algorithm.staleness={eta}", "launch.chunk_groups=8", *sizes])
            results = {p: simulate(cfg, p) for p in POLICIES}
            best = best_static_split(cfg, eta)
            cells = [f"{results[p].samples_per_s:.2f} ({results[p].efficiency:.2f})" for p in POLICIES]
            baseline = max(results[p].samples_per_s for p in ("verl", "areal", "roll", "streamrl", "verl-dynamic"))
            bidirl = results["bidirl"].samples_per_s
            print(f"| {workload} | {eta} | " + " | ".join(cells) +
                  f" | {best.samples_per_s:.2f} ({best.rollout_devices}/{best.devices - best.rollout_devices}) | "
                  f"{bidirl / baseline:.2f} | {bidirl / best.samples_per_s:.2f} |", flush=True)
