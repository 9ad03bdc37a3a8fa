"""``bidirl compare``: bidirl against named baselines on the same workload, data and seeds.

Where it runs: **live** on the pipeline's own devices when the cluster is here (CPU devices this
machine has cores for, or GPUs this node has), through the same runtime ``bidirl launch`` starts;
**simulated** otherwise (a pipeline that describes a cluster that is not here, such as
``sim-32gpu.yaml``, or a GPU pipeline on a machine without GPUs), on the performance model the planner
uses. Either way each policy runs at its own best split (and older-tail placement, where that can
change the run) -- the planner's, on ``sim.profile`` or the analytic model; on two devices the only
one, 1/1; on more CPU devices without a profile, the policy's default split -- whatever split the
pipeline fixes, and every run gets the same seed, so the same prompts.

Every baseline is a *scheduling policy reproduced on bidirl's runtime* and is labelled so, by the
policy's ``style`` (e.g. "veRL-style colocated synchronous"). The exception is ``trl``: the real TRL
``GRPOTrainer`` (:mod:`bidirl.peers`), live only, on the same model, data, reward and samples.

Output, inside the run directory: ``compare.json`` (one row per policy), ``compare.md`` (the table),
``compare_throughput.png`` (bars), live also ``compare_curves.png`` (held-out accuracy and reward per
step, overlaid) and each policy's own run folder (``compare/<name>/``: metrics, trace, Gantt chart).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from bidirl.config import PipelineConfig, load_config
from bidirl.errors import BidirlError, RunFailed
from bidirl.sched.policy import PEERS, POLICIES, baseline_names, style_of
from bidirl.sched.trace import CATEGORIES
from bidirl.ui import say

REPRODUCED = "reproduced on bidirl's runtime"


@dataclass
class Row:
    name: str  # as the user typed it (verl, areal, ...), or bidirl
    label: str
    where: str  # "live" or "simulated"
    split: str  # rollout/train devices
    samples_per_s: float
    time_breakdown: Dict[str, Dict[str, float]]  # per pool: share of device time by cause
    switches: int
    leases: Dict[str, Dict[str, float]]
    bound_ratio: Optional[float] = None  # simulated: the policy-independent bound step / the step
    accuracy_start: Optional[float] = None  # live: held-out greedy accuracy before and after
    accuracy_end: Optional[float] = None
    run_dir: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)
    # the staleness bound it ran at: the pipeline's, or a lower one the planner chose for it
    # (algorithm.plan_staleness); None where not recorded (a peer library's run)
    staleness: Optional[float] = None


def parse_baselines(text: str) -> List[str]:
    """``verl,areal,roll`` -> the names, or one line naming the culprit and the valid names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    valid = ", ".join((*baseline_names(), *PEERS))
    if not names:
        raise BidirlError(f"--baselines: name at least one of {valid}")
    for name in names:
        if name not in baseline_names() and name not in PEERS:
            hint = " (bidirl itself is always compared)" if name == "bidirl" else ""
            raise BidirlError(f"--baselines: unknown baseline '{name}'{hint}; valid: {valid}")
    return list(dict.fromkeys(names))


def label_of(name: str) -> str:
    if name in PEERS:
        return PEERS[name]
    return "bidirl (bidirectional borrowing)" if name == "bidirl" else f"{style_of(name)} ({REPRODUCED})"


def is_here(cfg: PipelineConfig) -> bool:
    """Whether the pipeline's cluster is this machine's: CPU devices it has cores for, or GPUs this node
    has; a pipeline whose stages simulate describes a cluster that is not here."""
    if "simulate" in cfg.stages:
        return False
    devices = max(2, cfg.cluster.devices)
    if cfg.cluster.device_type == "cpu":
        return devices <= (os.cpu_count() or 1)
    from bidirl.runtime.placement import gpus_on_this_node

    return cfg.cluster.nnodes == 1 and (gpus_on_this_node() or 0) >= devices


