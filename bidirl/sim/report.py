"""``bidirl simulate``: every requested policy on the configured cluster, a table, Gantt charts, a bar chart."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError
from bidirl.helpers import each_in_helpers, in_background, warm_up
from bidirl.sched.policy import policy_names
from bidirl.sched.trace import CATEGORIES
from bidirl.sim.run import SimResult, simulate
from bidirl.ui import console, progress_bar, say


def simulate_policies(cfg: PipelineConfig, policies: Sequence[str], out: Path,
                      planned: Optional[Dict[str, PipelineConfig]] = None,
                      replanners: Optional[Dict[str, Callable[[float], int]]] = None) -> List[SimResult]:
    results = run_policies(cfg, policies, planned, replanners)
    print_table(cfg, results)
    write_outputs(results, out)
    return results


def check_policies(policies: Sequence[str], given_as: str = "--policies") -> None:
    """Every name is a policy; else one line naming the first that is not, and where the user gave it."""
    unknown = [p for p in policies if p not in policy_names()]
    if unknown:
        raise BidirlError(f"unknown policy '{unknown[0]}' in {given_as} (known: {', '.join(policy_names())})")


def run_policies(cfg: PipelineConfig, policies: Sequence[str], planned: Optional[Dict[str, PipelineConfig]] = None,
                 replanners: Optional[Dict[str, Callable[[float], int]]] = None) -> List[SimResult]:
    """Every policy on the configured cluster, each as ``planned[policy]`` if given (the config with the
    planner's split and instance size filled in), else as configured, and re-planned every
    ``cluster.replan_every`` steps by ``replanners[policy]`` if given; a bad policy name or split is one
    BidirlError. (Every caller has ``planned_configs`` check each policy's settings first, before any is
    planned: so no bad-input line comes after this progress bar.)"""
    from bidirl.plots import import_plotting

    check_policies(policies)
    planned, replanners = planned or {}, replanners or {}
    configs = [(planned.get(name, cfg), name) for name in policies]
    warm_up(import_plotting)  # (the helpers import what the plots drawn next need while the simulations run)
    results: List[SimResult] = []
    try:
        with progress_bar(f"simulate {cfg.train.steps} steps", len(configs), cfg.logging.progress) as advance:
            if replanners:  # (a replanner is a closure: it runs here)
                for one, name in configs:
                    results.append(simulate(one, name, keep_trace=cfg.sim.gantt, replan=replanners.get(name),
                                            replan_every=cfg.cluster.replan_every))
                    advance(policy=name)
                return results
            # each policy is a simulation of its own: in the helper processes where the command has them
            done = each_in_helpers(functools.partial(_simulate, keep_trace=cfg.sim.gantt), configs)
            for (_, name), result in zip(configs, done):
                results.append(result)
                advance(policy=name)
            return results
    except (ValueError, RuntimeError) as exc:  # an impossible split, or a policy that cannot progress
        raise BidirlError(f"simulate: {exc}") from None


def _simulate(config_and_policy, keep_trace: bool) -> SimResult:
    return simulate(*config_and_policy, keep_trace=keep_trace)


def print_table(cfg: PipelineConfig, results: List[SimResult]) -> None:
    """The results go to stdout (progress and notes go to stderr), wide enough not to truncate."""
    from rich.console import Console
    from rich.table import Table

    out = Console(width=None if console.is_terminal else 160)
    sim = cfg.sim
    table = Table(title=f"{cfg.cluster.devices} x {sim.hardware}, {sim.model}, {sim.workload}, "
                        f"{cfg.train.steps} steps of {cfg.train.prompts_per_step}x{cfg.rollout.group_size}")
    for column in ("policy", "split r/t", "eta", "samples/s", f"x {results[0].policy}", "step s", "bound s",
                   "efficiency", "rollout pool %", "train pool %", "switches", "leases r->t / t->r"):
        table.add_column(column, justify="right")
    base = results[0].samples_per_s
    for r in results:
        table.add_row(r.policy, r.split, f"{r.eta:g}",
                      f"{r.samples_per_s:.2f}", f"{r.samples_per_s / base:.2f}" if base else "-", f"{r.step_s:.2f}",
                      f"{r.bound_step_s:.2f}", f"{r.efficiency:.2f}", breakdown_cell(r.time_breakdown.get("rollout")),
                      breakdown_cell(r.time_breakdown.get("train")), str(r.switches),
                      f"{r.leases.get('rollout->train', {}).get('leases', 0)} / "
                      f"{r.leases.get('train->rollout', {}).get('leases', 0)}")
    out.print("pool %: busy / tail / admission / switching / draining / syncing / no reason "
              "(device-time; bound = policy-independent lower bound on the step)")
    out.print(table)
    if not cfg.sim.profile:  # (the analytic model: each trainer as its system runs it, unless sim.recompute_logprob says)
        charged = [r.policy for r in results if r.recomputed_logprob]
        spared = [r.policy for r in results if not r.recomputed_logprob]
        out.print(f"old/proximal log-prob recompute (+2N FLOPs per token) charged to: {', '.join(charged) or 'none'}"
                  f"{'; not to: ' + ', '.join(spared) if spared else ''} (sim.recompute_logprob)")


def breakdown_cell(parts) -> str:
    """busy/tail/admission/switching/draining/syncing/no-reason percentages of one pool's device-time."""
    if not parts:
        return "-"
    return "/".join(f"{100 * parts[c]:.0f}" for c in CATEGORIES)


def write_outputs(results: List[SimResult], out: Path) -> Dict[str, str]:
    """results.json, each policy's trace and Gantt chart, and the throughput bar chart; the charts are
    drawn in helper processes where the command has them (:mod:`bidirl.helpers`), meanwhile the traces
    are written here."""
    from bidirl.plots import plot_bars, plot_gantt

    out.mkdir(parents=True, exist_ok=True)
    plots = {f"gantt-{r.policy}": in_background(plot_gantt, r.cluster.trace, r.makespan_s, out / f"gantt-{r.policy}.png",
                                                f"{r.policy}: {r.samples_per_s:.2f} samples/s")
             for r in results if r.cluster is not None}
    plots["throughput"] = in_background(plot_bars, [r.policy for r in results], [r.samples_per_s for r in results],
                                        out / "throughput.png", "simulated samples/s")
    files = {"results": str(out / "results.json")}
    (out / "results.json").write_text(json.dumps([r.row() for r in results], indent=2))
    for r in results:
        if r.cluster is not None:
            with open(out / f"trace-{r.policy}.jsonl", "w") as trace:
                trace.writelines(json.dumps(record) + "\n" for record in r.cluster.trace)
    files.update({name: str(plot.result()) for name, plot in plots.items()})
    say(f"wrote {out}")
    return files
