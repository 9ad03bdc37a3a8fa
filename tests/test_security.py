"""What bidirl never does with data it did not write: evaluate it, or unpickle it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "bidirl").rglob("*.py"), *(ROOT / "cli").rglob("*.py")])


def calls(name):
    """(file, line) of every call of ``name`` (a bare name or an attribute) in the package and CLI."""
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if called == name:
                    found.append((path.relative_to(ROOT), node))
    return found


def test_no_model_output_or_config_value_is_ever_evaluated_as_code():
    assert [(str(p), n.lineno) for name in ("eval", "exec") for p, n in calls(name)
            if not (isinstance(n.func, ast.Attribute) and n.func.attr == "eval" and not n.args)] == []
    # (``module.eval()`` -- torch's inference mode, no arguments -- is the only "eval" allowed)


def test_every_torch_load_refuses_pickled_objects():
    loads = [(p, n) for p, n in calls("load") if isinstance(n.func, ast.Attribute)
             and getattr(n.func.value, "attr", getattr(n.func.value, "id", "")) == "torch"]
    assert loads  # (the check sees them)
    for path, node in loads:
        flags = {k.arg: k.value for k in node.keywords}
        assert isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True, \
            f"{path}:{node.lineno} loads without weights_only=True"


def test_nothing_is_unpickled():
    assert [(str(p), n.lineno) for name in ("loads", "load") for p, n in calls(name)
            if isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == "pickle"] == []


def test_a_single_node_run_keeps_its_gradient_and_weight_sockets_on_loopback():
    from bidirl.runtime.launch import Topology, loopback_env

    assert loopback_env(Topology(), {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert loopback_env(Topology(), {"GLOO_SOCKET_IFNAME": "eth1"}) == {"NCCL_SOCKET_IFNAME": "lo"}  # the user's own
    assert loopback_env(Topology(nnodes=2, rdzv_endpoint="10.0.0.1:29400"), {}) == {}  # a cluster address: theirs
