"""The CLI as a user meets it: real subprocesses of the installed `bidirl` console script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.builders import shared_model_cache

BIDIRL = [str(Path(sys.executable).with_name("bidirl"))]
TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
        "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=128", "model.tiny.sft_steps=2",
        "model.tiny.sft_batch_size=8", "model.tiny.sft_examples=32", "data.eval_size=8",
        "logging.wandb_mode=offline", "logging.progress=false", "rollout.engine=hf"]


def bidirl(*args, cwd=None):
    env = {**os.environ, "WANDB_MODE": "offline"}
    return subprocess.run(BIDIRL + list(args), capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def assert_one_line_error(result, *fragments, code=2):
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_lists_every_stage_command():
    result = bidirl("--help")
    assert result.returncode == 0
    for command in ("run", "profile", "plan", "launch", "compare", "simulate", "prepare-model", "evaluate"):
        assert command in result.stdout


@pytest.mark.parametrize("args,fragment", [
    (["launch", "pipelines/cpu-tiny.yaml", "--nnodes", "abc"], "'--nnodes'"),
    (["run", "--dryrun", "pipelines/cpu-tiny.yaml"], "--dryrun"),
    (["run"], "'pipeline'"),
    (["simulate", "pipelines/sim-32gpu.yaml", "--policies"], "'--policies'"),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_a_usage_error_is_one_line_naming_it_not_a_box(args, fragment):
    assert_one_line_error(bidirl(*args), fragment)


def test_bidirl_alone_shows_the_help():
    result = bidirl()
    assert "run" in result.stdout and "simulate" in result.stdout and "Traceback" not in result.stderr


def test_unknown_key_in_pipeline_file_is_one_line_naming_file_and_key(write_yaml):
    path = write_yaml("name: x\nrollout:\n  temprature: 0.7\n")
    assert_one_line_error(bidirl("run", str(path)), str(path), "rollout.temprature", "rollout.temperature")


def test_wrong_type_override_is_one_line(write_yaml):
    assert_one_line_error(bidirl("run", "pipelines/cpu-tiny.yaml", "train.steps=lots"), "train.steps", "int")


def test_missing_pipeline_file_is_one_line():
    assert_one_line_error(bidirl("run", "pipelines/nope.yaml"), "pipelines/nope.yaml", "not found")


def test_malformed_yaml_is_one_line_with_its_line_number(write_yaml):
    path = write_yaml("name: x\nstages: [prepare_model\n")
    assert_one_line_error(bidirl("run", str(path)), f"{path}:", "malformed YAML")


def test_debug_flag_shows_the_traceback():
    result = bidirl("run", "pipelines/nope.yaml", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_run_writes_a_complete_run_directory(tmp_path):
    result = bidirl("run", "pipelines/cpu-tiny.yaml", f"output_dir={tmp_path}/runs",
                    f"model.cache_dir={shared_model_cache(tmp_path)}", "stages=[prepare_model,evaluate]", *TINY)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["tiny"]["hidden_size"] == 64 and config["data"]["task"] == "basic_arithmetic"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == ["prepare_model", "evaluate"]
    summary = json.loads((run_dir / "summary.json").read_text())
    evaluation = summary["evaluation"]  # 8 held-out problems (data.eval_size=8), each right or wrong
    assert summary["status"] == "ok" and evaluation["problems"] == rows[1]["eval_problems"] == 8
    assert evaluation["accuracy"] == pytest.approx(rows[1]["eval_accuracy"], abs=1e-4)
    assert (evaluation["accuracy"] * 8) == pytest.approx(round(evaluation["accuracy"] * 8), abs=1e-3)
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_train_stage_writes_metrics_curve_and_checkpoint(tmp_path):
    result = bidirl("run", "pipelines/cpu-tiny.yaml", f"output_dir={tmp_path}/runs",
                    f"model.cache_dir={shared_model_cache(tmp_path)}", "stages=[prepare_model,train]", "train.steps=3",
                    "logging.eval_every=2", "train.prompts_per_step=4", "rollout.group_size=4", *TINY)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("rollout_s", "train_s", "sync_s", "samples_per_s", "tokens_per_s", "grad_norm"):
        assert key in steps[0]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 2, 3]
    assert (run_dir / "learning_curve.png").stat().st_size > 0
    assert (run_dir / "checkpoint" / "config.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train"]["final_version"] == 3 and len(summary["train"]["curve"]) == 3
    report = (run_dir / "report.md").read_text()  # the training run's figures, read from summary["train"]
    assert "## Training run" in report and "samples/s" in report and "learning_curve.png" in report


def test_the_reports_plan_table_marks_the_chosen_split_and_names_each_rows_instance_size(tmp_path):
    from bidirl.report import plan_section

    alternatives = [{"rollout_devices": 8, "instance_devices": k, "samples_per_s": v, "step_s": 1.0}
                    for k, v in ((4, 60.1), (2, 53.3), (8, 49.5))]
    (tmp_path / "plan.json").write_text(json.dumps({"reason": "r", "predicted_samples_per_s": 60.1,
                                                    "predicted_step_s": 1.0, "alternatives": alternatives}))
    rows = [line for line in plan_section(tmp_path) if line.startswith("| ") and line[2].isalpha()]
    assert rows[1:] == ["| chosen | 8 | 4 | 60.1 | 1 |", "| alternative | 8 | 2 | 53.3 | 1 |",
                        "| alternative | 8 | 8 | 49.5 | 1 |"]


def test_the_reports_plan_table_names_each_rows_older_tail_placement_where_the_planner_chose_one(tmp_path):
    from bidirl.report import plan_section

    alternatives = [{"rollout_devices": r, "instance_devices": 1, "tail_placement": p, "samples_per_s": v,
                     "step_s": 1.0} for r, p, v in ((22, "none", 37.8), (21, "none", 37.5), (22, "due", 32.2))]
    (tmp_path / "plan.json").write_text(json.dumps({"reason": "r", "predicted_samples_per_s": 37.8,
                                                    "predicted_step_s": 1.0, "alternatives": alternatives}))
    rows = [line for line in plan_section(tmp_path) if line.startswith("| ") and line[2].isalpha()]
    assert rows == ["| split | rollout devices | devices per instance | older tails | samples/s | step s |",
                    "| chosen | 22 | 1 | none | 37.8 | 1 |", "| alternative | 21 | 1 | none | 37.5 | 1 |",
                    "| alternative | 22 | 1 | due | 32.2 | 1 |"]


def test_the_reports_plan_table_names_each_rows_staleness_where_the_planner_chose_among_several(tmp_path):
    from bidirl.report import plan_section

    alternatives = [{"rollout_devices": 16, "instance_devices": 8, "staleness": s, "samples_per_s": v, "step_s": 1.0}
                    for s, v in ((0.0, 43.8), (1.0, 35.5))]
    (tmp_path / "plan.json").write_text(json.dumps({"reason": "r", "predicted_samples_per_s": 43.8, "staleness": 0.0,
                                                    "predicted_step_s": 1.0, "alternatives": alternatives}))
    rows = [line for line in plan_section(tmp_path) if line.startswith("| ") and line[2].isalpha()]
    assert rows == ["| split | rollout devices | devices per instance | staleness | samples/s | step s |",
                    "| chosen | 16 | 8 | 0 | 43.8 | 1 |", "| alternative | 16 | 8 | 1 | 35.5 | 1 |"]


def test_a_report_writes_a_dash_for_a_figure_the_run_wrote_as_null_rather_than_failing_the_finished_run(tmp_path):
    from bidirl.report import write_report

    (tmp_path / "summary.json").write_text(json.dumps({
        "status": "ok", "stages": ["train", "simulate"], "evaluation": {"accuracy": None, "problems": 8},
        "train": {"samples_per_s": 1.5, "accuracy_start": 0.5, "accuracy_end": None, "homes": []}}))
    (tmp_path / "results.json").write_text(json.dumps([{"policy": "areal", "samples_per_s": None, "step_s": 2.0}]))
    report = write_report(tmp_path).read_text()
    assert "accuracy **50.0% -> -**" in report and "Base model held-out greedy accuracy: - on 8" in report
    assert "| areal | None | None | - | 0.00 | 2.00 | - | - | 0 |" in report


def test_a_report_says_how_many_held_out_problems_a_runs_accuracy_was_scored_on(tmp_path):
    from bidirl.report import write_report

    (tmp_path / "summary.json").write_text(json.dumps({"status": "ok", "stages": ["launch"]}))
    (tmp_path / "launch").mkdir()  # (the launch stage's own summary)
    (tmp_path / "launch" / "summary.json").write_text(json.dumps({
        "samples_per_s": 1.5, "accuracy_start": 0.5, "accuracy_end": 0.75, "eval_problems": 605, "homes": []}))
    assert "accuracy **50.0% -> 75.0%** on 605 held-out problems" in write_report(tmp_path).read_text()


def test_a_simulate_stages_report_holds_its_table_and_charts(tmp_path):
    result = bidirl("run", "pipelines/sim-32gpu.yaml", "cluster.devices=4", "train.steps=3",
                    "train.prompts_per_step=16", "cluster.rollout_devices=2", "sim.policies=[areal,bidirl]",
                    f"output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    (run,) = tmp_path.iterdir()
    report = (run / "report.md").read_text()
    assert "## Simulated policies" in report and "| areal | 2/2 |" in report and "| bidirl | 2/2 |" in report
    assert "gantt-bidirl.png" in report and "throughput.png" in report
    assert (run / "report.html").read_text().count("data:image/png;base64,") == 3


def test_wandb_online_without_an_api_key_is_one_line_and_leaves_no_run_directory(tmp_path):
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    result = subprocess.run(BIDIRL + ["run", "pipelines/cpu-tiny.yaml", "logging.wandb_mode=online",
                                      f"output_dir={tmp_path}", "stages=[prepare_model]"],
                            capture_output=True, text=True, env={**env_free, "HOME": str(tmp_path)}, timeout=600)
    assert_one_line_error(result, "logging.wandb_mode=online")
    assert not any(tmp_path.glob("cpu-tiny-*"))


PIPELINES = sorted(str(p.relative_to(Path(__file__).resolve().parents[1]))
                   for p in (Path(__file__).resolve().parents[1] / "pipelines").glob("*.yaml"))


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_dry_run_of_every_shipped_pipeline_validates_it_and_writes_nothing(pipeline, tmp_path):
    result = bidirl("run", pipeline, "--dry-run", f"output_dir={tmp_path}/runs", f"model.cache_dir={tmp_path}/cache",
                    cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert "dry run: nothing was started, written or downloaded" in result.stdout
    assert not any(tmp_path.iterdir())


def test_the_gsm8k_dry_run_plans_on_the_analytic_h100_model_and_prints_each_nodes_torchrun_command(tmp_path):
    result = bidirl("run", "pipelines/gsm8k.yaml", "--dry-run", "launch.rdzv_endpoint=10.1.2.3:29500",
                    f"output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "planned on analytic H100 1.5B: cluster.rollout_devices=" in out
    assert "total" in out and "GB of 80 GB" in out  # the per-device memory budget, both engines resident
    nodes = [line for line in out.splitlines() if line.startswith("node ")]
    assert len(nodes) == 2
    assert "--nproc-per-node=9" in nodes[0] and "--node-rank=0" in nodes[0]  # node 0 also runs the controller
    assert "--nproc-per-node=8" in nodes[1] and "--node-rank=1" in nodes[1]
    assert all("--master-addr=10.1.2.3" in n and "--master-port=29500" in n for n in nodes)
    assert "no plan or launch stage" not in out
    assert not any(tmp_path.iterdir())


def test_re_planning_a_comparison_re_plans_the_policies_that_have_a_partition_and_leaves_colocated_ones_be(tmp_path):
    # (the live comparison refused the demo's pipeline with `cluster.replan_every` because its verl baseline is
    # colocated, where `bidirl simulate` re-plans only the policies that have a split)
    from bidirl.compare import live_overrides
    from bidirl.config import load_config

    result = bidirl("run", "pipelines/cpu-demo.yaml", "--dry-run", "cluster.replan_every=5", f"output_dir={tmp_path}",
                    cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    cfg = load_config("pipelines/cpu-demo.yaml", ["cluster.replan_every=5"])
    assert "cluster.replan_every=0" in live_overrides(cfg, "verl")
    assert "cluster.replan_every=5" in live_overrides(cfg, "bidirl")


def test_quiet_leaves_only_errors_and_results(tmp_path):
    result = bidirl("--quiet", "compare", "pipelines/sim-32gpu.yaml", "cluster.devices=4", "train.steps=8",
                    "sim.gantt=false", f"output_dir={tmp_path}", "--baselines", "areal")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.strip().endswith("report.md")  # the table and the report's path: the results


def test_a_dry_run_with_an_impossible_setting_is_one_line(tmp_path):
    assert_one_line_error(bidirl("run", "pipelines/gsm8k.yaml", "--dry-run", "train.micro_batch_size=256",
                                 "train.gradient_checkpointing=false"), "does not fit")
    assert_one_line_error(bidirl("run", "pipelines/gsm8k.yaml", "--dry-run", "launch.rdzv_endpoint=nowhere"),
                          "launch.rdzv_endpoint", "host:port")
    assert_one_line_error(bidirl("run", "pipelines/cpu-tiny.yaml", "--dry-run", "stages=[launch]", "cluster.nnodes=2",
                                 "cluster.devices=4", "launch.mode=async"), "rendezvous", "launch.rdzv_endpoint")


@pytest.mark.slow  # (the demo pipeline's test runs the launch stage too)
def test_the_launch_stage_runs_the_runtime_inside_the_pipelines_run_directory(tmp_path):
    small = [t for t in TINY if not t.startswith("logging.wandb")] + [
        "logging.wandb_mode=disabled", "train.lr=1e-3", "train.prompts_per_step=8", "launch.chunk_groups=4",
        "train.steps=3", "logging.eval_every=3", "launch.collective_timeout_s=120"]
    result = bidirl("run", "pipelines/cpu-tiny.yaml", "stages=[prepare_model,launch]", "cluster.devices=2",
                    "launch.mode=async", "algorithm.staleness=1", f"output_dir={tmp_path}/runs",
                    f"model.cache_dir={shared_model_cache(tmp_path)}", *small)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()  # one run directory, the runtime's files inside it
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["launch"]["steps"] == 3 and summary["launch"]["policy"] == "async"
    for name in ("config.yaml", "launch.yaml", "launch/metrics.jsonl", "launch/trace.jsonl", "launch/gantt.png",
                 "launch/summary.json", "report.md", "report.html"):
        assert (run / name).is_file(), name
    report = (run / "report.md").read_text()
    assert "## bidirl on the hot-switch runtime" in report and "samples/s" in report and "gantt.png" in report


def test_compare_with_an_unknown_baseline_is_one_line_listing_the_valid_names(tmp_path):
    result = bidirl("compare", "--baselines", "verl,areall", f"output_dir={tmp_path}")
    assert_one_line_error(result, "unknown baseline 'areall'", "verl, areal", "roll")
    assert not any(tmp_path.iterdir())


def test_compare_without_baselines_compares_those_the_pipeline_names(tmp_path):
    result = bidirl("compare", "pipelines/sim-32gpu.yaml", "cluster.devices=4", "train.steps=8", "sim.gantt=false",
                    "compare.baselines=[areal]", f"output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    (run,) = tmp_path.iterdir()
    assert [r["name"] for r in json.loads((run / "compare.json").read_text())] == ["areal", "bidirl"]


def test_compare_on_a_cluster_that_is_not_here_simulates_every_policy_at_its_own_split(tmp_path):
    result = bidirl("compare", "pipelines/sim-32gpu.yaml", "cluster.devices=4", "train.steps=8", "sim.gantt=false",
                    f"output_dir={tmp_path}", "--baselines", "verl,areal,roll")
    assert result.returncode == 0, result.stderr
    (run,) = tmp_path.iterdir()
    rows = json.loads((run / "compare.json").read_text())
    assert [r["name"] for r in rows] == ["verl", "areal", "roll", "bidirl"]
    assert all(r["where"] == "simulated" and r["samples_per_s"] > 0 and 0 < r["bound_ratio"] <= 1 for r in rows)
    assert rows[0]["label"] == "veRL-style colocated synchronous (reproduced on bidirl's runtime)"
    assert all("reproduced on bidirl's runtime" in r["label"] for r in rows[:3])
    assert rows[0]["split"] == "colocated x4" and all(r["split"].count("/") == 1 for r in rows[1:])
    assert (run / "compare_throughput.png").is_file() and (run / "compare.md").is_file()
    report = (run / "report.md").read_text()
    assert "## Comparison" in report and "areal" in report
    assert "data:image/png;base64," in (run / "report.html").read_text()  # one self-contained file
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"


def test_the_demo_pipeline_profiles_plans_launches_and_compares_into_one_run_directory(tmp_path):
    small = [t for t in TINY if not t.startswith("logging.wandb")] + [
        "logging.wandb_mode=disabled", "train.lr=1e-3", "train.prompts_per_step=8", "train.micro_batch_size=8",
        "launch.chunk_groups=4", "train.steps=3", "logging.eval_every=3", "launch.collective_timeout_s=120",
        "compare.baselines=[verl,areal]"]
    result = bidirl("run", "pipelines/cpu-demo.yaml", f"output_dir={tmp_path}/runs",
                    f"model.cache_dir={shared_model_cache(tmp_path)}", *small)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["stages"] == ["prepare_model", "profile", "plan", "launch", "compare"]
    from bidirl.config import load_config
    from bidirl.perf.fitted import load_profile

    load_profile(run / "profile.json")  # (a profile the planner reads: it refuses a malformed one in one line)
    plan = json.loads((run / "plan.json").read_text())
    assert plan["policy"] == "bidirl" and plan["devices"] == 2 and plan["predicted_samples_per_s"] > 0
    assert plan["model"] == f"profile {run / 'profile.json'}"  # planned on this run's own profile
    launched = load_config(str(run / "launch" / "config.yaml"))
    assert launched.cluster.rollout_devices == plan["rollout_devices"] == 1  # launched at the planned split
    rows = json.loads((run / "compare.json").read_text())
    assert [r["name"] for r in rows] == ["verl", "areal", "bidirl"] and all(r["where"] == "live" for r in rows)
    assert rows[-1]["run_dir"] == str(run / "launch")  # the launch stage's bidirl run, reused, not run twice
    assert all(r["samples_per_s"] > 0 and r["accuracy_end"] is not None for r in rows)
    for name in ("report.md", "report.html", "compare.md", "compare_throughput.png", "compare_curves.png",
                 "profile.png", "launch/gantt.png", "compare/verl/summary.json", "compare/areal/trace.jsonl"):
        assert (run / name).is_file(), name
    report = (run / "report.md").read_text()
    for section in ("## Profile", "## Plan", "## bidirl on the hot-switch runtime", "## Comparison"):
        assert section in report


def test_a_re_run_without_run_dir_continues_this_pipelines_newest_run_not_one_whose_name_extends_it(tmp_path):
    from bidirl.config import load_config
    from bidirl.pipeline import latest_run

    for name in ("gsm8k-20261201-080000", "gsm8k-20261201-080000-1", "gsm8k-smollm2-20261202-090000",
                 "gsm8k-20261130-235959", "gsm8k-notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text("{}")
    cfg = load_config(None, ["name=gsm8k", f"output_dir={tmp_path}"])
    assert latest_run(cfg) == tmp_path / "gsm8k-20261201-080000-1"


def test_stages_run_again_set_their_old_rows_aside_and_keep_the_other_stages_rows(tmp_path):
    from bidirl.pipeline import set_aside

    rows = [{"step": 0, "stage": "prepare_model", "base_accuracy": 0.5}, {"step": 0, "stage": "evaluate",
            "eval_accuracy": 0.5}, {"step": 1, "reward_mean": 0.2}, {"step": 2, "eval_accuracy": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    for name in ("learning_curve.png", "report.md", "report.html"):
        (tmp_path / name).write_text("old")
    set_aside(tmp_path, ["evaluate", "train"])  # (--from evaluate: the train stage's rows name no stage)
    (aside,) = tmp_path.glob("replaced-*")
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows[:1]
    assert (aside / "metrics.jsonl").read_text().splitlines()[:3] == [json.dumps(r) for r in rows[1:]]
    assert sorted(p.name for p in aside.iterdir()) == ["learning_curve.png", "metrics.jsonl", "report.html",
                                                       "report.md"]


def test_a_row_torn_by_a_crash_is_set_aside_even_when_its_stage_is_not_run_again(tmp_path):
    from bidirl.pipeline import set_aside

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.2}) + '\n{"step": 2, "rew')
    set_aside(tmp_path, ["evaluate"])  # (--only evaluate: the train stage's rows stay)
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps({"step": 1, "reward_mean": 0.2}) + "\n"
    (aside,) = tmp_path.glob("replaced-*")
    assert (aside / "metrics.jsonl").read_text() == '{"step": 2, "rew'  # the next row appended starts a line


def test_a_stage_run_again_alone_keeps_the_summary_entries_of_the_stages_after_it(tmp_path):
    from bidirl.config import load_config
    from bidirl.pipeline import restored

    entries = {"model": 1, "evaluation": 2, "profile": 3, "plan": 4, "launch": 5, "compare": 6}
    (tmp_path / "summary.json").write_text(json.dumps({**entries, "status": "ok", "wall_s": 9}))
    cfg = load_config("pipelines/cpu-demo.yaml", ["stages=[prepare_model,evaluate,profile,plan,launch,compare]"])
    only = restored(cfg, tmp_path, "plan", only=True)[1]
    assert {k: only[k] for k in entries if k in only} == {k: v for k, v in entries.items() if k != "plan"}
    onward = restored(cfg, tmp_path, "evaluate")[1]  # (--from: every stage from it on runs again)
    assert {k for k in entries if k in onward} == {"model"}


def test_only_one_stage_runs_again_into_the_same_run_directory_and_the_old_output_is_kept_aside(tmp_path):
    simulated = ["pipelines/sim-32gpu.yaml", "stages=[plan,compare]", "cluster.devices=4", "train.steps=8",
                 "sim.gantt=false", f"output_dir={tmp_path}"]
    assert bidirl("run", *simulated, "compare.baselines=[verl,areal]").returncode == 0
    (run,) = tmp_path.iterdir()
    result = bidirl("run", *simulated, "compare.baselines=[roll]", "--only", "compare")
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == [run]  # no new run directory
    rows = json.loads((run / "compare.json").read_text())
    assert [r["name"] for r in rows] == ["roll", "bidirl"]
    (aside,) = run.glob("replaced-*")
    assert [r["name"] for r in json.loads((aside / "compare.json").read_text())] == ["verl", "areal", "bidirl"]
    assert (aside / "report.md").is_file() and (run / "report.md").is_file()  # the old report too, and a new one
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and "plan" in summary and set(summary["compare"]) == {"roll", "bidirl"}
    assert_one_line_error(bidirl("run", *simulated, "--from", "launch"), "--from launch", "plan, compare")


@pytest.mark.slow
def test_compare_runs_the_real_trl_grpo_trainer_beside_the_reproduced_policies(tmp_path):
    small = [t for t in TINY if not t.startswith("logging.wandb")] + [
        "logging.wandb_mode=disabled", "train.lr=1e-3", "train.prompts_per_step=8", "train.micro_batch_size=8",
        "launch.chunk_groups=4", "train.steps=3", "logging.eval_every=3", "launch.collective_timeout_s=120",
        "cluster.rollout_devices=1"]
    result = bidirl("compare", "pipelines/cpu-demo.yaml", f"output_dir={tmp_path}/runs",
                    f"model.cache_dir={shared_model_cache(tmp_path)}", *small, "--baselines", "areal,trl")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    rows = json.loads((run / "compare.json").read_text())
    assert [r["name"] for r in rows] == ["areal", "trl", "bidirl"] and all(r["where"] == "live" for r in rows)
    trl = rows[1]
    assert trl["label"].startswith("TRL GRPOTrainer (the real library") and trl["split"] == "1 process x 2 threads"
    assert trl["samples_per_s"] > 0 and 0 <= trl["accuracy_end"] <= 1
    rewards = [json.loads(line) for line in (run / "compare" / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rewards if "reward_mean" in r] == [1, 2, 3]  # TRL trained three steps
    assert "except trl: the real library" in (run / "compare.md").read_text()


def test_a_bar_chart_names_what_its_ratios_are_over_and_survives_a_policy_that_made_nothing(tmp_path):
    from matplotlib import pyplot  # noqa: F401  (the backend the plot picks)

    from bidirl.plots import bar_annotations, plot_bars

    assert bar_annotations(["verl", "bidirl"], [1.0, 2.0], base="bidirl") == (
        "above each bar: its samples/s over bidirl's", ["0.50x", "1.00x"])
    assert bar_annotations(["verl", "bidirl"], [0.0, 2.0]) == ("above each bar: its samples/s over verl's", ["-", "-"])
    plot_bars(["verl", "bidirl"], [0.0, 2.0], tmp_path / "a.png", "samples/s")  # (the base made nothing: "-")
    plot_bars(["verl", "bidirl"], [1.0, 2.0], tmp_path / "b.png", "samples/s", base="bidirl")
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
