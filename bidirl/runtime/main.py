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
# Set in torchrun's store (whose server outlives restarts of the worker group, as torch 2.13's agent
# keeps it) by a rank that stopped on an error every attempt would meet again: bad input, found while a
# rank starts (its config, the device count, the placement), or :class:`~bidirl.errors.Unrecoverable`
# later (a checkpoint that cannot be written on a full disk). Every attempt torchrun still starts then
# ends at once with STOPPED_EXIT; a dead or crashed process is restarted and resumes from the latest
# good checkpoint, and so is any other error (a stalled policy, replicas that diverged: a restart may
# not meet them again).
FATAL_KEY = "bidirl/fatal"
STOPPED_EXIT = 3  # (2 is a BidirlError's own exit: the rank that met the error says it)
INTERRUPTED_EXIT = 130  # (Ctrl-C, as a shell reports it)


def main(argv: list, choose_for: Optional[ChooseFor] = None) -> int:
    from bidirl.errors import BidirlError

    try:
        return _run(argv, choose_for)
    except BidirlError as exc:
        print(f"error (rank {os.environ.get('RANK', '?')}): {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C, on the controller: it has closed the run directory as interrupted, and
        return INTERRUPTED_EXIT  # `bidirl launch` says it once, with how to resume


def _run(argv: list, choose_for: Optional[ChooseFor]) -> int:
    take_ctrl_c()
    import torch
    import torch.distributed as dist

    from bidirl.config import load_config
    from bidirl.errors import BidirlError
    from bidirl.runtime.mailbox import Mailbox
    from bidirl.runtime.placement import claim, describe, gpus_on_this_node, placement_from_environment
    from bidirl.runtime_env import prepare_process

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # torchrun keeps its store across restarts of the worker group: each attempt gets its own key space
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    shared, _, _ = next(dist.rendezvous("env://"))
    if restart and shared.check([FATAL_KEY]):  # an earlier attempt stopped on an error (its line is above)
        return STOPPED_EXIT  # that a restart cannot fix: end this attempt at once, before any engine is built

    def stop_restarts(why: str) -> None:
        shared.set(FATAL_KEY, why)

    try:  # bad input: the same in every attempt
        cfg = load_config(argv[0], argv[1:])
        prepare_process(cfg.cluster.device_type)
        placement = placement_from_environment(cfg.cluster.device_type)
        claim(placement, cfg.cluster.device_type, visible=gpus_on_this_node())  # before anything opens CUDA
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        devices = world - 1
        if devices != cfg.cluster.devices:
            raise BidirlError(f"cluster.devices={cfg.cluster.devices} but torchrun started {devices} device ranks "
                              f"(+1 controller); pass --nproc-per-node accordingly")
    except BidirlError as exc:
        stop_restarts(str(exc))
        raise
    model_path = os.environ["BIDIRL_MODEL_PATH"]
    store = dist.PrefixStore(f"bidirl/{restart}", shared)
    store.set_timeout(_timedelta(cfg.launch.collective_timeout_s))
    mailbox = Mailbox(store, interruptible=rank == 0)
    if rank == 0:
        choose = choose_for(cfg) if choose_for and cfg.cluster.replan_every else None
        return _control(cfg, mailbox, devices, model_path, choose, restart, stop_restarts)
    from bidirl.runtime.worker import Worker

    # the weight sender/receiver thread gets its own store connection: threads never share a socket
    receiver_store = dist.PrefixStore(f"bidirl/{restart}", next(dist.rendezvous("env://"))[0])
    receiver_store.set_timeout(_timedelta(cfg.launch.collective_timeout_s))
    Worker(cfg, mailbox, rank - 1, devices, model_path, store=store, receiver_mailbox=Mailbox(receiver_store),
           placement=describe(placement, cfg.cluster.device_type)).run()  # (its write errors go to the controller)
    return 0


def take_ctrl_c() -> None:
    """A Ctrl-C reaches torchrun's agent, which sends SIGINT on to every rank (each in its own session) and
    kills those still there after its shutdown timeout. A device worker has nothing to save (the controller
    seals checkpoints), and it may be waiting inside a C++ call (its next command, a collective), where
    Python's handler would run only once that returns: it takes the signal's default action and ends at once,
    without a traceback. (A restart or a failed group is stopped with SIGTERM, as before.) The controller
    closes the run directory as interrupted: its waits for replies are cut into slices
    (``Mailbox(interruptible=True)``), and, since a store wait that times out is a C++ warning, its C++ log
    prints errors only, whatever TORCH_CPP_LOG_LEVEL says (it runs no collective whose warnings would help)."""
    import signal

    if os.environ.get("RANK", "0") != "0":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # (read as torch loads, just after)


def _control(cfg, mailbox, devices: int, model_path: str, choose, restart: int, stop_restarts) -> int:
    from transformers import AutoTokenizer

    from bidirl.runtime.controller import Controller
    from bidirl.runtime.launch import prior_from_environment
    from bidirl.ui import say

    run, resume = _open_run(cfg, restart, stop_restarts)
    say(f"run directory: {run.path}")
    try:
        summary = Controller(cfg, mailbox, run, devices, AutoTokenizer.from_pretrained(model_path),
                             prior=prior_from_environment(), choose=choose, resume=resume, restart=restart,
                             stop_restarts=stop_restarts).run_all()
        summary["base_model"] = model_path  # the weights every device started from (a cache folder, or the user's)
    except BaseException as failure:
        run.finish_after(failure)
        raise
    run.finish(summary)
    return 0


def _open_run(cfg, restart: int, stop_restarts: Callable[[str], None] = lambda why: None):
    """The run directory, and the checkpoint to resume from: ``bidirl launch --resume RUN`` asks for the
    latest good one (there must be one); so does a restart by torchrun after a process died (none yet:
    the run starts again from version 0, in the same directory)."""
    from bidirl.errors import BidirlError
    from bidirl.rundir import RunDir
    from bidirl.runtime.checkpoints import latest_good
    from bidirl.runtime.launch import RESUME_VARIABLE, RUN_PATH_VARIABLE
    from bidirl.ui import say

    path = os.environ.get(RUN_PATH_VARIABLE) or None
    asked = os.environ.get(RESUME_VARIABLE) == "1"
    if not (asked or restart) or path is None or not os.path.exists(path):
        return RunDir(cfg, path=path), None
    try:  # (a checkpoint that cannot be resumed from is the same in every attempt: later restarts end at once)
        resume = latest_good(path, warn=say)
        if resume is None and asked:
            raise BidirlError(f"--resume {path}: it holds no good checkpoint (checkpoints/v*/ with a valid "
                              "MANIFEST.json)")
    except BidirlError as exc:
        stop_restarts(str(exc))
        raise
    if restart:
        say(f"restart {restart} after a process failed: " + (f"resuming from {resume.path}" if resume
                                                             else "no checkpoint yet, starting again from version 0"))
    return RunDir.resumed(cfg, path, resume.version if resume else 0), resume


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))  # without the planner: cluster.replan_every is refused
