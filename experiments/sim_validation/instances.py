"""Coarse instances: does lending whole k-device instances make borrowing matter more?

    .venv/bin/python experiments/sim_validation/instances.py [steps]

32 simulated H100s, the results table's workloads at eta 1 (seed 0, chunk 8), each policy at the
planner's split for it, with instances of k devices (``cluster.instance_devices``: a rollout
instance tensor-parallel over k, a train group of k, leases of whole instances): 7B at k = 1 and 4,
32B at k = 8. Prints samples/s of the best version-bounded baseline among areal/roll/streamrl and of
bidirl, their ratio, and bidirl's leases. (``sweep.py --instances K [--model M]`` runs the whole table.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from bidirl.config import load_config
from bidirl.planner import plan, planned_config
from bidirl.sim.run import simulate

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

WORKLOADS = {"gsm8k": ["train.prompts_per_step=512"], "math": ["train.prompts_per_step=256"],
             "reasoning": ["train.prompts_per_step=128"]}
SHAPES = [("7B", 1), ("7B", 4), ("32B", 1), ("32B", 8)]
BASELINES = ("areal", "roll", "streamrl")


def run(workload: str, model: str, k: int, policy: str, steps: int):
    cfg = load_config(str(PIPELINES / "sim-32gpu.yaml"), [
        f"sim.workload={workload}", f"sim.model={model}", f"cluster.instance_devices={k}", f"train.steps={steps}",
        "algorithm.staleness=1", "algorithm.plan_staleness=false", "launch.chunk_groups=8", "rollout.group_size=8",
        f"launch.mode={policy}", *WORKLOADS[workload]])  # (eta 1 exactly: borrowing at one staleness)
    return simulate(planned_config(cfg, plan(cfg, policy)), policy)  # (the planner's split and placement)


def main(argv) -> None:
    steps = int(argv[0]) if argv else 30
    print("| workload | model | k | best baseline (samples/s, split) | bidirl (samples/s, split) | bidirl / best | "
          "bidirl leases r->t / t->r |")
    print("|---|---|---|---|---|---|---|")
    for workload in WORKLOADS:
        for model, k in SHAPES:
            results = {p: run(workload, model, k, p, steps) for p in (*BASELINES, "bidirl")}
            best = max(BASELINES, key=lambda p: results[p].samples_per_s)
            b, o = results["bidirl"], results[best]
            leases = b.leases
            count = lambda d: int(leases.get(d, {}).get("leases", 0))  # noqa: E731
            print(f"| {workload} | {model} | {k} | "
                  f"{best} {o.samples_per_s:.1f} ({o.rollout_devices}/{o.devices - o.rollout_devices}) | "
                  f"{b.samples_per_s:.1f} ({b.rollout_devices}/{b.devices - b.rollout_devices}) | "
                  f"{b.samples_per_s / o.samples_per_s:.2f} | {count('rollout->train')} / {count('train->rollout')} |",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
