"""``bidirl launch``: prepare the model once, then start the runtime through torchrun.

Single node (default): ``--standalone`` with ``cluster.devices + 1`` processes (the controller is
rank 0). Several nodes: every node runs ``bidirl launch`` with the same ``--nnodes`` and
``--rdzv-endpoint`` (node 0's address) and its own ``--node-rank``; node 0 runs the controller beside
its workers, so it starts one process more (``--nproc-per-node`` overrides; the ranks over all nodes
must add up to ``cluster.devices + 1``). :mod:`bidirl.runtime.placement` maps ranks to
GPUs. One OpenMP thread per process by default, because processes share the CPU cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError
from bidirl.sched.estimates import Estimates

if TYPE_CHECKING:
    from bidirl.perf.memory import DeviceBudget

RUN_PATH_VARIABLE = "BIDIRL_RUN_PATH"  # where the controller writes the run (a restarted controller: the same)
RESUME_VARIABLE = "BIDIRL_RESUME"  # "1": continue the run in RUN_PATH from its latest good checkpoint
PRIOR_VARIABLE = "BIDIRL_PRIOR_ESTIMATES"  # the controller's starting estimates, as JSON (see prior_from_environment)
CPU_OVERSUBSCRIPTION = 4  # CPU device workers per core before a launch is refused: beyond this they mostly wait


@dataclass
class Topology:
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: Optional[int] = None
    rdzv_endpoint: Optional[str] = None


def topology_of(cfg: PipelineConfig, nnodes: Optional[int] = None, node_rank: int = 0,
                nproc_per_node: Optional[int] = None, rdzv_endpoint: Optional[str] = None) -> Topology:
    """The torchrun topology: the command line's options where given, else the pipeline's
    (``cluster.nnodes``, ``launch.rdzv_endpoint``)."""
    from bidirl.config import is_endpoint

    for option, value in (("--nnodes", nnodes), ("--nproc-per-node", nproc_per_node)):
        if value is not None and value < 1:
            raise BidirlError(f"{option} {value}: must be at least 1 (or left out: the pipeline's)")
    if rdzv_endpoint is not None and not is_endpoint(rdzv_endpoint):
        raise BidirlError(f"--rdzv-endpoint {rdzv_endpoint!r}: must be host:port (node 0's address)")
    nodes = nnodes or cfg.cluster.nnodes
    endpoint = rdzv_endpoint or cfg.launch.rdzv_endpoint or None
    if nodes == 1 and nproc_per_node is not None and nproc_per_node != cfg.cluster.devices + 1:
        raise BidirlError(f"--nproc-per-node {nproc_per_node}: one node runs the controller and all cluster.devices="
                          f"{cfg.cluster.devices} device workers, so it takes {cfg.cluster.devices + 1} (or leave it out)")
    if nodes > 1 and not endpoint:
        raise BidirlError(f"{nodes} nodes need a rendezvous address: set launch.rdzv_endpoint=HOST:PORT (node 0) "
                          "or pass --rdzv-endpoint")
    if not 0 <= node_rank < nodes:
        raise BidirlError(f"--node-rank {node_rank}: must be between 0 and {nodes - 1} (--nnodes {nodes})")
    return Topology(nodes, node_rank, nproc_per_node, endpoint)


def processes_on_node(cfg: PipelineConfig, topo: Topology) -> int:
    """This node's torchrun processes: its device workers, plus the controller on node 0."""
    if topo.nproc_per_node:
        return topo.nproc_per_node
    if topo.nnodes == 1:
        return cfg.cluster.devices + 1
    if cfg.cluster.devices % topo.nnodes:
        raise BidirlError(f"cluster.devices={cfg.cluster.devices} does not split evenly over --nnodes {topo.nnodes}: "
                          "pass --nproc-per-node on every node (node 0 runs the controller too: its devices + 1)")
    return cfg.cluster.devices // topo.nnodes + (1 if topo.node_rank == 0 else 0)


def torchrun_command(cfg_path: str, overrides: List[str], cfg: PipelineConfig, topo: Topology) -> List[str]:
    nproc = processes_on_node(cfg, topo)
    # torchrun itself, ending a failed run in one line (bidirl.runtime.elastic)
    command = [sys.executable, "-m", "bidirl.runtime.elastic", f"--nnodes={topo.nnodes}", f"--nproc-per-node={nproc}"]
    if topo.nnodes == 1 and not topo.rdzv_endpoint:
        command.append("--standalone")
    else:
        # static rendezvous: --node-rank 0 is the node whose ranks start at 0, the controller's (c10d would
        # order nodes by arrival, and the node with the extra process could end up anywhere)
        host, _, port = (topo.rdzv_endpoint or "127.0.0.1:29400").rpartition(":")
        command += [f"--node-rank={topo.node_rank}", "--rdzv-backend=static", f"--master-addr={host}",
                    f"--master-port={port}"]
    # a dead process restarts the whole group, which resumes from the latest checkpoint (runtime.main)
    command.append(f"--max-restarts={cfg.launch.max_restarts}")
    return command + ["-m", "bidirl.torchrun_main", cfg_path, *overrides]


