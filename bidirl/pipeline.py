"""A pipeline is a list of stages run in order over one run directory.

Stages share a small ``state`` dict (e.g. ``prepare_model`` puts the prepared model there and
``evaluate`` uses it). Every stage is checked to exist *before* the run directory is created, so a
pipeline naming a stage that is not built yet fails at once with one line instead of half-running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from bidirl.config import DataConfig, PipelineConfig, to_yaml
from bidirl.errors import BidirlError, NotBuiltYet, RunFailed
from bidirl.report import write_report
from bidirl.rundir import WANDB_GROUP_VARIABLE, RunDir
from bidirl.runtime_env import prepare_process
from bidirl.ui import say

State = Dict[str, Any]

# Stages later issues build; a pipeline naming one fails before doing any work.
NOT_BUILT: Dict[str, str] = {}


def stage_prepare_model(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    from bidirl.models.sources import prepare_model

    start = time.time()
    prepared = prepare_model(cfg, report=say)
    state["model"] = prepared
    state["summary"]["model"] = {"path": prepared.path, "reused_cache": prepared.reused, **prepared.info}
    run.log(0, stage="prepare_model", prepare_s=round(time.time() - start, 2),
            base_accuracy=prepared.info.get("accuracy"))
    say(f"model ready: {prepared.path}")


def rollout_engine(cfg: PipelineConfig, state: State) -> Any:
    """The run's rollout engine, started once and shared by the stages (vLLM start-up costs seconds)."""
    from bidirl.engines.build import build_rollout_engine

    if "rollout" not in state:
        state["rollout"] = build_rollout_engine(cfg, state["model"].path)
    return state["rollout"]


