"""Simulate one policy (or several) on the configured cluster; the figures ``bidirl simulate`` reports.

With ``cluster.instance_devices: k`` > 1 the scheduler runs on units of k devices (a rollout instance
tensor-parallel over k, a train group of k; :mod:`bidirl.perf.instances`): the cluster of n devices
is n/k units, every policy decides on units, and results are reported in devices."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from bidirl.config import PipelineConfig
from bidirl.perf.analytic import HARDWARE, MODELS, PerfModel
from bidirl.perf.instances import InstanceModel
from bidirl.perf.model import PerformanceModel
from bidirl.perf.workload import Workload, preset
from bidirl.sched.assembly import DriverCapabilities, RunShape, assemble
from bidirl.sched.cluster import Cluster
from bidirl.sched.estimates import Estimates
from bidirl.sched.policy import POLICIES
from bidirl.sched.replanning import NO_REPLANNING, LengthReplanner
from bidirl.sched.trace import idle_and_breakdown, steady_step_s
from bidirl.sim.costs import CalibratedCosts, DrawnGroups, bound_of, bound_work, estimates, make_instance
from bidirl.sim.simulator import Simulator


@dataclass
class SimResult:
    policy: str
    eta: float  # the staleness bound the policy ran under (0 for synchronous policies)
    rollout_devices: int
    devices: int
    makespan_s: float
    samples_per_s: float
    tokens_per_s: float
    step_s: float
    bound_step_s: float  # the policy-independent lower bound on the mean step time (costs.step_bound)
    idle_ratio: Dict[str, float]
    time_breakdown: Dict[str, Dict[str, float]]  # per pool: busy and idle by cause (sched.trace.CATEGORIES)
    staleness: Dict[int, int]
    switches: int  # device role switches (an instance of k devices switching is k of them)
    leases: Dict[str, Dict[str, float]]  # per direction: leases (of whole instances), device-seconds, longest
    sim_seconds: float
    cluster: Optional[Cluster] = field(default=None, repr=False)
    steady_step_s: float = 0.0  # mean step after the first few (sched.trace.steady_step_s)
    instance_devices: int = 1  # devices per rollout instance / train group
    migrated_groups: int = 0  # prompt groups moved in flight to another device (Migrate)
    recomputed_logprob: bool = False  # its trainer was charged an old/proximal log-prob forward (recomputes_logprob)
    train_work_s: float = 0.0  # device-seconds of gradient work over the run (every batch's, however shared)
    # what decoding ran at: the decode batch (sequences) averaged over every instance's decoding time; the
    # KV capacity the bound's saturated decode assumes (costs.step_bound); and what a token cost (decoding
    # instance-seconds per token generated) over what it costs at capacity ((a + b * cap) / cap)
    decode_batch: float = 0.0
    decode_capacity: int = 0
    decode_token_cost: float = 0.0
    decoding_instances: float = 0.0  # instances decoding, averaged over the run (x decode_batch: sequences decoding)
    # the bound for a policy that never has more groups in flight than this run's admission window,
    # (eta + 1) batches of B groups (u updates of B / u each, where weights sync every u updates), the same
    # for every asynchronous policy at one eta (colocated verl: one batch; costs.window_bound): no policy held
    # to that window can beat it
    window_bound_s: float = 0.0

    @property
    def split(self) -> str:
        """``rollout/train`` devices, and the instance size where it is not one device."""
        k = f" k={self.instance_devices}" if self.instance_devices > 1 else ""
        return f"{self.rollout_devices}/{self.devices - self.rollout_devices}{k}"

    @property
    def efficiency(self) -> float:
        """Lower bound / step time: 1.0 would be every device busy with useful work at full speed."""
        return self.bound_step_s / self.step_s if self.step_s else 0.0

    def row(self) -> Dict[str, Any]:
        return {"policy": self.policy, "eta": self.eta, "split": self.split, "instance_devices": self.instance_devices,
                "samples_per_s": round(self.samples_per_s, 3), "tokens_per_s": round(self.tokens_per_s, 1),
                "step_s": round(self.step_s, 3), "bound_step_s": round(self.bound_step_s, 3),
                "efficiency": round(self.efficiency, 3), "idle_ratio": self.idle_ratio,
                "time_breakdown": self.time_breakdown,
                "staleness": {str(k): v for k, v in sorted(self.staleness.items())}, "switches": self.switches,
                "leases": self.leases, "recomputed_logprob": self.recomputed_logprob,
                "train_work_s": round(self.train_work_s, 3),
                "decode_batch": round(self.decode_batch, 1), "decode_capacity": self.decode_capacity,
                "decode_token_cost": round(self.decode_token_cost, 2),
                "window_bound_s": round(self.window_bound_s, 3), "decoding_instances": round(self.decoding_instances, 2),
                "sim_seconds": round(self.sim_seconds, 3)}


def recomputes_logprob(cfg: PipelineConfig, policy: Optional[str] = None) -> bool:
    """Whether the analytic model charges ``policy``'s trainer (default ``launch.mode``) a forward pass that
    recomputes old/proximal log-probs: ``sim.recompute_logprob`` if set, else what that policy's system does
    (:attr:`~bidirl.sched.policy.Policy.recomputes_logprob`). A simulated policy costs what the system it
    stands for runs: bidirl's own trainer takes them from the forward it trains with, veRL's and AReaL's
    recompute them."""
    forced, name = cfg.sim.recompute_logprob, policy or cfg.launch.mode
    if forced is not None:
        return forced
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy '{name}' (known: {', '.join(POLICIES)})")
    return POLICIES[name].recomputes_logprob


def on_live_trainer(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` as a live run trains: the live runtime runs bidirl's own trainer under every policy, whatever
    system its scheduling follows, so nothing recomputes log-probs there (unless ``sim.recompute_logprob``
    says so). For whatever predicts a ``bidirl launch`` run: the planner with the live driver, the prior."""
    if cfg.sim.recompute_logprob is not None:
        return cfg
    return dataclasses.replace(cfg, sim=dataclasses.replace(cfg.sim, recompute_logprob=False))


