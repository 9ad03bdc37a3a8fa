"""The results table: 32 simulated H100s, a 7B model, three workloads, eta in {0, 1, 2, 4}, every
baseline at its best split and in its published configuration.

    .venv/bin/python experiments/sim_validation/sweep.py [steps] [processes] [--switch]

For each (workload, eta) row:
  1. every policy that has a split (areal, roll, streamrl, verl-dynamic, verl-async, bidirl) gets its
     best one from the planner (``bidirl.planner.plan``: that policy simulated on candidate splits,
     seed 0, chunk 8, a short horizon), then the best of the 2 splits either side of that pick
     simulated over the table's own steps (``best_split``); ``experiments/planner/quality.py`` checks
     the planner's split and placement against exhaustive search over all 31 splits at both placements
     for every cell of this table;
  2. at that split, each policy runs over 3 seeds x chunk sizes {4, 8, 16}; a cell is the mean; every
     policy with a split (bidirl too) does 1-2 twice, once per older-tail placement
     (``launch.tail_placement`` due / none, ``at_best``), and keeps the better (named in its cell), as
     ``bidirl plan`` chooses between them for a run;
  3. bidirl's ratio to the best baseline (highest mean) is given as mean [min-max] over the 9
     (seed, chunk) pairs, each pair's ratio taken on the same workload draw.
Colocated ``verl`` has no split. ``verl-async`` runs as published (veRL's fully-async recipe: no
log-prob recompute, 4 streamed updates per sync, count-only staleness = the row's eta). Every policy's
trainer is charged the old/proximal log-prob recompute as its system runs it
(``Policy.recomputes_logprob``): veRL, AReaL, ROLL, StreamRL and veRL dynamic scheduling yes; bidirl's
own trainer (one optimizer step per batch: the proximal log-probs come from the forward it trains with)
and veRL fully-async no.
Efficiency is against the policy-independent bound (``bidirl.sim.costs.step_bound``); the detail
table gives every policy's device-time by cause per pool, the bound again for a policy held to the row's
admission window of (eta + 1) B groups in flight (``costs.window_bound``: every policy here is; it caps how
full decoding can get), and the decode batch each ran at against the KV capacity the first bound assumes.
Nothing here is tuned toward a ratio.

``--no-recompute`` instead runs the gsm8k and math rows at eta 0 and 1 with no policy charged the
old log-prob recompute (as if every baseline's trainer skipped it as bidirl's does).

``--rows gsm8k:2,gsm8k:4`` runs only those (workload, eta) rows.

``--switch`` instead sweeps the one switch cost every switching policy pays (0.5, 1, 2 s) on
gsm8k and math at eta 0 and 1, at the splits found with the modelled cost (every baseline at its better
placement, as in the table).

``--cadence`` instead asks where bidirl's gap to ``verl-async`` comes from: every row with bidirl and
``verl-async`` at 1, 2 and 4 optimizer updates per weight sync (``algorithm.updates_per_sync``; 4 is the
published setting, 1 is bidirl's own cadence), each at its own split (``best_split``), with the staleness of the
samples each trains (in optimizer updates, over all 9 runs); ``verl-async`` at its better older-tail placement
at each cadence, as in the table (``at_best``).

After the table and its device-time detail, the table again with each policy at its best staleness within
the row's bound, as ``bidirl plan`` chooses it (``algorithm.plan_staleness``): each cell the best of the rows
at 0, 1, 2, 4 up to the row's eta. The rows themselves run their eta exactly (``EXACT_ETA``).

``--no-refine`` takes the planner's split as it is (how the tables before 2026-12-05 evening were made).

``--instances K`` runs the whole table with coarse instances (``cluster.instance_devices=K``: every
rollout instance tensor-parallel over K devices, every train group K devices, leases of whole
instances) and ``--model M`` with another model preset (``sim.model``), e.g. ``--instances 4`` for
7B and ``--instances 8 --model 32B``.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from multiprocessing import Pool
from pathlib import Path
from typing import Dict, List, Tuple

from bidirl.config import load_config
from bidirl.planner import TIE, plan, staleness_candidates
from bidirl.sched.policy import POLICIES as POLICY_CLASSES
from bidirl.sched.trace import CATEGORIES
from bidirl.sim.run import SimResult, simulate

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

WORKLOADS = {"gsm8k": ["train.prompts_per_step=512", "rollout.group_size=8"],
             "math": ["train.prompts_per_step=256", "rollout.group_size=8"],
             "reasoning": ["train.prompts_per_step=128", "rollout.group_size=8"]}
BASELINES = ["verl", "areal", "roll", "streamrl", "verl-dynamic", "verl-async"]
POLICIES = BASELINES + ["bidirl"]
SPLIT_FREE = {"verl"}
PUBLISHED = {"verl-async": ["algorithm.updates_per_sync=4"]}  # (no recompute: the policy's own)
# each row runs its eta exactly, whatever the default (with algorithm.plan_staleness the planner would choose a
# lower one where faster: the table after the main one, "at the best staleness within the bound", takes that
# from the rows themselves)
EXACT_ETA = ["algorithm.plan_staleness=false"]
SEEDS, CHUNKS, SEARCH_CHUNK = (0, 1, 2), (4, 8, 16), 8
DEVICES = 32


EVERYONE: List[str] = []  # overrides for every policy (--no-recompute)


def config(workload: str, eta: float, steps: int, seed: int, chunk: int, policy: str, extra=()):
    return load_config(str(PIPELINES / "sim-32gpu.yaml"), [
        f"sim.workload={workload}", f"train.steps={steps}", f"algorithm.staleness={eta}", f"launch.chunk_groups={chunk}",
        f"seed={seed}", f"cluster.devices={DEVICES}", *WORKLOADS[workload], *PUBLISHED.get(policy, []), *EXACT_ETA,
        *EVERYONE, *extra])


REFINE = [2]  # splits either side of the planner's pick searched again on the table's horizon (0: none)


def best_split(workload, eta, steps, policy, extra=()) -> int:
    """``policy``'s best split: the planner's (the same search ``bidirl plan`` does, on its short horizon),
    then the planner again over the ``REFINE`` splits either side of that pick, each simulated for the
    table's own ``steps`` (at most the planner's ``SAMPLE_BUDGET``: 61 steps of gsm8k's 512 x 8) -- an
    exhaustive search of the neighbourhood: the issue allows a policy its best split by planner or by
    exhaustive search. Why: on sharp optima the short horizon can miss by one
    split; at gsm8k eta 2 it picked 17/15 for bidirl, 1% ahead of 18/14 at 14 steps, where 24 steps and
    more rank 18/14 first by 6% (``experiments/planner/horizon.py gsm8k 2 bidirl 16,17,18,19 14,24,36``).
    Every policy with a split gets the same search, at the older-tail placement ``extra`` names (default
    the policy's own, which ``runs`` then simulates: the planner does not choose one here)."""
    if not any(e.startswith("launch.tail_placement=") for e in extra):
        extra = [*extra, f"launch.tail_placement={POLICY_CLASSES[policy].tail_placement.value}"]
    cfg = config(workload, eta, steps, 0, SEARCH_CHUNK, policy, [f"launch.mode={policy}", *extra])
    first = plan(cfg, policy).rollout_devices
    if not REFINE[0]:
        return first
    k = max(1, cfg.cluster.instance_devices)  # (splits are whole instances)
    near = list(range(first - REFINE[0] * k, first + REFINE[0] * k + 1, k))
    return plan(cfg, policy, horizon=steps, splits=near).rollout_devices


def runs(workload, eta, steps, policy, split, extra=()) -> Dict[Tuple[int, int], SimResult]:
    return {(seed, chunk): simulate(config(workload, eta, steps, seed, chunk, policy, extra), policy, rollout_devices=split)
            for seed in SEEDS for chunk in CHUNKS}


def breakdown(parts) -> str:
    return "/".join(f"{100 * parts[c]:.0f}" for c in CATEGORIES) if parts else "-"


def paired_ratio(ours: Dict[Tuple[int, int], SimResult], theirs: Dict[Tuple[int, int], SimResult]) -> str:
    """``ours`` / ``theirs`` in samples/s, each (seed, chunk) pair on the same workload draw: mean [min-max]."""
    ratios = [ours[key].samples_per_s / theirs[key].samples_per_s for key in ours]
    return f"{statistics.mean(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


PLACEMENTS = ("due", "none")  # the older-tail placements every policy with a split is searched over


def placements_for(policy: str, eta: float) -> Tuple[str, ...]:
    """The placements ``policy`` is searched over, its own first (a tie keeps it); at eta 0 its own alone,
    since no device decodes an older tail there."""
    own = POLICY_CLASSES[policy].tail_placement.value
    return tuple(sorted(PLACEMENTS, key=lambda p: p != own)) if eta > 0 else (own,)


def at_best(workload, eta, steps, policy, extra=()) -> Tuple[str, Dict[Tuple[int, int], SimResult]]:
    """(placement, runs) of ``policy`` at its best split and, for a policy with a split, at its better
    older-tail placement (``launch.tail_placement``): keeping new groups off a due tail helps some
    policies on some workloads and costs them on others (bidirl's own, none, goes with its streamed
    steps, and costs it 3.5% in instances of 4 at reasoning eta 1), and the fair table gives each its better
    one, as ``bidirl plan`` does (``bidirl.planner.plan_placements``; here on the table's 9 runs)."""
    if policy in SPLIT_FREE:
        return "", runs(workload, eta, steps, policy, None, extra)
    best: Tuple[float, str, Dict[Tuple[int, int], SimResult]] = (-1.0, "", {})
    for placement in placements_for(policy, eta):
        placed = [*extra, f"launch.tail_placement={placement}"]
        results = runs(workload, eta, steps, policy, best_split(workload, eta, steps, policy, placed), placed)
        mean = statistics.mean(r.samples_per_s for r in results.values())
        if mean > best[0]:  # (a tie keeps the policy's own, tried first)
            best = (mean, placement, results)
    return best[1], best[2]


Runs = Dict[Tuple[int, int], float]  # (seed, chunk) -> samples/s


def row(args) -> Tuple[str, List[str], Dict[str, Runs]]:
    workload, eta, steps = args
    placements, results = {}, {}
    for p in POLICIES:
        placements[p], results[p] = at_best(workload, eta, steps, p)
    mean = {p: statistics.mean(r.samples_per_s for r in results[p].values()) for p in POLICIES}
    best = max(BASELINES, key=lambda p: mean[p])
    cells = []
    for p in POLICIES:
        any_run = next(iter(results[p].values()))
        efficiency = statistics.mean(r.efficiency for r in results[p].values())
        split = f" {any_run.rollout_devices}/{DEVICES - any_run.rollout_devices}" if p not in SPLIT_FREE else ""
        cells.append(f"{mean[p]:.2f} ({efficiency:.2f}){split}{' ' + placements[p] if placements[p] else ''}")
    line = (f"| {workload} | {eta} | " + " | ".join(cells) + f" | {best} | "
            f"{paired_ratio(results['bidirl'], results[best])} |")
    detail = []
    for p in POLICIES:
        one = results[p][(0, SEARCH_CHUNK)]  # seed 0, chunk 8: the breakdown of one representative run
        detail.append(f"| {workload} | {eta} | {p} | {one.rollout_devices}/{DEVICES - one.rollout_devices} | "
                      f"{one.samples_per_s:.2f} | {one.step_s:.2f} | {one.bound_step_s:.2f} | {one.efficiency:.2f} | "
                      f"{one.window_bound_s:.2f} | {one.window_bound_s / one.step_s:.2f} | "
                      f"{breakdown(one.time_breakdown.get('rollout'))} | {breakdown(one.time_breakdown.get('train'))} | "
                      f"{one.decode_batch:.0f} x {one.decoding_instances:.1f} | "
                      f"{one.decode_capacity} ({one.decode_token_cost:.1f}x) |")
    return line, detail, {p: {key: r.samples_per_s for key, r in results[p].items()} for p in POLICIES}


def within_bound_rows(table: Dict[Tuple[str, float], Dict[str, Runs]]) -> List[str]:
    """The table again with each policy at its best staleness within the row's bound, as ``bidirl plan``
    chooses it (``algorithm.plan_staleness``: 0, then 1, 2, 4, ... below the bound, and the bound): each
    cell the best of the rows at those etas, the freshest within ``TIE`` of it -- each row is the policy at
    exactly that eta, searched as above, so this needs no run of its own. A row some of whose candidates
    were not run is left out."""
    lines = []
    for (workload, eta), _ in table.items():
        candidates = [(workload, s) for s in staleness_candidates(eta)]
        if not all(c in table for c in candidates):
            continue
        def freshest_of_the_best(p):  # (as the planner: the lowest staleness within TIE of the best)
            means = [statistics.mean(table[c][p].values()) for c in candidates]
            return next(c for c, m in zip(candidates, means) if m >= (1 - TIE) * max(means))

        best = {p: freshest_of_the_best(p) for p in POLICIES}
        mean = {p: statistics.mean(table[best[p]][p].values()) for p in POLICIES}
        top = max(BASELINES, key=lambda p: mean[p])
        ratios = [table[best["bidirl"]]["bidirl"][key] / table[best[top]][top][key] for key in table[best[top]][top]]
        lines.append(f"| {workload} | {eta} | {top} {mean[top]:.2f} (at {best[top][1]:g}) | "
                     f"{mean['bidirl']:.2f} (at {best['bidirl'][1]:g}) | "
                     f"{statistics.mean(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |")
    return lines


def placed_splits(workload, eta, steps) -> Dict[Tuple[str, str], int]:
    """(policy, placement) -> its best split, for every placement ``at_best`` would try it at."""
    return {(p, placement): best_split(workload, eta, steps, p, [f"launch.tail_placement={placement}"])
            for p in POLICIES if p not in SPLIT_FREE for placement in placements_for(p, eta)}


def switch_row(args) -> str:
    workload, eta, steps, splits = args
    cells = []
    for switch_s in (0.5, 1.0, 2.0):
        def mean_of(p, placement, split):
            extra = [f"sim.switch_s={switch_s}", f"launch.tail_placement={placement}"]
            return statistics.mean(simulate(config(workload, eta, steps, seed, SEARCH_CHUNK, p, extra), p,
                                            rollout_devices=split, with_bound=False).samples_per_s for seed in SEEDS)

        mean = {p: mean_of(p, "auto", None) for p in SPLIT_FREE}
        for (p, placement), split in splits.items():  # every baseline at its better placement, as in the table
            mean[p] = max(mean.get(p, 0.0), mean_of(p, placement, split))
        best = max(BASELINES, key=lambda p: mean[p])
        cells.append(f"{mean['bidirl'] / mean[best]:.2f} ({best})")
    return f"| {workload} | {eta} | " + " | ".join(cells) + " |"


CADENCES = (1, 2, 4)  # verl-async's optimizer updates per weight sync in --cadence


def staleness_cell(results: Dict[Tuple[int, int], SimResult]) -> str:
    """Mean and largest staleness (optimizer updates) of the groups trained over all the runs."""
    histogram = sum((Counter(result.staleness) for result in results.values()), Counter())
    return f"{sum(k * n for k, n in histogram.items()) / histogram.total():.1f}, max {max(histogram)}"


def cadence_row(args) -> str:
    workload, eta, steps = args
    arms = {"bidirl": ("bidirl", [])}
    arms.update({f"u={u}": ("verl-async", [f"algorithm.updates_per_sync={u}"]) for u in CADENCES})
    results, placements = {}, {}
    for arm, (policy, extra) in arms.items():
        placements[arm], results[arm] = at_best(workload, eta, steps, policy, extra)
    cells = []
    for arm, by_run in results.items():
        mean = statistics.mean(r.samples_per_s for r in by_run.values())
        any_run = next(iter(by_run.values()))
        placed = f" {placements[arm]}" if placements[arm] else ""
        cells.append(f"{mean:.2f} {any_run.rollout_devices}/{DEVICES - any_run.rollout_devices}{placed} "
                     f"({staleness_cell(by_run)})")
    return (f"| {workload} | {eta} | " + " | ".join(cells) + " | " +
            " | ".join(paired_ratio(results["bidirl"], results[f"u={u}"]) for u in (1, 4)) + " |")


def main(argv: List[str]) -> None:
    for flag, key in (("--instances", "cluster.instance_devices"), ("--model", "sim.model")):
        if flag in argv:
            at = argv.index(flag)
            EVERYONE.append(f"{key}={argv[at + 1]}")
            argv = argv[:at] + argv[at + 2:]
    if "--no-refine" in argv:
        REFINE[0] = 0
    numbers = [a for a in argv if not a.startswith("--") and ":" not in a]
    steps = int(numbers[0]) if numbers else 60
    processes = int(numbers[1]) if len(numbers) > 1 else 2
    if "--switch" in argv:
        jobs = [(w, eta, steps, placed_splits(w, eta, steps)) for w in ("gsm8k", "math") for eta in (0, 1)]
        print("| workload | eta | switch 0.5 s | switch 1 s | switch 2 s |  (bidirl / best baseline)")
        print("|---|---|---|---|---|")
        with Pool(processes) as pool:
            for line in pool.imap(switch_row, jobs):
                print(line, flush=True)
        return
    rows = [(workload, eta) for workload in WORKLOADS for eta in (0, 1, 2, 4)]
    if "--rows" in argv:  # e.g. --rows gsm8k:2,gsm8k:4: only these rows of the table
        rows = [(w, int(e)) for w, e in (item.split(":") for item in argv[argv.index("--rows") + 1].split(","))]
    if "--no-recompute" in argv:
        EVERYONE.append("sim.recompute_logprob=false")
        rows = [(w, eta) for w in ("gsm8k", "math") for eta in (0, 1)]
    if "--cadence" in argv:
        print("| workload | eta | bidirl | verl-async u=1 | verl-async u=2 | verl-async u=4 (published) "
              "| bidirl / u=1 | bidirl / u=4 |  (samples/s, split, staleness in updates: mean, max)")
        print("|---|---|---|---|---|---|---|---|", flush=True)
        with Pool(processes) as pool:
            for line in pool.imap(cadence_row, [(workload, eta, steps) for workload, eta in rows]):
                print(line, flush=True)
        return
    header = ["workload", "eta", *(f"{p}" for p in POLICIES), "best baseline", "bidirl / best: mean [min-max]"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    jobs = [(workload, eta, steps) for workload, eta in rows]
    details: List[str] = []
    table: Dict[Tuple[str, float], Dict[str, Runs]] = {}
    with Pool(processes) as pool:
        for (workload, eta, _), (line, detail, runs_by_policy) in zip(jobs, pool.imap(row, jobs)):
            print(line, flush=True)
            details += detail
            table[(workload, eta)] = runs_by_policy
    print("\nEach policy at its best staleness within the row's bound (the rows above at 0, 1, 2, 4 up to it: "
          "what `bidirl plan` chooses under algorithm.plan_staleness)\n")
    print("| workload | eta (bound) | best baseline (samples/s, at staleness) | bidirl (samples/s, at staleness) | "
          "bidirl / best: mean [min-max] |")
    print("|---|---|---|---|---|")
    print("\n".join(within_bound_rows(table)))
    print("\nDevice-time by cause (seed 0, chunk 8), per pool: busy / tail / admission / switching / draining / "
          "syncing / no reason, %\n")
    print("| workload | eta | policy | split | samples/s | step s | bound s | efficiency | window bound s | "
          "efficiency (window) | rollout pool | train pool | decode batch x instances decoding | "
          "KV capacity (token cost over saturated) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(details))


if __name__ == "__main__":
    main(sys.argv[1:])