def stage_evaluate(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    from bidirl.data import load_problems
    from bidirl.evaluate import engine_accuracy
    from bidirl.prompts import PromptBuilder
    from bidirl.ui import progress_bar

    if "model" not in state:
        stage_prepare_model(cfg, run, state)
    engine = rollout_engine(cfg, state)
    problems = load_problems(cfg.data, "test")
    prompt = PromptBuilder.for_run(cfg.data, engine.tokenizer)
    prompts = [prompt(p) for p in problems]
    start = time.time()
    with progress_bar("greedy eval", len(problems), cfg.logging.progress) as advance:
        result = engine_accuracy(engine, problems, prompts, cfg.rollout.max_new_tokens, on_batch=advance)
    seconds = time.time() - start
    run.log(0, stage="evaluate", eval_accuracy=result.accuracy, eval_problems=result.num_problems,
            eval_s=round(seconds, 2))
    state["summary"]["evaluation"] = {"accuracy": round(result.accuracy, 4), "problems": result.num_problems,
                                      "seconds": round(seconds, 1), "examples": result.examples[:3]}
    say(f"held-out greedy accuracy: {result.accuracy:.1%} on {result.num_problems} problems ({seconds:.0f} s)")


def check_in_process_policy(cfg: PipelineConfig) -> None:
    """The train stage runs colocated GRPO in this process: a policy with two pools needs the runtime;
    its train engine is driven as the runtime drives it."""
    from bidirl.engines.build import check_runtime_train_engine
    from bidirl.sched.policy import POLICIES

    check_runtime_train_engine(cfg)
    if not POLICIES[cfg.launch.mode].synchronous:
        raise BidirlError(f"launch.mode={cfg.launch.mode} needs a rollout pool and a train pool, which the train "
                          "stage (one process) has not: use a launch stage, or `bidirl launch` with cluster.devices >= 2")


def stage_train(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    from bidirl.runtime.local import train_in_process

    check_in_process_policy(cfg)
    if "model" not in state:
        stage_prepare_model(cfg, run, state)
    result = train_in_process(cfg, run, state["model"].path, rollout_engine(cfg, state))
    state["summary"]["train"] = result
    if "accuracy_start" in result:
        say(f"held-out greedy accuracy {result['accuracy_start']:.1%} -> {result['accuracy_end']:.1%}; "
            f"curve: {result['learning_curve']}")


def stage_simulate(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    from bidirl.helpers import helper_processes
    from bidirl.planner import planned_configs, replanners
    from bidirl.sim.report import simulate_policies

    policies = list(cfg.sim.policies)
    with helper_processes():  # the planner's candidates and the plots on the other core
        planned = planned_configs(cfg, policies)
        results = simulate_policies(cfg, policies, run.path, planned, replanners(cfg, policies, planned))
    state["summary"]["simulate"] = [r.row() for r in results]


def stage_profile(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    """Measure the devices; later stages (plan, simulate) use the fitted model (sim.profile)."""
    from bidirl.profiling import profile_devices, progress_steps, summary_line
    from bidirl.ui import progress_bar

    with progress_bar("profile", progress_steps(cfg), cfg.logging.progress) as advance:
        profile = profile_devices(cfg, run.path, advance)
    state["cfg"] = dataclasses.replace(cfg, sim=dataclasses.replace(cfg.sim, profile=str(run.path / "profile.json")))
    state["summary"]["profile"] = {"file": str(run.path / "profile.json"), "decode_error": round(profile.decode.error, 4),
                                   "train_error": round(profile.train.error, 4)}
    say(f"profile: {summary_line(profile)}")
    say(f"wrote {run.path / 'profile.json'} and profile.png")


def stage_plan(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    """Choose the partition for launch.mode (and, under algorithm.plan_staleness, the staleness within the
    bound, and under launch.tail_placement: auto, the older-tail placement); later stages run with it
    (cluster.rollout_devices, algorithm.staleness, launch.tail_placement; a comparison plans each policy
    afresh under the pipeline's bound)."""
    from bidirl.helpers import helper_processes
    from bidirl.planner import plan, planned_config, print_plan, write_plan

    # for the driver that will run the split: the live runtime when a launch stage follows (as the dry run
    # and `bidirl launch` plan), else the simulated cluster
    live = "launch" in cfg.stages[cfg.stages.index("plan"):]
    try:
        with helper_processes():  # candidates on the other core (none once torch is loaded: a live run's)
            result = plan(cfg, driver=cfg.live_driver() if live else None)
    except (ValueError, RuntimeError) as exc:
        raise BidirlError(f"plan: {exc}") from None
    path = write_plan(result, run.path)
    print_plan(result)
    state["cfg"] = planned_config(cfg, result)
    state["summary"]["plan"] = {"file": str(path), "rollout_devices": result.rollout_devices,
                                "instance_devices": result.instance_devices, "tail_placement": result.tail_placement,
                                "staleness": result.staleness,
                                "predicted_samples_per_s": result.predicted_samples_per_s, "reason": result.reason}


def stage_launch(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    """The hot-switch runtime through torchrun, as ``bidirl launch`` runs it, writing into ``launch/`` of
    this run directory; at the plan stage's split if there was one (else the planner's, from
    ``sim.profile``, or the policy's default)."""
    from bidirl.config import load_config
    from bidirl.planner import live_partition, live_prior
    from bidirl.runtime.launch import launch, topology_of

    resolved = run.path / "launch.yaml"  # what every rank loads: the config as the stages before left it
    resolved.write_text(to_yaml(cfg))
    chosen = live_partition(cfg)
    cfg = load_config(resolved, chosen)
    out = run.path / "launch"
    try:
        code = launch(str(resolved), chosen, cfg, topology_of(cfg), prior=live_prior(cfg), run_path=str(out),
                      resume=bool(state.get("resume")))
    except KeyboardInterrupt as interrupted:  # (the pipeline's run directory is what resumes, not launch/ in it)
        raise KeyboardInterrupt(f"its launch stage's checkpoints resume with `bidirl run PIPELINE --resume "
                                f"{run.path}`" if str(interrupted) else "") from None
    if code:
        raise RunFailed(f"launch: the runtime exited with code {code} (its output is above; its files: {out})")
    summary = json.loads((out / "summary.json").read_text())
    keep = ("policy", "devices", "homes", "eta", "steps", "samples_per_s", "idle_ratio", "switches", "leases",
            "staleness_histogram", "accuracy_start", "accuracy_end", "eval_problems", "gantt", "learning_curve")
    state["summary"]["launch"] = {"dir": str(out), **{k: summary[k] for k in keep if k in summary}}


def stage_compare(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    """bidirl against ``compare.baselines`` (:mod:`bidirl.compare`), reusing the launch stage's run of
    bidirl where there was one; the table, plots and each run's folder go into this run directory."""
    from bidirl.compare import compare

    resolved = run.path / "compare.yaml"  # the config as the stages before left it (the profile, say)
    resolved.write_text(to_yaml(cfg))
    done = {cfg.launch.mode: state["summary"]["launch"]["dir"]} if "launch" in state["summary"] else {}
    try:
        rows = compare(cfg, str(resolved), [], list(cfg.compare.baselines), run.path, done, log_table=run.table)
    except KeyboardInterrupt:  # (a compared run is not resumed: the stage runs again)
        raise KeyboardInterrupt(f"the comparison runs again with `bidirl run PIPELINE --from compare --run-dir "
                                f"{run.path}`") from None
    state["summary"]["compare"] = {r.name: {"samples_per_s": r.samples_per_s, "where": r.where, "split": r.split,
                                            "accuracy_end": r.accuracy_end} for r in rows}


STAGES: Dict[str, Callable[[PipelineConfig, RunDir, State], None]] = {
    "profile": stage_profile,
    "plan": stage_plan,
    "simulate": stage_simulate,
    "prepare_model": stage_prepare_model,
    "evaluate": stage_evaluate,
    "train": stage_train,
    "launch": stage_launch,
    "compare": stage_compare,
}


def check_stages_built(cfg: PipelineConfig) -> None:
    for stage in cfg.stages:
        if stage in NOT_BUILT:
            raise NotBuiltYet(f"stage '{stage}' ({NOT_BUILT[stage]}) is not built yet")


def run_stages(cfg: PipelineConfig, stages) -> RunDir:
    """The named stages of ``cfg`` into a new run directory (``bidirl profile`` / ``plan``)."""
    return run_pipeline(dataclasses.replace(cfg, stages=list(stages)))


INPUT_STAGES = ("prepare_model", "evaluate", "train", "profile", "launch", "compare")
ON_THIS_DEVICE = ("evaluate", "train", "profile")  # (stages whose engines run in this process)
LOAD_WEIGHTS = (*ON_THIS_DEVICE, "launch")  # (and a live comparison)


def check_inputs(cfg: PipelineConfig, stages: Optional[List[str]] = None, devices_here: bool = True) -> None:
    """The data and the model a pipeline names, checked before anything is written: local data must load
    and hold problems with numeric answers; a local model folder must hold a readable config, and weights if
    a stage will load them here (not in a dry run, ``devices_here`` off); the tiny model needs a
    reasoning-gym task; ``smollm2`` its package. Nothing is downloaded (a hub model or dataset:
    :func:`fetch_hub_inputs`, the last check). ``stages``: those that will run (default: the pipeline's)."""
    from bidirl.compare import is_here
    from bidirl.models.sources import check_model_folder, is_local

    stages = cfg.stages if stages is None else stages
    if not any(stage in INPUT_STAGES for stage in stages):
        return
    if not from_hub(cfg.data):
        check_problems(cfg.data)
    if cfg.model.source == "tiny" and cfg.data.source != "reasoning_gym":
        raise BidirlError("model.source 'tiny' is trained on a reasoning_gym task; set data.source=reasoning_gym")
    if cfg.model.source == "tiny":
        from bidirl.models.base import check_tiny_prompt_style

        check_tiny_prompt_style(cfg.data.prompt_style)
    if is_local(cfg.model.source):
        loads = any(stage in LOAD_WEIGHTS for stage in stages) or ("compare" in stages and is_here(cfg))
        check_model_folder(cfg.model.source, weights=devices_here and loads)
    elif cfg.model.source == "smollm2":
        from bidirl.models.sources import smollm2_package_dir

        smollm2_package_dir()  # (the package that ships it is installed)


def fetch_hub_inputs(cfg: PipelineConfig, stages: Optional[List[str]] = None) -> None:
    """A hub model and a hub dataset that the stages will use, fetched now: found in the hub's cache, or
    downloaded into it once. So a name that cannot be had fails before the run directory exists (the stages
    then find them cached). Called last, after every check that needs no download."""
    from bidirl.models.sources import is_hub, prepare_hub
    from bidirl.ui import say

    stages = cfg.stages if stages is None else stages
    if not any(stage in INPUT_STAGES for stage in stages):
        return
    if is_hub(cfg.model.source):
        prepare_hub(cfg.model.source, report=say)
    if from_hub(cfg.data):
        check_problems(cfg.data)  # (datasets keeps what it downloads: the stages load it from there)


def from_hub(data: DataConfig) -> bool:
    """GSM8K named by a hub id (``openai/gsm8k``), not a local file or folder."""
    from bidirl.models.sources import is_hub

    return data.source == "gsm8k" and is_hub(data.path)


def check_problems(data: DataConfig) -> None:
    """The held-out split loads (the first 50 problems of it) and holds problems; else one line."""
    from bidirl.data import load_problems

    if not load_problems(dataclasses.replace(data, eval_size=min(data.eval_size, 50)), "test"):
        where = data.path if data.source == "gsm8k" else f"data.task={data.task}"
        raise BidirlError(f"{where}: no problems in the held-out split (data.eval_size={data.eval_size})")


def preflight(cfg: PipelineConfig, devices_here: bool = True) -> None:
    """What the stages would reject, checked before anything is written: the data and model, the profile
    file, the plan; and, unless ``devices_here`` is off (a dry run, which may prepare another machine's
    run), that this machine has the devices the stages will use, and, last, that a hub model and dataset can be had."""
    check_inputs(cfg, devices_here=devices_here)
    if cfg.sim.profile:
        if not Path(cfg.sim.profile).is_file():
            raise BidirlError(f"sim.profile={cfg.sim.profile}: no such file (run `bidirl profile` first)")
        from bidirl.sim.run import sim_workload

        sim_workload(cfg)  # (it reads the profile: a malformed one, or one measured for other settings, fails)
    if "plan" in cfg.stages and "profile" not in cfg.stages[: cfg.stages.index("plan")]:
        from bidirl.planner import preflight as plan_preflight

        plan_preflight(cfg, cfg.launch.mode)
    if "train" in cfg.stages:
        check_in_process_policy(cfg)
    if "launch" in cfg.stages:  # (as `bidirl launch` checks them: the partition, then this node's devices)
        from bidirl.runtime.launch import check_devices, check_plan, topology_of

        check_plan(cfg)
        if devices_here:
            check_devices(cfg, topology_of(cfg), warn=False)  # (the launch stage warns of shared cores itself)
    elif devices_here and cfg.cluster.device_type == "cuda" and any(s in ON_THIS_DEVICE for s in cfg.stages):
        import torch

        if not torch.cuda.is_available():  # (this process would build its engines there)
            raise BidirlError("cluster.device_type=cuda but torch sees no CUDA device here (a CPU build, no GPU or "
                              "no driver): use cluster.device_type=cpu, or run on a GPU node")
    if "simulate" in cfg.stages:
        from bidirl.planner import preflight as plan_preflight
        from bidirl.sim.report import check_policies

        check_policies(cfg.sim.policies)
        for policy in cfg.sim.policies:  # (memory is the planner's to check, for the splits it scores)
            plan_preflight(cfg, policy, check_memory=False)
    if "compare" in cfg.stages:
        from bidirl.compare import preflight as compare_preflight

        compare_preflight(cfg, list(cfg.compare.baselines))
    if devices_here:  # (a dry run downloads nothing)
        fetch_hub_inputs(cfg)


def dry_run(cfg: PipelineConfig, cfg_path: str, overrides: List[str]) -> None:
    """What ``bidirl run`` would do, started nothing: the pipeline is validated (every check a stage makes
    before its output exists), the partition planned -- from the analytic model of ``sim.hardware`` on
    accelerators, from ``sim.profile`` where given -- and the torchrun command of every node printed.
    Writes nothing and downloads nothing."""
    from bidirl.planner import live_device_budget

    show = functools.partial(print, flush=True)  # stdout, unwrapped: the commands are meant to be copied
    check_stages_built(cfg)
    preflight(cfg, devices_here=False)
    show(f"pipeline {cfg.name}: stages {' -> '.join(cfg.stages)}; {cfg.cluster.devices} {cfg.cluster.device_type} "
         f"device{'s' if cfg.cluster.devices > 1 else ''}, policy {cfg.launch.mode}, model {cfg.model.source}")
    budget = live_device_budget(cfg)
    if budget is not None:
        show("memory per device (both engines resident):\n" + budget.table())
    if "simulate" in cfg.stages:
        show(f"simulate: {cfg.cluster.devices} simulated {cfg.sim.hardware} with sim.model={cfg.sim.model}, "
             f"policies {', '.join(cfg.sim.policies)}")
    if "launch" in cfg.stages or "plan" in cfg.stages:
        plan_and_commands(cfg, cfg_path, overrides, show)
    else:
        show("no plan or launch stage: nothing to plan, nothing started through torchrun")
    if "compare" in cfg.stages:
        from bidirl.compare import is_here

        show(f"compare: bidirl against {', '.join(cfg.compare.baselines)}, "
             f"{'live on these devices' if is_here(cfg) else 'simulated (the cluster is not this machine)'}")
    show("dry run: nothing was started, written or downloaded")


def plan_and_commands(cfg: PipelineConfig, cfg_path: str, overrides: List[str], show: Callable[..., None]) -> None:
    """The dry run's plan (where one is needed) and every node's torchrun command (with a launch stage)."""
    from bidirl.planner import describe_model, needs_planning, plan, planned_overrides, print_plan, with_instances
    from bidirl.runtime.launch import torchrun_command, topology_of

    chosen = list(overrides)
    if not cfg.cluster.instance_devices:  # the live engines run one device each
        cfg, chosen = with_instances(cfg, 1), [*chosen, "cluster.instance_devices=1"]
    if needs_planning(cfg, cfg.launch.mode):
        if cfg.cluster.device_type == "cpu" and not cfg.sim.profile:
            show("CPU devices and no sim.profile: the profile stage measures them at run time and the plan "
                 "stage plans on that; without one, launch uses the policy's default split")
        else:
            result = plan(cfg, driver=cfg.live_driver())
            print_plan(result)
            show(f"planned on {describe_model(cfg)}: {' '.join(planned_overrides(cfg, result))}")
            chosen += planned_overrides(cfg, result)
    if "launch" in cfg.stages:  # (its partition was checked by preflight, as the run's would be)
        topology = topology_of(cfg)
        for node in range(topology.nnodes):
            command = torchrun_command(cfg_path, chosen, cfg, dataclasses.replace(topology, node_rank=node))
            show(f"node {node}: torchrun " + " ".join(command[3:]))


@contextlib.contextmanager
def wandb_group(name: str) -> Iterator[None]:
    """Runs started meanwhile (the launch stage's runtime, compared policies) join W&B group ``name``."""
    before = os.environ.get(WANDB_GROUP_VARIABLE)
    os.environ[WANDB_GROUP_VARIABLE] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(WANDB_GROUP_VARIABLE, None)
        else:
            os.environ[WANDB_GROUP_VARIABLE] = before


def run_pipeline(cfg: PipelineConfig, run_dir: Optional[Path] = None, first: Optional[str] = None,
                 only: bool = False, resume: bool = False) -> RunDir:
    """The pipeline's stages into a new run directory; or, with ``run_dir`` and ``first`` (``--from`` /
    ``--only``), stage ``first`` (and, unless ``only``, the stages after it) again into that existing
    directory, the earlier stages' outputs reused and the re-run stages' old outputs kept aside.
    ``resume`` (``--resume RUN``): the launch stage continues its run from its latest good checkpoint,
    and the stages after it run again."""
    check_stages_built(cfg)
    prepare_process(cfg.cluster.device_type)
    stages = list(cfg.stages)
    if resume:
        if "launch" not in stages:
            raise BidirlError(f"--resume: pipeline '{cfg.name}' has no launch stage to resume")
        from bidirl.runtime.launch import check_resumable

        skipped = check_resumable(str(Path(run_dir) / "launch") if run_dir else None, cfg)
        first = "launch"
    if first is not None:
        stages = rerun_stages(cfg, first, only)
        cfg, summary = restored(cfg, run_dir, first, resume, only)
        preflight(dataclasses.replace(cfg, stages=stages))
        for warning in skipped if resume else []:  # (once nothing else refuses the resume)
            say(warning)
        run = RunDir.existing(cfg, run_dir)
        again = "resuming its launch stage" if resume else f"again from stage '{first}'{', only' if only else ''}"
        say(f"run directory: {run.path} ({again})")
        set_aside(run.path, [s for s in stages if not (resume and s == "launch")])  # a resumed launch stays
    else:
        preflight(cfg)  # bad input fails here, before the run directory exists
        run = RunDir(cfg)
        summary = {"stages": stages}
        say(f"run directory: {run.path}")
    state: State = {"summary": summary, "cfg": cfg, "run": run, "resume": resume}
    if first is not None and (run.path / "launch" / "summary.json").is_file() and "launch" not in stages:
        summary.setdefault("launch", {})["dir"] = str(run.path / "launch")  # compare reuses it
    try:
        with wandb_group(run.path.name):
            for stage in stages:
                STAGES[stage](state["cfg"], run, state)
    except BaseException as failure:
        run.finish_after(failure, state["summary"])
        raise
    run.finish({**state["summary"], "status": "ok"})
    say(f"report: {write_report(run.path)} (and report.html)")
    return run


# What each stage writes into the run directory: a stage run again first moves these aside.
STAGE_OUTPUTS = {
    "profile": ("profile.json", "profile.png"),
    "plan": ("plan.json",),
    "launch": ("launch", "launch.yaml"),
    "compare": ("compare", "compare.yaml", "compare.json", "compare.md", "compare_throughput.png",
                "compare_curves.png"),
    "simulate": ("results.json", "throughput.png", "gantt-*.png", "trace-*.jsonl"),
    "train": ("checkpoint", "snapshots", "learning_curve.png", "gantt.png", "trace.jsonl"),
}
REPORT_FILES = ("report.md", "report.html")  # of the whole run: written again at its end


def rerun_stages(cfg: PipelineConfig, first: str, only: bool) -> List[str]:
    if first not in cfg.stages:
        raise BidirlError(f"--{'only' if only else 'from'} {first}: the pipeline's stages are "
                          f"{', '.join(cfg.stages)}")
    return [first] if only else cfg.stages[cfg.stages.index(first):]


SUMMARY_KEYS = {"prepare_model": "model", "evaluate": "evaluation"}  # a stage's entry in summary.json (else its name)


def restored(cfg: PipelineConfig, run_dir: Optional[Path], first: str,
             resume: bool = False, only: bool = False) -> Tuple[PipelineConfig, State]:
    """What the stages before ``first`` left in ``run_dir``, as they would have handed it on: the
    profile (``sim.profile``), the plan's split and placement, the previous summary. ``resume``: a run whose pipeline
    process was killed (SIGKILL, a lost machine) wrote no summary; its stages' files are enough."""
    from bidirl.planner import load_plan, planned_config

    flag = "--resume" if resume else "--run-dir"
    written = run_dir is not None and (Path(run_dir) / "summary.json").is_file()
    killed = resume and run_dir is not None and (Path(run_dir) / "config.yaml").is_file()
    if not (written or killed):
        raise BidirlError(f"{flag} {run_dir}: not a run directory (no summary.json): pass one that "
                          "`bidirl run` wrote")
    run_dir, path = Path(run_dir), Path(run_dir) / "summary.json"
    ran = pipeline_of(run_dir)
    if ran is not None and ran != cfg.name:  # (its config, profile and plan would be another pipeline's)
        raise BidirlError(f"{flag} {run_dir}: a run of pipeline '{ran}', not of '{cfg.name}': pass a run directory "
                          f"of '{cfg.name}', or run the pipeline that wrote it")
    try:
        summary = json.loads(path.read_text()) if written else {}
    except (OSError, ValueError) as exc:
        raise BidirlError(f"{path}: not readable ({type(exc).__name__})") from None
    if not isinstance(summary, dict):
        raise BidirlError(f"{path}: not a run summary (a JSON object), but a "
                          f"{type(summary).__name__}: pass a run directory that `bidirl run` wrote")
    before = cfg.stages[: cfg.stages.index(first)]
    if "profile" in before and (run_dir / "profile.json").is_file():
        cfg = dataclasses.replace(cfg, sim=dataclasses.replace(cfg.sim, profile=str(run_dir / "profile.json")))
    if "plan" in before and (run_dir / "plan.json").is_file():
        cfg = planned_config(cfg, load_plan(run_dir / "plan.json", cfg))
    again = rerun_stages(cfg, first, only)  # their entries: this run's, or none
    dropped = {"status", "run_dir", "wall_s", *(SUMMARY_KEYS.get(stage, stage) for stage in again)}
    keep = {k: v for k, v in summary.items() if k not in dropped}
    return cfg, {**keep, "stages": list(cfg.stages)}


def pipeline_of(run_dir: Path) -> Optional[str]:
    """The name of the pipeline a run directory's ``config.yaml`` was resolved from (None if it has none)."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return str(config["name"]) if isinstance(config, dict) and "name" in config else None


def set_aside(run: Path, stages: List[str]) -> None:
    """The outputs of the stages about to run again go to ``replaced-<time>/``: nothing is lost."""
    aside = run / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    patterns = [pattern for stage in stages for pattern in STAGE_OUTPUTS.get(stage, ())] + list(REPORT_FILES)
    for pattern in patterns:
        for path in sorted(run.glob(pattern)):
            aside.mkdir(exist_ok=True)
            path.rename(aside / path.name)
    _metrics_aside(run / "metrics.jsonl", aside, stages)  # (the train stage's curve: the new run's alone)


def _metrics_aside(metrics: Path, aside: Path, stages: List[str]) -> None:
    """The rows of ``metrics.jsonl`` that ``stages`` logged move to ``aside``; the other stages' rows stay.
    A stage names itself in its rows (``stage``); the train stage's steps and evaluations do not. A row
    torn by a crash moves too, whichever stage runs again: the rows appended next must start a line."""
    if not metrics.is_file():
        return
    kept, moved = [], []
    for line in metrics.read_text().splitlines(keepends=True):
        row = _row(line)
        (moved if not row or row.get("stage", "train") in stages else kept).append(line)
    if moved:
        aside.mkdir(exist_ok=True)
        (aside / "metrics.jsonl").write_text("".join(moved))
        metrics.write_text("".join(kept))


def _row(line: str) -> Dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError:  # (a torn last row, cut short by a crash)
        return {}
    return row if isinstance(row, dict) else {}


def latest_run(cfg: PipelineConfig) -> Optional[Path]:
    """The newest run directory of this pipeline under ``output_dir`` (``--from`` without ``--run-dir``):
    ``<name>-<YYYYmmdd-HHMMSS>[-n]`` exactly (another pipeline named ``<name>-something`` is not this one's)."""
    ours = re.compile(re.escape(cfg.name) + r"-(\d{8}-\d{6})(?:-(\d+))?")
    runs = [(match.group(1), int(match.group(2) or 0), p) for p in Path(cfg.output_dir).glob(f"{cfg.name}-*")
            if (match := ours.fullmatch(p.name)) and (p / "summary.json").is_file()]
    return max(runs)[2] if runs else None