def perf_model(cfg: PipelineConfig, policy: Optional[str] = None) -> PerformanceModel:
    """The fitted model of ``sim.profile`` if one is given, else the analytic model of the declared hardware
    as it times ``policy``'s trainer (default ``launch.mode``; see :func:`recomputes_logprob`)."""
    sim = cfg.sim
    if sim.profile:
        from bidirl.perf.fitted import load_profile

        return load_profile(sim.profile).model()  # (the live trainer as measured: sim.recompute_logprob is analytic)
    if sim.model in MODELS:
        spec = MODELS[sim.model]
    else:
        from bidirl.models.footprint import model_spec_of

        spec = model_spec_of(cfg, sim.model)
    return PerfModel(HARDWARE[sim.hardware], spec, mfu=sim.mfu, rollout_efficiency=sim.rollout_efficiency,
                     with_reference=sim.with_reference, recompute_logprob=recomputes_logprob(cfg, policy),
                     load_s=sim.load_s)


def instance_size(cfg: PipelineConfig) -> int:
    """``cluster.instance_devices``, which must have been chosen by now (0 asks the planner to choose it)."""
    if not cfg.cluster.instance_devices:
        raise ValueError("cluster.instance_devices=0 (the planner's choice) must be planned before simulating: "
                         "bidirl.planner.resolve_partition")
    return cfg.cluster.instance_devices


def unit_model(cfg: PipelineConfig, policy: Optional[str] = None) -> PerformanceModel:
    """The performance model of one scheduling unit: a device, or an instance of ``cluster.instance_devices``."""
    k = instance_size(cfg)
    return perf_model(cfg, policy) if k == 1 else InstanceModel(perf_model(cfg, policy), k)