def check_plan(cfg: PipelineConfig) -> None:
    """An impossible partition fails here, in one line, before any process starts: the very assembly
    the controller will make, on the live runtime's capabilities."""
    from bidirl.engines.build import check_runtime_train_engine
    from bidirl.sched.assembly import assemble
    from bidirl.sched.estimates import MeasuredEstimates
    from bidirl.sched.replanning import NO_REPLANNING, LengthReplanner

    if cfg.cluster.instance_devices not in (0, 1):  # (0, the planner's choice, is 1 live: live_partition)
        raise BidirlError(f"cluster.instance_devices={cfg.cluster.instance_devices}: instances of several devices are "
                          "simulated and planned only (`bidirl simulate`, `bidirl plan`); the runtime's engines run "
                          "one device each")
    every = cfg.cluster.replan_every  # a replanner that is never asked: the same assembly checks
    replanner = LengthReplanner(every, lambda: None, lambda mean: 0) if every else NO_REPLANNING
    try:
        assemble(cfg.launch.mode, cfg.run_shape(), cfg.live_driver(), MeasuredEstimates(), replanner)
    except ValueError as exc:
        raise BidirlError(str(exc)) from None
    check_runtime_train_engine(cfg)


def check_memory(cfg: PipelineConfig, model_path: str) -> "DeviceBudget":
    """A device holds the rollout engine and the trainer at once: a plan whose sum does not fit fails
    here, in one line, before any process starts (:func:`~bidirl.models.footprint.device_budget`)."""
    from bidirl.models.footprint import device_budget, model_spec_of

    return device_budget(cfg, model_spec_of(cfg, model_path))


def check_devices(cfg: PipelineConfig, topo: Topology, warn: bool = True) -> None:
    """The devices this node must run exist: a GPU per device worker (cuda), or cores enough for the
    CPU device workers. Each CPU worker runs one thread, so a few more workers than cores only queue
    for them (a warning, unless ``warn`` is off: timings are distorted, results are not); many more
    would crawl (an error)."""
    if cfg.cluster.device_type == "cuda":
        check_gpus(cfg, topo)
        return
    workers = processes_on_node(cfg, topo) - (topo.node_rank == 0)
    cores = os.cpu_count() or 1
    if workers > CPU_OVERSUBSCRIPTION * cores:
        raise BidirlError(f"cluster.devices={cfg.cluster.devices}: this node would run {workers} CPU device workers "
                          f"on {cores} cores (one thread per device, at most {CPU_OVERSUBSCRIPTION} per core); "
                          "lower cluster.devices or add nodes")
    if workers > cores and warn:
        print(f"warning: {workers} CPU device workers share {cores} cores: they take turns, so measured times "
              "(and the schedules built on them) are slower than on a core each", file=sys.stderr)


def check_gpus(cfg: PipelineConfig, topo: Topology) -> None:
    """Each of this node's device workers owns a GPU (:mod:`bidirl.runtime.placement`): too few, or none,
    is one line here rather than a failure inside torchrun."""
    from bidirl.runtime.placement import check_node, gpus_on_this_node

    gpus = gpus_on_this_node()
    if gpus is None:  # no NVIDIA driver listing: ask torch (NVML; this process never trains)
        import torch

        gpus = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not gpus and not (visible or "").strip():
        raise BidirlError("cluster.device_type=cuda but this node has no NVIDIA GPU: use cluster.device_type=cpu, "
                          "or run on a GPU node")
    controller_here = topo.node_rank == 0
    check_node(processes_on_node(cfg, topo) - controller_here, controller_here, gpus, visible)


