"""The GPU path's logic, checked on any machine: which process owns which GPU, what torchrun is told,
and the engines' memory settings."""

import pytest

from bidirl.errors import BidirlError
from bidirl.perf.analytic import ARCHITECTURES
from bidirl.runtime.launch import Topology, processes_on_node, torchrun_command
from bidirl.runtime.placement import claim, place
from tests.builders import small_config


def placements(per_node, nodes, device_type="cuda"):
    """Every process of a cluster as torchrun numbers them: node 0 runs the controller and its workers."""
    out, rank = [], 0
    for node in range(nodes):
        for local in range(per_node + (1 if node == 0 else 0)):
            out.append((node, place(rank, local, device_type)))
            rank += 1
    return out


@pytest.mark.parametrize("per_node,nodes", [(8, 1), (4, 2), (8, 4)])
def test_every_worker_owns_one_gpu_of_its_node_and_the_controller_none(per_node, nodes):
    cluster = placements(per_node, nodes)
    controller = [p for _, p in cluster if p.is_controller]
    assert len(controller) == 1 and controller[0].rank == 0 and controller[0].gpu is None
    workers = [(node, p) for node, p in cluster if not p.is_controller]
    assert sorted(p.device for _, p in workers) == list(range(per_node * nodes))
    for node in range(nodes):
        assert sorted(p.gpu for n, p in workers if n == node) == list(range(per_node))  # each GPU once


def test_on_cpu_no_process_claims_an_accelerator():
    assert all(p.gpu is None for _, p in placements(2, 1, "cpu"))


def test_a_worker_sees_only_its_gpu_and_deepspeed_is_told_it_is_local_rank_0():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,5", "LOCAL_RANK": "4"}
    claim(place(rank=4, local_rank=4, device_type="cuda"), "cuda", env)
    assert env == {"CUDA_VISIBLE_DEVICES": "5", "LOCAL_RANK": "0"}  # the fourth listed GPU, seen as cuda:0
    env = {}
    claim(place(rank=0, local_rank=0, device_type="cuda"), "cuda", env)
    assert env == {"CUDA_VISIBLE_DEVICES": ""}


def test_a_node_started_with_more_workers_than_gpus_is_one_clear_error():
    with pytest.raises(BidirlError, match="needs GPU 4 but this node has 4 .*one process more"):
        claim(place(rank=5, local_rank=5, device_type="cuda"), "cuda", {}, visible=4)


