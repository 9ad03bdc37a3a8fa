"""Simulator vs published figures (calibration.md): case A (veRL GSM8K step breakdown), case B (veRL
fully-async vs colocated on 32 H20), case C (the BiDiRL RFC's borrowing ablation).

    .venv/bin/python experiments/sim_validation/validate.py

Prints a markdown table; the README next to this file holds the last run and what disagrees and why.
"""

from __future__ import annotations

import statistics
from typing import Dict, List
from pathlib import Path

from bidirl.config import load_config
from bidirl.planner import candidate, plan, planned_config, planning_config
from bidirl.sched.trace import intervals
from bidirl.sim.run import simulate

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)


def phase_seconds(result) -> Dict[str, float]:
    """Mean wall seconds per step of each phase of a colocated run, from device 0's view: generation is
    the time it serves rollout (generating, or idle waiting for the slowest sequence elsewhere)."""
    spans = [i for i in intervals(result.cluster.trace, result.makespan_s) if i[0] == 0]
    steps = result.cluster.version
    phases = {"generating": lambda s, r: r == "rollout" and s in ("generating", "idle", "syncing"),
              "training": lambda s, r: s == "training", "switching": lambda s, r: s == "switching"}
    return {name: sum(stop - start for _, s, r, start, stop in spans if test(s, r)) / steps
            for name, test in phases.items()}


