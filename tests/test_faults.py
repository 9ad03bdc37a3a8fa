"""Faults injected into live 2-device runs: a process killed with SIGKILL mid-run. torchrun restarts
the worker group, which resumes from the run's latest good checkpoint; the run still completes every
configured optimizer step, each exactly once. A hard timeout turns a hang into a failure."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from bidirl.runtime.checkpoints import FOLDER, sealed, verify
from bidirl.runtime.replay import check_record, read_batches
from tests.test_runtime import BIDIRL, SMALL, folders, read_jsonl

HARD_TIMEOUT_S = 600
STEPS, EVERY = 9, 3


def start(root: Path, *overrides, env=None, **popen) -> subprocess.Popen:
    args = ["launch", "pipelines/cpu-tiny.yaml", *folders(root), *SMALL, "cluster.devices=2", f"train.steps={STEPS}",
            f"train.checkpoint_every={EVERY}", "logging.eval_every=3", "launch.max_restarts=1", *overrides]
    return subprocess.Popen(BIDIRL + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, **popen)


def wait_for(condition, process: subprocess.Popen, deadline: float) -> None:
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended (code {process.returncode}) before the fault: {process.stdout.read()[-3000:]}")
        if time.time() > deadline:
            process.kill()
            pytest.fail("no checkpoint and no later step within the timeout")
        time.sleep(0.2)


def ended(launcher: subprocess.Popen, deadline: float) -> str:
    """The run's output once it ends; a hang past ``deadline`` kills its whole process tree and fails."""
    try:
        return launcher.communicate(timeout=max(1.0, deadline - time.time()))[0]
    except subprocess.TimeoutExpired:
        for process in psutil.Process(launcher.pid).children(recursive=True) + [psutil.Process(launcher.pid)]:
            try:
                process.kill()
            except psutil.Error:
                pass
        pytest.fail("the run hung")


