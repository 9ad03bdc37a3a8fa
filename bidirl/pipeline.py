"""A pipeline is a list of stages run in order over one run directory.

Stages share a small ``state`` dict (e.g. ``prepare_model`` puts the prepared model there and
``evaluate`` uses it). Every stage is checked to exist *before* the run directory is created, so a
pipeline naming a stage that is not built yet fails at once with one line instead of half-running.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError, NotBuiltYet
from bidirl.rundir import RunDir
from bidirl.runtime_env import prepare_process
from bidirl.ui import say

State = Dict[str, Any]

# Stages later issues build; a pipeline naming one fails before doing any work.
NOT_BUILT = {
    "launch": "the multi-process runtime as a stage; run `bidirl launch PIPELINE` instead",
    "profile": "profiling the performance model",
    "plan": "the scheduling-aware planner",
    "compare": "baseline comparison",
}


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


def stage_train(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    from bidirl.runtime.local import train_in_process
    from bidirl.sched.policy import POLICIES

    if not POLICIES[cfg.launch.mode].synchronous:
        raise BidirlError(f"launch.mode={cfg.launch.mode} needs a rollout pool and a train pool: "
                          "use `bidirl launch` with cluster.devices >= 2")
    if "model" not in state:
        stage_prepare_model(cfg, run, state)
    result = train_in_process(cfg, run, state["model"].path, rollout_engine(cfg, state))
    state["summary"]["train"] = result
    if "accuracy_start" in result:
        say(f"held-out greedy accuracy {result['accuracy_start']:.1%} -> {result['accuracy_end']:.1%}; "
            f"curve: {result['learning_curve']}")


def stage_simulate(cfg: PipelineConfig, run: RunDir, state: State) -> None:
    from bidirl.sim.report import simulate_policies

    results = simulate_policies(cfg, list(cfg.sim.policies), run.path)
    state["summary"]["simulate"] = [r.row() for r in results]


STAGES: Dict[str, Callable[[PipelineConfig, RunDir, State], None]] = {
    "simulate": stage_simulate,
    "prepare_model": stage_prepare_model,
    "evaluate": stage_evaluate,
    "train": stage_train,
}


def check_stages_built(cfg: PipelineConfig) -> None:
    for stage in cfg.stages:
        if stage in NOT_BUILT:
            raise NotBuiltYet(f"stage '{stage}' ({NOT_BUILT[stage]}) is not built yet")


def run_pipeline(cfg: PipelineConfig) -> RunDir:
    check_stages_built(cfg)
    prepare_process(cfg.cluster.device_type)
    run = RunDir(cfg)
    say(f"run directory: {run.path}")
    state: State = {"summary": {"stages": list(cfg.stages)}}
    try:
        for stage in cfg.stages:
            STAGES[stage](cfg, run, state)
    except BaseException:
        run.finish({**state["summary"], "status": "failed"})
        raise
    run.finish({**state["summary"], "status": "ok"})
    return run