def test_torchrun_is_told_node_0_runs_the_controller_beside_its_workers():
    cfg = small_config("cluster.devices=8")
    one = torchrun_command("p.yaml", [], cfg, Topology())
    assert "--nproc-per-node=9" in one and "--standalone" in one
    first = torchrun_command("p.yaml", ["x=1"], cfg, Topology(nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:29500"))
    second = torchrun_command("p.yaml", ["x=1"], cfg, Topology(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500"))
    assert "--nproc-per-node=5" in first and "--nproc-per-node=4" in second
    for command in (first, second):  # static rendezvous: node 0 gets ranks from 0, so it holds the controller
        assert {"--rdzv-backend=static", "--master-addr=10.0.0.1", "--master-port=29500"} <= set(command)
    assert "--node-rank=1" in second and command[-2:] == ["p.yaml", "x=1"]


def test_devices_that_do_not_split_over_the_nodes_need_explicit_process_counts():
    with pytest.raises(BidirlError, match="does not split evenly over --nnodes 3"):
        processes_on_node(small_config("cluster.devices=8"), Topology(nnodes=3))
    assert processes_on_node(small_config("cluster.devices=8"), Topology(nnodes=3, nproc_per_node=4)) == 4


@pytest.mark.parametrize("override,culprit", [("rollout.gpu_memory_utilization=1.2", "rollout.gpu_memory_utilization"),
                                              ("rollout.max_num_seqs=0", "rollout.max_num_seqs"),
                                              ("train.logprob_chunk_tokens=-1", "train.logprob_chunk_tokens")])
def test_a_memory_setting_out_of_range_names_its_key(override, culprit):
    from bidirl.config import ConfigError

    with pytest.raises(ConfigError, match=culprit):
        small_config(override)


QWEN25_1_5B = dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                   max_position_embeddings=32768)  # Qwen2.5-1.5B-Instruct's config.json (the shape fields)


def model_folder(tmp_path, name, fields):
    import json

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder)


def gpu_config(*overrides):
    return small_config("cluster.device_type=cuda", "model.dtype=bfloat16", "rollout.max_new_tokens=512", *overrides)


def test_a_hot_switch_device_budget_counts_both_engines_from_the_real_parameter_count(tmp_path):
    from bidirl.runtime.launch import check_memory

    budget = check_memory(gpu_config("train.micro_batch_size=16", "train.gradient_checkpointing=true",
                                     "rollout.gpu_memory_utilization=0.3"),
                          model_folder(tmp_path, "qwen2.5-1.5b", QWEN25_1_5B))
    params = 1_543_714_304  # Qwen2.5-1.5B as published, tied embeddings once: accelerate's empty-weights count
    assert budget.items["trainer weights"] == 4 * params and budget.items["AdamW moments"] == 8 * params
    assert budget.items["vLLM"] == 0.3 * 80e9 and budget.items["compute copies"] == 2 * params
    assert budget.items["logits"] == 2048 * 10 * 151936  # one chunk of positions, not the micro-batch's 16k
    assert budget.fits and 70e9 < budget.total < 80e9


def test_a_plan_that_does_not_fit_device_memory_fails_before_launch_naming_the_largest_items(tmp_path):
    from bidirl.runtime.launch import check_memory

    seven_b = model_folder(tmp_path, "qwen2.5-7b", ARCHITECTURES["7B"])
    with pytest.raises(BidirlError, match=r"a device holds both engines and .* does not fit in 80 GB \(largest: "
                                          r"AdamW moments 60\.9 GB"):
        check_memory(gpu_config("train.micro_batch_size=16", "train.gradient_checkpointing=true"), seven_b)
    one_b = model_folder(tmp_path, "qwen2.5-1.5b", QWEN25_1_5B)
    with pytest.raises(BidirlError, match=r"largest: activations"):  # 64 x 1k tokens, every layer kept
        check_memory(gpu_config("train.micro_batch_size=64"), one_b)
    with pytest.raises(BidirlError, match=r"rollout.gpu_memory_utilization=0.05: .* cannot hold"):
        check_memory(gpu_config("rollout.gpu_memory_utilization=0.05"), seven_b)


def test_the_planner_refuses_a_hot_switch_setting_that_launch_would_refuse(tmp_path):
    from bidirl.planner import plan, preflight

    seven_b = model_folder(tmp_path, "qwen2.5-7b", ARCHITECTURES["7B"])
    cfg = gpu_config(f"model.source={seven_b}", "train.micro_batch_size=16", "cluster.devices=4",
                     "launch.mode=async")
    with pytest.raises(BidirlError, match=r"a device holds both engines and .* does not fit in 80 GB"):
        plan(cfg, check_memory=True)
    preflight(gpu_config(f"model.source={model_folder(tmp_path, 'qwen2.5-1.5b', QWEN25_1_5B)}",
                         "train.micro_batch_size=16", "train.gradient_checkpointing=true",
                         "rollout.gpu_memory_utilization=0.3", "cluster.devices=4", "launch.mode=async"), "async")


def test_a_node_with_fewer_gpus_than_workers_is_refused_before_torchrun_starts():
    from bidirl.runtime.placement import check_node

    check_node(8, True, 8)  # eight workers and the controller, which needs no GPU
    with pytest.raises(BidirlError, match="would run 8 device workers .*controller.* but has 4 GPUs"):
        check_node(8, True, 4)
    with pytest.raises(BidirlError, match="has 2 GPUs visible"):
        check_node(4, False, 8, visible="0,3")
    check_node(64, False, None)  # no driver listing: nothing known to check


def test_launching_on_cuda_without_a_gpu_is_one_line():
    import torch

    from bidirl.runtime.launch import check_gpus

    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BidirlError, match="cluster.device_type=cuda but this node has no NVIDIA GPU"):
        check_gpus(gpu_config("cluster.devices=2"), Topology())


def test_cpu_workers_may_share_cores_with_a_warning_but_not_crowd_them(monkeypatch, capsys):
    from bidirl.runtime.launch import check_devices

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    check_devices(small_config("cluster.devices=2"), Topology())
    assert capsys.readouterr().err == ""
    check_devices(small_config("cluster.devices=3"), Topology())  # the CI machine's 3-device tests
    assert "3 CPU device workers share 2 cores" in capsys.readouterr().err
    with pytest.raises(BidirlError, match="cluster.devices=9: .* 9 CPU device workers on 2 cores"):
        check_devices(small_config("cluster.devices=9"), Topology())


# ---- communicators -------------------------------------------------------------------------------

@pytest.mark.parametrize("devices,expected", [(8, 9), (32, 33), (1024, 1025)])
def test_a_run_builds_n_plus_one_communicators_and_at_most_three_beyond_the_primary(devices, expected):
    from bidirl.runtime.groups import communicators

    built = communicators(devices, primary=0, train_homes=range(devices // 2))
    assert len(built) == len(set(built)) == expected
    per_device = [sum(device in members for _, members in built) for device in range(devices)]
    assert per_device[0] == devices + 1 and max(per_device[1:]) <= 3


@pytest.mark.parametrize("devices,primary", [(8, 0), (8, 5), (32, 7)])
def test_building_in_the_one_canonical_order_cannot_deadlock(devices, primary):
    """Every device first-uses its communicators in the global order; a first use completes only when all
    its members have reached it. Played out, every communicator completes."""
    from bidirl.runtime.groups import MAIN_FAMILY, WEIGHTS_FAMILY, communicators

    built = communicators(devices, primary, train_homes=[primary, *range(devices - 3, devices)])
    for family in (MAIN_FAMILY, WEIGHTS_FAMILY):
        queues = {d: [c for c in built if c[0] in family and d in c[1]] for d in range(devices)}
        while any(queues.values()):
            ready = [c for c in {q[0] for q in queues.values() if q} if all(queues[m] and queues[m][0] == c for m in c[1])]
            assert ready, f"deadlock with {[q[0] for q in queues.values() if q]}"
            for kind, members in ready:
                for m in members:
                    queues[m].pop(0)


def run_ranks(devices, body):
    """``body(device, store)`` on one thread per device over an in-process store (gloo); their results."""
    import threading

    import torch.distributed as dist

    store, results, errors = dist.HashStore(), {}, []

    def one(device):
        try:
            results[device] = body(device, store)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(d,)) for d in range(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("homes_now", [[0, 1], [0, 3]])  # the starting train pool, and one re-planning changed
def test_a_steps_gradients_sum_over_home_and_lent_devices_on_every_home_trainer(homes_now):
    import torch

    from bidirl.runtime.groups import MAIN_FAMILY, Groups

    members, lent = sorted({*homes_now, 2}), [2]

    def body(device, store):
        groups = Groups(store, device, 4, 0, [0, 1], "cpu", 30, MAIN_FAMILY)
        grads = torch.full((3,), float(device + 1))
        if device in members:
            groups.reduce_step(grads, members, lent)
        return grads

    out = run_ranks(4, body)
    total = sum(d + 1 for d in members)
    for device in homes_now:
        assert out[device].tolist() == [total] * 3
    assert out[2].tolist() == [3.0] * 3  # a lent device only gave


def test_every_device_joins_each_weight_broadcast_on_its_own_thread():
    import torch

    from bidirl.runtime.groups import WEIGHTS_FAMILY, Groups

    def body(device, store):
        groups = Groups(store, device, 3, 1, [1], "cpu", 30, WEIGHTS_FAMILY)
        weights = torch.arange(4.0) if device == 1 else torch.zeros(4)
        groups.broadcast_weights(weights, 3)
        return weights

    assert all(w.tolist() == [0.0, 1.0, 2.0, 3.0] for w in run_ranks(3, body).values())
