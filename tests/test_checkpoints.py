"""Checkpoints are sealed atomically, verified before use, pruned to the last K, and a failed write
leaves the previous ones intact. (The live kill-and-resume runs are in tests/test_faults.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bidirl.data import PromptSampler, Problem
from bidirl.runtime.checkpoints import FOLDER, latest_good, partial_path, seal, sealed, verify
from tests.builders import shared_model_cache


def trainer_files(run: Path, version: int, payload: bytes = b"weights") -> Path:
    """What the primary trainer writes into a partial checkpoint."""
    partial = partial_path(run, version)
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(payload * 100)
    (partial / "optimizer.pt").write_bytes(b"adam" * 50)
    return partial


def checkpoint(run: Path, version: int, keep: int = 3) -> Path:
    return seal(trainer_files(run, version), {"version": version}, keep)


def test_a_sealed_checkpoint_lists_every_file_with_its_checksum_and_leaves_no_partial_folder(tmp_path):
    path = checkpoint(tmp_path, 5)
    assert path.name == "v00005" and verify(path) is None
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert set(manifest) == {"model.safetensors", "optimizer.pt", "controller.json"}
    assert not list((tmp_path / FOLDER).glob(".partial-*"))


def test_only_the_newest_k_checkpoints_are_kept(tmp_path):
    for version in (2, 4, 6, 8):
        checkpoint(tmp_path, version, keep=2)
    assert [p.name for p in sealed(tmp_path / FOLDER)] == ["v00006", "v00008"]


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning_for_the_one_before(tmp_path):
    checkpoint(tmp_path, 3)
    newest = checkpoint(tmp_path, 6)
    weights = bytearray((newest / "model.safetensors").read_bytes())
    weights[10] ^= 0xFF  # one flipped bit
    (newest / "model.safetensors").write_bytes(bytes(weights))
    warnings = []
    found = latest_good(tmp_path, warnings.append)
    assert found.version == 3 and found.path.name == "v00003"
    assert warnings == [f"warning: checkpoint {newest} skipped: model.safetensors does not match its checksum"]


def test_a_checkpoint_missing_a_file_or_its_manifest_is_not_good(tmp_path):
    path = checkpoint(tmp_path, 3)
    (path / "optimizer.pt").unlink()
    assert verify(path) == "optimizer.pt is missing"
    (path / "MANIFEST.json").unlink()
    assert "no readable MANIFEST.json" in verify(path)
    assert latest_good(tmp_path, lambda _: None) is None


def test_a_partial_checkpoint_left_by_a_crash_is_never_resumed_from(tmp_path):
    checkpoint(tmp_path, 3)
    trainer_files(tmp_path, 6)  # the process died before sealing it
    assert latest_good(tmp_path, lambda _: None).version == 3


WRITE_WITH_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from pathlib import Path
from bidirl.errors import BidirlError
from bidirl.runtime.checkpoints import seal
from tests.test_checkpoints import trainer_files
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
run = Path(sys.argv[1])
partial = trainer_files(run, 6)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
try:
    seal(partial, {"version": 6, "padding": "x" * 1000}, 3)
except BidirlError as exc:
    print(exc)
"""


