"""Performance models fitted from profiles, the scheduling-aware planner, and their files."""

import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bidirl.config import load_config
from bidirl.errors import BidirlError
from bidirl.perf.fitted import Fit, Profile, fit_decode, fit_line, least_squares, load_profile
from bidirl.profiling import CO_RUNNING_PAIRS, DECODE_PASSES, IDLE, LENGTH_BATCHES, TRAIN, paired_slowdown
from bidirl.planner import fits_memory, load_plan, plan, planning_config, preflight, write_plan
from bidirl.sim.run import perf_model, simulate
from tests.builders import shared_model_cache

BIDIRL = str(Path(sys.executable).with_name("bidirl"))
SMALL = ["cluster.devices=8", "train.prompts_per_step=64", "rollout.group_size=4", "train.steps=6",
         "launch.chunk_groups=8", "launch.mode=areal"]


def small(*overrides):
    return load_config("pipelines/sim-32gpu.yaml", [*SMALL, *overrides])


def synthetic_profile(**changes) -> Profile:
    fields = dict(device="cpu", decode=Fit({"a": 2e-3, "b": 1e-4, "c": 1e-7}, 0.01),
                  prefill=Fit({"per_token": 1e-5}, 0.02), train=Fit({"fixed_s": 0.05, "per_token_s": 2e-4}, 0.03),
                  weights={"load_s": 0.02, "publish_s": 0.01, "bytes": 1.3e7},
                  switch={"to_rollout_s": 0.02, "to_train_s": 1e-5}, capacity=512,
                  workload={"prompt_tokens": 9, "mean_tokens": 3.5, "cap": 8, "prompt_sigma": 0.3, "sample_sigma": 0.2})
    fields.update(changes)
    return Profile(**fields)


def test_fits_recover_known_coefficients_from_synthetic_points():
    points = [{"batch": b, "context": c, "step_s": 0.003 + 2e-4 * b + 5e-7 * b * c}
              for b in (4, 16, 64, 256) for c in (20, 60, 120)]
    fit = fit_decode(points)
    assert fit.coefficients == pytest.approx({"a": 0.003, "b": 2e-4, "c": 5e-7}, rel=1e-6)
    assert fit.error < 1e-9
    line = fit_line([{"tokens": t, "seconds": 0.1 + 3e-4 * t} for t in (1000, 2000, 4000)], "tokens", "seconds",
                    ("fixed_s", "per_token_s"))
    assert line.coefficients == pytest.approx({"fixed_s": 0.1, "per_token_s": 3e-4})
    # points far from 0 tokens whose line would cross below 0: the best line through the origin instead
    far = [{"tokens": t, "seconds": -0.2 + 3e-4 * t} for t in (2000, 3000, 4000)]
    through = fit_line(far, "tokens", "seconds", ("fixed_s", "per_token_s")).coefficients
    assert through["fixed_s"] == 0.0 and through["per_token_s"] == pytest.approx(
        sum(p["tokens"] * p["seconds"] for p in far) / sum(p["tokens"] ** 2 for p in far))


def test_a_streamed_steps_parts_cost_what_the_whole_batch_does_even_under_a_negative_fitted_intercept():
    # real profiles fit intercepts of -0.02 to -0.16 s (points far from 0 tokens); the intercept is charged
    # once per step, and the rest per part, so a negative one must not come off every part
    from bidirl.sim.costs import CalibratedCosts
    from bidirl.perf.workload import preset

    for fixed in (-0.1, 0.05):
        model = synthetic_profile(train=Fit({"fixed_s": fixed, "per_token_s": 2e-4}, 0.03)).model()
        costs = CalibratedCosts(model, preset("gsm8k"), group_size=4, steps=10, seed=0)
        whole = model.train_compute_seconds(4000) - costs.train_fixed_s
        parts = 8 * (model.train_compute_seconds(500) - costs.train_fixed_s)
        assert parts == pytest.approx(whole) == pytest.approx(2e-4 * 4000)


def test_a_profile_used_with_another_cap_group_size_task_difficulty_source_model_or_engine_is_one_line(tmp_path):
    from bidirl.perf.fitted import measured_with
    from bidirl.sim.run import sim_workload

    cpu = ["cluster.devices=2", f"sim.profile={tmp_path / 'profile.json'}", "rollout.max_new_tokens=8",
           "rollout.group_size=4", "data.task=basic_arithmetic", "data.task_config={max_digits: 1}"]
    measured = measured_with(small(*cpu))  # (what `bidirl profile` records)
    assert measured["model.source"] == "tiny" and "model.tiny.seed" not in measured
    (tmp_path / "profile.json").write_text(synthetic_profile(meta=measured).to_json())
    assert sim_workload(small(*cpu)).name == "measured" == sim_workload(small(*cpu, "model.tiny.seed=3")).name
    for changed in ("rollout.max_new_tokens=1024", "rollout.group_size=2", "data.task=chain_sum",
                    "data.source=gsm8k", "data.task_config={max_digits: 3}", "model.tiny.hidden_size=512",
                    "model.source=smollm2", "rollout.engine=vllm", "train.engine=deepspeed", "rollout.temperature=0.7",
                    "cluster.device_type=cuda"):
        key = changed.split("=")[0]
        with pytest.raises(BidirlError, match=f"measured with {key}=.* but the pipeline has {key}=.*; profile again"):
            sim_workload(small(*cpu, changed))


def test_a_profile_names_a_local_dataset_by_its_folder_not_its_path_on_the_host_that_measured_it(tmp_path):
    from bidirl.perf.fitted import measured_with

    (tmp_path / "gsm8k").mkdir()
    local = measured_with(small("data.source=gsm8k", f"data.path={tmp_path / 'gsm8k'}"))
    assert local["data.source"] == "gsm8k" and local["data.path"] == "gsm8k"
    assert measured_with(small("data.source=gsm8k", "data.path=openai/gsm8k"))["data.path"] == "openai/gsm8k"


def test_a_decode_fit_never_trades_one_term_below_zero_against_another():
    # one profile's points as measured: its largest batch timed in a slow minute read 37.6 ms at the usual
    # context and 25.4 ms at a longer one, and plain least squares made the context term negative
    measured = [(8, 120.5, 6.64), (32, 120.25, 10.42), (64, 118.0, 14.81), (128, 119.25, 37.6), (128, 194.25, 25.4)]
    fit = fit_decode([{"batch": b, "context": c, "step_s": ms / 1000} for b, c, ms in measured])
    assert min(fit.coefficients.values()) >= 0
    unconstrained = least_squares([(1, b, b * c) for b, c, _ in measured], [ms / 1000 for *_, ms in measured])
    assert unconstrained[2] < 0  # (what the fit once kept)


