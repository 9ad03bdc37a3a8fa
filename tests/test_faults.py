"""Faults injected into live 2-device runs: a process killed with SIGKILL mid-run. torchrun restarts
the worker group, which resumes from the run's latest good checkpoint; the run still completes every
configured optimizer step, each exactly once. A hard timeout turns a hang into a failure."""

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from bidirl.runtime.checkpoints import FOLDER, sealed, verify
from tests.test_runtime import BIDIRL, SMALL, read_jsonl

HARD_TIMEOUT_S = 600
STEPS, EVERY = 9, 3


def start(root: Path, *overrides) -> subprocess.Popen:
    args = ["launch", "pipelines/cpu-tiny.yaml", f"output_dir={root}/runs", f"model.cache_dir={root}/cache", *SMALL,
            "cluster.devices=2", f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}", "logging.eval_every=3",
            "launch.max_restarts=1", *overrides]
    return subprocess.Popen(BIDIRL + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(condition, process: subprocess.Popen, deadline: float) -> None:
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended (code {process.returncode}) before the fault: {process.stdout.read()[-3000:]}")
        if time.time() > deadline:
            process.kill()
            pytest.fail("no checkpoint and no later step within the timeout")
        time.sleep(0.2)


def device_process(launcher: subprocess.Popen, device: int) -> psutil.Process:
    """The torchrun worker process of ``device`` (rank device + 1; rank 0 is the controller)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(device + 1) and "bidirl.torchrun_main" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    pytest.fail(f"no process of device {device}")


def killed_mid_run(root: Path, device_of, *overrides) -> Path:
    """Starts a run, kills ``device_of(run_dir)`` with SIGKILL once a checkpoint is sealed and a later step
    trained, and waits for the run to end; returns its run directory."""
    launcher, deadline = start(root, *overrides), time.time() + HARD_TIMEOUT_S
    runs = root / "runs"
    wait_for(lambda: runs.is_dir() and any(runs.iterdir()), launcher, deadline)
    (run,) = runs.iterdir()

    def checkpoint_and_a_later_step():
        metrics = run / "metrics.jsonl"
        rows = read_jsonl(metrics) if metrics.exists() else []
        return sealed(run / FOLDER) and any(r.get("step", 0) > EVERY and "reward_mean" in r for r in rows)

    wait_for(checkpoint_and_a_later_step, launcher, deadline)
    device_process(launcher, device_of(run)).send_signal(signal.SIGKILL)
    try:
        output, _ = launcher.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        launcher.kill()
        pytest.fail("the run hung after the kill")
    assert launcher.returncode == 0, output[-4000:]
    return run


def assert_every_step_trained_exactly_once(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "reward_mean" in r]
    assert steps == list(range(1, STEPS + 1))  # none lost, none applied twice
    resumed = summary["resumed"]
    assert resumed["restart"] == 1 and resumed["from_version"] % EVERY == 0 and resumed["from_version"] >= EVERY
    rolled_back = [r["step"] for r in read_jsonl(run / "metrics.rolled-back.jsonl")]
    assert all(step > resumed["from_version"] for step in rolled_back)
    for checkpoint in sealed(run / FOLDER):  # no file left corrupt
        assert verify(checkpoint) is None
    assert not list((run / FOLDER).glob(".partial-*"))
    assert [p["step"] for p in summary["curve"]] == [0, 3, 6, 9]  # the learning curve spans the crash
    return summary


def primary(run: Path) -> int:
    return 1  # cluster.rollout_devices=1: device 0 rolls out, device 1 is the primary trainer


@pytest.mark.slow
def test_a_killed_rollout_worker_restarts_the_group_which_resumes_and_completes_every_step(tmp_path):
    run = killed_mid_run(tmp_path, lambda run: 0, "launch.mode=async", "cluster.rollout_devices=1")
    assert_every_step_trained_exactly_once(run)


def test_a_killed_primary_trainer_loses_no_step_and_applies_none_twice(tmp_path):
    run = killed_mid_run(tmp_path, primary, "launch.mode=async", "cluster.rollout_devices=1")
    summary = assert_every_step_trained_exactly_once(run)
    assert summary["homes"] == ["rollout", "train"]


def test_a_group_that_finally_fails_ends_in_one_line_naming_each_dead_process(monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from bidirl.runtime.elastic import describe_failures

    monkeypatch.setenv("BIDIRL_RUN_PATH", "runs/x")
    failures = {2: ProcessFailure(1, 4242, -9, "/nonexistent"), 0: ProcessFailure(0, 4241, 2, "/nonexistent")}
    assert describe_failures(failures, 2) == (
        "the runtime failed after 2 restart(s): the controller (rank 0) exited with code 2, device 1 (rank 2) was "
        "killed by SIGKILL; its checkpoints (if any) resume with --resume runs/x")
