"""The shape of the code: layers that point down, no import cycles, closed sets of actions, events and
commands that every driver handles, a policy or a runtime command added as one class."""

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from bidirl.runtime import protocol as msg
from bidirl.sched import events as ev

ROOT = Path(__file__).resolve().parents[1]

# Highest layer first. A module may import its own layer or lower ones, never a higher one. An entry
# names a module and everything under it; "=name" names that module alone. The engines package's
# __init__ is only a name registry (it imports nothing), so configuration may read it.
LAYERS = [
    ("pipeline", ["bidirl.pipeline", "bidirl.torchrun_main", "bidirl.compare", "bidirl.report", "bidirl.peers"]),
    ("planner | profiling", ["bidirl.planner", "bidirl.profiling"]),
    ("runtime | sim", ["bidirl.runtime", "bidirl.sim", "bidirl.rundir", "bidirl.plots"]),
    ("engines", ["bidirl.engines"]),
    ("models", ["bidirl.models"]),
    ("data/prompts", ["bidirl.data", "bidirl.prompts", "bidirl.evaluate"]),
    ("config", ["bidirl.config"]),
    ("sched/grpo/reward", ["bidirl.sched", "bidirl.perf", "bidirl.grpo", "bidirl.reward", "bidirl.samples",
                           "bidirl.errors", "bidirl.ui", "bidirl.runtime_env", "bidirl.helpers", "=bidirl.engines",
                           "=bidirl"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in (ROOT / "bidirl").rglob("*.py")}


def layer_of(module: str) -> int:
    """Index in LAYERS (0 = highest) of the most specific entry that names ``module``."""
    matches = []
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            name = entry.lstrip("=")
            if module == name or (not entry.startswith("=") and module.startswith(name + ".")):
                matches.append((len(name) + entry.startswith("="), index))
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def imports_of(module: str) -> set:
    """bidirl modules ``module`` imports anywhere in its file (lazy imports too; TYPE_CHECKING blocks not)."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_imports_only_its_own_layer_or_lower_ones():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
              for m, deps in GRAPH.items() for dep in deps if layer_of(dep) < layer_of(m)]
    assert upward == []


def test_the_runtime_and_the_simulator_do_not_import_each_other():
    crossing = [(m, d) for m, deps in GRAPH.items() for d in deps
                if {m.split(".")[1], d.split(".")[1]} == {"runtime", "sim"}]
    assert crossing == []


def test_no_two_files_import_each_other_directly_or_through_others():
    state, cycles = {}, []

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_actions_and_events_are_closed_sets_that_the_bookkeeping_and_both_drivers_handle_completely():
    from bidirl.runtime.controller import Controller
    from bidirl.sched.cluster import Cluster
    from bidirl.sim.simulator import Simulator

    defined = lambda base: {c for c in base.__subclasses__() if c.__module__ == ev.__name__}  # noqa: E731
    assert defined(ev.Action) == set(ev.ACTIONS) and defined(ev.Event) == set(ev.EVENTS)
    assert set(Cluster.APPLY) == set(ev.ACTIONS)
    assert set(Cluster.COMPLETE) == set(ev.EVENTS)
    assert set(Simulator.START) == set(ev.ACTIONS)
    assert set(Controller.EXECUTE) == set(ev.ACTIONS)


def test_an_action_the_bookkeeping_does_not_know_fails_loudly():
    from bidirl.sched.cluster import Cluster
    from bidirl.sched.roles import Role

    @dataclass(frozen=True)
    class Teleport(ev.Action):
        device: int

    cluster = Cluster([Role.ROLLOUT, Role.TRAIN], batch_groups=4, eta=1, steps=2, chunk_groups=4)
    with pytest.raises(TypeError, match="no rule for action"):
        cluster.apply(Teleport(0))


def test_every_runtime_command_has_its_worker_handler_and_every_loop_reply_its_controller_translation():
    from bidirl.runtime.controller import Controller
    from bidirl.runtime.worker import Worker

    defined = lambda base: {c for c in base.__subclasses__() if c.__module__ == msg.__name__}  # noqa: E731
    assert defined(msg.Command) == set(msg.COMMANDS) and defined(msg.Reply) == set(msg.REPLIES)
    assert [c.__name__ for c in msg.COMMANDS if not callable(getattr(Worker, c.handler, None))] == []
    awaited_directly = {msg.Ready, msg.Evaluated, msg.Stopped}  # (CheckpointSaved: the final one is, too)
    assert set(Controller.TRANSLATE) == set(msg.REPLIES) - awaited_directly


@pytest.fixture
def registry_restored():
    from bidirl.sched.policy import POLICIES

    saved = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(saved)


def test_a_new_policy_is_one_class_known_to_config_simulator_and_bookkeeping(registry_restored):
    from bidirl.config import load_config
    from bidirl.sched.policies import AsyncPolicy, issue
    from bidirl.sched.roles import Role
    from bidirl.sim.run import simulate

    class OneChunkAtATime(AsyncPolicy):  # the whole policy: a rollout device takes a chunk only when idle
        name, aliases = "toy-one-chunk", ("toy",)

        def fill(self, cluster, actions):
            for device in cluster.idle(Role.ROLLOUT):
                groups = min(cluster.next_chunk_size(), cluster.admissible(device))
                if cluster.can_admit(device, groups) and cluster.has_room(device, groups):
                    issue(cluster, actions, ev.Generate(device.index, groups))

    cfg = load_config("pipelines/sim-32gpu.yaml", ["cluster.devices=4", "train.prompts_per_step=16", "train.steps=4",
                                                   "rollout.group_size=4", "launch.chunk_groups=4",
                                                   "launch.mode=toy"])
    result = simulate(cfg, cfg.launch.mode, keep_trace=True)
    cluster = result.cluster
    assert result.policy == "toy" and cluster.trained_groups == cluster.admitted == 4 * 16
    assert max(result.staleness) <= 1
    started_idle = [r for r in cluster.trace if r["reason"].startswith("chunk ") and r["to"] == "generating"]
    assert len(started_idle) == len(cluster.chunks)  # every chunk began on an idle device


def test_a_new_runtime_command_is_one_dataclass_and_one_handler():
    from bidirl.runtime.worker import Worker

    @dataclass(frozen=True)
    class Ping(msg.Command):
        handler = "ping"
        text: str

    @dataclass
    class Pong(msg.Reply):
        text: str

    class PingWorker(Worker):
        def ping(self, command: Ping) -> Pong:
            return Pong(text=command.text[::-1])

    posted = []
    worker = object.__new__(PingWorker)  # only the dispatch is exercised: no engines needed
    worker.device, worker.mailbox = 3, type("Box", (), {"post": staticmethod(posted.append)})()
    assert worker.serve_one(Ping("abc")) is True
    assert posted[0].text == "cba" and posted[0].device == 3 and posted[0].seconds >= 0


def test_the_code_passes_ruff_as_configured_in_pyproject():
    import subprocess
    import sys

    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "bidirl", "cli", "tests", "experiments"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