def test_a_checkpoint_that_cannot_be_written_is_one_clear_error_and_the_previous_stays_intact(tmp_path):
    previous = checkpoint(tmp_path, 3)
    done = subprocess.run([sys.executable, "-c", WRITE_WITH_A_FILE_SIZE_LIMIT, str(tmp_path)],
                          capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message.startswith(f"checkpoint {tmp_path / FOLDER / 'v00006'}: cannot write it (File too large)")
    assert message.endswith("the latest checkpoint stays v00003") and "\n" not in message
    assert verify(previous) is None and latest_good(tmp_path, lambda _: None).version == 3
    assert not list((tmp_path / FOLDER).glob(".partial-*"))


def test_the_data_cursor_skips_exactly_what_drawing_would_have_drawn():
    problems = [Problem(question=str(i), answer=str(i)) for i in range(7)]
    drawn, skipped = PromptSampler(problems, seed=3), PromptSampler(problems, seed=3)
    drawn.next(17)  # over two epochs and into a third
    skipped.skip(17)
    assert [p.question for p in drawn.next(9)] == [p.question for p in skipped.next(9)]


def test_a_resumed_prompt_stream_draws_the_untrained_positions_again_first_then_goes_on_where_it_stopped():
    problems = [Problem(question=str(i), answer=str(i)) for i in range(7)]
    original = PromptSampler(problems, seed=3).take(30)  # (position, problem) over four epochs
    assert [position for position, _ in original] == list(range(30))
    resumed = PromptSampler(problems, seed=3)
    resumed.resume(drawn=20, redo=[16, 3, 18])  # 3 was still generating; 16 and 18 waited for a batch
    again = resumed.take(5)
    assert again[:3] == [original[3], original[16], original[18]] and again[3:] == original[20:22]
    assert resumed.take(8) == original[22:30]


def test_a_checkpoint_keeps_the_prompts_drawn_and_not_trained_and_a_resume_draws_exactly_those_again():
    """At eta >= 1 the groups a version has trained are not the first version x B drawn: the cursor keeps
    the positions of the others, trained after the resume, each once -- through a second resume too."""
    from bidirl.prompts import PromptBuilder
    from bidirl.runtime.batches import RolloutData
    from bidirl.samples import Sample
    from bidirl.sched.cluster import Chunk
    from tests.builders import small_config

    cfg = small_config("rollout.group_size=2")
    problems = [Problem(question=f"{i} + 1", answer=str(i + 1)) for i in range(50)]
    stream = [problem.answer for _, problem in PromptSampler(problems, seed=5).take(20)]  # answer per position

    def data_path(cursor=None) -> RolloutData:
        data = RolloutData(cfg, PromptBuilder.for_run(cfg.data))
        data.__dict__["sampler"] = PromptSampler(problems, seed=5)  # (the cached property, set)
        if cursor:
            data.resume(cursor)
        return data

    def asked(data: RolloutData, chunk: Chunk) -> list:
        """The chunk's request: the answers of the problems it was given."""
        return list(data.request(chunk).answers)

    def finished(data: RolloutData, chunk: Chunk, groups: list) -> None:
        """``groups`` (indices within ``chunk``) finished: two samples each, one rewarded."""
        data.collect(chunk.index, [Sample(i, [1], [2], "", [-0.1], chunk.version, reward=float(r),
                                          extra={"group": chunk.first + i}) for i in groups for r in (0, 1)], 1.0)

    first = data_path()
    chunks = [Chunk(index=i, device=0, first=4 * i, groups=4, version=0) for i in range(3)]
    assert [a for c in chunks for a in asked(first, c)] == stream[:12]  # positions 0..11
    finished(first, chunks[0], [0, 1, 2, 3])
    finished(first, chunks[1], [0, 1])  # groups 4, 5 done; 6, 7 still generating
    finished(first, chunks[2], [0, 1])  # groups 8, 9 done; 10, 11 still generating
    step = first.batch(0, [(chunks[0], 4), (chunks[2], 2)])  # groups 0-3, 8 and 9 make version 1
    first.trained(step)
    assert step.prompts == (0, 1, 2, 3, 8, 9)
    cursor = first.cursor()  # the checkpoint at version 1
    assert cursor == {"drawn": 12, "redo": [4, 5, 6, 7, 10, 11]}

    second = data_path(cursor)
    chunk = Chunk(index=0, device=0, first=6, groups=4, version=1)  # (the cluster numbers groups anew)
    assert asked(second, chunk) == [stream[p] for p in (4, 5, 6, 7)]
    finished(second, chunk, [0, 1, 2, 3])
    step = second.batch(1, [(chunk, 4)])
    second.trained(step)
    assert step.prompts == (4, 5, 6, 7)
    assert second.cursor() == {"drawn": 12, "redo": [10, 11]}  # still to draw again; nothing in flight

    third = data_path(second.cursor())
    chunk = Chunk(index=0, device=0, first=10, groups=4, version=2)
    assert asked(third, chunk) == [stream[p] for p in (10, 11, 12, 13)]  # then the stream goes on at 12
    finished(third, chunk, [0, 1, 2, 3])
    assert third.batch(2, [(chunk, 4)]).prompts == (10, 11, 12, 13)


def logged_run(tmp_path, steps: int):
    """A run directory whose run logged steps 1..``steps``, and its config."""
    from bidirl.rundir import RunDir
    from tests.builders import small_config

    cfg = small_config("logging.wandb_mode=disabled")
    run = RunDir(cfg, path=tmp_path / "run")
    for step in range(1, steps + 1):
        run.log(step, reward_mean=0.1 * step)
    run.close()
    return cfg


def test_a_resumed_run_directory_keeps_each_step_once_and_sets_later_rows_aside(tmp_path):
    from bidirl.rundir import RunDir

    cfg = logged_run(tmp_path, 7)
    resumed = RunDir.resumed(cfg, tmp_path / "run", version=4)
    resumed.log(5, reward_mean=0.9)
    resumed.close()
    steps = [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    aside = [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.rolled-back.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5] and aside == [5, 6, 7]


def test_a_row_torn_by_a_crash_and_the_batches_of_later_steps_are_set_aside_on_resume(tmp_path):
    from bidirl.rundir import RunDir

    cfg = logged_run(tmp_path, 3)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 4, "rew')  # the process died writing its last row
    # one line per optimizer step (step k makes version k + 1), as logging.record_batches writes them
    (tmp_path / "run" / "batches.jsonl").write_text("".join(json.dumps({"step": k}) + "\n" for k in range(4)))
    RunDir.resumed(cfg, tmp_path / "run", version=2).close()
    steps = [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (tmp_path / "run" / "metrics.rolled-back.jsonl").read_text().splitlines()[-1] == '{"step": 4, "rew'
    batches = [json.loads(r)["step"] for r in (tmp_path / "run" / "batches.jsonl").read_text().splitlines()]
    aside = [json.loads(r)["step"] for r in (tmp_path / "run" / "batches.rolled-back.jsonl").read_text().splitlines()]
    assert batches == [0, 1] and aside == [2, 3]  # a replay sees each step once, in order


def test_a_resumed_run_directory_continues_its_own_wandb_run_rather_than_starting_another(tmp_path):
    from bidirl.rundir import RunDir
    from tests.builders import small_config

    cfg = small_config("logging.wandb_mode=offline")
    run = RunDir(cfg, path=tmp_path / "run")
    run.log(1, reward_mean=0.1)
    run.close()
    resumed = RunDir.resumed(cfg, tmp_path / "run", version=1)
    resumed.log(2, reward_mean=0.2)
    resumed.close()
    attempts = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2  # (W&B keeps a folder per process that wrote to the run)
    # The run id is read from each folder's transaction log (run-<id>.wandb), not from the folder's
    # name: two processes starting in the same second give the second folder a "-1" suffix.
    run_ids = {log.stem.removeprefix("run-") for folder in attempts for log in folder.glob("run-*.wandb")}
    assert len(run_ids) == 1  # one run id
    import wandb

    wandb.teardown()  # (W&B's service writes the log behind finish(); at teardown it has written all of it)
    # W&B cannot take back the rows the crashed attempt logged past the checkpoint: the resumed ones say so
    assert [{k: row.get(k) for k in ("step", "attempt")} for row in wandb_history(attempts[1])] == \
        [{"step": 2, "attempt": 1}]
    assert [row.get("attempt") for row in wandb_history(attempts[0])] == [None]


def wandb_history(run: Path) -> list:
    """The history rows an offline W&B run wrote (its run-<id>.wandb transaction log: LevelDB-style 32 KiB
    blocks of records -- crc32, length, type: 1 whole, 2 first, 3 middle, 4 last -- after W&B's header).
    ``run``: a run directory with one W&B attempt, or one attempt's ``offline-run-*`` folder."""
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = run.glob("run-*.wandb") if run.name.startswith("offline-run-") else run.glob("wandb/offline-run-*/run-*.wandb")
    data, rows, pos, pending = path.read_bytes(), [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # (a block's tail too short for a header is padding)
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_every_metric_reaches_wandb_against_the_runs_own_step_even_logged_after_a_later_one(tmp_path):
    # held-out evaluations are logged after training, at steps 0, eval_every, ...: W&B drops a row logged at
    # an internal step below its last, so each row carries the run's step as a value W&B plots against
    from bidirl.rundir import RunDir
    from tests.builders import small_config

    run = RunDir(small_config("logging.wandb_mode=offline"), path=tmp_path / "run")
    run.log(3, reward_mean=0.4)
    run.log(0, time_s=12.5, eval_accuracy=0.6)
    run.log(3, time_s=20.0, eval_accuracy=0.7)
    run.close()
    import wandb

    wandb.teardown()  # (W&B's service writes the log behind finish(); at teardown it has written all of it)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in wandb_history(tmp_path / "run")]
    assert rows == [{"step": 3, "time_s": rows[0]["time_s"], "reward_mean": 0.4},
                    {"step": 0, "time_s": 12.5, "eval_accuracy": 0.6}, {"step": 3, "time_s": 20.0, "eval_accuracy": 0.7}]


def test_a_nan_or_infinite_figure_is_written_as_json_null_so_strict_readers_can_read_the_run(tmp_path):
    from bidirl.rundir import RunDir
    from tests.builders import small_config

    run = RunDir(small_config(), path=tmp_path / "run")
    run.log(1, grad_norm=float("nan"), loss=float("inf"), reward_mean=0.5)
    run.finish({"status": "ok", "train": {"accuracy_end": float("nan"), "curve": [[0, float("-inf")]]}})
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert row["grad_norm"] is None and row["loss"] is None and row["reward_mean"] == 0.5
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert summary["train"] == {"accuracy_end": None, "curve": [[0, None]]}


def test_a_run_ended_by_ctrl_c_reads_interrupted_and_one_ended_by_an_error_reads_failed_with_its_line(tmp_path):
    from bidirl.report import write_report
    from bidirl.rundir import RunDir
    from tests.builders import small_config

    def ended(name: str, failure: BaseException) -> dict:
        RunDir(small_config(), path=tmp_path / name).finish_after(failure, {"stages": ["plan"]})
        return json.loads((tmp_path / name / "summary.json").read_text())

    interrupted = ended("stopped", KeyboardInterrupt())
    assert interrupted["status"] == "interrupted" and "error" not in interrupted
    assert interrupted["stages"] == ["plan"]  # what the run had reached stays
    failed = ended("broken", RuntimeError("the primary trainer died\n(traceback below)"))
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: the primary trainer died"
    assert "Status **interrupted**" in write_report(tmp_path / "stopped").read_text()


def test_a_full_disk_while_closing_a_failed_run_does_not_hide_why_it_failed(tmp_path, monkeypatch):
    import bidirl.rundir as rundir
    from tests.builders import small_config

    run = rundir.RunDir(small_config(), path=tmp_path / "run")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    class FullDiskFile:  # the metrics file: closing flushes its last row to the same full disk
        closed = False

        def close(self):
            self.closed = True
            full_disk()

    monkeypatch.setattr(rundir, "_write_atomic", full_disk)
    run._metrics.close()
    run._metrics = FullDiskFile()
    run.finish_after(RuntimeError("the primary trainer died"))  # returns: the caller raises its failure next
    assert run._metrics.closed


def test_a_failed_runs_error_is_the_first_line_that_says_something(tmp_path):
    from bidirl.rundir import RunDir
    from tests.builders import small_config

    RunDir(small_config(), path=tmp_path / "run").finish_after(ValueError("\n  bad shard: model-00002\n(details)"))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["error"] == "ValueError: bad shard: model-00002"


def test_a_resume_starts_on_the_partition_its_checkpoint_was_taken_on_not_the_configured_split(tmp_path):
    """Re-planning moved a rollout device to the train pool before the checkpoint: the resumed run starts
    there, with the same primary trainer, not on the configured 2 rollout / 1 train."""
    from bidirl.runtime.checkpoints import Checkpoint, partition
    from bidirl.sched.assembly import assemble
    from bidirl.sched.roles import Role
    from tests.builders import small_config

    cfg = small_config("cluster.devices=3", "cluster.rollout_devices=2", "launch.mode=areal")
    taken = Checkpoint(tmp_path, 4, {"policy": "areal", "homes": ["rollout", "train", "train"], "primary": 2})
    cluster = assemble("areal", cfg.run_shape(), cfg.live_driver(), resumed=partition(taken, "areal", 3)).cluster
    assert [d.home for d in cluster.devices] == [Role.ROLLOUT, Role.TRAIN, Role.TRAIN] and cluster.primary == 2
    configured = assemble("areal", cfg.run_shape(), cfg.live_driver()).cluster
    assert [d.home for d in configured.devices] == [Role.ROLLOUT, Role.ROLLOUT, Role.TRAIN]


def test_a_rollout_device_that_re_planning_was_moving_to_the_train_pool_starts_there_on_resume(tmp_path):
    """Device 1 was draining its groups to move (``leaving``) when the checkpoint was taken: a resumed run
    has nothing to drain, so it starts as a trainer."""
    from bidirl.runtime.checkpoints import Checkpoint, partition
    from bidirl.sched.roles import Role

    taken = Checkpoint(tmp_path, 4, {"policy": "areal", "homes": ["rollout", "rollout", "train"], "primary": 2,
                                     "leaving": [1]})
    assert partition(taken, "areal", 3) == ([Role.ROLLOUT, Role.TRAIN, Role.TRAIN], 2)


def test_a_re_planning_move_to_a_device_the_run_does_not_have_is_refused():
    from bidirl.runtime.checkpoints import Checkpoint, partition

    edited = Checkpoint(Path("v00004"), 4, {"policy": "areal", "homes": ["rollout", "train"], "primary": 1,
                                            "leaving": [5]})
    with pytest.raises(ValueError, match=r"its re-planning moves \('leaving'\) name device 5 of 2"):
        partition(edited, "areal", 2)


def test_a_checkpoint_of_the_last_version_resumes_only_to_finish_a_run_that_died_after_training():
    from bidirl.errors import BidirlError
    from bidirl.runtime.checkpoints import Checkpoint, check_compatible
    from tests.builders import small_config

    cfg = small_config("train.steps=4", "train.prompts_per_step=8")
    last = Checkpoint(Path("v00004"), 4, controller_state(Path("run"), 4, 8))
    check_compatible(last, cfg, finishing=True)  # (its final checkpoint and evaluation were left: it finishes them)
    with pytest.raises(BidirlError, match="nothing is left to train \\(raise train.steps to continue\\)"):
        check_compatible(last, cfg)
    with pytest.raises(BidirlError, match="the checkpoint trained 8 prompts per step"):
        check_compatible(last, small_config("train.steps=6", "train.prompts_per_step=16"), finishing=True)


def test_a_checkpoint_of_another_policy_or_device_count_resumes_on_the_configured_split(tmp_path):
    from bidirl.runtime.checkpoints import Checkpoint, partition

    taken = Checkpoint(tmp_path, 4, {"policy": "areal", "homes": ["rollout", "train", "train"], "primary": 2})
    assert partition(taken, "bidirl", 3) is None and partition(taken, "areal", 4) is None
    before_homes = Checkpoint(tmp_path, 4, {"policy": "areal"})
    assert partition(before_homes, "areal", 3) is None
    # one from before the primary was kept: its first home trainer (each resumes the same trainer state)
    before_primary = Checkpoint(tmp_path, 4, {"policy": "areal", "homes": ["rollout", "train", "train"]})
    assert partition(before_primary, "areal", 3)[1] == 1


def test_a_resumed_partition_without_its_primary_in_the_train_pool_is_refused_in_one_line():
    from bidirl.sched.assembly import assemble
    from bidirl.sched.roles import Role
    from tests.builders import small_config

    cfg = small_config("cluster.devices=2", "launch.mode=areal")
    with pytest.raises(ValueError, match=r"the resumed partition \['train', 'rollout'\] \(primary 1\) does not fit"):
        assemble("areal", cfg.run_shape(), cfg.live_driver(), resumed=([Role.TRAIN, Role.ROLLOUT], 1))


# ---- resuming: the same model, a moved run directory, checkpoints sealed over edited files ----------
BIDIRL = str(Path(sys.executable).with_name("bidirl"))
ROOT = Path(__file__).resolve().parents[1]
TINY = "pipelines/cpu-tiny.yaml"


def controller_state(run: Path, version: int, groups: int) -> dict:
    """A controller.json as a two-device async run writes it at ``version`` (snapshots at 0 and 2)."""
    return {"version": version, "seed": 0, "groups_per_step": groups, "prompts": {"drawn": groups * version + 4,
            "redo": [groups * version + 1]}, "untrained_groups": 4, "next_group": groups * version + 4,
            "staleness": {"0": groups * version}, "homes": ["rollout", "train"], "primary": 1, "leaving": [],
            "policy": "async", "report": {"snapshots": [[v, str(run / "snapshots" / f"v{v:05d}.pt")] for v in (0, 2)],
                                          "version_seconds": {str(v): 1.5 * v for v in range(version + 1)},
                                          "consumed_samples": 64, "consumed_tokens": 900, "rl_seconds": 3.0,
                                          "replica_checks": version}}


def resumable_run(run: Path, cfg, version: int = 2) -> Path:
    """A run directory of ``cfg`` (its config.yaml, its snapshots) with a checkpoint sealed at ``version``."""
    from bidirl.config import to_yaml

    (run / "snapshots").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    for v in (0, 2):
        (run / "snapshots" / f"v{v:05d}.pt").write_bytes(b"snapshot")
    seal(trainer_files(run, version), controller_state(run, version, cfg.train.prompts_per_step), 3)
    return run


def sealed_over(checkpoint_path: Path, name: str, text: str) -> None:
    """``name`` in the checkpoint edited to ``text``, and its manifest written again to match (it verifies)."""
    from bidirl.runtime.checkpoints import _sha256

    (checkpoint_path / name).write_text(text)
    manifest = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
                for f in sorted(checkpoint_path.iterdir()) if f.name != "MANIFEST.json"}
    (checkpoint_path / "MANIFEST.json").write_text(json.dumps(manifest))


def launched(run: Path, *args: str) -> subprocess.CompletedProcess:
    """``bidirl launch`` of the CPU tiny pipeline, resuming ``run`` (whatever it writes kept beside it)."""
    keep = [f"output_dir={run.parent}/runs", f"model.cache_dir={shared_model_cache(run.parent)}",
            "logging.wandb_mode=disabled"]
    return subprocess.run([BIDIRL, "launch", TINY, *keep, *args, "--resume", str(run)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed (exit code 2, no traceback)."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    return lines[0]


def listing(folder: Path) -> list:
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


def test_a_resume_with_another_model_shape_is_one_line_before_anything_is_written_or_launched(tmp_path):
    from bidirl.config import load_config

    run = resumable_run(tmp_path / "run", load_config(TINY))  # the default hidden size, 256
    before = listing(run)
    line = one_line_error(launched(run, "train.steps=4", "model.tiny.hidden_size=64"))
    assert "model.tiny.hidden_size=256" in line and "model.tiny.hidden_size=64" in line and str(run) in line
    assert listing(run) == before  # no config.resumed-*.yaml, no metrics rolled back, the checkpoint intact


def test_a_resume_with_another_model_source_is_refused_and_one_with_another_precision_or_cache_is_not(tmp_path):
    from bidirl.errors import BidirlError
    from bidirl.runtime.checkpoints import check_compatible
    from tests.builders import small_config

    resumable_run(tmp_path / "run", small_config())
    checkpoint = latest_good(tmp_path / "run", lambda _: None)
    with pytest.raises(BidirlError, match="model.source=tiny .*configured with model.source=smollm2"):
        check_compatible(checkpoint, small_config("model.source=smollm2"))
    # the trainer keeps fp32 master weights whatever model.dtype says; the SFT recipe only made the starting weights
    check_compatible(checkpoint, small_config("model.dtype=bfloat16", f"model.cache_dir={tmp_path}/elsewhere",
                                              "model.tiny.sft_steps=10"))


def test_a_run_directory_moved_after_its_checkpoint_resumes_with_its_snapshots_where_they_are_now(tmp_path):
    from bidirl.rundir import RunDir
    from bidirl.runtime.reporting import RunReport
    from tests.builders import small_config

    cfg = small_config()
    resumable_run(tmp_path / "old", cfg)
    (tmp_path / "old").rename(tmp_path / "new")
    checkpoint = latest_good(tmp_path / "new", lambda _: None)
    report = RunReport(cfg, RunDir.resumed(cfg, tmp_path / "new", checkpoint.version))
    report.resume(checkpoint.state, {"from_version": checkpoint.version})
    report.run.close()
    assert report.snapshots == [(v, str(tmp_path / "new" / "snapshots" / f"v{v:05d}.pt")) for v in (0, 2)]
    assert all(Path(path).is_file() for _, path in report.snapshots)


def real_state(**changes) -> str:
    state = controller_state(Path("/runs/run"), 2, 128)
    return json.dumps({**state, **changes})


EDITED_CONTROLLER_FILES = {  # controller.json as edited, then sealed again (its manifest matches) -> the line names
    "an empty mapping": ("{}", "no 'version'"),
    "no batch size": (json.dumps({"version": 2}), "no 'groups_per_step'"),
    "not JSON": ("{not json", "not readable JSON"),
    "a list": ("[]", "a JSON list, not the controller's state"),
    "a version in words": (real_state(version="abc"), "'version' is 'abc'"),
    "a version its folder does not have": (real_state(version=7), "'version' is 7, but the checkpoint is v00002"),
    "a batch size in quotes": (real_state(groups_per_step="2"), "'groups_per_step' is '2'"),
    "homes as a number": (real_state(homes=5), "'homes' is 5"),
    "a move of a device named in words": (real_state(leaving=["x"]), "'leaving' is [\"x\"]"),
    "a staleness histogram as a list": (real_state(staleness=[1]), "'staleness' is [1]"),
    "a data cursor without its positions": (real_state(prompts={"drawn": 3}), "'prompts' is {\"drawn\": 3}"),
    "a learning curve without its snapshots": (real_state(report={}), "'report.snapshots' is missing"),
}


@pytest.mark.parametrize("case", list(EDITED_CONTROLLER_FILES))
def test_a_controller_file_sealed_over_an_edit_is_one_line_naming_the_file_and_the_field(case, tmp_path):
    from bidirl.config import load_config

    text, culprit = EDITED_CONTROLLER_FILES[case]
    run = resumable_run(tmp_path / "run", load_config(TINY))
    sealed_over(run / FOLDER / "v00002", "controller.json", text)
    before = listing(run)
    line = one_line_error(launched(run, "train.steps=4"))
    assert f"{run / FOLDER / 'v00002' / 'controller.json'}: " in line and culprit in line, line
    assert listing(run) == before


def test_a_partition_read_from_an_edited_controller_file_is_one_line_naming_the_field(tmp_path):
    from bidirl.errors import BidirlError
    from bidirl.runtime.checkpoints import Checkpoint, partition

    with pytest.raises(BidirlError, match=r"v00004/controller.json: 'homes' is 5, not a list"):
        partition(Checkpoint(tmp_path / "v00004", 4, {"policy": "areal", "homes": 5}), "areal", 2)
    with pytest.raises(BidirlError, match=r"v00004/controller.json: 'leaving' is \[\"x\"\], not a list of device"):
        partition(Checkpoint(tmp_path / "v00004", 4, {"policy": "areal", "homes": ["rollout", "train"],
                                                       "leaving": ["x"]}), "areal", 2)


EDITED_MANIFESTS = {  # MANIFEST.json as edited -> why the checkpoint does not verify
    "a list": ("[]", "MANIFEST.json is a JSON list, not a mapping"),
    "a string": ('"sealed"', "MANIFEST.json is a JSON str, not a mapping"),
    "an entry without its size": (None, "MANIFEST.json's entry for controller.json is {\"sha256\""),
    "a file outside the checkpoint": (json.dumps({"../../config.yaml": {}, "controller.json": {}}),
                                      "MANIFEST.json names '../../config.yaml', a file outside the checkpoint"),
}


@pytest.mark.parametrize("case", list(EDITED_MANIFESTS))
def test_an_edited_manifest_does_not_verify_and_a_resume_from_it_alone_is_one_line_naming_it(case, tmp_path):
    from bidirl.config import load_config

    text, why = EDITED_MANIFESTS[case]
    run = resumable_run(tmp_path / "run", load_config(TINY))
    path = run / FOLDER / "v00002"
    if text is None:
        manifest = json.loads((path / "MANIFEST.json").read_text())
        del manifest["controller.json"]["bytes"]
        text = json.dumps(manifest)
    (path / "MANIFEST.json").write_text(text)
    assert verify(path).startswith(why)
    line = one_line_error(launched(run, "train.steps=4"))
    assert "none of its checkpoints verifies against its MANIFEST.json" in line and why in line, line


def test_a_model_folder_resumed_by_another_spelling_or_as_its_hub_id_is_the_same_and_two_hub_ids_are_not(
        tmp_path, monkeypatch):
    from bidirl.errors import BidirlError
    from bidirl.runtime.checkpoints import check_same_model
    from tests.builders import small_config

    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    monkeypatch.chdir(tmp_path)
    resumable_run(tmp_path / "run", small_config("model.source=models/m"))
    checkpoint = latest_good(tmp_path / "run", lambda _: None)
    check_same_model(checkpoint, small_config(f"model.source={folder}"))  # (typed from elsewhere: one folder)
    check_same_model(checkpoint, small_config("model.source=org/m"))  # (a hub id and a folder: cannot tell)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 16}))
    with pytest.raises(BidirlError, match="model.source=models/m .*configured with model.source="):
        check_same_model(checkpoint, small_config(f"model.source={copy}"))  # (another architecture)
    hub = tmp_path / "hub-run"
    resumable_run(hub, small_config("model.source=org/a"))
    with pytest.raises(BidirlError, match="model.source=org/a .*configured with model.source=org/b"):
        check_same_model(latest_good(hub, lambda _: None), small_config("model.source=org/b"))