def test_the_decode_timings_go_through_prompts_the_prefix_cache_has_not_seen():
    from bidirl.profiling import FreshPrompts

    class Words:  # a tokenizer counting words
        def __call__(self, text, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": text.split()})

    prompts = FreshPrompts(["a", "b c", "d e f", "g"], Words())
    assert prompts.longest == 3
    assert prompts.next(3) == (["a", "b c", "d e f"], [1, 2, 3])
    assert prompts.next(2) == (["g", "a"], [1, 1])  # every prompt once before any comes round again


def test_a_line_fitted_to_timings_that_fall_as_work_grows_is_flat_at_their_mean_not_falling():
    noisy = [{"tokens": 60, "seconds": 0.031}, {"tokens": 120, "seconds": 0.027}, {"tokens": 250, "seconds": 0.029}]
    line = fit_line(noisy, "tokens", "seconds", ("fixed_s", "per_token_s"))
    assert line.coefficients == pytest.approx({"fixed_s": 0.029, "per_token_s": 0.0})


def test_the_measured_workload_knows_which_share_of_samples_grpo_trains(tmp_path):
    from bidirl.perf.fitted import fit_workload

    lengths = [[3, 4, 3, 5], [2, 2, 3, 2], [6, 5, 7, 6], [3, 3, 4, 3]]
    rewards = [[1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]]  # two groups teach something
    workload = fit_workload(lengths, 9.0, 8, rewards)
    assert workload["informative"] == 0.5 and workload["mean_tokens"] == pytest.approx(61 / 16)
    every = synthetic_profile(workload={**workload, "informative": 1.0})
    half = synthetic_profile(workload=workload)
    work = {}
    for name, profile in (("every", every), ("half", half)):
        path = tmp_path / f"{name}.json"
        path.write_text(profile.to_json())
        work[name] = simulate(small("cluster.devices=2", "train.prompts_per_step=16", "launch.chunk_groups=16",
                                    f"sim.profile={path}"), "areal").step_s
    assert work["half"] < 0.75 * work["every"]  # a train-bound run: the trainer is charged for what it trains


def test_a_profile_round_trips_through_its_schema(tmp_path):
    for profile in (synthetic_profile(), synthetic_profile(logprob=Fit({"fixed_s": 0.01, "per_token_s": 5e-5}, 0.04)),
                    synthetic_profile(co_running={"decode": 1.05, "train": 1.2, "train_step_s": 1.3}),
                    synthetic_profile(requests={"per_request_s": 2e-3, "points": [{"sequences": 64}]}),
                    synthetic_profile(warmup={"rollout_s": 2.0, "train_s": 0.1, "timings": {}}),
                    synthetic_profile(step_overhead={"per_micro_batch_s": 4e-3, "finish_s": 0.03})):
        (tmp_path / "profile.json").write_text(profile.to_json())
        assert load_profile(tmp_path / "profile.json") == profile


def test_a_measured_workload_replays_its_groups_scaled_to_the_mean_asked_for(tmp_path):
    import dataclasses

    from bidirl.perf.fitted import fit_workload
    from bidirl.perf.workload import GroupDraws

    measured = fit_workload([[10, 10, 10, 10], [30, 30, 30, 30]], 9.0, 40)
    profile = synthetic_profile(workload=measured)
    (tmp_path / "profile.json").write_text(profile.to_json())
    workload = load_profile(tmp_path / "profile.json").measured_workload()
    draws = GroupDraws(0, 4)
    groups = [workload.group_lengths(draws, g, 0, 10) for g in range(200)]
    assert {tuple(g) for g in groups} == {(10,) * 4, (30,) * 4}  # the measured shapes, not a log-normal
    assert groups == [workload.group_lengths(GroupDraws(0, 4), g, 0, 10) for g in range(200)]  # common draws
    longer = dataclasses.replace(workload, mean_tokens=40.0)  # what the re-planner asks about
    assert {tuple(longer.group_lengths(draws, g, 0, 10)) for g in range(200)} == {(20,) * 4, (40,) * 4}  # capped


def test_a_fitted_model_charges_a_log_prob_recompute_only_when_asked_and_only_if_measured():
    plain = synthetic_profile().model()
    measured = synthetic_profile(logprob=Fit({"fixed_s": 0.01, "per_token_s": 5e-5}, 0.04)).model()
    assert measured.train_compute_seconds(1000) == plain.train_compute_seconds(1000) == pytest.approx(0.25)
    assert measured.train_compute_seconds(1000, recompute_logprob=True) == pytest.approx(0.25 + 0.06)
    assert measured.logprob_seconds(1000) == pytest.approx(0.06)
    with pytest.raises(ValueError, match="no forward-only log-prob fit"):
        plain.logprob_seconds(1000)


def test_devices_sharing_a_host_are_charged_at_their_co_running_speed():
    alone = synthetic_profile(logprob=Fit({"fixed_s": 0.01, "per_token_s": 5e-5}, 0.04)).model()
    beside = synthetic_profile(logprob=Fit({"fixed_s": 0.01, "per_token_s": 5e-5}, 0.04),
                               co_running={"decode": 1.1, "train": 1.25}).model()
    assert beside.train_compute_seconds(1000) == pytest.approx(1.25 * alone.train_compute_seconds(1000))
    assert beside.logprob_seconds(1000) == pytest.approx(1.25 * alone.logprob_seconds(1000))
    # decoding alone is as fast as measured alone; the simulator slows it only while a neighbour trains
    assert beside.decode_line(50.0) == alone.decode_line(50.0) and beside.decode_slowdown_beside_training() == 1.1
    assert alone.decode_slowdown_beside_training() == 1.0 and beside.load_seconds() == alone.load_seconds()


def test_each_request_costs_its_measured_overhead_beyond_prefill_and_decode():
    from bidirl.perf.workload import Workload
    from bidirl.sim.costs import generation_seconds

    workload = Workload(name="w", prompt_tokens=9, mean_tokens=3.5, cap=8, prompt_sigma=0.3, sample_sigma=0.2)
    lengths = [3, 4, 3, 5] * 16  # one chunk: 16 groups of 4
    bare = generation_seconds(synthetic_profile().model(), workload, lengths, 4)
    charged = generation_seconds(synthetic_profile(requests={"per_request_s": 2e-3}).model(), workload, lengths, 4)
    assert charged == pytest.approx(bare + 64 * 2e-3)  # (a device does a request's own work in turn)
    assert synthetic_profile().model().request_overhead_seconds() == 0.0  # older profiles did not measure it


def test_a_profiled_warm_up_is_charged_where_the_runtime_pays_it_the_first_step_not_the_first_chunk(tmp_path):
    # the live worker warms its rollout engine at start-up, before the run's clock (as a GPU engine warms at
    # its start); the trainer's first step still pays its own
    first_chunk, first_step = {}, {}
    for name, warmup in (("steady", None), ("warming", {"rollout_s": 5.0, "train_s": 0.5})):
        (tmp_path / f"{name}.json").write_text(synthetic_profile(warmup=warmup).to_json())
        cfg = small(f"sim.profile={tmp_path / name}.json", "cluster.devices=2", "launch.chunk_groups=8",
                    "train.prompts_per_step=16", "algorithm.staleness=1")
        result = simulate(cfg, "async", rollout_devices=1, keep_trace=True, driver=cfg.live_driver())
        first_chunk[name] = next(r["t"] for r in result.cluster.trace if r["reason"] == "chunk 0 done")
        first_step[name] = next(r["t"] for r in result.cluster.trace if r["reason"] == "step -> v1")
    assert first_chunk["warming"] == pytest.approx(first_chunk["steady"])
    assert first_step["warming"] == pytest.approx(first_step["steady"] + 0.5, abs=0.05)
    assert synthetic_profile().model().warmup_seconds("train") == 0.0  # older profiles did not measure it


def test_the_simulator_slows_decoding_on_a_shared_host_only_while_a_train_step_runs(tmp_path):
    steps = {}
    long_answers = {"prompt_tokens": 9, "mean_tokens": 60.0, "cap": 120, "prompt_sigma": 0.3, "sample_sigma": 0.2}
    for name, co in (("alone", None), ("beside", {"decode": 1.5, "train": 1.0})):
        profile = synthetic_profile(co_running=co, workload=long_answers,
                                    train=Fit({"fixed_s": 0.05, "per_token_s": 2e-5}, 0.03))
        (tmp_path / f"{name}.json").write_text(profile.to_json())
        cfg = small(f"sim.profile={tmp_path / name}.json", "cluster.devices=2", "launch.chunk_groups=16",
                    "train.prompts_per_step=16", "algorithm.staleness=1")
        steps[name] = simulate(cfg, "async", rollout_devices=1).step_s
    # rollout-bound: decode is slowed while the trainer runs, which is part of the time, not all of it
    assert steps["alone"] * 1.02 < steps["beside"] < steps["alone"] * 1.45


def test_the_simulator_slows_decoding_on_a_shared_host_while_another_device_decodes_too(tmp_path):
    steps = {}
    long_answers = {"prompt_tokens": 9, "mean_tokens": 60.0, "cap": 120, "prompt_sigma": 0.3, "sample_sigma": 0.2}
    for name, co in (("alone", None), ("beside", {"decode": 1.0, "train": 1.0, "decode_beside_decode": 1.5})):
        profile = synthetic_profile(co_running=co, workload=long_answers,
                                    train=Fit({"fixed_s": 0.05, "per_token_s": 2e-5}, 0.03))
        (tmp_path / f"{name}.json").write_text(profile.to_json())
        cfg = small(f"sim.profile={tmp_path / name}.json", "cluster.devices=2", "launch.chunk_groups=8",
                    "train.prompts_per_step=16", "algorithm.staleness=1")
        for policy, split in (("sync", {}), ("async", {"rollout_devices": 1})):
            steps[name, policy] = simulate(cfg, policy, **split).step_s
    # colocated: both devices generate the batch at once, each slowed while the other still decodes (the
    # shorter share ends first, so not the whole time); disaggregated: one device decodes, alone
    assert steps["alone", "sync"] * 1.1 < steps["beside", "sync"] < steps["alone", "sync"] * 1.5
    assert steps["beside", "async"] == steps["alone", "async"]
    assert synthetic_profile().model().decode_slowdown_beside_decoding() == 1.0  # older profiles did not measure it


@pytest.mark.parametrize("damage,message", [
    (lambda d: "not json{", "not a readable profile.json"),
    (lambda d: {**d, "schema": "other"}, "'schema' must be"),
    (lambda d: {k: v for k, v in d.items() if k != "train"}, "missing key 'train'"),
    (lambda d: {**d, "capacity": -3}, "key 'capacity' must be a positive integer"),
    (lambda d: {**d, "weights": {**d["weights"], "load_s": "fast"}}, "key 'weights.load_s' must be a finite number"),
    (lambda d: {**d, "co_running": {"decode": 1.1}}, "missing key 'train'"),
    (lambda d: {**d, "co_running": {"decode": 0, "train": 1.2}}, "key 'co_running.decode' must be a slowdown factor"),
    (lambda d: {**d, "co_running": {"decode": 1.1, "train": 1.0, "decode_beside_decode": 0}},
     "key 'co_running.decode_beside_decode' must be a slowdown factor"),
    (lambda d: {**d, "requests": {"per_request_s": -1}}, "key 'requests.per_request_s' must be a finite number >= 0"),
    (lambda d: {**d, "warmup": {"rollout_s": 2.0}}, "missing key 'train_s'"),
    (lambda d: {**d, "step_overhead": {"per_micro_batch_s": 0.004, "finish_s": "slow"}},
     "key 'step_overhead.finish_s' must be a finite number >= 0"),
    (lambda d: {**d, "warmup": {"rollout_s": -2.0, "train_s": 0}}, "key 'warmup.rollout_s' must be a finite number >= 0"),
    # sections of the wrong shape (a list, a string, a number where a mapping goes), found in review
    (lambda d: {**d, "requests": [1, 2]}, "key 'requests' must be a mapping"),
    (lambda d: {**d, "warmup": "x"}, "key 'warmup' must be a mapping"),
    (lambda d: {**d, "co_running": [1]}, "key 'co_running' must be a mapping"),
    (lambda d: {**d, "step_overhead": 3}, "key 'step_overhead' must be a mapping"),
    (lambda d: {**d, "meta": "abc"}, "key 'meta' must be a mapping"),
    (lambda d: {**d, "capacity": True}, "key 'capacity' must be a positive integer"),
    (lambda d: {**d, "prefill": {**d["prefill"], "coefficients": {"per_token": -1e-4}}},
     "key 'prefill.coefficients.per_token' must be a finite number >= 0"),
])
def test_a_corrupt_profile_is_one_line_naming_the_file_and_the_key(tmp_path, damage, message):
    data = json.loads(synthetic_profile().to_json())
    damaged = damage(data)
    (tmp_path / "profile.json").write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    with pytest.raises(BidirlError, match=message) as error:
        load_profile(tmp_path / "profile.json")
    assert str(tmp_path / "profile.json") in str(error.value) and "\n" not in str(error.value)


def test_the_simulator_runs_on_a_fitted_model_and_the_measured_workload(tmp_path):
    (tmp_path / "profile.json").write_text(synthetic_profile().to_json())
    cfg = small(f"sim.profile={tmp_path / 'profile.json'}", "cluster.devices=2", "launch.chunk_groups=16",
                "train.prompts_per_step=16", "algorithm.staleness=1")
    result = simulate(cfg, "areal", keep_trace=True)
    assert result.cluster.trained_groups == 6 * 16 and result.tokens_per_s > 0
    assert perf_model(cfg).switch_seconds("train") == pytest.approx(1e-5)


def test_partitions_respect_memory_and_a_model_that_fits_nowhere_is_one_line():
    perf = perf_model(small("sim.model=32B", "sim.hardware=H20"))
    assert not fits_memory(perf, 1, 2)  # one trainer cannot hold 32B of training state
    assert fits_memory(perf, 2, 16)
    with pytest.raises(BidirlError, match="does not fit .* on any partition"):
        plan(small("sim.model=32B", "sim.hardware=H20", "cluster.devices=3"))


def test_a_train_device_holds_its_share_of_the_training_state_and_one_micro_batch_of_activations():
    perf = perf_model(small("sim.model=7B", "sim.hardware=H100"))
    memory = perf.memory_bytes(longest_sequence=1117)  # gsm8k: one 16k-token micro-batch
    assert memory["activations"] == pytest.approx(31.4e9, rel=0.02)  # 3.3 checkpoints + 3.2 one layer + 24.9 logits
    assert perf.memory_bytes(longest_sequence=32768)["activations"] == pytest.approx(2 * memory["activations"])
    # two trainers hold the 7B training state (61 GB each), but not beside a micro-batch's activations
    assert memory["train_state"] / 2 < 0.95 * memory["hbm"]
    assert not fits_memory(perf, 30, 32, 1117) and fits_memory(perf, 29, 32, 1117)
    with pytest.raises(BidirlError, match=r"61 GB of training state \(sharded over 2\) \+ 31 GB of activations"):
        plan(small("sim.model=7B", "sim.hardware=H100", "cluster.devices=3"))


def test_the_planner_splits_in_whole_instances_and_tensor_parallel_instances_hold_a_share_of_the_weights():
    from bidirl.perf.analytic import HARDWARE, ModelSpec, PerfModel

    chosen = plan(small("cluster.devices=16", "cluster.instance_devices=4"), "areal", horizon=6)
    assert chosen.rollout_devices % 4 == 0 and chosen.instance_devices == 4
    assert "instances of 4 devices" in chosen.reason
    huge = PerfModel(HARDWARE["H100"], ModelSpec("50B", 50e9, 2e5))  # 100 GB of bf16 weights
    assert not fits_memory(huge, 8, 64) and fits_memory(huge, 8, 64, instance_devices=2)


@pytest.mark.parametrize("overrides,message", [
    (["cluster.instance_devices=3"], "key 'cluster.instance_devices' must be one of 1, 2, 4, 8 or 0"),
    (["cluster.instance_devices=0", "cluster.rollout_devices=4"], "cluster.rollout_devices must be 0 too"),
    (["cluster.devices=6", "cluster.instance_devices=4"], "must be multiples of cluster.instance_devices=4"),
    (["cluster.instance_devices=2", "sim.profile=p.json"], "needs the analytic model"),
])
def test_coarse_instances_that_cannot_be_built_are_one_line(overrides, message):
    with pytest.raises(BidirlError, match=message):
        small(*overrides)


def test_a_rollout_heavy_workload_gets_more_rollout_devices_than_a_train_heavy_one():
    # (16 devices: on 8, memory caps the reasoning split at 5/3 -- three trainers hold 7B's training state
    # beside a 16k-token micro-batch; one placement for both: the split alone is compared)
    rollout_heavy = plan(small("sim.workload=reasoning", "train.prompts_per_step=16", "cluster.devices=16",
                               "launch.tail_placement=due"), horizon=6)
    train_heavy = plan(small("sim.workload=gsm8k", "train.prompts_per_step=64", "cluster.devices=16",
                             "launch.tail_placement=due"), horizon=6)
    assert rollout_heavy.rollout_devices > train_heavy.rollout_devices


@pytest.mark.parametrize("placement", ["due", "none"])
@pytest.mark.parametrize("policy", ["areal", "bidirl", "roll"])
def test_the_pruned_search_scores_within_the_tie_margin_of_the_exhaustive_best(policy, placement):
    cfg = small("sim.workload=math", "algorithm.staleness=1", f"launch.tail_placement={placement}")
    chosen = plan(cfg, policy, horizon=6)
    legal = preflight(cfg, policy, True)  # the splits whose train pool holds the 7B's training state
    assert legal == [1, 2, 3, 4, 5]
    best = max(simulate(cfg, policy, rollout_devices=x, with_bound=False).samples_per_s for x in legal)
    assert chosen.predicted_samples_per_s >= 0.99 * best


def test_a_plan_round_trips_and_one_that_no_longer_fits_the_pipeline_is_refused(tmp_path):
    cfg = small()
    result = plan(cfg, horizon=6)
    path = write_plan(result, tmp_path)
    assert load_plan(path, cfg) == result and 0 < result.rollout_devices < 8
    with pytest.raises(BidirlError, match="planned for 8 devices .* cluster.devices=16"):
        load_plan(path, small("cluster.devices=16"))
    path.write_text(json.dumps({**json.loads(path.read_text()), "rollout_devices": "four"}))
    with pytest.raises(BidirlError, match="key 'rollout_devices' must be a whole number"):
        load_plan(path, cfg)


@pytest.mark.parametrize("edit,culprit", [
    ({"rollout_devices": 3, "instance_devices": 2}, "must be whole instances of 2 devices"),
    ({"rollout_devices": 0}, "is 0 \\(colocated\\), but policy 'bidirl' has a rollout and a train pool"),
    ({"policy": "areal"}, "planned for policy 'areal' but the pipeline has launch.mode=bidirl"),
    ({"instance_devices": 2.0}, "key 'instance_devices' must be one of 1, 2, 4, 8"),
    ({"tail_placement": "sideways"}, "key 'tail_placement' must be one of auto, due, none"),
])
def test_a_plan_that_the_run_would_follow_differently_is_refused_naming_the_key(tmp_path, edit, culprit):
    cfg = small("launch.mode=bidirl", "cluster.instance_devices=0")  # (any instance size may be loaded)
    path = write_plan(plan(small("launch.mode=bidirl"), horizon=6), tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(BidirlError, match=culprit):
        load_plan(path, cfg)


def test_colocated_policies_have_nothing_to_partition():
    assert plan(small(), "verl", horizon=6).rollout_devices == 0


def test_plan_cli_writes_plan_json_and_prints_the_table(tmp_path):
    result = subprocess.run([BIDIRL, "plan", "pipelines/sim-32gpu.yaml", *SMALL, f"output_dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "chosen" in result.stdout
    (run,) = tmp_path.iterdir()
    assert json.loads((run / "plan.json").read_text())["policy"] == "areal"


def test_a_plan_in_progress_shows_how_many_splits_it_simulated_and_the_best_so_far(monkeypatch):
    # (a plan simulates its candidates for ~10 s at 32 devices; the spinner is what a user sees meanwhile)
    import contextlib

    import bidirl.ui as ui

    news, opened = [], []

    @contextlib.contextmanager
    def spinner(description, enabled=True):
        opened.append(description)
        yield news.append

    monkeypatch.setattr(ui, "activity", spinner)
    result = plan(small(), "areal")  # (it plans both older-tail placements: two searches)
    assert opened == ["planning 'areal'"]  # one spinner for the whole plan, however many searches it runs
    counts = [int(line.split()[0]) for line in news]
    assert counts == sorted(counts) and counts[-1] == result.simulated_splits
    best = news[-1].split("best ")[1]  # e.g. "3/5: 102 samples/s"
    rollout, train = best.split(":")[0].split("/")
    assert int(rollout) + int(train) == 8 and best.endswith(" samples/s")


def test_off_a_terminal_or_quiet_a_spinner_shows_nothing_and_never_nests(monkeypatch):
    import bidirl.ui as ui

    with ui.activity("off a terminal") as show:  # (pytest captures stderr: not a terminal)
        show("news")
        assert not ui._live[0]
    monkeypatch.setattr(type(ui.console), "is_terminal", property(lambda self: True))
    with ui.activity("outer") as show:
        assert ui._live[0]
        with ui.activity("inner") as inner:  # (rich draws one live display at a time)
            inner("news")
        assert ui._live[0]
    assert not ui._live[0]
    monkeypatch.setenv(ui.QUIET_VARIABLE, "1")
    with ui.activity("quiet"):
        assert not ui._live[0]


def test_plan_with_a_missing_profile_is_one_line_and_leaves_no_run_directory(tmp_path):
    result = subprocess.run([BIDIRL, "plan", "pipelines/sim-32gpu.yaml", *SMALL, f"output_dir={tmp_path}/out",
                             "--profile", str(tmp_path / "nope.json")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: sim.profile=")
    assert not (tmp_path / "out").exists()


def test_simulate_asks_the_planner_for_each_policys_split_when_none_is_given(tmp_path):
    from bidirl.planner import planned_configs

    splits = {p: c.cluster.rollout_devices
              for p, c in planned_configs(small("cluster.rollout_devices=0"), ["verl", "areal", "bidirl"]).items()}
    assert splits["verl"] == 0 and 0 < splits["areal"] < 8 and 0 < splits["bidirl"] < 8
    fixed = planned_configs(small("cluster.rollout_devices=3"), ["areal"])
    assert fixed["areal"].cluster.rollout_devices == 3


@pytest.mark.parametrize("bad, culprit", [
    (["algorithm.staleness=0.5"], "a fractional bound needs count-only staleness"),
    (["sim.model=32B"], "does not fit"),
])
def test_bad_input_for_any_policy_is_refused_before_the_first_is_planned(bad, culprit, monkeypatch):
    # (each plan simulates its candidate splits for seconds: the last policy's bad input used to come after them)
    import bidirl.planner as planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned before every policy was checked"))
    with pytest.raises(BidirlError, match=culprit):
        planner.planned_configs(small("cluster.rollout_devices=0", *bad), ["areal", "bidirl", "verl-async"])


def test_asked_to_choose_the_instance_size_the_planner_plans_each_size_and_keeps_the_best():
    from bidirl.planner import instance_sizes, planned_configs

    cfg = small("sim.workload=math", "cluster.devices=16", "cluster.instance_devices=0")
    assert instance_sizes(cfg, "areal") == [1, 2, 4, 8] and instance_sizes(cfg, "verl") == [1, 2, 4, 8]
    chosen = plan(cfg, "areal", horizon=6)
    each = {k: plan(small("sim.workload=math", "cluster.devices=16", f"cluster.instance_devices={k}"), "areal",
                    horizon=6).predicted_samples_per_s for k in (1, 2, 4, 8)}
    assert chosen.predicted_samples_per_s == max(each.values())  # no near-tie here: the best size wins outright
    assert chosen.instance_devices == max(each, key=each.get) and chosen.rollout_devices % chosen.instance_devices == 0
    assert f"instances of {chosen.instance_devices} device" in chosen.reason and "by instance size" in chosen.reason
    assert {a["instance_devices"] for a in chosen.alternatives} > {chosen.instance_devices}  # other sizes listed
    # bidirl simulate: each policy runs at its own planned size, and the table says which
    planned = planned_configs(cfg, ["areal", "verl"])
    assert all(c.cluster.instance_devices in (1, 2, 4, 8) for c in planned.values())
    result = simulate(planned["areal"], "areal", with_bound=False)
    assert result.instance_devices == planned["areal"].cluster.instance_devices
    k = result.instance_devices
    assert result.split.endswith(f" k={k}") if k > 1 else "k=" not in result.split


def test_an_instance_size_that_does_not_fit_memory_is_skipped_and_when_none_fits_the_error_says_why(tmp_path):
    # a 70B shape: one device's share of its bf16 weights (141 GB) leaves an H100 no KV cache; two's does
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
         "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256}))
    cfg = small(f"sim.model={tmp_path}", "cluster.devices=64", "cluster.instance_devices=0", "train.steps=4")
    result = plan(cfg, "areal", horizon=4)
    assert result.instance_devices > 1 and all(a["instance_devices"] > 1 for a in result.alternatives)
    with pytest.raises(BidirlError, match="does not fit in H100 memory on any partition of 16 devices"):
        plan(small(f"sim.model={tmp_path}", "cluster.devices=16", "cluster.instance_devices=0"), "areal", horizon=4)


def test_a_colocated_policy_fits_a_model_its_tensor_parallel_instances_hold_and_refuses_it_on_one_device(tmp_path):
    # the 70B shape again: colocated, each device holds a shard of the training state and its share of an
    # instance's weights -- a quarter at k=4. The check used one device's whole weights at every k
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
         "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256}))
    assert preflight(small(f"sim.model={tmp_path}", "cluster.devices=64", "cluster.instance_devices=4"), "sync") == []
    with pytest.raises(BidirlError, match="does not fit in H100 memory colocated on 64 devices"):
        preflight(small(f"sim.model={tmp_path}", "cluster.devices=64", "cluster.instance_devices=1"), "sync")


def test_a_live_launch_and_a_profiled_machine_choose_one_device_instances():
    from bidirl.planner import instance_sizes, live_partition

    profiled = small("cluster.instance_devices=0")
    profiled.sim.profile = "profile.json"  # (never read: a profile measures one-device instances)
    assert instance_sizes(profiled, "areal") == [1]
    cpu = load_config("pipelines/cpu-tiny.yaml", ["cluster.devices=2", "launch.mode=async",
                                                  "cluster.instance_devices=0"])
    assert live_partition(cpu) == ["cluster.instance_devices=1"]  # no profile: the policy's default split


def test_the_planning_horizon_is_counted_in_samples_so_small_batches_of_long_responses_simulate_more_steps():
    from bidirl.planner import HORIZON, MAX_HORIZON, horizon_steps

    def steps(prompts, run_steps=60, eta=0):
        return horizon_steps(small(f"train.prompts_per_step={prompts}", "rollout.group_size=8",
                                   f"train.steps={run_steps}", f"algorithm.staleness={eta}"))

    assert steps(512) == HORIZON and steps(256) == 2 * HORIZON and steps(128) == MAX_HORIZON == 4 * HORIZON
    assert steps(128, run_steps=20) == 20 and steps(16) == MAX_HORIZON  # never past the run, nor MAX_HORIZON
    assert horizon_steps(small(), horizon=6) == 6  # an explicit horizon is kept


def test_the_planning_horizon_adds_eta_steps_where_a_straggler_holds_its_batch_up_only_at_its_deadline():
    from bidirl.planner import HORIZON, horizon_steps

    def steps(eta, run_steps=60, policy="areal"):
        return horizon_steps(small("train.prompts_per_step=512", "rollout.group_size=8", f"train.steps={run_steps}",
                                   f"algorithm.staleness={eta}"), policy=policy)

    assert [steps(eta) for eta in (0, 1, 2, 4)] == [HORIZON, HORIZON + 1, HORIZON + 2, HORIZON + 4]
    assert steps(4, run_steps=14) == 14  # still never past the run
    assert steps(2, policy="verl-async") == HORIZON  # count-only staleness: no deadline to hold a batch up


def bidirl_at_math_eta_0():
    return load_config("pipelines/sim-32gpu.yaml", ["sim.workload=math", "train.prompts_per_step=256",
                                                    "rollout.group_size=8", "algorithm.staleness=0", "train.steps=60",
                                                    "launch.mode=bidirl"])


def test_a_close_call_on_the_planning_horizon_is_settled_on_twice_that_horizon_unless_a_horizon_is_given():
    # bidirl at math eta 1 (the results table's row): on the planner's 25 steps (24 + eta) 21/11 leads; on 50
    # steps 22/10 does
    cfg = dataclasses.replace(bidirl_at_math_eta_0(), algorithm=dataclasses.replace(
        bidirl_at_math_eta_0().algorithm, staleness=1.0))
    settled = plan(cfg)
    assert settled.horizon_steps == 50 and "scored again on 50 steps" in settled.reason
    assert settled.rollout_devices == 22
    as_asked = plan(cfg, horizon=24)
    assert as_asked.rollout_devices == 21 and "again" not in as_asked.reason


@pytest.mark.slow  # (a minute: six instance sizes planned, each alternative simulated again)
def test_every_instance_size_a_plan_lists_is_scored_on_the_one_horizon_its_close_call_settled_on():
    # at math eta 0 one size's plan settles a close call on 48 steps; the other sizes' plans stop at 24, and
    # are scored again on 48, so what a plan lists compares alike
    cfg = bidirl_at_math_eta_0()
    sized = plan(dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, instance_devices=0)))
    assert sized.horizon_steps == 48 and len({a["instance_devices"] for a in sized.alternatives}) > 1
    for listed in sized.alternatives:
        k = listed["instance_devices"]
        k_cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, instance_devices=k))
        again = simulate(planning_config(k_cfg, 48, "bidirl"), "bidirl", rollout_devices=listed["rollout_devices"],
                         with_bound=False)
        assert again.samples_per_s == pytest.approx(listed["samples_per_s"], abs=1e-3)


class DriftingHost:
    """A neighbour at the edge: records what it is told; the host slows by 10% per timing, and by 20%
    more while the neighbour trains."""

    def __init__(self):
        self.doing, self.told, self.timings = IDLE, [], 0

    def set(self, work):
        self.doing = work
        self.told.append(work)

    def measure(self):
        self.timings += 1
        return (1 + 0.1 * self.timings) * (1.2 if self.doing == TRAIN else 1.0)


def test_a_co_running_factor_is_measured_in_alternating_pairs_so_a_drifting_host_does_not_read_as_a_slowdown():
    host = DriftingHost()
    measured = paired_slowdown(host.measure, host, TRAIN, pairs=4)
    assert host.told[:8] == [IDLE, TRAIN, TRAIN, IDLE, IDLE, TRAIN, TRAIN, IDLE] and host.told[-1] == IDLE
    assert measured["factor"] == pytest.approx(1.2, rel=0.01)  # alone-then-beside in one go would read 1.45
    assert len(measured["alone_s"]) == len(measured["beside_s"]) == 4


TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.tiny.intermediate_size=128", "model.tiny.sft_steps=2", "model.tiny.sft_batch_size=8",
        "model.tiny.sft_examples=32", "data.eval_size=8", "logging.wandb_mode=disabled", "logging.progress=false",
        "rollout.engine=hf", "launch.chunk_groups=8", "train.prompts_per_step=8"]


def test_profile_measures_the_real_engines_and_the_planner_and_simulator_use_it(tmp_path):
    result = subprocess.run([BIDIRL, "profile", "pipelines/cpu-tiny.yaml", *TINY, "cluster.devices=2",
                             "train.prompts_per_step=16",  # a batch of two chunks (TINY's chunk: 8 groups)
                             f"output_dir={tmp_path}/runs", f"model.cache_dir={shared_model_cache(tmp_path)}"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "profile.png").stat().st_size > 0
    profile = load_profile(run / "profile.json")
    assert len(profile.decode.points) >= 4 and len(profile.train.points) == 3
    # (a tiny model's few trained samples can time alike, so the fitted slope may be flat: the points are
    # what this checks -- three real optimizer steps, on growing parts of the batch)
    sizes = [p["tokens"] for p in profile.train.points]
    assert sizes == sorted(sizes) and all(p["seconds"] > 0 for p in profile.train.points)
    assert profile.workload["cap"] == 8
    # lengths of four whole batches of the run's first prompts, and training on samples of a whole batch --
    # not of the last decode batch timed (one chunk), which the profile once measured by mistake
    assert len(profile.workload["groups"]) == LENGTH_BATCHES * 16
    # and the prompt length the simulator adds to every trained sample is those prompts' own (the decode
    # timings' prompts, the split's first few, once read 19.8 tokens where the run's averaged 22.1)
    from transformers import AutoTokenizer

    from bidirl.data import PromptSampler, load_problems
    from bidirl.prompts import PromptBuilder

    run_cfg = load_config("pipelines/cpu-tiny.yaml", TINY)
    tokenizer = AutoTokenizer.from_pretrained(profile.meta["model"])
    prompt = PromptBuilder.for_run(run_cfg.data, tokenizer)
    drawn = PromptSampler(load_problems(run_cfg.data, "train"), run_cfg.seed).next(LENGTH_BATCHES * 16)
    assert profile.workload["prompt_tokens"] == round(statistics.mean(
        len(tokenizer(prompt(p), add_special_tokens=False).input_ids) for p in drawn))
    assert len(profile.logprob.points) == 3 and 0 < profile.workload["informative"] <= 1
    # two CPU devices share this machine: each stage was timed again beside a process doing the other
    assert profile.co_running["train"] > 0.5 and profile.co_running["decode"] > 0.5
    assert profile.co_running["train_beside_train"] > 0.5  # and training beside a joined device's training
    assert profile.co_running["decode_beside_decode"] > 0.5  # and decoding beside decoding
    assert all(len(pairs["ratios"]) == CO_RUNNING_PAIRS for pairs in profile.co_running["pairs"].values())
    # a forward is cheaper: at every measured size, and in the fits where they were measured (a tiny model's
    # points span 30-60 tokens and time almost alike: extrapolated to 1000 tokens, their slopes' noise decides)
    assert all(lp["seconds"] < tp["seconds"] for lp, tp in zip(profile.logprob.points, profile.train.points))
    largest = profile.train.points[-1]["tokens"]
    assert profile.model().logprob_seconds(largest) < profile.model().train_compute_seconds(largest)
    # where the profile's own time went, part by part, and in its one-line summary
    assert list(profile.meta["seconds"]) == ["engines", "decode", "lengths", "train", "requests", "co_running",
                                             "weights"]
    # chunks generated as a live device does it, one per pass of the decode sweep, against the fits; and each
    # request's own work (its scoring and reply), timed: each request's cost beyond the fits
    assert len(profile.requests["points"]) == DECODE_PASSES
    assert all(p["measured_s"] > 0 and p["modelled_s"] > 0 for p in profile.requests["points"])
    assert profile.requests["per_request_s"] >= profile.requests["own_work_s"] > 0
    # a fresh engine's first call, against the same call warm: what a live device's first chunk pays (usually
    # about 2 s on this CPU; but how much is the host's, so only what was timed is checked: once, in a full run
    # of this file, the first call timed no slower than the warm one and the warm-up read 0)
    timed = profile.warmup["timings"]["rollout"]
    assert timed["first_s"] > 0 and timed["warm_s"] > 0
    assert profile.warmup["rollout_s"] == pytest.approx(max(0.0, timed["first_s"] - timed["warm_s"]))
    assert profile.warmup["train_s"] >= 0
    # a live step's work beyond its gradient passes, through the runtime's own mailbox and finish code
    assert profile.step_overhead["per_micro_batch_s"] > 0 and profile.step_overhead["finish_s"] > 0
    assert all(s >= 0 for s in profile.meta["seconds"].values()) and "measured in" in result.stderr
    cfg = load_config("pipelines/cpu-tiny.yaml", [*TINY, "cluster.devices=2", "launch.mode=async", "train.steps=4",
                                                  f"sim.profile={run / 'profile.json'}"])
    chosen = plan(cfg)
    assert chosen.rollout_devices == 1 and chosen.model.startswith("profile")  # two devices: one split
    assert simulate(cfg, "async").samples_per_s > 0


def test_search_finds_the_peak_of_a_single_peaked_score_on_any_cluster_size():
    from bidirl.planner import search

    for devices in (2, 3, 8, 33, 1024):
        for peak in {1, devices // 3, devices - 1} - {0}:
            seen = []
            best = search(list(range(1, devices)), devices // 2, lambda x: seen.append(x) or -abs(x - peak))
            assert best == peak and len(set(seen)) <= 8 + 2 * devices.bit_length()


def test_a_large_cluster_is_planned_on_a_replica_with_the_same_batch_per_device():
    result = plan(small("cluster.devices=256", "train.prompts_per_step=2048"), horizon=4)
    assert "64-device replica" in result.reason and 0 < result.rollout_devices < 256
    assert result.rollout_devices % 4 == 0  # a replica split, scaled by 4


def test_a_replica_scores_only_splits_that_stand_for_ones_the_full_cluster_can_hold():
    # a 32B model on 128 H100s: the train pool needs 103 devices or more, so 25 rollout devices at most. The
    # replica (64 devices) is searched among the splits that scale to a legal one, so the plan's throughput
    # is that of the split it names, and its alternatives are distinct splits at each placement scored
    cfg = load_config("pipelines/sim-32gpu.yaml", ["cluster.devices=128", "sim.model=32B", "sim.workload=dapo-28k",
                                                   "train.prompts_per_step=64", "rollout.group_size=4"])
    result = plan(cfg, "areal", horizon=1)
    assert result.rollout_devices <= 25 == max(preflight(cfg, "areal", True))
    splits = [(a["rollout_devices"], a["tail_placement"]) for a in result.alternatives]
    assert len(splits) == len(set(splits)) > 1 and max(x for x, _ in splits) <= 25


def test_a_replica_of_whole_instances_is_searched_over_every_split_of_whole_instances():
    cfg = load_config("pipelines/sim-32gpu.yaml", ["cluster.devices=80", "cluster.instance_devices=8",
                                                   "train.prompts_per_step=80", "launch.mode=areal",
                                                   "launch.tail_placement=due", "algorithm.plan_staleness=false"])
    # (the splits at one placement and one staleness)
    result = plan(cfg, horizon=1)  # (legal splits 8 apart: a tolerance of half a device kept only one)
    assert result.simulated_splits >= 4 and len({a["rollout_devices"] for a in result.alternatives}) >= 4
    assert all(a["rollout_devices"] % 8 == 0 for a in result.alternatives)


def test_a_replicas_batch_stays_a_multiple_of_the_updates_per_sync():
    cfg = load_config("pipelines/sim-32gpu.yaml", ["cluster.devices=96", "train.prompts_per_step=1000",
                                                   "algorithm.updates_per_sync=4", "launch.mode=verl-async"])
    assert "64-device replica" in plan(cfg, horizon=2).reason  # (the replica's 667 prompts were refused)


def test_replanning_on_drifting_lengths_moves_devices_between_pools_and_keeps_every_invariant():
    cfg = small("sim.workload=math-drift", "train.steps=12", "algorithm.staleness=1", "train.prompts_per_step=32")
    wanted = {}

    def choose(mean_tokens):  # a stand-in for the planner: more rollout devices as responses grow
        wanted[mean_tokens] = 2 if mean_tokens < 700 else 6
        return wanted[mean_tokens]

    result = simulate(cfg, "bidirl", rollout_devices=2, keep_trace=True, replan=choose, replan_every=3)
    cluster = result.cluster
    assert wanted and cluster.rehomes, "lengths grew, so the partition changed"
    assert sum(d.home.value == "rollout" for d in cluster.devices) == 6
    assert cluster.trained_groups == 12 * 32 and max(result.staleness) <= 1  # every group once, within eta
    assert not cluster.open_leases and all(d.role is d.home for d in cluster.devices)
    assert cluster.primary not in {device for _, device, _ in cluster.rehomes}
    homes = {record["device"]: record["home"] for record in cluster.trace}
    assert [homes[d.index] for d in cluster.devices] == [d.home.value for d in cluster.devices]


def test_the_devices_each_pool_holds_and_serves_and_the_older_tails_are_kept_exact_through_leases_and_rehomes(
        monkeypatch):
    from bidirl.sched.cluster import Cluster
    from bidirl.sched.roles import DeviceState, Role

    checked, tails = [], []
    settle = Cluster.settle

    def settle_and_check(cluster):  # after every decision both drivers carry out
        settle(cluster)
        for (role, home), members in cluster.serving.items():
            assert members == {d.index for d in cluster.devices if d.role is role and d.home is home}
        older = [d.index for d in cluster.devices if d.state is DeviceState.GENERATING and d.role is Role.ROLLOUT
                 and d.home is Role.ROLLOUT and cluster.inflight[d.index] and d.after_work in ([], ["load"])
                 and max(cluster.inflight_by_version[d.index]) < cluster.weights_next(d)]
        assert cluster.older_tails() == older
        checked.append(cluster.now)
        tails.extend(older)

    monkeypatch.setattr(Cluster, "settle", settle_and_check)
    cfg = small("sim.workload=math", "train.steps=12", "algorithm.staleness=1", "train.prompts_per_step=32",
                "launch.tail_placement=due")  # (tails that keep new groups away: rollout devices lent to training too)
    result = simulate(cfg, "bidirl", rollout_devices=2, keep_trace=True, replan=lambda mean: 2 if mean < 700 else 6,
                      replan_every=3)
    assert checked and tails and result.cluster.rehomes and set(result.leases) == {"rollout->train", "train->rollout"}


def test_the_planner_replans_on_measured_lengths_for_both_drivers_and_colocated_policies_have_nothing_to_replan():
    from bidirl.planner import replanner, replanners
    from bidirl.sched.assembly import LIVE, assemble
    from bidirl.sched.replanning import LengthReplanner

    cfg = small("sim.workload=math-drift", "train.steps=6")
    choose = replanner(cfg, "areal")
    assert 0 < choose(400.0) < 8
    asks = LengthReplanner(2, lambda: 400.0, choose)
    assert assemble("areal", cfg.run_shape(), LIVE, replanner=asks).policy.replanner is asks  # the runtime re-plans too
    with pytest.raises(ValueError, match="no partition to re-plan"):
        assemble("sync", cfg.run_shape(), LIVE, replanner=asks)
    assert set(replanners(small("cluster.replan_every=2"), ["sync", "areal", "bidirl"])) == {"areal", "bidirl"}
    assert replanners(cfg, ["areal"]) == {}


def test_a_re_plan_that_asks_for_more_rollout_devices_than_the_last_moves_only_the_new_shortfall():
    # 6 rollout devices still decoding; a re-plan asks for 3 (three are marked to leave once drained), the
    # next for 5: one leaves, not three -- which then moved and had the following call move one back
    from bidirl.sched import events as ev
    from bidirl.sched.cluster import Cluster
    from bidirl.sched.replanning import repartition_toward
    from bidirl.sched.roles import Role

    cluster = Cluster([Role.ROLLOUT] * 6 + [Role.TRAIN] * 2, batch_groups=8, eta=1, steps=10, chunk_groups=1)
    for device in range(6):
        cluster.apply(ev.Generate(device, 1))
    repartition_toward(cluster, [], 3)
    assert len(cluster.leaving) == 3
    repartition_toward(cluster, [], 5)
    assert len(cluster.leaving) == 1
    for device in range(6):
        cluster.complete(ev.ChunkDone(device, device))
    moves: list = []
    repartition_toward(cluster, moves, 5)
    repartition_toward(cluster, moves, 5)
    assert [(m.device, m.home) for m in moves] == [(next(iter(cluster.rehoming)), Role.TRAIN)]
    assert sum(d.home is Role.ROLLOUT for d in cluster.devices) == 5


def test_replanning_toward_fewer_rollout_devices_drains_them_and_new_trainers_hold_the_primarys_version():
    cfg = small("sim.workload=gsm8k", "train.steps=10", "algorithm.staleness=1", "train.prompts_per_step=32")
    result = simulate(cfg, "areal", rollout_devices=6, keep_trace=True, replan=lambda mean: 2, replan_every=2)
    cluster = result.cluster
    moved = [device for _, device, home in cluster.rehomes if home == "train"]
    assert len(moved) == 4 and not cluster.leaving and sum(d.home.value == "rollout" for d in cluster.devices) == 2
    assert cluster.trained_groups == 10 * 32 and max(result.staleness) <= 1
    for device in moved:  # from its rehome on, a new trainer trains every step with the current weights
        arrived = next(r for r in cluster.trace if r["device"] == device and r["home"] == "train"
                       and r["from"] == "switching")
        assert arrived["version"] == max(r["version"] for r in cluster.trace if r["t"] <= arrived["t"]
                                         and r["device"] == cluster.primary)


@pytest.mark.parametrize("override,message", [
    ("cluster.devices=1", "needs a rollout and a train pool"),
    ("sim.model=32B", "does not fit"),
])
def test_an_impossible_plan_is_one_line_and_leaves_no_run_directory(tmp_path, override, message):
    args = [BIDIRL, "plan", "pipelines/sim-32gpu.yaml", *SMALL, "sim.hardware=H20", override, f"output_dir={tmp_path}/out"]
    if override == "sim.model=32B":
        args.append("cluster.devices=2")
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr and message in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_corrupt_profile_given_to_plan_is_one_line_and_leaves_no_run_directory(tmp_path):
    (tmp_path / "profile.json").write_text(json.dumps({**json.loads(synthetic_profile().to_json()), "capacity": 0}))
    result = subprocess.run([BIDIRL, "plan", "pipelines/sim-32gpu.yaml", *SMALL, f"output_dir={tmp_path}/out",
                             "--profile", str(tmp_path / "profile.json")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "key 'capacity' must be a positive integer" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_live_run_starts_its_cost_estimates_from_the_profile_of_its_devices(tmp_path, monkeypatch):
    from bidirl.planner import live_prior
    from bidirl.runtime.launch import PRIOR_VARIABLE, encode_prior, prior_from_environment

    cpu = ["cluster.device_type=cpu", "cluster.devices=2", "train.prompts_per_step=16", "launch.chunk_groups=4"]
    assert live_prior(small(*cpu)) == (None, "none (no sim.profile): measured as the run goes")
    (tmp_path / "profile.json").write_text(synthetic_profile().to_json())
    prior, source = live_prior(small(*cpu, f"sim.profile={tmp_path / 'profile.json'}"))
    assert prior.measured and prior.switch_s == pytest.approx(0.02) and "profile" in source
    assert prior.train_batch_s == pytest.approx(0.05 + 2e-4 * 16 * 4 * (9 + 3.5), rel=0.2)  # B*G*(prompt+response) tokens
    monkeypatch.setenv(PRIOR_VARIABLE, encode_prior((prior, source)))
    assert prior_from_environment() == (prior, source)  # what the controller receives
    monkeypatch.delenv(PRIOR_VARIABLE)
    assert prior_from_environment() == (None, "none")


def test_training_is_profiled_around_the_samples_a_step_will_train_not_the_whole_batch():
    from bidirl.profiling import training_sizes

    assert training_sizes(256, 0.76) == [64, 128, 256]  # most groups teach: up to the whole batch
    assert training_sizes(128, 0.07) == [4, 9, 18]  # a step trains ~9 samples: from half to twice that
    assert len(set(training_sizes(4, 0.01))) == 2  # a tiny batch still gives a line


@pytest.mark.parametrize("workload", ["math-drift", "reasoning", "gsm8k"])
def test_lengths_measured_after_the_cap_give_back_the_mean_before_it(workload):
    import dataclasses

    from bidirl.perf.workload import GroupDraws, preset

    shape = dataclasses.replace(preset(workload), mean_tokens=3200 if workload != "gsm8k" else 232, drift=0.0)
    lengths = [n for group in shape.groups_lengths(GroupDraws(0, 8), 0, 4000, 0, 1) for n in group]
    measured = sum(lengths) / len(lengths)
    assert measured == pytest.approx(shape.capped_mean(shape.mean_tokens), rel=0.02)  # the draws' own mean
    assert shape.uncapped_mean(measured) == pytest.approx(shape.mean_tokens, rel=0.03)
    if workload == "math-drift":  # (its 4k cap cuts 3.2k-mean lengths by about a fifth)
        assert measured < 0.85 * shape.mean_tokens


def test_whatever_predicts_a_live_run_times_the_live_trainer_whatever_system_the_policy_follows():
    from bidirl.planner import live_prior
    from bidirl.sim.run import simulate

    # the live runtime trains with bidirl's own trainer under every policy: no recompute pass for areal either
    areal, bidirl = (live_prior(small("cluster.device_type=cuda", f"launch.mode={policy}"))[0]
                     for policy in ("areal", "bidirl"))  # (an accelerator: the analytic model is its prior)
    assert areal.train_batch_s == bidirl.train_batch_s
    cfg = small()
    assert simulate(cfg, "areal").recomputed_logprob  # a simulated AReaL recomputes, as AReaL does
    assert not simulate(cfg, "areal", driver=cfg.live_driver()).recomputed_logprob  # a live run's does not
    assert simulate(small("sim.recompute_logprob=true"), "areal", driver=cfg.live_driver()).recomputed_logprob


def placements_simulated(monkeypatch) -> set:
    """The older-tail placements of every run the simulator assembles from now on (filled as they run)."""
    import bidirl.sim.run as sim_run

    seen, real = set(), sim_run.assemble

    def assemble_and_note(*args, **kwargs):
        assembly = real(*args, **kwargs)
        seen.add(assembly.cluster.tail_placement.value)
        return assembly

    monkeypatch.setattr(sim_run, "assemble", assemble_and_note)
    return seen


@pytest.mark.parametrize("placement, expected", [("auto", {"due", "none"}), ("due", {"due"}), ("none", {"none"})])
def test_the_planner_chooses_the_older_tail_placement_only_where_the_pipeline_leaves_it_open(
        monkeypatch, placement, expected):
    seen = placements_simulated(monkeypatch)
    result = plan(small("launch.mode=bidirl", "algorithm.staleness=1", f"launch.tail_placement={placement}"))
    assert seen == expected  # both scored under auto; only the one asked for otherwise
    assert result.tail_placement in expected


@pytest.mark.parametrize("policy", ["bidirl", "areal"])
def test_the_planner_keeps_the_better_placement_and_the_run_takes_it(policy):
    from bidirl.planner import planned_config

    cfg = small(f"launch.mode={policy}", "sim.workload=math", "algorithm.staleness=1")
    chosen = plan(cfg, horizon=6)
    each = {p: plan(small(f"launch.mode={policy}", "sim.workload=math", "algorithm.staleness=1",
                          f"launch.tail_placement={p}"), horizon=6) for p in ("due", "none")}
    best = max(r.predicted_samples_per_s for r in each.values())
    assert chosen.predicted_samples_per_s >= 0.995 * best  # the better one, or the policy's own within 0.5%
    assert chosen.tail_placement == "none"  # areal's own is due: here new groups beside its tails pay (4.9 vs 4.4)
    assert (chosen.rollout_devices, chosen.predicted_samples_per_s) == (
        each[chosen.tail_placement].rollout_devices, each[chosen.tail_placement].predicted_samples_per_s)
    assert f"older-tail placement '{chosen.tail_placement}'" in chosen.reason
    assert planned_config(cfg, chosen).launch.tail_placement == chosen.tail_placement
    # the alternatives name the placement each was scored at: the chosen one first, then the best of both
    assert chosen.alternatives[0]["tail_placement"] == chosen.tail_placement
    assert {a["tail_placement"] for a in chosen.alternatives} == {"due", "none"}


NO_ROOM_BESIDE_A_CHUNK = {  # (the live runtime's devices hold one chunk at a time, and so does a simulated one
    # whose KV cache holds no more than a chunk's groups -- reasoning's 51 here, in chunks of 64: a tail never
    # shares its decode batch there)
    "eta 0": ["algorithm.staleness=0"], "colocated": ["launch.mode=verl"], "live": [],
    "a KV cache of one chunk": ["sim.workload=reasoning", "launch.chunk_groups=64"]}


@pytest.mark.parametrize("why", NO_ROOM_BESIDE_A_CHUNK)
def test_where_no_new_group_can_go_beside_an_older_tail_the_planner_leaves_the_placement_to_the_policy(
        monkeypatch, why):
    seen = placements_simulated(monkeypatch)
    cfg = small("launch.mode=bidirl", "algorithm.staleness=1", *NO_ROOM_BESIDE_A_CHUNK[why])
    result = plan(cfg, horizon=4, driver=cfg.live_driver() if why == "live" else None)
    assert result.tail_placement == "auto" and len(seen) == 1


def test_a_kv_cache_that_holds_more_than_a_chunk_leaves_the_placement_to_the_planner(monkeypatch):
    seen = placements_simulated(monkeypatch)
    plan(small("launch.mode=bidirl", "algorithm.staleness=1", "sim.workload=reasoning", "launch.chunk_groups=32"),
         horizon=4)
    assert seen == {"due", "none"}  # (51 groups beside chunks of 32)


def test_a_live_device_whose_chunks_join_its_batch_in_flight_leaves_the_placement_to_the_planner(monkeypatch):
    seen = placements_simulated(monkeypatch)
    cfg = small("launch.mode=bidirl", "algorithm.staleness=1", "rollout.engine=vllm",
                f"launch.inflight_groups={2 * small().launch.chunk_groups}")
    plan(cfg, horizon=4, driver=cfg.live_driver())
    assert cfg.live_driver().inflight_groups == 2 * cfg.launch.chunk_groups and seen == {"due", "none"}


def test_a_plan_for_another_older_tail_placement_than_the_pipeline_fixes_is_refused(tmp_path):
    from bidirl.planner import planned_config

    path = write_plan(plan(small("launch.mode=bidirl", "launch.tail_placement=none"), horizon=6), tmp_path)
    assert load_plan(path, small("launch.mode=bidirl")).tail_placement == "none"  # auto: the plan's choice
    with pytest.raises(BidirlError, match="planned with older-tail placement 'none' but the pipeline has "
                                          "launch.tail_placement=due"):
        load_plan(path, small("launch.mode=bidirl", "launch.tail_placement=due"))
    # a plan written before placements were planned, or one where the placement could not matter, names
    # none (auto): it was scored at the pipeline's, which the run keeps
    older = {k: v for k, v in json.loads(path.read_text()).items() if k != "tail_placement"}
    path.write_text(json.dumps(older))
    fixed = small("launch.mode=bidirl", "launch.tail_placement=due")
    assert planned_config(fixed, load_plan(path, fixed)).launch.tail_placement == "due"


def test_a_re_plan_moves_the_split_at_the_placement_the_run_keeps(monkeypatch):
    from bidirl.planner import replanner

    seen = placements_simulated(monkeypatch)
    replanner(small("sim.workload=math"), "areal")(400.0)  # (auto, never planned: areal's own)
    assert seen == {"due"}


def test_a_simulated_comparison_plans_each_policys_placement_whatever_the_pipeline_fixed():
    from bidirl.compare import with_policy
    from bidirl.planner import planned_configs

    cfg = small("sim.workload=math", "launch.tail_placement=due", "cluster.rollout_devices=1")
    planned = planned_configs(cfg, ["areal", "bidirl"], each=with_policy)
    assert planned["areal"].launch.tail_placement == "none"  # the planner's (as in the test above), not the pipeline's
    assert all(c.cluster.rollout_devices > 1 for c in planned.values())  # (each planned: 1 is far too few here)
    assert planned_configs(cfg, ["areal"])["areal"].launch.tail_placement == "due"  # `bidirl simulate` keeps it


def stalenesses_simulated(monkeypatch) -> set:
    """The staleness bound of every run the simulator assembles from now on (filled as they run)."""
    import bidirl.sim.run as sim_run

    seen, real = set(), sim_run.assemble

    def assemble_and_note(policy, shape, *args, **kwargs):
        seen.add(shape.staleness)
        return real(policy, shape, *args, **kwargs)

    monkeypatch.setattr(sim_run, "assemble", assemble_and_note)
    return seen


def test_the_planner_tries_on_policy_and_doubling_bounds_below_the_pipelines_staleness():
    from bidirl.planner import staleness_candidates

    assert staleness_candidates(4) == [0, 1, 2, 4] and staleness_candidates(3) == [0, 1, 2, 3]
    assert staleness_candidates(1) == [0, 1] and staleness_candidates(0.5) == [0, 0.5]  # (verl-async's fractions)


def test_the_planner_keeps_the_fastest_staleness_within_the_bound_and_a_re_plan_keeps_it(monkeypatch):
    from bidirl.planner import replanner

    seen = stalenesses_simulated(monkeypatch)
    cfg = small("launch.mode=bidirl", "sim.workload=math", "algorithm.staleness=2", "algorithm.plan_staleness=true")
    chosen = plan(cfg, horizon=4)
    assert seen == {0, 1, 2}
    each = {s: plan(small("launch.mode=bidirl", "sim.workload=math", f"algorithm.staleness={s}",
                          "algorithm.plan_staleness=false"), horizon=4) for s in (0, 1, 2)}
    best = max(p.predicted_samples_per_s for p in each.values())
    assert chosen.predicted_samples_per_s >= 0.995 * best  # the fastest, or a fresher one within 0.5%
    assert (chosen.rollout_devices, chosen.predicted_samples_per_s) == (
        each[chosen.staleness].rollout_devices, each[chosen.staleness].predicted_samples_per_s)
    assert f"staleness {chosen.staleness:g} of at most 2" in chosen.reason
    assert {a["staleness"] for a in chosen.alternatives} > {chosen.staleness}  # the others' best listed too
    seen.clear()
    replanner(cfg)(20.0)  # a re-plan at run time moves the split only, at the staleness the run keeps
    assert seen == {2}


def test_where_on_policy_runs_faster_the_plan_runs_on_policy_and_a_comparison_keeps_the_pipelines_bound(
        monkeypatch, tmp_path):
    from bidirl.compare import live_overrides, with_policy
    from bidirl.planner import planned_config, planned_overrides, replanner

    # 32B in instances of 8 on 32 H100s: 2 instances a pool. At eta 1 the pools pipeline and cannot balance;
    # on-policy, every instance takes the one batch in turn (43.8 against 35.5 samples/s at 16/16)
    cfg = load_config("pipelines/sim-32gpu.yaml", ["cluster.instance_devices=8", "sim.model=32B", "sim.workload=gsm8k",
                                                   "train.prompts_per_step=512", "rollout.group_size=8",
                                                   "launch.mode=bidirl", "algorithm.staleness=1",
                                                   "algorithm.plan_staleness=true"])
    chosen = plan(cfg)
    assert chosen.staleness == 0 and chosen.reason.startswith("staleness 0 of at most 1")
    run = planned_config(cfg, load_plan(write_plan(chosen, tmp_path), cfg))  # (through plan.json, as a launch)
    assert (run.algorithm.staleness, run.algorithm.plan_staleness, run.algorithm.staleness_bound) == (0, False, 1)
    assert run.run_shape().staleness == 0  # the run keeps it: no sample is staler than on-policy
    seen = stalenesses_simulated(monkeypatch)
    replanner(run)(150.0)  # and so does a re-plan at run time
    assert seen == {0}
    overrides = planned_overrides(cfg, chosen)
    assert load_config("pipelines/sim-32gpu.yaml", ["cluster.instance_devices=8", *overrides]).algorithm.staleness == 0
    # a comparison after the plan plans every policy afresh under the pipeline's bound, not under bidirl's pick
    assert with_policy(run, "areal").algorithm.staleness == 1 and with_policy(run, "areal").algorithm.plan_staleness
    fresh = load_config("pipelines/sim-32gpu.yaml", ["cluster.instance_devices=8", *overrides,
                                                     *live_overrides(run, "areal")]).algorithm
    assert (fresh.staleness, fresh.plan_staleness, fresh.staleness_bound) == (1, True, None)


def test_a_plan_above_the_pipelines_staleness_bound_or_off_the_one_it_fixes_is_refused(tmp_path):
    def pipeline(staleness, planned=True):
        return small("launch.mode=bidirl", f"algorithm.staleness={staleness}", f"algorithm.plan_staleness={planned}")

    path = write_plan(plan(pipeline(1, planned=False), horizon=4), tmp_path)
    assert load_plan(path, pipeline(2)).staleness == 1  # within the bound
    with pytest.raises(BidirlError, match="planned at staleness 1 but the pipeline has algorithm.staleness=0;"):
        load_plan(path, pipeline(0))
    with pytest.raises(BidirlError, match=r"algorithm.staleness=2 \(algorithm.plan_staleness: false\)"):
        load_plan(path, pipeline(2, planned=False))
    older = {k: v for k, v in json.loads(path.read_text()).items() if k != "staleness"}  # written before: the pipeline's
    path.write_text(json.dumps(older))
    assert load_plan(path, pipeline(0)).staleness is None