def live_overrides(cfg: PipelineConfig, name: str) -> List[str]:
    """How a live comparison runs ``name``: on the pipeline's devices (two at least), at the split,
    older-tail placement and staleness (under the pipeline's bound) the planner chooses for it (its own
    where nothing is planned), re-planned as the pipeline says where it has a partition to re-plan."""
    from bidirl.planner import unplanned_staleness

    fresh = unplanned_staleness(cfg).algorithm
    return [f"cluster.devices={max(2, cfg.cluster.devices)}", f"launch.mode={name}", "cluster.rollout_devices=0",
            "launch.tail_placement=auto", f"algorithm.staleness={fresh.staleness!r}",
            f"algorithm.plan_staleness={str(fresh.plan_staleness).lower()}", "algorithm.staleness_bound=null",
            f"cluster.replan_every={replan_every(cfg, name)}"]


def replan_every(cfg: PipelineConfig, name: str) -> int:
    """``cluster.replan_every`` for ``name``: the pipeline's, or 0 for a colocated policy, which has no partition
    to re-plan (as ``bidirl simulate`` re-plans only the policies that have one)."""
    return cfg.cluster.replan_every if POLICIES[name].repartitions else 0


def with_policy(cfg: PipelineConfig, name: str) -> PipelineConfig:
    """``cfg`` for a simulated comparison of ``name``: the split, placement and staleness (under the
    pipeline's bound) left to the planner, as for each policy of a live one (``live_overrides``)."""
    from bidirl.planner import unplanned_staleness

    cfg = unplanned_staleness(cfg)
    return dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, mode=name, tail_placement="auto"),
                               cluster=dataclasses.replace(cfg.cluster, devices=max(2, cfg.cluster.devices),
                                                           rollout_devices=0, replan_every=replan_every(cfg, name)))


def preflight(cfg: PipelineConfig, names: List[str]) -> None:
    """What the comparison would reject, checked before anything is written: every policy's partition
    (live: the runtime's own assembly check; simulated: the planner's)."""
    peers = [n for n in names if n in PEERS]
    policies = [*(n for n in names if n not in PEERS), "bidirl"]
    for name in peers:
        if not is_here(cfg):
            raise BidirlError(f"--baselines {name}: {name} is a real system that runs live only, and this pipeline's "
                              "cluster is not this machine (it would be simulated)")
        from bidirl.peers import check_installed

        check_installed(name)
    if is_here(cfg):
        from bidirl.runtime.launch import check_plan

        for name in policies:
            check_plan(with_policy(cfg, name))
    else:
        from bidirl.planner import preflight as plan_preflight

        for name in policies:
            plan_preflight(cfg, name)


def compare(cfg: PipelineConfig, cfg_path: str, overrides: List[str], names: List[str], out: Path,
            done: Optional[Dict[str, str]] = None, log_table: Optional[Callable[..., None]] = None) -> List[Row]:
    """bidirl and each of ``names``, live or simulated (:func:`is_here`); ``done``: policy -> a live run
    folder already made by an earlier stage (the pipeline's ``launch`` of bidirl), reused; ``log_table``:
    where the table also goes (the run's W&B Table)."""
    policies = [*names, "bidirl"]
    rows = (compare_live(cfg, cfg_path, overrides, policies, out, done or {}) if is_here(cfg)
            else compare_simulated(cfg, policies, out))
    write(rows, out)
    if log_table is not None:
        log_table("comparison", HEADER, table_rows(rows))
    return rows