def case_a() -> List[str]:
    cfg = load_config(str(PIPELINES / "sim-32gpu.yaml"), [
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


CASE_B = ["cluster.devices=32", "sim.hardware=H20", "sim.workload=dapo-28k", "train.prompts_per_step=512",
          "rollout.group_size=16", "train.steps=20", "launch.chunk_groups=8"]
# the published fully-async run: staleness_threshold 0.5, partial rollout, trigger_parameter_sync_step 4
# (4 streamed updates per sync), old log-probs taken from the rollout (no recompute); colocated recomputes
FULLY_ASYNC = ["algorithm.staleness=0.5", "algorithm.updates_per_sync=4",  # (no recompute: verl-async's own)
               "algorithm.plan_staleness=false"]  # (the published threshold, exactly)


def case_b() -> List[str]:
    sync = simulate(load_config(str(PIPELINES / "sim-32gpu.yaml"), CASE_B), "verl", keep_trace=True)
    phases = phase_seconds(sync)
    lines = ["| case B: veRL, Qwen2.5-Math-7B DAPO 28k, 32xH20, 512x16 | published | simulated |", "|---|---|---|",
             f"| colocated step s | 790.10 | {sync.step_s:.1f} |",
             f"| colocated generation s | 357.41 | {phases['generating']:.1f} |",
             f"| colocated old log-prob + update s | 377.51 | {phases['training']:.1f} |"]
    cfg = load_config(str(PIPELINES / "sim-32gpu.yaml"), CASE_B + FULLY_ASYNC)
    published = {16: "2.66 (2.68 per step)"}
    for split in (8, 16, 24):
        result = simulate(cfg, "verl-async", rollout_devices=split)
        lines.append(f"| fully-async {split}:{32 - split} x colocated (trainer idle {result.idle_ratio['train']:.0%}, "
                     f"rollout idle {result.idle_ratio['rollout']:.0%}) | {published.get(split, '')} | "
                     f"{result.samples_per_s / sync.samples_per_s:.2f} |")
    # the planner's view of the same three splits: its own objective (the planning horizon, seed 0)
    chosen = plan(cfg, "verl-async")
    short = planning_config(planned_config(cfg, chosen), policy="verl-async")  # (at the placement it chose)
    scores = {split: candidate(short, "verl-async", split).samples_per_s for split in (8, 16, 24)}
    ranking = " > ".join(f"{x}:{32 - x}" for x in sorted(scores, key=scores.get, reverse=True))
    lines.append(f"| planner ranking ({short.train.steps}-step horizon) | 8:24 > 16:16 > 24:8 | {ranking} |")
    lines.append(f"| planner's split for verl-async ({chosen.simulated_splits} splits simulated, older-tail "
                 f"placement {chosen.tail_placement}) |  | {chosen.rollout_devices}:{32 - chosen.rollout_devices} |")
    return lines


def tor_ceiling(result, lendable: int) -> float:
    """An estimate of the most Trainer-on-RollPool could add to ``result``, a Rollout-on-TrainPool-only run,
    under one premise: it speeds up nothing but the train step's gradient work. At best -- all ``lendable``
    rollout instances in every step from its start, switches, transfers and the generation they would lose
    all free -- that cuts a step's work W / n to W / (n + lendable); n: the instances that trained the step,
    averaged over its wall time (from the run's trace; they only join a step in progress, so this is the
    most a step of the same work could be shortened), W: the step's share of the run's gradient work
    (``SimResult.train_work_s``, in instance-seconds here). Ceiling = makespan / (makespan - those
    savings): a step that waits for its groups (streamed) is charged only for its work, never the wait."""
    cluster = result.cluster
    spans = [i for i in intervals(cluster.trace, result.makespan_s) if i[1] == "training"]
    steps = [i for i in spans if i[0] == cluster.primary]
    assert len(steps) == cluster.steps, "the primary trains each step in one stretch"
    work = result.train_work_s / result.instance_devices / cluster.steps
    saving = 0.0
    for _, _, _, start, stop in steps:
        n = sum(min(stop, i[4]) - max(start, i[3]) for i in spans if i[3] < stop and i[4] > start) / (stop - start)
        saving += work / n - work / (n + lendable)
    return result.makespan_s / (result.makespan_s - saving)


def case_c() -> List[str]:
    """The BiDiRL RFC ablation's setting: 16 GPUs split 4 rollout / 12 train, batch 60, ~2k responses."""
    lines = ["| case C: 16xH100, 4/12, 60x8, math workload | none | RoT only | ToR only | both | "
             "both / none (published) | both / best one direction (published) | ToR's ceiling over RoT only |",
             "|---|---|---|---|---|---|---|---|"]
    published = {0: "1.51", 1: "1.30", 2: "1.17", 4: "1.11"}
    for eta in (0, 1, 2, 4):
        configs = [load_config(str(PIPELINES / "sim-32gpu.yaml"), [
            "cluster.devices=16", "sim.workload=math", "train.prompts_per_step=60", "rollout.group_size=8",
            "train.steps=30", f"algorithm.staleness={eta}", "launch.chunk_groups=4", f"seed={seed}",
            "sim.recompute_logprob=true"])  # the RFC's implementation trains with veRL's trainer, which recomputes
            for seed in range(3)]  # mean of three workload draws
        runs = {p: [simulate(cfg, p, rollout_devices=4, keep_trace=p == "bidirl-rot") for cfg in configs]
                for p in ("bidirl-none", "bidirl-rot", "bidirl-tor", "bidirl")}
        r = {p: statistics.mean(x.samples_per_s for x in results) for p, results in runs.items()}
        ceiling = statistics.mean(tor_ceiling(x, 4) for x in runs["bidirl-rot"])
        one = max(r["bidirl-rot"], r["bidirl-tor"])
        lines.append(f"| eta={eta} | {r['bidirl-none']:.2f} | {r['bidirl-rot']:.2f} | {r['bidirl-tor']:.2f} | "
                     f"{r['bidirl']:.2f} | {r['bidirl'] / r['bidirl-none']:.2f} ({published[eta]}) | "
                     f"{r['bidirl'] / one:.2f} (1.10-1.12) | {ceiling:.3f} |")
    return lines


if __name__ == "__main__":
    print("\n".join(case_a()))
    print()
    print("\n".join(case_b()))
    print()
    print("\n".join(case_c()))
