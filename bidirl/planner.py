"""``bidirl plan``: the scheduling-aware planner. Chooses the rollout/train partition by simulating the
policy that will run, on the pipeline's performance model and workload.

Scheduling-aware means the score of a split is the simulated throughput of *that policy* on it (its
staleness bound, its lending, its switches), not a balance of two averages: a policy that borrows
devices at run time can prefer a different split than a static one.

Search (pruned, not all n - 1 splits): candidates are simulated on a short horizon
(:func:`horizon_steps`: about ``PLAN_SAMPLES`` simulated samples, at least ``HORIZON`` and at most
``MAX_HORIZON`` steps, fewer for very large batches so a candidate costs at most ``SAMPLE_BUDGET``
samples): a horizon in samples rather than steps, because a candidate's cost is its simulated samples
and a small batch of long responses needs more steps before its tails settle the ranking (12 steps of
128 reasoning prompts ranked 24/8 first where 60 steps over three seeds rank 27/5 first); plus eta
steps for a policy with per-group deadlines, before which no straggler can hold a batch up. First a
coarse grid of about ``GRID`` evenly spaced splits plus the analytic balance point of the estimated
stage times (``balanced_split``); then a bisection inside the bracket one grid step either side of
the best grid point (throughput against split rises to one plateau and falls: each
round simulates the midpoints on either side of the best so far and halves the bracket). A close
call -- several splits within ``CLOSE`` of the best score -- is settled by simulating those splits
again on twice the horizon (or on the whole run, if shorter; not where no more steps are allowed --
the run's length, or ``SAMPLE_BUDGET`` -- nor where the caller gave the horizon); the plan then lists
only those splits, all scored on that horizon. Near neighbours can swap places on the first steps
alone (bidirl at gsm8k eta 2: 17/15 led 18/14 by 1% at 14 steps, 18/14 leads by 5-6% from 24 steps
on). Instance sizes (below) are compared on one horizon: the longest any size was planned on. Among
splits within ``TIE`` of the best score the one closest to the balance point wins: its residual
imbalance is the smallest in whole devices, which is what borrowed devices absorb.

A cluster of more than ``REPLICA`` devices is planned on a replica of ``REPLICA`` devices with the
same batch per device: the split and the throughput scale with the cluster (what does not scale
is the all-reduce's ring term, 2(n-1)/n, which grows by under 2% from 64 to 1024 devices).
``experiments/planner/quality.py`` checks the choice against exhaustive search.

Coarse instances (``cluster.instance_devices: k``): only splits in whole instances are legal, the
search runs over instances, and a rollout device holds 1/k of the weights (tensor parallel). With
``cluster.instance_devices: 0`` the planner also chooses k (:func:`plan_instance_sizes`): every size
of 1, 2, 4, 8 that divides the cluster into at least two units and fits memory is planned as above, and
the best wins; near-ties (``TIE``) go to the smallest, whose leases lend the finest grain. A profiled
machine's devices run one-device instances, so there k is 1.

Older-tail placement (``launch.tail_placement: auto``, the default): where it can change the run, the
planner also chooses where new groups may go (:func:`plan_placements`,
:class:`~bidirl.sched.cluster.TailPlacement`): not beside a tail of an older version that the next step
waits for (``due``), or beside every tail (``none``, continuous batching). Each placement is planned as
above, and the better wins; near-ties (``TIE``) go to the policy's own. Its worth turns on the split,
the instance size and the workload, as the split's does (bidirl's own, ``none``, is up to 18% better
for it at 7B on one-device instances, and 3.5% worse at reasoning eta 1 in instances of 4), so it is
scored the same way. It cannot change a run at eta 0 (no older tail), a colocated policy, or a driver
whose rollout devices hold one chunk at a time (the CPU runtime: no new group ever goes beside a tail
there); those plans keep ``auto``, the policy's own.

Memory: a partition must fit -- the rollout engine's weights leaving at least 10% of HBM for a KV cache on
every rollout device, and on every train device the training state (16 bytes per parameter) sharded over
the train pool plus one micro-batch's activations, within 95% of HBM (the rest: CUDA context, NCCL
buffers, allocator fragmentation). :func:`fits_memory`, analytic models only, with the model's sizes
counted from its config (``sim.model`` a preset, ``pipeline`` or a config; a profiled CPU has no such
limit here). A colocated policy holds both on every device.

Writes ``plan.json`` (chosen split, predicted step time and samples/s, predicted device-time per pool
by cause, the top alternatives and a one-line reason); :func:`load_plan` validates one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bidirl.config import INSTANCE_SIZES, PipelineConfig
from bidirl.errors import BidirlError, read_json_document
from bidirl.helpers import map_in_helpers, side_by_side
from bidirl.perf.analytic import PerfModel
from bidirl.perf.memory import DeviceBudget
from bidirl.perf.workload import Workload
from bidirl.sched.assembly import DriverCapabilities
from bidirl.sched.cluster import TailPlacement
from bidirl.sched.estimates import Estimates, balanced_split
from bidirl.sched.policy import POLICIES
from bidirl.sim.run import (check_simulation, model_estimates, on_live_trainer, perf_model, sim_workload, simulate,
                            simulated_inflight_groups, unit_model)

SCHEMA = "bidirl.plan/1"
TIE = 0.005  # splits within 0.5% of the best score are equally good
CLOSE = 0.02  # splits within 2% of the best on the planning horizon are scored again on twice that horizon
HORIZON = 12  # simulated steps per candidate at least (a run's own steps if fewer)
PLAN_SAMPLES = 49_152  # simulated samples per candidate aimed at (12 steps of 512 x 8): smaller batches get more steps
MAX_HORIZON = 48
SAMPLE_BUDGET = 250_000  # simulated samples per candidate at most: 1024-device plans stay under a minute
MIN_HORIZON = 4
GRID = 7  # coarse grid points before the bisection
REPLICA = 64  # larger clusters are planned on a replica of this many devices with the same per-device batch


@dataclass
class Candidate:
    rollout_devices: int
    samples_per_s: float
    step_s: float
    time_breakdown: Dict[str, Dict[str, float]] = field(default_factory=dict)


@dataclass
class Plan:
    policy: str
    devices: int
    rollout_devices: int  # 0 for a colocated policy (no partition)
    predicted_step_s: float
    predicted_samples_per_s: float
    predicted_time_breakdown: Dict[str, Dict[str, float]]
    alternatives: List[Dict[str, Any]]
    reason: str
    model: str  # which performance model scored it
    horizon_steps: int
    simulated_splits: int
    plan_seconds: float
    instance_devices: int = 1  # devices per rollout instance / train group (optional in plan.json)
    # the older-tail placement the run takes (launch.tail_placement; optional in plan.json): the one
    # the planner chose, the one the pipeline fixed, or auto (the policy's own) where it cannot matter
    tail_placement: str = TailPlacement.AUTO.value
    # the staleness bound the run keeps (algorithm.staleness; optional in plan.json): the one it was scored
    # at -- the pipeline's, or a lower one the planner chose (algorithm.plan_staleness)
    staleness: Optional[float] = None

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, indent=2)


def describe_model(cfg: PipelineConfig) -> str:
    return f"profile {cfg.sim.profile}" if cfg.sim.profile else f"analytic {cfg.sim.hardware} {cfg.sim.model}"


KV_RESERVE = 0.10  # of HBM a rollout engine must have left after its weights, for a KV cache
TRAIN_HEADROOM = 0.05  # of HBM a train device keeps free beyond training state and activations


def fits_memory(perf: Any, rollout_devices: int, devices: int, longest_sequence: int = 0,
                instance_devices: int = 1) -> bool:
    """``rollout_devices`` 0 means colocated (every device in both roles). Rollout devices: the engine's
    bf16 weights leave at least ``KV_RESERVE`` of HBM for a KV cache. Train devices: the training state
    (16 bytes per parameter: bf16 weights and gradients, fp32 master weights and two AdamW moments)
    sharded over the train pool, FSDP/ZeRO-3 style, plus the activations of one micro-batch holding
    sequences of up to ``longest_sequence`` tokens, within (1 - ``TRAIN_HEADROOM``) of HBM. A rollout
    instance of ``instance_devices`` holds 1/k of the weights on each device (tensor parallel)."""
    if not isinstance(perf, PerfModel):
        return True  # a profiled device: its limits were measured, not modelled
    memory = perf.memory_bytes(longest_sequence)
    train = devices - rollout_devices
    return rollout_fits(memory, instance_devices) and train > 0 and train_fits(memory, train)


def rollout_fits(memory: Dict[str, float], instance_devices: int) -> bool:
    return memory["weights"] / instance_devices < (1 - KV_RESERVE) * memory["hbm"]


def train_fits(memory: Dict[str, float], train_devices: int) -> bool:
    state_and_activations = memory["train_state"] / train_devices + memory["activations"]
    return state_and_activations < (1 - TRAIN_HEADROOM) * memory["hbm"]


def memory_advice(perf: Any, train_devices: int, longest_sequence: int, instance_devices: int = 1) -> str:
    """Why the best case does not fit, in numbers (for the one-line error)."""
    memory, gb = perf.memory_bytes(longest_sequence), 1e9
    if not rollout_fits(memory, instance_devices):
        share = memory["weights"] / instance_devices
        return f"its bf16 weights ({share / gb:.0f} GB per device) leave no KV cache in {memory['hbm'] / gb:.0f} GB"
    return (f"a train device needs {memory['train_state'] / train_devices / gb:.0f} GB of training state (sharded "
            f"over {train_devices}) + {memory['activations'] / gb:.0f} GB of activations, of "
            f"{memory['hbm'] / gb:.0f} GB")


def live_device_budget(cfg: PipelineConfig) -> Optional[DeviceBudget]:
    """:func:`~bidirl.models.footprint.device_budget` of a pipeline meant for the live runtime on accelerators
    (``cluster.device_type: cuda``), when its model's size can be counted without a download (the tiny
    model, a local folder, a hub id already in the local cache, else the ``sim.model`` preset that stands
    for it); None otherwise (``bidirl launch`` checks again once the model is prepared)."""
    if cfg.cluster.device_type != "cuda":
        return None
    from bidirl.models.footprint import device_budget, model_spec_of

    from bidirl.perf.analytic import MODELS

    source = cfg.model.source
    if source != "tiny" and not Path(source).expanduser().exists():  # a hub id: its cached config, no download
        from huggingface_hub import try_to_load_from_cache

        source = try_to_load_from_cache(source, "config.json")
        if not isinstance(source, str):  # not downloaded: the preset it names for the planner, if any
            return device_budget(cfg, MODELS[cfg.sim.model]) if cfg.sim.model in MODELS else None
    return device_budget(cfg, model_spec_of(cfg, "pipeline" if source == "tiny" else source))


def plan(cfg: PipelineConfig, policy: Optional[str] = None, horizon: Optional[int] = None,
         workload: Optional[Workload] = None, check_memory: bool = True,
         driver: Optional[DriverCapabilities] = None, splits: Optional[List[int]] = None) -> Plan:
    """The best partition for ``policy``: :func:`planned_partition`'s, with a spinner that counts the splits
    simulated so far (as the plan's ``simulated_splits`` will) and names the best yet on the planning horizon
    (on a terminal, with ``logging.progress``; nothing inside another bar, such as ``planned_configs``')."""
    if _search.show is not None:  # (a plan inside this one: per instance size, staleness, placement or replica)
        return planned_partition(cfg, policy, horizon, workload, check_memory, driver, splits)
    from bidirl.ui import activity
    with activity(f"planning '{policy or cfg.launch.mode}'", cfg.logging.progress) as show:
        _search.show, _search.devices, _search.splits, _search.best = show, cfg.cluster.devices, 0, None
        try:
            return planned_partition(cfg, policy, horizon, workload, check_memory, driver, splits)
        finally:
            _search.show = None


@dataclass
class _Search:
    """What the spinner of the plan in progress shows (:func:`plan`): ``show`` is None while none runs."""

    show: Optional[Callable[[str], None]] = None
    devices: int = 0  # the cluster planned for (a large one's splits are simulated on a replica)
    splits: int = 0
    best: Optional[Tuple[float, int, int]] = None  # (samples/s, rollout devices, devices)

    def scored(self, candidates: Sequence["Candidate"], devices: int) -> None:
        if self.show is None or not candidates:
            return
        self.splits += len(candidates)
        top = max(candidates, key=lambda c: c.samples_per_s)
        if self.best is None or top.samples_per_s > self.best[0]:
            self.best = (top.samples_per_s, top.rollout_devices, devices)
        rate, r, n = self.best
        split = "colocated" if r == 0 else f"{r}/{n - r}"
        replica = f" of a {n}-device replica" if n == REPLICA and self.devices > REPLICA else ""
        self.show(f"{self.splits} splits simulated, best {split}{replica}: {rate:.3g} samples/s")


_search = _Search()


def planned_partition(cfg: PipelineConfig, policy: Optional[str] = None, horizon: Optional[int] = None,
                      workload: Optional[Workload] = None, check_memory: bool = True,
                      driver: Optional[DriverCapabilities] = None, splits: Optional[List[int]] = None) -> Plan:
    """The best partition for ``policy`` (default ``launch.mode``) on the pipeline's workload (or
    ``workload``: lengths measured by a running job), simulated with ``driver``'s capabilities (default
    the simulated cluster's; ``cfg.live_driver()`` for a ``bidirl launch`` run), over ``horizon`` steps
    (default :func:`horizon_steps`), among ``splits`` if given (rollout devices; a replica's that stand for
    the full cluster's legal ones); impossible settings are BidirlError. Under ``algorithm.plan_staleness``
    the staleness is chosen too, at most ``algorithm.staleness`` (:func:`plan_staleness`), and under
    ``launch.tail_placement: auto`` the older-tail placement, where it can change the run
    (:func:`plan_placements`). The order: instance size, staleness, placement, split."""
    if not cfg.cluster.instance_devices:
        return plan_instance_sizes(cfg, policy, horizon, workload, check_memory, driver)
    policy = policy or cfg.launch.mode
    if staleness_is_open(cfg, policy):
        return plan_staleness(cfg, policy, horizon, workload, check_memory, driver, splits)
    if placement_is_open(cfg, policy, driver, workload):
        return plan_placements(cfg, policy, horizon, workload, check_memory, driver, splits)
    start = time.perf_counter()
    cfg = on_live_trainer(cfg) if driver is not None else cfg  # (a live run's trainer, whatever the policy)
    legal = preflight(cfg, policy, check_memory)
    if splits is not None:
        legal = [x for x in legal if x in splits] or legal
    short = planning_config(cfg, horizon, policy)
    steps = short.train.steps
    devices = cfg.cluster.devices
    workload = workload or sim_workload(cfg)
    if POLICIES[policy].synchronous:  # colocated: every device does both, nothing to partition
        result = simulate(short, policy, with_bound=False, workload=workload, driver=driver)
        only = Candidate(0, result.samples_per_s, result.step_s, result.time_breakdown)
        _search.scored([only], devices)
        return _plan(cfg, policy, only, [only], "colocated policy: every device generates, then trains",
                     steps, 1, start)
    if devices > REPLICA:
        return _plan_on_replica(cfg, policy, legal, start, workload, horizon, driver)
    k = cfg.cluster.instance_devices
    est = model_estimates(cfg, workload=workload, policy=policy)  # of one unit (a device, or an instance of k)
    balance = k * balanced_split(devices // k, est, cfg.train.prompts_per_step)  # preflight: 2 units or more
    scored: Dict[int, Candidate] = {}

    def score_all(units: List[int]) -> None:  # the search runs over whole instances
        todo = [x * k for x in units if x * k not in scored]  # (in helper processes where there are any)
        done = map_in_helpers(functools.partial(candidate, short, policy, workload=workload, driver=driver), todo)
        scored.update(zip(todo, done))
        _search.scored(done, devices)

    def score(units: int) -> float:
        score_all([units])
        return scored[units * k].samples_per_s

    search([x // k for x in legal], balance // k, score, score_all)
    final = scored
    top = max(c.samples_per_s for c in scored.values())
    contenders = [x for x, c in scored.items() if c.samples_per_s >= (1 - CLOSE) * top]
    longer = planning_config(cfg, 2 * steps, policy)
    settled = ""
    if horizon is None and len(contenders) > 1 and longer.train.steps > steps:  # (a horizon given is kept)
        # a close call is settled on twice the horizon: a short horizon ranks near neighbours by noise
        # and by the first steps, where a split short of rollout devices has not yet paid for it (at
        # gsm8k eta 2 bidirl's 17/15 led 18/14 by 1% at 14 steps; 24 steps and more rank 18/14 first
        # by 5-6%, as do 60 steps over 3 seeds). Every split it compares gets the same longer horizon.
        final = dict(zip(contenders, map_in_helpers(functools.partial(
            candidate, longer, policy, workload=workload, driver=driver), contenders)))
        steps, settled = longer.train.steps, (f"; the {len(contenders)} within {CLOSE:.0%} of the best scored again "
                                                f"on {longer.train.steps} steps")
        top = max(c.samples_per_s for c in final.values())
    ties = [c for c in final.values() if c.samples_per_s >= (1 - TIE) * top]
    chosen = min(ties, key=lambda c: (abs(c.rollout_devices - balance), -c.samples_per_s))
    ranked = sorted(final.values(), key=lambda c: -c.samples_per_s)  # (settled: only what was scored on its horizon)
    reason = (f"{chosen.rollout_devices}/{devices - chosen.rollout_devices} gives the best simulated '{policy}' "
              f"throughput ({chosen.samples_per_s:.3g} samples/s) of {len(scored)} splits scored on "
              f"{describe_model(cfg)}{f' in instances of {k} devices' if k > 1 else ''}; stage-time balance "
              f"point {balance}/{devices - balance}{settled}")
    if chosen.samples_per_s < top:
        reason += f"; within {TIE:.1%} of the best, it is the closest to the balance point"
    return _plan(cfg, policy, chosen, ranked, reason, steps, len(scored), start)


def instance_sizes(cfg: PipelineConfig, policy: str) -> List[int]:
    """The instance sizes the planner chooses from (``cluster.instance_devices: 0``): each of 1, 2, 4, 8
    that divides the cluster into units enough for the policy (two pools, or one colocated); 1 alone on
    a profiled machine, whose devices were measured one engine each."""
    if cfg.sim.profile:
        return [1]
    units = 1 if policy in POLICIES and POLICIES[policy].synchronous else 2
    return [k for k in INSTANCE_SIZES if cfg.cluster.devices % k == 0 and cfg.cluster.devices // k >= units] or [1]


def fitting_sizes(cfg: PipelineConfig, policy: str, check_memory: bool = True) -> List[int]:
    """The sizes of :func:`instance_sizes` that pass :func:`preflight` (memory); if none does, the largest
    size's error -- its best case, with the fewest weights per rollout device."""
    fitting, refused = [], None
    for k in instance_sizes(cfg, policy):
        try:
            preflight(with_instances(cfg, k), policy, check_memory)
            fitting.append(k)
        except BidirlError as exc:
            refused = exc
    if not fitting:
        raise refused
    return fitting


def with_instances(cfg: PipelineConfig, instance_devices: int) -> PipelineConfig:
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, instance_devices=instance_devices))


def plan_instance_sizes(cfg: PipelineConfig, policy: Optional[str], horizon: Optional[int],
                        workload: Optional[Workload], check_memory: bool,
                        driver: Optional[DriverCapabilities]) -> Plan:
    """The best split of each instance size that fits (:func:`fitting_sizes`), and the best of those;
    near-ties go to the smallest size (a lease lends a whole instance: smaller ones absorb imbalance more
    finely)."""
    start = time.perf_counter()
    policy = policy or cfg.launch.mode
    plans = plans_of([with_instances(cfg, k) for k in fitting_sizes(cfg, policy, check_memory)], policy, horizon,
                     workload, check_memory, driver)
    plans = on_one_horizon(cfg, plans, policy, workload, check_memory, driver, "instance sizes")
    return chosen_among(plans, start, "instance size", lambda p: f"{p.instance_devices}", "the smallest size",
                        lambda p: f"instances of {p.instance_devices} device{'s' if p.instance_devices > 1 else ''}")


def plans_of(cfgs: List[PipelineConfig], policy: str, horizon: Optional[int], workload: Optional[Workload],
             check_memory: bool, driver: Optional[DriverCapabilities], splits: Optional[List[int]] = None) -> List[Plan]:
    """A plan of each config (of instance sizes, staleness bounds, or placements), searched side by side
    where there are helper processes (``side_by_side``): each search asks for a few splits a round, and
    one after the other they left the helpers idle between rounds."""
    return side_by_side(functools.partial(plan, policy=policy, horizon=horizon, workload=workload,
                                          check_memory=check_memory, driver=driver, splits=splits), cfgs)


def chosen_among(plans: List[Plan], start: float, by: str, label: Callable[[Plan], str], preferred: str,
                 named: Callable[[Plan], str]) -> Plan:
    """The first of ``plans`` (of instance sizes, staleness bounds, or placements, in order of preference:
    ``preferred`` says which) within ``TIE`` of the best, its reason saying why and each one's score, its
    alternatives the best of all of them (:func:`merged_alternatives`), its cost theirs."""
    top = max(p.predicted_samples_per_s for p in plans)
    chosen = next(p for p in plans if p.predicted_samples_per_s >= (1 - TIE) * top)
    scores = ", ".join(f"{label(p)}: {p.predicted_samples_per_s:.3g}" for p in plans)
    tie = f"; within {TIE:.1%} of the best, {preferred}" if chosen.predicted_samples_per_s < top else ""
    return dataclasses.replace(chosen, alternatives=merged_alternatives(chosen, plans),
                               reason=f"{named(chosen)} (best samples/s by {by}: {scores}{tie}); {chosen.reason}",
                               simulated_splits=sum(p.simulated_splits for p in plans),
                               plan_seconds=round(time.perf_counter() - start, 2))


def merged_alternatives(chosen: Plan, plans: List[Plan]) -> List[Dict[str, Any]]:
    """What a plan chosen among ``plans`` (of instance sizes, staleness bounds, or placements) lists: its own best three
    splits, the chosen one first, then the best of the others', six in all."""
    others = sorted((a for p in plans if p is not chosen for a in p.alternatives), key=lambda a: -a["samples_per_s"])
    return (chosen.alternatives[:3] + others)[:6]


def on_one_horizon(cfg: PipelineConfig, plans: List[Plan], policy: str, workload: Optional[Workload],
                   check_memory: bool, driver: Optional[DriverCapabilities], compared: str) -> List[Plan]:
    """``plans`` (of instance sizes, staleness bounds, or placements) made comparable: a plan whose close call was settled on
    twice the horizon has the longer one, and a split scores differently there. The others' picks are
    planned again on the longest, alone, at their own instance size, staleness and placement (on a replica
    too, where the cluster is large, as their first plans were)."""
    longest = max(p.horizon_steps for p in plans)

    def again(p: Plan) -> Plan:
        again = plan(with_plans_staleness(with_placement(with_instances(cfg, p.instance_devices),
                                                         TailPlacement(p.tail_placement)), p),
                     policy, longest, workload, check_memory, driver, splits=[p.rollout_devices])
        return dataclasses.replace(again, reason=f"{p.reason}; scored again on {longest} steps to compare {compared}",
                                   simulated_splits=p.simulated_splits + again.simulated_splits)

    shorter = iter(side_by_side(again, [p for p in plans if p.horizon_steps < longest]))  # (threads: no pickling)
    return [p if p.horizon_steps == longest else next(shorter) for p in plans]


def staleness_is_open(cfg: PipelineConfig, policy: str) -> bool:
    """Is the staleness the planner's to choose? Under ``algorithm.plan_staleness``, above 0, for a policy
    with two pools (a colocated one trains each batch before the next is generated, whatever the bound)."""
    return (cfg.algorithm.plan_staleness and cfg.algorithm.staleness > 0 and policy in POLICIES
            and not POLICIES[policy].synchronous)


def staleness_candidates(bound: float) -> List[float]:
    """The staleness bounds the planner tries under ``bound``: 0 (on-policy), then 1, 2, 4, ... below it,
    then the bound itself (doubling: what a lower bound buys changes slowly away from 0, and every
    candidate costs a whole plan)."""
    candidates, step = [0.0], 1.0
    while step < bound:
        candidates.append(step)
        step *= 2
    return candidates + ([float(bound)] if bound > 0 else [])


def staleness_bound(cfg: PipelineConfig) -> float:
    """The staleness bound of the pipeline ``cfg`` was planned from (its own where no plan lowered it)."""
    return cfg.algorithm.staleness if cfg.algorithm.staleness_bound is None else cfg.algorithm.staleness_bound


def with_staleness(cfg: PipelineConfig, staleness: float) -> PipelineConfig:
    """``cfg`` at exactly ``staleness`` (the planner chooses no other), recording the bound it was chosen
    under where that is higher."""
    bound = staleness_bound(cfg)
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(
        cfg.algorithm, staleness=staleness, plan_staleness=False, staleness_bound=bound if bound > staleness else None))


def unplanned_staleness(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` with the staleness a plan chose given back to the planner: its bound, open again (``bidirl
    compare`` plans every policy afresh)."""
    if cfg.algorithm.staleness_bound is None:
        return cfg
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(
        cfg.algorithm, staleness=cfg.algorithm.staleness_bound, plan_staleness=True, staleness_bound=None))


def with_plans_staleness(cfg: PipelineConfig, result: Plan) -> PipelineConfig:
    """``cfg`` at the staleness ``result`` was scored at, if it names one."""
    return cfg if result.staleness is None else with_staleness(cfg, result.staleness)


def plan_staleness(cfg: PipelineConfig, policy: str, horizon: Optional[int], workload: Optional[Workload],
                   check_memory: bool, driver: Optional[DriverCapabilities], splits: Optional[List[int]]) -> Plan:
    """The best plan at each staleness of :func:`staleness_candidates` (the pipeline's is a bound: a run may
    keep a lower one, and its samples are then no staler than the pipeline allows), and the best of those;
    near-ties (``TIE``) go to the lowest, whose samples are freshest. Compared on one horizon, as instance
    sizes are (:func:`plan_instance_sizes`)."""
    start = time.perf_counter()
    bound = cfg.algorithm.staleness
    plans = on_one_horizon(cfg, plans_of([with_staleness(cfg, s) for s in staleness_candidates(bound)], policy, horizon,
                                         workload, check_memory, driver, splits), policy, workload, check_memory, driver,
                           "staleness bounds")  # (the freshest first)
    return chosen_among(plans, start, "staleness", lambda p: f"{p.staleness:g}", "the freshest",
                        lambda p: f"staleness {p.staleness:g} of at most {bound:g}")


def placement_is_open(cfg: PipelineConfig, policy: str, driver: Optional[DriverCapabilities],
                      workload: Optional[Workload] = None) -> bool:
    """Is the older-tail placement the planner's to choose, and can it change the run? Only under
    ``launch.tail_placement: auto``, for a policy with two pools, at eta > 0 (at eta 0 no device decodes an
    older version's groups), where a rollout device holds more than one chunk in flight, so that new groups
    can go beside its work in flight: in the simulator, a KV cache of more than a chunk's groups (the two
    placements run identically otherwise, and planning both would only double the time); in the live
    runtime, only where chunks join a batch in flight (``launch.inflight_groups``)."""
    if not (TailPlacement(cfg.launch.tail_placement) is TailPlacement.AUTO and policy in POLICIES
            and not POLICIES[policy].synchronous and cfg.algorithm.staleness > 0):
        return False
    held = (driver.inflight_groups if driver is not None
            else simulated_inflight_groups(cfg, unit_model(cfg, policy), workload or sim_workload(cfg)))
    return held > cfg.launch.chunk_groups


def with_placement(cfg: PipelineConfig, placement: TailPlacement) -> PipelineConfig:
    return dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, tail_placement=placement.value))


def plan_placements(cfg: PipelineConfig, policy: str, horizon: Optional[int], workload: Optional[Workload],
                    check_memory: bool, driver: Optional[DriverCapabilities], splits: Optional[List[int]]) -> Plan:
    """The best split at each older-tail placement, and the better of the two; near-ties (``TIE``) go to
    the policy's own. Compared on one horizon, as instance sizes are (:func:`plan_instance_sizes`)."""
    start = time.perf_counter()
    own = POLICIES[policy].tail_placement
    order = [own] + [p for p in (TailPlacement.DUE, TailPlacement.NONE) if p is not own]
    plans = on_one_horizon(cfg, plans_of([with_placement(cfg, p) for p in order], policy, horizon, workload, check_memory,
                                         driver, splits), policy, workload, check_memory, driver, "placements")
    return chosen_among(plans, start, "placement", lambda p: p.tail_placement, "the policy's own",
                        lambda p: f"older-tail placement '{p.tail_placement}'")


def preflight(cfg: PipelineConfig, policy: str, check_memory: bool = True) -> List[int]:
    """The checks a plan can fail without simulating anything (one BidirlError line each); returns the
    splits that fit memory (empty for a colocated policy, and when the planner chooses the instance size:
    then some size must fit). Run before any output exists."""
    if policy not in POLICIES:
        raise BidirlError(f"unknown policy '{policy}' (known: {', '.join(POLICIES)})")
    if check_memory:
        live_device_budget(cfg)  # the runtime's hot-switch devices hold both engines, whatever the split
    if not cfg.cluster.instance_devices:  # the planner's choice: at least one size must pass
        fitting_sizes(cfg, policy, check_memory)
        return []
    devices, k, perf = cfg.cluster.devices, cfg.cluster.instance_devices, perf_model(cfg)
    workload = sim_workload(cfg)
    longest = workload.prompt_tokens + workload.cap  # one sequence never splits over micro-batches
    if POLICIES[policy].synchronous:  # every device holds a rollout engine and a shard of the training state
        if check_memory and not fits_memory(perf, 0, devices, longest, k):  # (rollout in instances of k)
            raise BidirlError(f"sim.model={cfg.sim.model} does not fit in {cfg.sim.hardware} memory colocated on "
                              f"{devices} devices: {memory_advice(perf, devices, longest, k)}; use more "
                              "devices or a smaller model")
        return []
    if devices < 2 * k:
        raise BidirlError(f"policy '{policy}' needs a rollout and a train pool: cluster.devices={devices} is too few "
                          f"(use {2 * k} or more, or a colocated policy such as launch.mode=sync)")
    legal = [x for x in range(k, devices, k) if not check_memory or fits_memory(perf, x, devices, longest, k)]
    if not legal:  # the best case: one rollout instance, every other device training
        raise BidirlError(f"sim.model={cfg.sim.model} does not fit in {cfg.sim.hardware} memory on any partition of "
                          f"{devices} devices: {memory_advice(perf, devices - k, longest, k)}; use more devices or "
                          "a smaller model")
    return legal


def horizon_steps(cfg: PipelineConfig, horizon: Optional[int] = None, policy: Optional[str] = None) -> int:
    """Steps each candidate of ``policy`` (default ``launch.mode``) is simulated for: ``horizon`` if given,
    else about ``PLAN_SAMPLES`` samples' worth (``HORIZON`` to ``MAX_HORIZON`` steps) plus, for a policy
    that bounds each group's staleness, eta steps; never more than the run's steps, nor more than
    ``SAMPLE_BUDGET`` samples (but ``MIN_HORIZON`` steps at least).

    Why eta more: with per-group deadlines a long sequence holds a batch up only at its deadline, eta
    steps after it started, so over the first eta steps a split short of rollout devices looks as good
    as any. (12 steps at gsm8k eta 4 ranked 14/18 first for areal; 16 steps and more, like 60 steps,
    rank 15/17 first, 248 samples/s against 216 at 60 steps, seed 0: 14/18's batches wait 30-80 s for
    a straggler every few steps after step 12.) A count-only policy (veRL fully-async) trains a long
    sequence whenever it ends and never waits for one: nothing to add (at gsm8k eta 2, 14 steps tied
    its 16/16 with 17/15, which 12 steps and 60 steps over 3 seeds rank first, 274 against 261)."""
    samples_per_step = cfg.train.prompts_per_step * cfg.rollout.group_size
    if horizon is None:
        deadlines = POLICIES[policy or cfg.launch.mode].deadlines
        horizon = (min(MAX_HORIZON, max(HORIZON, PLAN_SAMPLES // samples_per_step))
                   + (math.ceil(cfg.algorithm.staleness) if deadlines else 0))
    return max(1, min(cfg.train.steps, horizon, max(MIN_HORIZON, SAMPLE_BUDGET // samples_per_step)))


def planning_config(cfg: PipelineConfig, horizon: Optional[int] = None, policy: Optional[str] = None) -> PipelineConfig:
    """``cfg`` cut to the planner's horizon for ``policy`` (default ``launch.mode``): what every candidate
    split is simulated on."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=horizon_steps(cfg, horizon, policy)))


def candidate(short: PipelineConfig, policy: str, rollout_devices: int, workload: Optional[Workload] = None,
              driver: Optional[DriverCapabilities] = None) -> Candidate:
    """The planner's score of one split: ``policy`` simulated on it over the planning horizon."""
    r = simulate(short, policy, rollout_devices=rollout_devices, with_bound=False, workload=workload, driver=driver)
    return Candidate(rollout_devices, r.samples_per_s, r.step_s, r.time_breakdown)


def _plan_on_replica(cfg: PipelineConfig, policy: str, legal: List[int], start: float,
                     workload: Optional[Workload], horizon: Optional[int], driver: Optional[DriverCapabilities]) -> Plan:
    """Memory is checked on the full cluster (``legal``), not on the replica, whose pools are smaller."""
    devices, factor = cfg.cluster.devices, cfg.cluster.devices / REPLICA
    u = max(1, cfg.algorithm.updates_per_sync)  # (it must divide the batch: the replica's too)
    replica = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, devices=REPLICA), train=dataclasses.replace(
        cfg.train, prompts_per_step=max(u, u * round(cfg.train.prompts_per_step / factor / u))))
    # the replica's splits that stand for a legal one (memory is the full cluster's), each for the legal
    # split nearest its scaled size: what it scores is what the cluster would run
    k = cfg.cluster.instance_devices or 1  # (legal splits are whole instances: k devices apart)
    stands_for = {x: min(legal, key=lambda y: abs(y - x * factor)) for x in range(k, REPLICA, k)}
    allowed = [x for x, y in stands_for.items() if abs(y - x * factor) <= k * factor / 2]
    small = plan(replica, policy, horizon, workload, check_memory=False, driver=driver, splits=allowed or None)
    scaled = [Candidate(min(legal, key=lambda x: abs(x - a["rollout_devices"] * factor)), a["samples_per_s"] * factor,
                        a["step_s"]) for a in small.alternatives]
    chosen = Candidate(min(legal, key=lambda x: abs(x - small.rollout_devices * factor)),
                       small.predicted_samples_per_s * factor, small.predicted_step_s, small.predicted_time_breakdown)
    reason = (f"{chosen.rollout_devices}/{devices - chosen.rollout_devices}: the best split of a {REPLICA}-device replica "
              f"with the same batch per device, scaled by {factor:g} (predicted throughput scaled likewise); "
              f"replica: {small.reason}")
    return _plan(cfg, policy, chosen, scaled, reason, small.horizon_steps,
                 small.simulated_splits, start)


def search(legal: List[int], balance: int, score: Callable[[int], float],
           score_all: Callable[[List[int]], None] = lambda splits: None) -> int:
    """The best of ``legal`` splits by ``score``: a coarse grid, then bisection around its best point.
    ``score_all`` is told each round's splits before they are scored one by one (to score them at once)."""
    step = max(1, len(legal) // GRID)
    grid = sorted({*legal[::step], legal[-1], min(legal, key=lambda x: abs(x - balance))})
    score_all(grid)
    best = max(grid, key=score)
    # the bracket is one grid step either side (the balance point, also scored, does not narrow it: on a
    # noisy plateau the best split can lie beyond it)
    lo, hi = best - step, best + step
    while True:
        inside = [x for x in legal if lo < x < hi]
        left = [x for x in inside if x < best]
        right = [x for x in inside if x > best]
        probes = [side[len(side) // 2] for side in (left, right) if side]
        if not probes:
            return best
        seen = (lo, hi, best, *probes)
        score_all(probes)
        best = max((best, *probes), key=score)
        lo = max(x for x in seen if x < best) if best > lo else lo
        hi = min(x for x in seen if x > best) if best < hi else hi


def _plan(cfg, policy, chosen: Candidate, ranked: List[Candidate], reason: str, steps: int, simulated: int,
          start: float) -> Plan:
    ranked = [chosen] + [c for c in ranked if c.rollout_devices != chosen.rollout_devices]
    alternatives = [{"rollout_devices": c.rollout_devices, "instance_devices": cfg.cluster.instance_devices,
                     "tail_placement": cfg.launch.tail_placement, "staleness": cfg.algorithm.staleness,
                     "samples_per_s": round(c.samples_per_s, 4), "step_s": round(c.step_s, 4)} for c in ranked[:5]]
    return Plan(policy, cfg.cluster.devices, chosen.rollout_devices, round(chosen.step_s, 4),
                round(chosen.samples_per_s, 4), chosen.time_breakdown, alternatives, reason, describe_model(cfg),
                steps, simulated, round(time.perf_counter() - start, 2), cfg.cluster.instance_devices,
                cfg.launch.tail_placement, cfg.algorithm.staleness)


def replanner(cfg: PipelineConfig, policy: Optional[str] = None,
              driver: Optional[DriverCapabilities] = None) -> Callable[[float], int]:
    """For re-planning at run time: mean response length measured -> the planner's split for it (the
    pipeline's workload with that mean and no further drift). Lengths are measured after the cap; a
    workload's mean is before it (:meth:`Workload.uncapped_mean`). A re-plan moves the split only: it is
    scored at the staleness and the older-tail placement the run keeps (``auto``: the policy's own)."""
    base = sim_workload(cfg)
    cfg = with_staleness(cfg, cfg.algorithm.staleness)
    if TailPlacement(cfg.launch.tail_placement) is TailPlacement.AUTO:
        cfg = with_placement(cfg, POLICIES[policy or cfg.launch.mode].tail_placement)

    def choose(mean_tokens: float) -> int:
        measured = dataclasses.replace(base, mean_tokens=base.uncapped_mean(mean_tokens), drift=0.0)
        return plan(cfg, policy, workload=measured, driver=driver).rollout_devices

    return choose


def replanners(cfg: PipelineConfig, policies: List[str],
               planned: Optional[Dict[str, PipelineConfig]] = None) -> Dict[str, Callable[[float], int]]:
    """For ``bidirl simulate``: with ``cluster.replan_every``, a replanner for each policy that has a
    partition, at the instance size, staleness and older-tail placement it runs (``planned[policy]``'s, if
    given)."""
    if not cfg.cluster.replan_every:
        return {}
    planned = planned or {}
    return {p: replanner(planned.get(p, cfg), p) for p in policies if p in POLICIES and not POLICIES[p].synchronous}


def needs_planning(cfg: PipelineConfig, policy: str) -> bool:
    """``cluster.rollout_devices: 0`` with a policy that has a partition on two or more devices, or
    ``cluster.instance_devices: 0``."""
    if not cfg.cluster.instance_devices:
        return True
    return not (cfg.cluster.rollout_devices or POLICIES[policy].synchronous or cfg.cluster.devices < 2)


def resolve_partition(cfg: PipelineConfig, policy: Optional[str] = None) -> PipelineConfig:
    """``cluster.rollout_devices: 0`` (and ``cluster.instance_devices: 0``) mean "ask the planner": the
    config with the planned split (and instance size, the staleness under ``algorithm.plan_staleness``, and
    under ``launch.tail_placement: auto`` the older-tail placement) filled in (unchanged for colocated
    policies and for a split the user chose)."""
    policy = policy or cfg.launch.mode
    if not needs_planning(cfg, policy):
        return cfg
    return planned_config(cfg, plan(cfg, policy))


def planned_config(cfg: PipelineConfig, result: Plan) -> PipelineConfig:
    """``cfg`` running ``result``'s split (a colocated plan leaves the configured one), instance size,
    staleness (a lower one than the pipeline's is run exactly, the pipeline's kept as its bound) and
    older-tail placement (a plan that left it ``auto`` leaves the configured one)."""
    auto = result.tail_placement == TailPlacement.AUTO.value
    cfg = with_staleness(cfg, result.staleness) if chose_staleness(cfg, result) else cfg
    return dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, rollout_devices=result.rollout_devices or cfg.cluster.rollout_devices,
        instance_devices=result.instance_devices),
        launch=dataclasses.replace(cfg.launch, tail_placement=cfg.launch.tail_placement if auto else result.tail_placement))


def planned_overrides(cfg: PipelineConfig, result: Plan) -> List[str]:
    """The ``key=value`` overrides that make a run of ``cfg`` follow ``result``: its split, and its
    older-tail placement and staleness where the plan chose ones the config does not say."""
    placed = result.tail_placement not in (TailPlacement.AUTO.value, cfg.launch.tail_placement)
    chosen = with_staleness(cfg, result.staleness).algorithm if chose_staleness(cfg, result) else None
    bound = "null" if chosen is None or chosen.staleness_bound is None else repr(chosen.staleness_bound)
    return [f"cluster.rollout_devices={result.rollout_devices}",
            *([f"launch.tail_placement={result.tail_placement}"] if placed else []),
            *([f"algorithm.staleness={chosen.staleness!r}", "algorithm.plan_staleness=false",
               f"algorithm.staleness_bound={bound}"] if chosen else [])]


def chose_staleness(cfg: PipelineConfig, result: Plan) -> bool:
    """Was ``result`` scored at another staleness than ``cfg`` runs (one the planner chose under its bound)?"""
    return result.staleness is not None and result.staleness != cfg.algorithm.staleness


def live_partition(cfg: PipelineConfig) -> List[str]:
    """For ``bidirl launch``: the overrides that fix the planned split (and staleness, and placement), or
    nothing. A live run is planned on a profile of its own devices (``sim.profile``); without one, the
    policy's default split is used. The live engines run one device each, so ``cluster.instance_devices:
    0`` (the planner's choice) is 1."""
    from bidirl.ui import say

    if cfg.cluster.replan_every and not cfg.sim.profile and cfg.cluster.device_type == "cpu":
        raise BidirlError("cluster.replan_every on CPU devices needs a profile of them to plan with: run `bidirl "
                          "profile` and pass sim.profile=.../profile.json")
    one_device = [] if cfg.cluster.instance_devices else ["cluster.instance_devices=1"]
    cfg = cfg if cfg.cluster.instance_devices else with_instances(cfg, 1)
    if not needs_planning(cfg, cfg.launch.mode):
        return one_device
    if not cfg.sim.profile and cfg.cluster.device_type == "cpu":
        say("cluster.rollout_devices=0 and no sim.profile: the policy's default split (run `bidirl profile` and "
            "pass sim.profile=.../profile.json to let the planner choose)")
        return one_device
    try:
        result = plan(cfg, driver=cfg.live_driver())  # scored as the live runtime will run it
    except (ValueError, RuntimeError) as exc:  # an impossible setting: one line, before any process starts
        raise BidirlError(f"plan: {exc}") from None
    chosen, overrides = result.rollout_devices, planned_overrides(cfg, result)
    say(f"planner: {chosen} rollout / {cfg.cluster.devices - chosen} train devices for '{cfg.launch.mode}' "
        f"({', '.join([describe_model(cfg), *overrides[1:]])})")
    return [*one_device, *overrides]


def live_prior(cfg: PipelineConfig) -> Tuple[Optional[Estimates], str]:
    """For ``bidirl launch``: what the cost-aware policies believe before the run has measured
    anything, and where that comes from -- the profile of these devices (``sim.profile``), or the
    analytic model of ``sim.hardware``/``sim.model`` on an accelerator; none for a CPU without a profile
    (no analytic model describes it), so such a run lends no trainer before it has measured a chunk, and no
    rollout device before it has measured a step."""
    if not cfg.sim.profile and cfg.cluster.device_type == "cpu":
        return None, "none (no sim.profile): measured as the run goes"
    return model_estimates(on_live_trainer(cfg)), describe_model(cfg)


def planned_configs(cfg: PipelineConfig, policies: List[str],
                    each: Optional[Callable[[PipelineConfig, str], PipelineConfig]] = None) -> Dict[str, PipelineConfig]:
    """For ``bidirl simulate``: each policy's config (``each(cfg, policy)``, if given: ``bidirl compare``
    clears the split, placement and staleness for the planner), with its planned split (and instance size,
    staleness and older-tail placement) where ``cluster.rollout_devices`` (``cluster.instance_devices``) is 0.
    A progress bar counts the policies planned: each plan simulates its candidate splits (about 10 s a
    policy for 32 devices on 2 cores), the longest silent wait of ``bidirl simulate``."""
    from bidirl.ui import progress_bar

    configs = {p: each(cfg, p) if each else cfg for p in policies}
    to_plan = [p for p in policies if needs_planning(configs[p], p)]
    planned: Dict[str, PipelineConfig] = {}
    try:
        for p in policies:  # every policy's bad input before the first is planned (each takes seconds)
            check_simulation(configs[p], p)
            if p in to_plan:
                preflight(configs[p], p)
        with progress_bar("plan each policy's split", len(to_plan), cfg.logging.progress and bool(to_plan)) as advance:
            for p in policies:
                planned[p] = resolve_partition(configs[p], p)
                if p in to_plan:
                    advance(planned=f"{p} {planned[p].cluster.rollout_devices}/"
                            f"{cfg.cluster.devices - planned[p].cluster.rollout_devices}")
    except (ValueError, RuntimeError) as exc:  # an impossible setting: the same line simulate would give
        raise BidirlError(f"simulate: {exc}") from None
    return planned


def print_plan(result: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    from bidirl.ui import console

    out = Console(width=None if console.is_terminal else 140)
    table = Table(title=f"plan for '{result.policy}' on {result.devices} devices ({result.model}, "
                        f"{result.horizon_steps}-step horizon, {result.simulated_splits} splits simulated)")
    placed = any(placement_of(result, alt) != TailPlacement.AUTO.value for alt in result.alternatives)
    stalenesses = {staleness_of(result, alt) for alt in result.alternatives}
    for column in ("split r/t", "instance", *(("staleness",) if len(stalenesses) > 1 else ()),
                   *(("older tails",) if placed else ()), "samples/s", "step s", ""):
        table.add_column(column, justify="right")
    for alt in result.alternatives:
        k, placement = alt.get("instance_devices", result.instance_devices), placement_of(result, alt)
        staleness = staleness_of(result, alt)
        chosen = (alt["rollout_devices"], k, placement, staleness) == (
            result.rollout_devices, result.instance_devices, result.tail_placement, result.staleness)
        table.add_row(f"{alt['rollout_devices']}/{result.devices - alt['rollout_devices']}" if alt["rollout_devices"]
                      else "colocated", f"{k} device{'s' if k > 1 else ''}",
                      *((f"{staleness:g}",) if len(stalenesses) > 1 else ()), *((placement,) if placed else ()),
                      f"{alt['samples_per_s']:.3f}", f"{alt['step_s']:.3f}", "chosen" if chosen else "")
    out.print(table)
    if result.tail_placement != TailPlacement.AUTO.value and not placed:
        out.print(f"older-tail placement: {result.tail_placement}")
    out.print(result.reason)


def placement_of(result: Plan, alternative: Dict[str, Any]) -> str:
    """The older-tail placement an alternative was scored at (plans written before they named one: the plan's)."""
    return alternative.get("tail_placement", result.tail_placement)


def staleness_of(result: Plan, alternative: Dict[str, Any]) -> Optional[float]:
    """The staleness an alternative was scored at (likewise)."""
    return alternative.get("staleness", result.staleness)


def write_plan(result: Plan, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "plan.json.tmp"
    tmp.write_text(result.to_json())
    tmp.replace(out / "plan.json")
    return out / "plan.json"


def load_plan(path: str | Path, cfg: PipelineConfig) -> Plan:
    """A validated plan that still fits the pipeline; otherwise one line naming the file and the key."""
    path = Path(path)
    data = read_json_document(path, SCHEMA, "plan.json", "plan again with `bidirl plan PIPELINE`")
    names = [f.name for f in dataclasses.fields(Plan)]
    # older plans: one-device instances, the policy's placement, the pipeline's staleness
    optional = {"instance_devices", "tail_placement", "staleness"}
    missing = [n for n in names if n not in data and n not in optional]
    if missing:
        raise BidirlError(f"{path}: missing key '{missing[0]}'; plan again with `bidirl plan`")
    for key in ("devices", "rollout_devices"):
        if isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 0:
            raise BidirlError(f"{path}: key '{key}' must be a whole number >= 0")
    if data["rollout_devices"] >= data["devices"]:
        raise BidirlError(f"{path}: key 'rollout_devices' ({data['rollout_devices']}) must be below 'devices' "
                          f"({data['devices']}); plan again with `bidirl plan`")
    if not isinstance(data["policy"], str) or data["policy"] not in POLICIES:
        raise BidirlError(f"{path}: key 'policy' names no known policy ({data['policy']!r}); plan again with `bidirl plan`")
    if data["devices"] != cfg.cluster.devices:
        raise BidirlError(f"{path}: planned for {data['devices']} devices ({data['rollout_devices']} rollout) but the "
                          f"pipeline has cluster.devices={cfg.cluster.devices}; plan again with `bidirl plan`")
    k = data.get("instance_devices", 1)
    if not isinstance(k, int) or isinstance(k, bool) or k not in INSTANCE_SIZES:  # (2.0 == 2, but not a size)
        raise BidirlError(f"{path}: key 'instance_devices' must be one of {', '.join(map(str, INSTANCE_SIZES))}; "
                          "plan again with `bidirl plan`")
    if cfg.cluster.instance_devices and k != cfg.cluster.instance_devices:  # 0: the planner's choice, any size
        raise BidirlError(f"{path}: planned for instances of {k} devices but the pipeline has "
                          f"cluster.instance_devices={cfg.cluster.instance_devices}; plan again with `bidirl plan`")
    if data["devices"] % k or data["rollout_devices"] % k:  # (the run would round the split to whole instances)
        raise BidirlError(f"{path}: key 'rollout_devices' ({data['rollout_devices']} of {data['devices']}) must be "
                          f"whole instances of {k} devices; plan again with `bidirl plan`")
    if not data["rollout_devices"] and not POLICIES[data["policy"]].synchronous:
        raise BidirlError(f"{path}: key 'rollout_devices' is 0 (colocated), but policy '{data['policy']}' has a "
                          "rollout and a train pool; plan again with `bidirl plan`")
    if data["policy"] != cfg.launch.mode:  # (a split is the best for the policy it was planned for)
        raise BidirlError(f"{path}: planned for policy '{data['policy']}' but the pipeline has "
                          f"launch.mode={cfg.launch.mode}; plan again with `bidirl plan`")
    # (a plan written before placements were planned has none: it was scored at the pipeline's, as is one
    # whose placement could not change the run, which says auto)
    placement = data.get("tail_placement", TailPlacement.AUTO.value)
    placements = [p.value for p in TailPlacement]
    if placement not in placements:
        raise BidirlError(f"{path}: key 'tail_placement' must be one of {', '.join(placements)}; plan again with "
                          "`bidirl plan`")
    if TailPlacement.AUTO.value not in (placement, cfg.launch.tail_placement) and placement != cfg.launch.tail_placement:
        raise BidirlError(f"{path}: planned with older-tail placement '{placement}' but the pipeline has "
                          f"launch.tail_placement={cfg.launch.tail_placement}; plan again with `bidirl plan`")
    staleness = data.get("staleness")
    if staleness is not None:
        if isinstance(staleness, bool) or not isinstance(staleness, (int, float)) or not 0 <= staleness < math.inf:
            raise BidirlError(f"{path}: key 'staleness' must be a number >= 0; plan again with `bidirl plan`")
        fixed = not cfg.algorithm.plan_staleness  # (the user's, or one a plan already chose: exactly)
        if staleness > staleness_bound(cfg) or (fixed and staleness != cfg.algorithm.staleness):
            has = (f"algorithm.staleness={cfg.algorithm.staleness:g} (algorithm.plan_staleness: false)" if fixed
                   else f"algorithm.staleness={staleness_bound(cfg):g}")
            raise BidirlError(f"{path}: planned at staleness {staleness:g} but the pipeline has {has}; "
                              "plan again with `bidirl plan`")
    return Plan(**{n: data[n] for n in names if n not in optional}, instance_devices=k, tail_placement=placement,
                staleness=staleness)
