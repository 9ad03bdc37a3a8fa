"""What every torchrun rank runs (``python -m bidirl.torchrun_main``, which supplies the planner).

Rank 0 is the controller (no engines, no process groups); ranks 1..N are device workers 0..N-1.
``bidirl launch`` builds the torchrun command.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

# the pipeline's config -> (mean response length -> rollout devices): the planner, for re-planning
ChooseFor = Callable[[Any], Callable[[float], int]]


def main(argv: list, choose_for: Optional[ChooseFor] = None) -> int:
    from bidirl.errors import BidirlError

    try:
        return _run(argv, choose_for)
    except BidirlError as exc:
        print(f"error (rank {os.environ.get('RANK', '?')}): {exc}", file=sys.stderr)
        return exc.exit_code


def _run(argv: list, choose_for: Optional[ChooseFor]) -> int:
    import torch
    import torch.distributed as dist

    from bidirl.config import load_config
    from bidirl.errors import BidirlError
    from bidirl.runtime.mailbox import Mailbox
    from bidirl.runtime.placement import claim, describe, gpus_on_this_node, placement_from_environment
    from bidirl.runtime_env import prepare_process

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(argv[0], argv[1:])
    prepare_process(cfg.cluster.device_type)
    placement = placement_from_environment(cfg.cluster.device_type)
    claim(placement, cfg.cluster.device_type, visible=gpus_on_this_node())  # before anything opens CUDA
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    devices = world - 1
    if devices != cfg.cluster.devices:
        raise BidirlError(f"cluster.devices={cfg.cluster.devices} but torchrun started {devices} device ranks "
                          f"(+1 controller); pass --nproc-per-node accordingly")
    model_path = os.environ["BIDIRL_MODEL_PATH"]
    store, _, _ = next(dist.rendezvous("env://"))
    store = dist.PrefixStore("bidirl", store)
    store.set_timeout(_timedelta(cfg.launch.collective_timeout_s))
    mailbox = Mailbox(store)
    if rank == 0:
        choose = choose_for(cfg) if choose_for and cfg.cluster.replan_every else None
        return _control(cfg, mailbox, devices, model_path, choose)
    from bidirl.runtime.worker import Worker

    # the weight sender/receiver thread gets its own store connection: threads never share a socket
    receiver_store = dist.PrefixStore("bidirl", next(dist.rendezvous("env://"))[0])
    receiver_store.set_timeout(_timedelta(cfg.launch.collective_timeout_s))
    Worker(cfg, mailbox, rank - 1, devices, model_path, store=store, receiver_mailbox=Mailbox(receiver_store),
           placement=describe(placement, cfg.cluster.device_type)).run()
    return 0


def _control(cfg, mailbox, devices: int, model_path: str, choose) -> int:
    from transformers import AutoTokenizer

    from bidirl.rundir import RunDir
    from bidirl.runtime.controller import Controller
    from bidirl.runtime.launch import prior_from_environment
    from bidirl.ui import say

    from bidirl.runtime.launch import RUN_PATH_VARIABLE

    run = RunDir(cfg, path=os.environ.get(RUN_PATH_VARIABLE) or None)
    say(f"run directory: {run.path}")
    try:
        summary = Controller(cfg, mailbox, run, devices, AutoTokenizer.from_pretrained(model_path),
                             prior=prior_from_environment(), choose=choose).run_all()
    except BaseException:
        run.finish({"status": "failed"})
        raise
    run.finish(summary)
    return 0


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))  # without the planner: cluster.replan_every is refused