# ---- live ----------------------------------------------------------------------------------------
def compare_live(cfg: PipelineConfig, cfg_path: str, overrides: List[str], policies: List[str], out: Path,
                 done: Dict[str, str]) -> List[Row]:
    from bidirl.planner import live_partition, live_prior
    from bidirl.runtime.launch import launch, topology_of

    devices = max(2, cfg.cluster.devices)
    rows = []
    for name in policies:
        folder = done.get(name)
        if name in PEERS:
            folder = str(out / "compare" / name)
            say(f"compare: {name} live (the real library) in one process with {devices} threads")
            run_peer(cfg_path, overrides, Path(folder))
        elif folder is None:
            chosen = [*overrides, *live_overrides(cfg, name)]
            run_cfg = load_config(cfg_path, chosen)
            chosen += live_partition(run_cfg)  # this policy's own split (the planner's, or its default)
            run_cfg = load_config(cfg_path, chosen)
            folder = str(out / "compare" / name)
            say(f"compare: {name} live on {devices} {cfg.cluster.device_type} devices")
            code = launch(cfg_path, chosen, run_cfg, topology_of(run_cfg), prior=live_prior(run_cfg), run_path=folder)
            if code:
                raise RunFailed(f"compare: the {name} run exited with code {code} (its files: {folder})")
        rows.append(live_row(name, Path(folder)))
    return rows


def run_peer(cfg_path: str, overrides: List[str], folder: Path) -> None:
    """A peer system in its own process (its threads, its imports), writing a summary as a run does."""
    import subprocess
    import sys

    code = subprocess.call([sys.executable, "-m", "bidirl.peers", str(folder), cfg_path, *overrides])
    if code:
        raise RunFailed(f"compare: the {folder.name} run exited with code {code} (its files: {folder})")


def live_row(name: str, folder: Path) -> Row:
    summary = json.loads((folder / "summary.json").read_text())
    homes = summary.get("homes", [])
    split = f"{homes.count('rollout')}/{homes.count('train')}" if "rollout" in homes else f"colocated x{len(homes)}"
    if name in PEERS:
        split = f"1 process x {summary.get('threads', 1)} threads"
    return Row(name, label_of(name), "live", split, summary["samples_per_s"], summary["time_breakdown"],
               summary["switches"].get("count", 0), summary.get("leases", {}),
               accuracy_start=summary.get("accuracy_start"), accuracy_end=summary.get("accuracy_end"),
               run_dir=str(folder), extra={"staleness_histogram": summary.get("staleness_histogram", {}),
                                           "migrations": len(summary.get("migrations", []))},
               staleness=summary.get("eta"))


# ---- simulated -----------------------------------------------------------------------------------
def compare_simulated(cfg: PipelineConfig, policies: List[str], out: Path) -> List[Row]:
    from bidirl.helpers import helper_processes
    from bidirl.planner import planned_configs, replanners
    from bidirl.sim.report import run_policies, write_outputs

    say(f"compare: simulated ({cfg.cluster.devices} x {cfg.sim.hardware}, sim.model={cfg.sim.model}): the "
        "pipeline's cluster is not this machine")
    with helper_processes():  # the planner's candidates and the plots on the other core
        # each policy at the planner's split and placement for it, as live (with_policy), whatever the
        # pipeline fixed or an earlier plan stage chose for launch.mode
        planned = planned_configs(cfg, policies, each=with_policy)
        results = run_policies(cfg, policies, planned, replanners(cfg, policies, planned))
        write_outputs(results, out / "compare")
    return [Row(name, label_of(name), "simulated", r.split if r.rollout_devices else f"colocated x{r.devices}",
                r.samples_per_s, r.time_breakdown, r.switches, r.leases,
                bound_ratio=r.efficiency, run_dir=str(out / "compare"), staleness=r.eta)
            for name, r in zip(policies, results)]


# ---- output --------------------------------------------------------------------------------------
def pool_cell(parts: Optional[Dict[str, float]]) -> str:
    if not parts:
        return "-"
    busy = 100 * parts.get("busy", 0.0)
    idle = sorted(((c, v) for c, v in parts.items() if c != "busy" and v >= 0.01), key=lambda cv: -cv[1])[:2]
    return f"busy {busy:.0f}%" + "".join(f", {c} {100 * v:.0f}%" for c, v in idle)