def launch(cfg_path: str, overrides: List[str], cfg: PipelineConfig, topo: Topology,
           prior: Tuple[Optional[Estimates], str] = (None, "none"), run_path: Optional[str] = None,
           resume: bool = False) -> int:
    """Starts torchrun and waits for it. ``prior``: the cost estimates the controller starts from and
    where they come from (the planner's :func:`~bidirl.planner.live_prior`). ``run_path``: the folder
    the controller writes the run into (the ``launch`` stage's, inside a pipeline's run directory);
    default a new run directory under ``output_dir``, named now so that a restarted controller finds it.
    ``resume``: ``run_path`` is an existing run, to continue from its latest good checkpoint."""
    from bidirl.models.sources import check_model_folder, is_local, prepare_model
    from bidirl.rundir import new_run_path
    from bidirl.runtime_env import prepare_process
    from bidirl.ui import say

    check_plan(cfg)  # (a --resume was checked by the caller, before it wrote anything)
    check_devices(cfg, topo)  # before anything is downloaded
    if is_local(cfg.model.source):  # (every device loads its weights)
        check_model_folder(cfg.model.source)
    prepare_process(cfg.cluster.device_type)
    model = prepare_model(cfg, report=say)
    if cfg.cluster.device_type == "cuda":
        say("memory per device (both engines resident):\n" + check_memory(cfg, model.path).table())
    env = {**os.environ, "BIDIRL_MODEL_PATH": model.path, **loopback_env(topo, os.environ)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env[PRIOR_VARIABLE] = encode_prior(prior)
    env[RUN_PATH_VARIABLE] = str(run_path or new_run_path(cfg))
    env[RESUME_VARIABLE] = "1" if resume else ""
    command = torchrun_command(cfg_path, overrides, cfg, topo)
    say("launching: " + " ".join(command[1:]))
    return wait_for(subprocess.Popen(command, env=env), env[RUN_PATH_VARIABLE])


def wait_for(torchrun: "subprocess.Popen", run_path: str) -> int:
    """torchrun's exit code. A Ctrl-C reaches torchrun too (one process group), which stops every rank; the
    controller closes the run directory as interrupted. So torchrun is waited for (up to its own shutdown
    timeout and a margin; a second Ctrl-C stops waiting, and torchrun is told to end) before the
    interruption goes on, naming the run to resume if it has a checkpoint."""
    from bidirl.runtime.checkpoints import FOLDER, sealed

    try:
        return torchrun.wait()
    except KeyboardInterrupt:
        try:
            torchrun.wait(timeout=TORCHRUN_SHUTDOWN_S)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):  # (or only this process got the Ctrl-C)
            torchrun.terminate()
            with contextlib.suppress(KeyboardInterrupt, subprocess.TimeoutExpired):
                torchrun.wait(timeout=10)
        resume = f"its checkpoints resume with --resume {run_path}" if sealed(Path(run_path) / FOLDER) else ""
        raise KeyboardInterrupt(resume) from None


TORCHRUN_SHUTDOWN_S = 90  # torchrun's agent waits 30 s for its ranks to stop, then kills them: a margin over it


def loopback_env(topo: Topology, environ: Dict[str, str]) -> Dict[str, str]:
    """One node and no cluster address: the gradient and weight groups' sockets (gloo; NCCL's bootstrap)
    bind to loopback, unless the user chose an interface. torchrun's own stores are bound to loopback
    by :func:`bidirl.runtime.elastic.bind_stores_to_loopback`; what travels there is data-only JSON
    that decodes into bidirl's own message types only (:mod:`bidirl.runtime.wire`)."""
    if topo.nnodes > 1 or topo.rdzv_endpoint:
        return {}
    return {key: "lo" for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if key not in environ}


def check_resumable(run_path: Optional[str], cfg: PipelineConfig) -> List[str]:
    """``--resume RUN``: a run directory with a checkpoint that verifies, checked before anything starts.
    Returns a warning for each newer one that does not verify, skipped as the controller will skip it: the
    caller says them once its other checks have passed (a refused command prints its one line only)."""
    from bidirl.runtime.checkpoints import FOLDER, check_compatible, latest_good, partition, sealed
    from bidirl.sched.assembly import assemble

    if not run_path or not os.path.isdir(run_path) or not os.path.isfile(os.path.join(run_path, "config.yaml")):
        raise BidirlError(f"--resume {run_path}: not a run directory (no config.yaml there)")
    if not sealed(os.path.join(run_path, FOLDER)):
        raise BidirlError(f"--resume {run_path}: the run has no checkpoint yet ({FOLDER}/v*/; "
                          "train.checkpoint_every sets how often a run writes one)")
    warnings: List[str] = []
    checkpoint = latest_good(run_path, warn=warnings.append)
    if checkpoint is None:
        newest = warnings[0].split("skipped: ")[-1]
        raise BidirlError(f"--resume {run_path}: none of its checkpoints verifies against its MANIFEST.json (the "
                          f"newest: {newest}); start a new run")
    # here, not after torchrun has started every process; a run that died after its last step (no summary
    # that says it finished) may resume at its last version: that finishes it
    check_compatible(checkpoint, cfg, finishing=not finished(run_path))
    try:
        resumed = partition(checkpoint, cfg.launch.mode, cfg.cluster.devices)  # where the run resumes (re-planned?)
        if resumed is not None:
            assemble(cfg.launch.mode, cfg.run_shape(), cfg.live_driver(), resumed=resumed)
    except ValueError as exc:
        raise BidirlError(f"--resume {run_path}: {checkpoint.path}: {exc}") from None
    return warnings


def finished(run_path: str) -> bool:
    """Did the run in ``run_path`` end well (its summary says so)?"""
    try:
        return json.loads(Path(run_path, "summary.json").read_text()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def encode_prior(prior: Tuple[Optional[Estimates], str]) -> str:
    estimates, source = prior
    return json.dumps({"source": source, "estimates": asdict(estimates) if estimates else None})


def prior_from_environment() -> Tuple[Optional[Estimates], str]:
    """In the controller: the starting estimates ``launch`` handed over (none when started otherwise)."""
    handed = json.loads(os.environ.get(PRIOR_VARIABLE) or '{"source": "none", "estimates": null}')
    return (Estimates(**handed["estimates"]) if handed["estimates"] else None), handed["source"]
