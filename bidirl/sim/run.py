"""Simulate one policy (or several) on the configured cluster; the figures ``bidirl simulate`` reports."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from bidirl.config import PipelineConfig
from bidirl.perf.analytic import HARDWARE, MODELS, PerfModel
from bidirl.perf.workload import preset
from bidirl.sched.assembly import DriverCapabilities, assemble
from bidirl.sched.cluster import Cluster
from bidirl.sched.trace import pool_idle_ratio
from bidirl.sim.costs import CalibratedCosts, estimates, make_instance
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
    ideal_step_s: float
    idle_ratio: Dict[str, float]
    staleness: Dict[int, int]
    switches: int
    leases: Dict[str, Dict[str, float]]
    sim_seconds: float
    cluster: Optional[Cluster] = field(default=None, repr=False)

    @property
    def efficiency(self) -> float:
        """tau* / tau: 1.0 means no device ever idled and switching was free."""
        return self.ideal_step_s / self.step_s if self.step_s else 0.0

    def row(self) -> Dict[str, Any]:
        return {"policy": self.policy, "eta": self.eta, "split": f"{self.rollout_devices}/{self.devices - self.rollout_devices}",
                "samples_per_s": round(self.samples_per_s, 3), "tokens_per_s": round(self.tokens_per_s, 1),
                "step_s": round(self.step_s, 3), "ideal_step_s": round(self.ideal_step_s, 3),
                "efficiency": round(self.efficiency, 3), "idle_ratio": self.idle_ratio,
                "staleness": {str(k): v for k, v in sorted(self.staleness.items())}, "switches": self.switches, "leases": self.leases,
                "sim_seconds": round(self.sim_seconds, 3)}


def perf_model(cfg: PipelineConfig) -> PerfModel:
    sim = cfg.sim
    return PerfModel(HARDWARE[sim.hardware], MODELS[sim.model], mfu=sim.mfu, rollout_efficiency=sim.rollout_efficiency,
                     with_reference=sim.with_reference, recompute_logprob=sim.recompute_logprob)


def simulate(cfg: PipelineConfig, policy_name: str, eta: Optional[float] = None,
             rollout_devices: Optional[int] = None, keep_trace: bool = False) -> SimResult:
    start = time.perf_counter()
    perf, workload = perf_model(cfg), preset(cfg.sim.workload)
    shape = cfg.run_shape()
    if eta is not None:
        shape = dataclasses.replace(shape, staleness=eta)
    if rollout_devices is not None:
        shape = dataclasses.replace(shape, rollout_devices=rollout_devices)
    B, G, devices, steps = shape.batch_groups, cfg.rollout.group_size, shape.devices, shape.steps
    est = estimates(perf, workload, G, B, devices, cfg.sim.switch_s, shape.chunk_groups)
    # a simulated rollout device batches continuously: it holds a KV cache's worth of groups at once
    capacity_groups = max(shape.chunk_groups, -(-make_instance(perf, workload).capacity // G))
    simulator_can = DriverCapabilities(allows_join=True, interruptible=True, streams_updates=True,
                                       inflight_groups=capacity_groups)
    run = assemble(policy_name, shape, simulator_can, est)
    policy, cluster = run.policy, run.cluster
    colocated = policy.synchronous  # veRL's two switches per step add up to its reshard time
    costs = CalibratedCosts(perf, workload, G, cluster.steps, cfg.seed,
                            switch_s=cfg.sim.reshard_s / 2 if colocated else cfg.sim.switch_s, load_s=cfg.sim.load_s)
    simulator = Simulator(cluster, policy, costs)
    simulator.run()
    makespan = cluster.now
    samples = cluster.trained_groups * G
    rollout_device_s = sum(i.busy_s for i in simulator.instances.values())
    ideal = (rollout_device_s + costs.train_device_s) / devices / steps
    homes_map = {d.index: d.home.value for d in cluster.devices}
    return SimResult(policy_name, cluster.eta, run.rollout_devices, devices, makespan,
                     samples / makespan, costs.tokens() / makespan, makespan / steps, ideal,
                     pool_idle_ratio(cluster.trace, makespan, homes_map), dict(cluster.staleness),
                     costs.switches, cluster.lease_summary(), time.perf_counter() - start,
                     cluster if keep_trace else None)


def best_static_split(cfg: PipelineConfig, eta: float) -> SimResult:
    """The `areal` policy with its split chosen by search over every split (a tuned static baseline)."""
    results = [simulate(cfg, "areal", eta, x) for x in range(1, cfg.cluster.devices)]
    return max(results, key=lambda r: r.samples_per_s)