def device_process(launcher: subprocess.Popen, device: int, required: bool = True) -> psutil.Process:
    """The torchrun worker process of ``device`` (rank device + 1; rank 0 is the controller)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(device + 1) and "bidirl.torchrun_main" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    if required:
        pytest.fail(f"no process of device {device}")
    return None


def checkpoint_and_a_later_step(run: Path, launcher: subprocess.Popen, device: int) -> bool:
    metrics = run / "metrics.jsonl"
    rows = read_jsonl(metrics) if metrics.exists() else []
    return bool(sealed(run / FOLDER)) and any(r.get("step", 0) > EVERY and "reward_mean" in r for r in rows)


def killed_mid_run(root: Path, device: int, *overrides, when=checkpoint_and_a_later_step, env=None) -> Path:
    """Starts a run, kills ``device``'s process with SIGKILL once ``when`` holds (by default: a checkpoint
    is sealed and a later step trained), and waits for the run to end; returns its run directory."""
    launcher, deadline = start(root, *overrides, env=env), time.time() + HARD_TIMEOUT_S
    runs = root / "runs"
    wait_for(lambda: runs.is_dir() and any(runs.iterdir()), launcher, deadline)
    (run,) = runs.iterdir()
    wait_for(lambda: when(run, launcher, device), launcher, deadline)
    device_process(launcher, device).send_signal(signal.SIGKILL)
    output = ended(launcher, deadline)
    assert launcher.returncode == 0, output[-4000:]
    return run


def assert_every_step_trained_exactly_once(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "reward_mean" in r]
    assert steps == list(range(1, STEPS + 1))  # none lost, none applied twice
    resumed = summary["resumed"]
    assert resumed["restart"] == 1 and resumed["from_version"] % EVERY == 0
    rolled_back = run / "metrics.rolled-back.jsonl"
    # a step's row rolls back only if the step came after the checkpoint; a held-out evaluation's whatever
    # its step, since the resumed run evaluates every snapshot again (a kill that lands once training is
    # over, during the evaluations, resumes from the last version with evaluation rows already logged)
    assert all(r["step"] > resumed["from_version"] or "eval_accuracy" in r
               for r in (read_jsonl(rolled_back) if rolled_back.exists() else []))
    for checkpoint in sealed(run / FOLDER):  # no file left corrupt
        assert verify(checkpoint) is None
    assert not list((run / FOLDER).glob(".partial-*"))
    assert [p["step"] for p in summary["curve"]] == [0, 3, 6, 9]  # the learning curve spans the crash
    return summary


ROLLOUT, PRIMARY = 0, 1  # with cluster.rollout_devices=1: device 0 rolls out, device 1 is the primary trainer


def test_ctrl_c_ends_a_live_run_in_one_line_naming_how_to_resume_and_keeps_its_checkpoints(tmp_path):
    # as a terminal's Ctrl-C: SIGINT to the foreground process group (the CLI and torchrun, which sends it on to
    # every rank); the run is started as a terminal starts it, with SIGINT's default action (a background shell
    # ignores it)
    launcher, deadline = start(tmp_path, "launch.mode=async", "cluster.rollout_devices=1", "train.steps=40",
                               start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)), \
        time.time() + HARD_TIMEOUT_S
    runs = tmp_path / "runs"
    wait_for(lambda: runs.is_dir() and any(runs.iterdir()), launcher, deadline)
    (run,) = runs.iterdir()
    wait_for(lambda: checkpoint_and_a_later_step(run, launcher, ROLLOUT), launcher, deadline)
    os.killpg(launcher.pid, signal.SIGINT)
    output = ended(launcher, deadline)
    assert launcher.returncode == 130 and "Traceback" not in output and "death signal" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == f"interrupted: its checkpoints resume with --resume {run}"
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"  # (closed, not left half-written)
    assert sealed(run / FOLDER) and all(verify(checkpoint) is None for checkpoint in sealed(run / FOLDER))


@pytest.mark.slow
def test_a_killed_rollout_worker_restarts_the_group_which_resumes_and_completes_every_step(tmp_path):
    run = killed_mid_run(tmp_path, ROLLOUT, "launch.mode=async", "cluster.rollout_devices=1")
    assert_every_step_trained_exactly_once(run)


def test_a_killed_primary_trainer_loses_no_step_and_applies_none_twice_nor_any_prompt(tmp_path):
    run = killed_mid_run(tmp_path, PRIMARY, "launch.mode=async", "cluster.rollout_devices=1",
                         "algorithm.staleness=1", "logging.record_batches=true")
    summary = assert_every_step_trained_exactly_once(run)
    assert summary["homes"] == ["rollout", "train"] and summary["resumed"]["from_version"] >= EVERY
    # eta 1: the checkpoint's next batch was generating. Those groups' problems are drawn again first
    # after the resume (none skipped), and no problem of the seeded prompt stream is trained twice
    redo = json.loads((Path(summary["resumed"]["checkpoint"]) / "controller.json").read_text())["prompts"]["redo"]
    # (usually some were: how many depends on where generation stood when the primary died)
    assert len(redo) == summary["resumed"]["discarded_groups"]
    trained = [position for step in read_batches(run) for position in step.prompts]
    assert len(trained) == STEPS * 8 and len(set(trained)) == len(trained)
    assert set(redo) <= set(trained)
    # no group number reused either, and every draw of every group trained or left out
    assert check_record(read_batches(run), group_size=4, staleness=1, groups_per_step=8) == []


def frozen_in_a_lease(run: Path, launcher: subprocess.Popen, device: int) -> bool:
    process = device_process(launcher, device, required=False)
    try:
        return process is not None and process.status() == psutil.STATUS_STOPPED
    except psutil.Error:  # (it ended meanwhile)
        return False


@pytest.mark.slow
def test_a_device_killed_in_the_middle_of_a_lease_is_survived(tmp_path):
    # the rollout device, lent to a train step, freezes there (SIGSTOP, BIDIRL_FAULT_STALL) and is killed so
    run = killed_mid_run(tmp_path, ROLLOUT, "launch.mode=async-lend", "algorithm.staleness=0",
                         "train.prompts_per_step=32", "train.micro_batch_size=8", when=frozen_in_a_lease,
                         env={"BIDIRL_FAULT_STALL": "0:25"})
    summary = assert_every_step_trained_exactly_once(run)
    assert summary["resumed"]["restart"] == 1


def test_a_group_that_finally_fails_ends_in_one_line_naming_each_dead_process_and_its_role(monkeypatch, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from bidirl.runtime.elastic import describe_failures

    (tmp_path / "devices.json").write_text(json.dumps([{"device": 0, "rank": 1, "home": "rollout", "primary": False},
                                                       {"device": 1, "rank": 2, "home": "train", "primary": True}]))
    monkeypatch.setenv("BIDIRL_RUN_PATH", str(tmp_path))
    failures = {2: ProcessFailure(1, 4242, -9, "/nonexistent"), 0: ProcessFailure(0, 4241, 2, "/nonexistent"),
                1: ProcessFailure(0, 4240, -15, "/nonexistent")}  # (stopped by torchrun: not a cause)
    assert describe_failures(failures, 2) == (
        "the runtime failed after 2 restart(s): the controller (rank 0) exited with code 2, device 1 (rank 2, train "
        "pool, the primary trainer) was killed by SIGKILL (torchrun then stopped the other 1); their output is above, "
        f"and the run's checkpoints (if any) resume with --resume {tmp_path}")


def test_a_group_stopped_by_an_error_a_restart_cannot_fix_is_not_described_as_dead_processes(monkeypatch, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from bidirl.runtime.elastic import describe_failures, stopped_on_an_error

    monkeypatch.setenv("BIDIRL_RUN_PATH", str(tmp_path))
    # the last attempt: every rank saw bidirl's mark in the store and ended at once (STOPPED_EXIT), or was stopped
    stopped = {0: ProcessFailure(0, 4240, 3, "/nonexistent"), 1: ProcessFailure(1, 4241, 3, "/nonexistent"),
               2: ProcessFailure(2, 4242, -15, "/nonexistent")}
    assert stopped_on_an_error(stopped)
    assert describe_failures(stopped, 2) == (
        "the runtime stopped on the error above, which a restart cannot fix (any restart that followed ended at "
        f"once); the run's checkpoints (if any) resume with --resume {tmp_path}")
    killed = {**stopped, 2: ProcessFailure(2, 4242, -9, "/nonexistent")}  # a dead process is no user error
    assert not stopped_on_an_error(killed)
    unmarked = {0: ProcessFailure(0, 4240, 2, "/nonexistent"), 1: ProcessFailure(1, 4241, -15, "/nonexistent")}
    assert not stopped_on_an_error(unmarked)  # (its own line says what; restarts were not stopped for it)


def test_a_checkpoint_a_restarted_controller_cannot_resume_from_stops_every_later_restart(monkeypatch, tmp_path):
    import bidirl.runtime.main as main
    from bidirl.errors import BidirlError
    from bidirl.runtime import checkpoints

    def unresumable(path, warn):  # (say a controller.json edited while the run went on)
        raise BidirlError("checkpoints/v00002/controller.json: no 'staleness': the checkpoint cannot be resumed from")

    monkeypatch.setattr(checkpoints, "latest_good", unresumable)
    monkeypatch.setenv("BIDIRL_RUN_PATH", str(tmp_path))
    marked = []
    with pytest.raises(BidirlError):
        main._open_run(None, 1, marked.append)
    assert marked == ["checkpoints/v00002/controller.json: no 'staleness': the checkpoint cannot be resumed from"]


@pytest.mark.slow
def test_a_dead_process_with_no_restarts_left_ends_the_run_in_one_line_naming_it(tmp_path):
    launcher, deadline = start(tmp_path, "launch.mode=async", "cluster.rollout_devices=1", "launch.max_restarts=0"), \
        time.time() + HARD_TIMEOUT_S
    runs = tmp_path / "runs"
    wait_for(lambda: runs.is_dir() and any(runs.iterdir()) and (next(runs.iterdir()) / "devices.json").exists(),
             launcher, deadline)
    device_process(launcher, PRIMARY).send_signal(signal.SIGKILL)
    output, _ = launcher.communicate(timeout=max(1.0, deadline - time.time()))
    assert launcher.returncode == 1
    assert output.strip().splitlines()[-1].startswith(
        "error: the runtime failed after 0 restart(s): device 1 (rank 2, train pool, the primary trainer) was killed "
        "by SIGKILL")


@pytest.mark.slow
def test_a_finished_run_resumed_with_more_steps_continues_its_curve_in_the_same_directory(tmp_path):
    first = start(tmp_path, "launch.mode=async", "cluster.rollout_devices=1", "train.steps=6")
    output, _ = first.communicate(timeout=HARD_TIMEOUT_S)
    assert first.returncode == 0, output[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    more = subprocess.run(BIDIRL + ["launch", "pipelines/cpu-tiny.yaml", *folders(tmp_path), *SMALL, "cluster.devices=2",
                                    "launch.mode=async", "cluster.rollout_devices=1", f"train.steps={STEPS}",
                                    f"train.checkpoint_every={EVERY}", "logging.eval_every=3", "--resume", str(run)],
                          capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    assert more.returncode == 0, more.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run.name]  # no second run directory
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed"]["from_version"] == 6 and summary["resumed"]["restart"] == 0
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "reward_mean" in r]
    assert steps == list(range(1, STEPS + 1)) and [p["step"] for p in summary["curve"]] == [0, 3, 6, 9]
    assert summary["samples_per_s"] > 0 and summary["steps"] == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("device", [ROLLOUT, PRIMARY], ids=["receiver", "sender"])
def test_a_worker_lost_during_a_weight_publish_never_leaves_a_version_half_applied(tmp_path, device):
    # killed in attempt 0 while version 5 is published: the primary before it sends, the rollout device
    # after the transfer and before staging it; the restart resumes from checkpoint v3. On-policy (eta 0),
    # every sample is generated with the weights its step trains, so every step checks that the rollout
    # engine serves exactly the trainer's version (fresh_logp_gap: zero up to numerics), never a mix
    launcher = start(tmp_path, "launch.mode=async", "cluster.rollout_devices=1", "algorithm.staleness=0",
                     env={"BIDIRL_FAULT_KILL_IN_PUBLISH": f"{device}:5"})
    output = ended(launcher, time.time() + HARD_TIMEOUT_S)
    assert launcher.returncode == 0, output[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    summary = assert_every_step_trained_exactly_once(run)
    assert summary["resumed"]["restart"] == 1 and summary["resumed"]["from_version"] == 3
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward_mean" in r]
    assert all(r["staleness_max"] == 0 and r["fresh_logp_gap"] < 1e-4 for r in rows), \
        [(r["step"], r.get("fresh_logp_gap")) for r in rows]


@pytest.mark.slow  # (the killed-primary test above restarts a run in the default suite)
def test_a_process_lost_after_the_last_step_is_restarted_to_finish_the_run_not_to_fail_it(tmp_path):
    # device 0 is killed as the final evaluation starts, in attempt 0: every step is trained and the last
    # version's checkpoint sealed. The restart resumes at that version, trains nothing, saves the final
    # checkpoint and evaluates every snapshot (it used to refuse: "nothing is left to train")
    launcher = start(tmp_path, "launch.mode=async", "cluster.rollout_devices=1",
                     env={"BIDIRL_FAULT_KILL_IN_EVALUATION": f"0:{STEPS}"})
    output = ended(launcher, time.time() + HARD_TIMEOUT_S)
    assert launcher.returncode == 0, output[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    summary = assert_every_step_trained_exactly_once(run)
    assert summary["resumed"]["from_version"] == STEPS and summary["final_version"] == STEPS
    assert (run / "checkpoint" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_disk_that_fills_during_a_checkpoint_stops_the_run_in_one_line_and_keeps_the_previous(tmp_path):
    # from the primary's checkpoint of v6 on, the kernel refuses its writes (EFBIG, as a full disk does)
    launcher = start(tmp_path, "launch.mode=async", "cluster.rollout_devices=1", env={"BIDIRL_FAULT_DISK_FULL": "6"})
    output = ended(launcher, time.time() + HARD_TIMEOUT_S)
    assert launcher.returncode == 2, output[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    errors = [line for line in output.splitlines() if line.startswith("error")]
    assert errors[0].startswith(f"error (rank 0): checkpoint v00006: the primary trainer could not write "
                                f"{run / FOLDER / '.partial-v00006'} (File too large); free space")
    assert errors[-1].startswith("error: the runtime stopped on the error above, which a restart cannot fix")
    assert errors[-1].endswith(f"resume with --resume {run}")
    assert "restart 1 after a process failed" not in output  # no attempt resumed only to meet it again
    assert [c.name for c in sealed(run / FOLDER)] == ["v00003"] and verify(sealed(run / FOLDER)[0]) is None
    assert not list((run / FOLDER).glob(".partial-*"))


@pytest.mark.slow
def test_a_pipeline_run_resumed_continues_its_launch_stage_and_runs_the_stages_after_it(tmp_path):
    common = ["run", "pipelines/cpu-tiny.yaml", "stages=[prepare_model,launch]", *folders(tmp_path), *SMALL,
              "cluster.devices=2", "launch.mode=async", "cluster.rollout_devices=1",
              f"train.checkpoint_every={EVERY}", "logging.eval_every=3"]
    first = subprocess.run(BIDIRL + common + ["train.steps=6"], capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    for summary in (run / "summary.json", run / "launch" / "summary.json"):
        summary.unlink()  # as a pipeline killed by SIGKILL after its last checkpoint leaves it: no summaries
    more = subprocess.run(BIDIRL + common + [f"train.steps={STEPS}", "--resume", str(run)], capture_output=True,
                          text=True, timeout=HARD_TIMEOUT_S)
    assert more.returncode == 0, more.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run.name]  # the same run directory
    launch = json.loads((run / "launch" / "summary.json").read_text())
    assert launch["resumed"]["from_version"] == 6 and launch["steps"] == STEPS
    steps = [r["step"] for r in read_jsonl(run / "launch" / "metrics.jsonl") if "reward_mean" in r]
    assert steps == list(range(1, STEPS + 1)) and [p["step"] for p in launch["curve"]] == [0, 3, 6, 9]
    pipeline = json.loads((run / "summary.json").read_text())
    assert pipeline["status"] == "ok" and pipeline["launch"]["steps"] == STEPS
    assert (run / "report.md").is_file()