def unit_shape(cfg: PipelineConfig) -> RunShape:
    """The run's shape in scheduling units (devices when ``cluster.instance_devices`` is 1)."""
    shape, k = cfg.run_shape(), instance_size(cfg)
    return dataclasses.replace(shape, devices=shape.devices // k, rollout_devices=shape.rollout_devices // k)


def simulated_inflight_groups(cfg: PipelineConfig, perf: PerformanceModel, workload: Workload) -> int:
    """Groups a simulated rollout unit holds in flight: it batches continuously, so a KV cache's worth at
    once -- and at least one chunk."""
    return max(cfg.launch.chunk_groups, -(-make_instance(perf, workload).capacity // cfg.rollout.group_size))


def simulated_driver(cfg: PipelineConfig, perf: PerformanceModel, workload: Workload) -> DriverCapabilities:
    """What the simulated cluster can do: mid-step joins, interruptible generation, continuous batching of a
    KV cache's worth of groups, streamed updates, re-homing and migration."""
    return DriverCapabilities(allows_join=True, interruptible=True, streams_updates=True,
                              inflight_groups=simulated_inflight_groups(cfg, perf, workload), rehomes=True,
                              migrates=True)


def check_simulation(cfg: PipelineConfig, policy_name: str) -> None:
    """What :func:`simulate` would refuse before it simulates anything (ValueError, or BidirlError naming a
    file): the performance model and workload (a corrupt or foreign ``sim.profile``) and the policy's
    assembly on the configured cluster (too few devices for two pools, a staleness bound it cannot keep,
    updates per sync that do not divide the batch). Nothing is simulated, so a command checks every policy
    before it plans or simulates the first: bad input is one line, not a minute of planning and then one.
    (An instance size left to the planner is checked at one device here; the planner checks the sizes.)"""
    if not cfg.cluster.instance_devices:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, instance_devices=1))
    perf, workload = unit_model(cfg, policy_name), sim_workload(cfg)
    assemble(policy_name, unit_shape(cfg), simulated_driver(cfg, perf, workload), model_estimates(cfg, perf, workload))


def sim_workload(cfg: PipelineConfig) -> Workload:
    """The measured workload of ``sim.profile`` if it has one, else the ``sim.workload`` preset."""
    if cfg.sim.profile:
        from bidirl.perf.fitted import check_profile_fits, load_profile, measured_with

        profile = load_profile(cfg.sim.profile)
        check_profile_fits(profile, cfg.sim.profile, measured_with(cfg))
        measured = profile.measured_workload()
        if measured is not None:
            return measured
    return preset(cfg.sim.workload)


def model_estimates(cfg: PipelineConfig, perf: Optional[PerformanceModel] = None,
                    workload: Optional[Workload] = None, policy: Optional[str] = None) -> Estimates:
    """What the cost-aware policies believe work costs, from the performance model of ``cfg`` (its
    profile or its analytic hardware, as it times ``policy``'s trainer) on its workload: what the
    simulator's policies decide with, and a live run's starting point before it has measured anything."""
    perf, workload = perf or unit_model(cfg, policy), workload or sim_workload(cfg)
    shape = unit_shape(cfg)
    return estimates(perf, workload, cfg.rollout.group_size, shape.batch_groups, shape.devices,
                     cfg.sim.switch_s or perf.switch_seconds(), shape.chunk_groups)


def simulate(cfg: PipelineConfig, policy_name: str, eta: Optional[float] = None,
             rollout_devices: Optional[int] = None, keep_trace: bool = False, with_bound: bool = True,
             workload: Optional[Workload] = None, replan: Optional[Callable[[float], int]] = None,
             replan_every: int = 10, driver: Optional[DriverCapabilities] = None) -> SimResult:
    """``policy_name`` on the configured cluster (or on ``workload``). With ``replan`` (mean response
    length -> rollout devices, e.g. the planner), the partition is re-planned every ``replan_every``
    steps on the lengths measured so far (:class:`~bidirl.sched.replanning.LengthReplanner`).

    ``driver``: the capabilities to simulate (default: the simulated cluster's -- mid-step joins,
    interruptible generation, continuous batching of a KV cache's worth of groups). Pass the live
    runtime's (:data:`~bidirl.sched.assembly.LIVE`) to predict a ``bidirl launch`` run: one chunk in
    flight per device, loads at the chunk's end, mid-step joins in whole micro-batches. ``rollout_devices`` counts devices
    (a multiple of ``cluster.instance_devices``), and so does the result."""
    start = time.perf_counter()
    cfg = on_live_trainer(cfg) if driver is not None else cfg  # (predicting a live run: its trainer)
    k = instance_size(cfg)
    own_workload = workload is None  # (the bound is of the configured workload: it may reuse our draws)
    perf, workload = unit_model(cfg, policy_name), workload or sim_workload(cfg)
    shape = unit_shape(cfg)
    if eta is not None:
        shape = dataclasses.replace(shape, staleness=eta)
    if rollout_devices is not None:
        if rollout_devices % k:
            raise ValueError(f"{rollout_devices} rollout devices are not whole instances of {k} devices")
        shape = dataclasses.replace(shape, rollout_devices=rollout_devices // k)
    G, devices, steps = cfg.rollout.group_size, shape.devices, shape.steps
    switch_s = cfg.sim.switch_s  # one figure for every policy whose devices switch (0: the model's)
    est = model_estimates(cfg, perf, workload)
    simulator_can = driver or simulated_driver(cfg, perf, workload)
    costs: Optional[CalibratedCosts] = None  # built below, once the cluster knows its step count
    replanner = (LengthReplanner(replan_every, lambda: costs.trained_lengths.mean_since_last_asked(),
                                 lambda mean: replan(mean) // k)  # the planner counts devices, the cluster units
                 if replan else NO_REPLANNING)
    run = assemble(policy_name, shape, simulator_can, est, replanner)
    policy, cluster = run.policy, run.cluster
    costs = CalibratedCosts(perf, workload, G, cluster.steps, cfg.seed, switch_s=switch_s)
    pull = cfg.train.micro_batch_size if simulator_can.pulls_micro_batches else 0
    simulator = Simulator(cluster, policy, costs, pull_samples=pull, lease_timeout_s=cfg.launch.lease_timeout_s,
                          whole_calls=not simulator_can.reports_groups)
    simulator.run()
    makespan = cluster.now
    samples = cluster.trained_groups * G
    bound = bound_step(cfg, perf, shape.staleness, costs.drawn if own_workload else None) if with_bound else 0.0
    # the bound of the window this run was held to -- at the eta it ran under (0 for a synchronous policy,
    # whose on-policy tail then counts too), not the configured one
    window = cluster.admission_limit(0)  # groups the run may ever have in flight
    window_bound = (bound_step(cfg, perf, cluster.eta, costs.drawn if own_workload else None, window)
                    if with_bound else 0.0)
    homes_map = cluster.homes_at_start()  # (a device re-planning moved is charged to each pool in turn)
    idle, breakdown = idle_and_breakdown(cluster.trace, makespan, homes_map, cluster.step_wait_s)
    return SimResult(policy_name, cluster.eta, run.rollout_devices * k, devices * k, makespan,
                     samples / makespan, costs.tokens() / makespan, makespan / steps, bound,
                     idle, breakdown, dict(cluster.staleness),
                     costs.switches * k, in_devices(cluster.lease_summary(), k), time.perf_counter() - start,
                     cluster if keep_trace else None,
                     steady_step_s(cluster.version_times, updates_per_step=cluster.updates_per_sync), k,
                     sum(groups for _, _, _, groups, _ in cluster.migrations),
                     not cfg.sim.profile and recomputes_logprob(cfg, policy_name), costs.train_device_s * k,
                     *decode_batch(simulator, makespan, costs.tokens()), window_bound)


def decode_batch(simulator: Simulator, makespan: float, tokens: int) -> Tuple[float, int, float, float]:
    """(mean decode batch, KV capacity, token cost over saturated, instances decoding) of a run's rollout
    engines: sequences decoding together, averaged over all the time any instance decoded; the
    instance-seconds of decoding per token generated (``tokens``), slow-downs included, over what a token
    costs at the KV capacity (the decode line, as the bound charges it); and how many instances decoded,
    averaged over the run. Zeros where the costs have no continuous batching or nothing decoded."""
    instances = list((simulator.instances or {}).values())
    busy = sum(i.busy_s for i in instances)
    if not busy or not makespan or not tokens:
        return 0.0, 0, 0.0, 0.0
    one = instances[0]
    saturated = (one.step_a + one.step_b * one.capacity) / one.capacity
    return sum(i.batch_s for i in instances) / busy, one.capacity, busy / tokens / saturated, busy / makespan


def in_devices(leases: Dict[str, Dict[str, float]], k: int) -> Dict[str, Dict[str, float]]:
    """The cluster's lease summary counts scheduling units (instances of ``k`` devices): a lease lends a
    whole instance, so it stays one lease, but of k devices' time."""
    return {direction: {**entry, "device_s": round(entry["device_s"] * k, 3)} for direction, entry in leases.items()}


_BOUNDS: Dict[tuple, tuple] = {}  # (instance, per-step work) of each bound's cluster and workload draw


def without_recompute(perf: PerformanceModel) -> PerformanceModel:
    """``perf`` with no log-prob recompute charged: the bound never charges it (costs.step_bound), so
    policies whose trainers differ only there share one bound."""
    if isinstance(perf, InstanceModel):
        return InstanceModel(without_recompute(perf.perf), perf.k)
    return dataclasses.replace(perf, recompute_logprob=False) if isinstance(perf, PerfModel) else perf


def bound_step(cfg: PipelineConfig, perf: PerformanceModel, eta: float, drawn: Optional[DrawnGroups] = None,
               window_groups: int = 0) -> float:
    """The policy-independent step bound of this cluster and workload draw (memoised: every policy of a
    comparison shares it); with ``window_groups``, the bound for policies held to that admission window.
    ``drawn``: groups a simulation of ``cfg`` drew already (read, not redrawn)."""
    units = cfg.cluster.devices // instance_size(cfg)
    key = (repr(without_recompute(perf)), cfg.sim.workload, cfg.sim.profile, cfg.rollout.group_size,
           cfg.train.prompts_per_step, cfg.train.steps, units, cfg.seed, eta)
    if key not in _BOUNDS:
        workload = sim_workload(cfg)
        _BOUNDS[key] = make_instance(perf, workload), bound_work(
            perf, workload, cfg.rollout.group_size, cfg.train.prompts_per_step, cfg.train.steps, units, cfg.seed, eta,
            drawn)
    instance, steps_work = _BOUNDS[key]
    return bound_of(instance, steps_work, units, window_groups * cfg.rollout.group_size)


def best_static_split(cfg: PipelineConfig, eta: float) -> SimResult:
    """The `areal` policy with its split chosen by search over every split (a tuned static baseline)."""
    k = instance_size(cfg)
    results = [simulate(cfg, "areal", eta, x) for x in range(k, cfg.cluster.devices, k)]
    return max(results, key=lambda r: r.samples_per_s)
