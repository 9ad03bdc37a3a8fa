"""Helper processes: the planner's candidates and the plots on another core, with the same results."""

import json
import os
import subprocess
import sys

import pytest

from bidirl.helpers import in_background, map_in_helpers, side_by_side

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# run in a fresh interpreter: helpers are never forked from a process with torch loaded, and the test
# suite's own process usually has it
PLAN_BOTH_WAYS = """
import json, sys
from bidirl.config import load_config
from bidirl.helpers import helper_processes, in_background, map_in_helpers
from bidirl.planner import plan

cfg = load_config("pipelines/sim-32gpu.yaml", ["cluster.devices=12", "train.prompts_per_step=48", "rollout.group_size=4",
                                                "train.steps=8", "launch.chunk_groups=4"])
from bidirl.sim.report import run_policies


def nested(x):  # a task that asks for helpers itself: it gets none, and its work runs in its helper
    return map_in_helpers(abs, [-x, x]) + [in_background(abs, -x).result()]


def simulated(results):
    return [{**r.row(), "sim_seconds": None, "trace": r.cluster.trace} for r in results]


fixed = load_config("pipelines/sim-32gpu.yaml", ["cluster.devices=12", "cluster.rollout_devices=6", "train.steps=6",
                                                 "train.prompts_per_step=48", "rollout.group_size=4"])
# the staleness and the placement chosen too: the alternatives' searches side by side, nested
choosing = load_config("pipelines/sim-32gpu.yaml", ["cluster.devices=12", "train.prompts_per_step=48",
                                                     "rollout.group_size=4", "train.steps=8", "launch.chunk_groups=4",
                                                     "algorithm.staleness=2", "algorithm.plan_staleness=true",
                                                     "launch.tail_placement=auto"])
alone, runs_alone = plan(cfg, "bidirl"), simulated(run_policies(fixed, ["areal", "bidirl"]))
chose_alone = plan(choosing, "bidirl")
with helper_processes() as workers:
    helped, runs_helped = plan(cfg, "bidirl"), simulated(run_policies(fixed, ["areal", "bidirl"]))
    chose_helped = plan(choosing, "bidirl")
    try:
        map_in_helpers(int, ["1", "not a number"])
        error = None
    except ValueError as exc:
        error = str(exc)
    loaded_torch = "torch" in sys.modules
    nested_results = map_in_helpers(nested, [1, 2])
print(json.dumps({"workers": workers, "error": error, "torch": loaded_torch, "same_runs": runs_helped == runs_alone,
                  "nested": nested_results,
                  "plans": [[p.rollout_devices, p.alternatives, p.simulated_splits] for p in (alone, helped)],
                  "chosen": [[p.rollout_devices, p.staleness, p.tail_placement, p.alternatives, p.simulated_splits,
                              p.reason.split("; ")[0]] for p in (chose_alone, chose_helped)]}))
"""


def test_the_planner_and_the_policies_simulate_alike_with_helper_processes_and_without():
    out = subprocess.run([sys.executable, "-c", PLAN_BOTH_WAYS], capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["torch"]  # (the planner never needs torch)
    cores = os.cpu_count() or 1
    assert result["workers"] == (min(2, cores) if cores >= 2 else 0)
    alone, helped = result["plans"]
    assert helped == alone  # same split, same alternatives in the same order, same number of splits scored
    chose_alone, chose_helped = result["chosen"]  # (staleness and placement searched side by side in threads)
    assert chose_helped == chose_alone and "by staleness" in chose_alone[-1]
    assert result["same_runs"]  # each policy simulated in a helper: the same rows and traces, in the order asked
    assert result["error"] == "invalid literal for int() with base 10: 'not a number'"  # a helper's error reaches us
    assert result["nested"] == [[1, 1, 1], [2, 2, 2]]  # helper work asked for inside a helper runs there, not never


def test_without_helpers_the_work_runs_here_in_order_and_its_errors_reach_the_caller():
    assert map_in_helpers(lambda x: x * x, [3, 1, 2]) == [9, 1, 4]
    assert side_by_side(lambda x: x * x, [3, 1, 2]) == [9, 1, 4]
    assert in_background(sum, [1, 2]).result() == 3
    with pytest.raises(ZeroDivisionError):
        in_background(lambda: 1 / 0).result()


def test_no_helpers_are_forked_beside_torch():
    # (a fresh process: in this one torch may or may not be loaded, depending on the tests before)
    script = ("import torch, os\n"
              "from bidirl.helpers import helper_processes, map_in_helpers\n"
              "with helper_processes() as workers:\n"
              "    print(workers, map_in_helpers(str, [1, 2]) == ['1', '2'], *map_in_helpers(lambda _: os.getpid(), [0, 1]),"
              " os.getpid())\n")
    workers, same, *pids = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                          check=True, cwd=ROOT).stdout.split()
    assert workers == "0" and same == "True" and len(set(pids)) == 1  # the work ran here, in torch's process
