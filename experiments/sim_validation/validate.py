"""Simulator vs published figures (calibration.md): case A (veRL GSM8K step breakdown), case B (async vs sync).

    .venv/bin/python experiments/sim_validation/validate.py

Prints a markdown table; the README next to this file holds the last run and what disagrees and why.
"""

from __future__ import annotations

from typing import Dict, List

from bidirl.config import load_config
from bidirl.sched.trace import intervals
from bidirl.sim.run import simulate


def phase_seconds(result) -> Dict[str, float]:
    """Mean seconds per step the colocated cluster spends generating and training (device 0's view)."""
    spans = [i for i in intervals(result.cluster.trace, result.makespan_s) if i[0] == 0]
    steps = result.cluster.version
    return {state: sum(stop - start for _, s, _, start, stop in spans if s == state) / steps
            for state in ("generating", "training", "switching")}


def case_a() -> List[str]:
    cfg = load_config("pipelines/sim-32gpu.yaml", [
        "cluster.devices=8", "train.prompts_per_step=1024", "rollout.group_size=5", "train.steps=5",
        "sim.with_reference=true", "launch.chunk_groups=128"])
    result = simulate(cfg, "verl", keep_trace=True)
    phases = phase_seconds(result)
    rows = [("generation", 26.7, phases["generating"]),
            ("old log-prob + reference + actor update", 8.25 + 8.74 + 29.1, phases["training"]),
            ("reshard (two switches)", 1.2, phases["switching"])]
    lines = ["| case A: veRL GRPO 7B GSM8K, 8xH100, 1024x5 | published s | simulated s | error |", "|---|---|---|---|"]
    for name, published, simulated in rows:
        lines.append(f"| {name} | {published:.2f} | {simulated:.2f} | {100 * (simulated / published - 1):+.1f}% |")
    return lines


def case_b() -> List[str]:
    lines = ["| case B: 32xH20, reasoning workload | samples/s | x colocated |", "|---|---|---|"]
    base = ["cluster.devices=32", "sim.hardware=H20", "sim.workload=reasoning", "train.prompts_per_step=128",
            "rollout.group_size=8", "train.steps=20", "algorithm.staleness=1", "launch.chunk_groups=8"]
    cfg = load_config("pipelines/sim-32gpu.yaml", base)
    sync = simulate(cfg, "verl")
    lines.append(f"| colocated sync (verl) | {sync.samples_per_s:.3f} | 1.00 |")
    for split in (8, 16, 24):
        result = simulate(cfg, "areal", rollout_devices=split)
        lines.append(f"| async {split}:{32 - split} (areal, eta=1) | {result.samples_per_s:.3f} | "
                     f"{result.samples_per_s / sync.samples_per_s:.2f} |")
    lines.append("| published: fully-async 16:16 vs colocated | | 2.66 |")
    return lines


if __name__ == "__main__":
    print("\n".join(case_a()))
    print()
    print("\n".join(case_b()))
