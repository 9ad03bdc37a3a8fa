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
    unpicklers = {"pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    imported = []
    for path in SOURCES:  # not imported at all, under any name
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            imported += [(str(path.relative_to(ROOT)), node.lineno) for n in names if n.split(".")[0] in unpicklers]
    assert imported == []
    # numpy's loaders unpickle only when asked to
    assert [(str(p), n.lineno) for p, n in calls("load") if any(k.arg == "allow_pickle" for k in n.keywords)] == []


def test_every_yaml_load_uses_a_safe_loader():
    import yaml

    import bidirl.config

    loads = [(p, n) for p, n in calls("load")
             if isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == "yaml"]
    assert loads  # (the check sees them)
    for path, node in loads:
        loader = {k.arg: k.value for k in node.keywords}.get("Loader")
        assert isinstance(loader, ast.Name), f"{path}:{node.lineno} yaml.load without a named Loader"
        assert issubclass(getattr(bidirl.config, loader.id), yaml.SafeLoader), f"{path}:{node.lineno}"
    assert calls("unsafe_load") == [] and calls("full_load") == []


def test_a_single_node_run_keeps_its_gradient_and_weight_sockets_on_loopback():
    from bidirl.runtime.launch import Topology, loopback_env

    assert loopback_env(Topology(), {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert loopback_env(Topology(), {"GLOO_SOCKET_IFNAME": "eth1"}) == {"NCCL_SOCKET_IFNAME": "lo"}  # the user's own
    assert loopback_env(Topology(nnodes=2, rdzv_endpoint="10.0.0.1:29400"), {}) == {}  # a cluster address: theirs