def lease_cell(leases: Dict[str, Dict[str, float]]) -> str:
    return (f"{int(leases.get('rollout->train', {}).get('leases', 0))} / "
            f"{int(leases.get('train->rollout', {}).get('leases', 0))}")


def table_rows(rows: List[Row]) -> List[List[str]]:
    bidirl = next(r for r in rows if r.name == "bidirl")
    out = []
    for r in rows:
        accuracy = (f"{100 * r.accuracy_start:.1f} -> {100 * r.accuracy_end:.1f}"
                    if r.accuracy_start is not None and r.accuracy_end is not None else "-")
        out.append([r.name, r.label, r.where, r.split, f"{r.staleness:g}" if r.staleness is not None else "-",
                    f"{r.samples_per_s:.2f}",
                    f"{bidirl.samples_per_s / r.samples_per_s:.2f}x" if r.samples_per_s else "-",
                    pool_cell(r.time_breakdown.get("rollout")), pool_cell(r.time_breakdown.get("train")),
                    f"{r.bound_ratio:.2f}" if r.bound_ratio is not None else "-", str(r.switches), lease_cell(r.leases),
                    accuracy])
    return out


HEADER = ["policy", "what it is", "run", "split r/t", "staleness", "samples/s", "bidirl / this", "rollout pool",
          "train pool", "bound / step", "switches", "leases r->t / t->r", "held-out accuracy %"]


def print_rows(rows: List[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    from bidirl.ui import console

    table = Table(title="bidirl against the baselines (each at its own split: the planner's where there is a "
                        "performance model; same data and seeds)",
                  caption=caption(rows))
    for column in HEADER:
        table.add_column(column, justify="left" if column in ("policy", "what it is") else "right")
    for cells in table_rows(rows):
        cells[1] = cells[1].replace(f" ({REPRODUCED})", "")  # said once, in the caption
        table.add_row(*cells)
    Console(width=None if console.is_terminal else 200).print(table)


def caption(rows: List[Row]) -> str:
    peers = [r.name for r in rows if r.name in PEERS]
    but = f" (except {', '.join(peers)}: the real library)" if peers else ""
    return f"every baseline{but} is a scheduling policy {REPRODUCED}, not the original system"


def markdown(rows: List[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    notes = ["", "Pools: share of device time busy, then the two largest other shares (of "
             f"{', '.join(CATEGORIES)}: switching, draining and syncing are transitions, not idle). "
             "Bound / step: the policy-independent lower bound on the mean step over the simulated step "
             f"(simulated runs only). {caption(rows).capitalize()}."]
    return "\n".join(lines + notes) + "\n"


def write(rows: List[Row], out: Path) -> None:
    from bidirl.plots import plot_bars

    (out / "compare.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    (out / "compare.md").write_text(markdown(rows))
    plot_bars([r.name for r in rows], [r.samples_per_s for r in rows], out / "compare_throughput.png",
              f"{rows[0].where} samples/s", base="bidirl")
    live = [r for r in rows if r.where == "live"]
    if live:
        plot_curves(live, out / "compare_curves.png")
    print_rows(rows)


def plot_curves(rows: List[Row], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, reward) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in rows:
        metrics = [json.loads(line) for line in (Path(r.run_dir) / "metrics.jsonl").read_text().splitlines()]
        evals = [m for m in metrics if "eval_accuracy" in m]
        steps = [m for m in metrics if "reward_mean" in m]
        if evals:
            acc.plot([m["time_s"] for m in evals], [100 * m["eval_accuracy"] for m in evals], marker="o", ms=3,
                     label=r.name)
        if steps:
            reward.plot([m["step"] for m in steps], [m["reward_mean"] for m in steps], label=r.name, lw=1)
    acc.set_xlabel("training time (s)")
    acc.set_ylabel("held-out greedy accuracy (%)")
    reward.set_xlabel("optimizer step")
    reward.set_ylabel("mean reward of the batch")
    for ax in (acc, reward):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
