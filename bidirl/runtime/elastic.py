"""torchrun, as ``bidirl launch`` runs it: ``python -m bidirl.runtime.elastic <torchrun arguments>``.

The same elastic agent (restarts after a dead process included), but when the worker group finally
fails it ends with one line per failed rank -- which process, how it died, how to resume -- instead of
torchrun's multi-line report and traceback. A rank that failed on a user error has already printed its
own ``error (rank R): ...`` line, and the launch exits with code 2. Where a restart would meet that
error again (bad input found as a rank starts, a checkpoint on a full disk), the attempts torchrun
still starts end at once (``bidirl.runtime.main.FATAL_KEY``).

On one node without a cluster address (``--standalone``), torchrun's stores listen on loopback only
(:func:`bind_stores_to_loopback`): torch's c10d server would bind the wildcard address whatever host
it is given.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from typing import Dict


def describe_failures(failures: Dict[int, object], restarts: int) -> str:
    """One line: every failed rank (0 is the controller, R > 0 device R - 1, its pool from the run's
    ``devices.json``) and how it ended."""
    run = os.environ.get("BIDIRL_RUN_PATH", "")
    resume = f"the run's checkpoints (if any) resume with --resume {run}" if run else ""
    if stopped_on_an_error(failures):
        return (f"the runtime stopped on the error above, which a restart cannot fix (any restart that followed "
                f"ended at once){'; ' + resume if resume else ''}")
    tail = f"; their output is above, and {resume}" if resume else ""
    roles = _roles(run)
    # torchrun stops every other process of the group with SIGTERM once one fails: name the cause
    causes = {r: f for r, f in failures.items() if getattr(f, "exitcode", None) != -15} or failures
    parts = []
    for rank, failure in sorted(causes.items()):
        who = "the controller (rank 0)" if rank == 0 else f"device {rank - 1} (rank {rank}{roles.get(rank, '')})"
        code = getattr(failure, "exitcode", None)
        how = (f"was killed by {failure.signal_name()}" if code is not None and code < 0
               else f"exited with code {code}")
        parts.append(f"{who} {how}")
    if len(causes) < len(failures):
        parts[-1] += f" (torchrun then stopped the other {len(failures) - len(causes)})"
    return f"the runtime failed after {restarts} restart(s): {', '.join(parts)}{tail}"


def stopped_on_an_error(failures: Dict[int, object]) -> bool:
    """Did the last attempt end at once because an earlier one met an error that a restart cannot fix
    (``bidirl.runtime.main.FATAL_KEY``: every rank exits with STOPPED_EXIT, or was stopped by torchrun)?"""
    from bidirl.runtime.main import STOPPED_EXIT

    codes = [getattr(f, "exitcode", None) for f in failures.values()]
    return STOPPED_EXIT in codes and all(code in (STOPPED_EXIT, -15) for code in codes)


def user_error(failures: Dict[int, object]) -> bool:
    """Did the group end on bad input (a rank's BidirlError, exit code 2, with its own line above)?"""
    codes = [getattr(f, "exitcode", None) for f in failures.values()]
    return stopped_on_an_error(failures) or (2 in codes and all(code in (2, -15) for code in codes))


def _roles(run: str) -> Dict[int, str]:
    try:
        with open(os.path.join(run, "devices.json")) as f:
            devices = json.load(f)
    except (OSError, ValueError):
        return {}
    return {d["rank"]: f", {d['home']} pool" + (", the primary trainer" if d["primary"] else "") for d in devices}


LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_stores_to_loopback(args) -> None:
    """A standalone run's two c10d stores (the rendezvous's, and the one its workers share through
    ``MASTER_ADDR``) listen on 127.0.0.1 alone. torch's server binds the wildcard address whatever host
    it is given, but it accepts a socket already listening (``master_listen_fd``): every store server
    asked for on a loopback host gets one bound here. The workers are told 127.0.0.1 (``--local-addr``),
    not this machine's name, which may resolve to another interface."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    args.local_addr = args.local_addr or LOOPBACK

    class LoopbackTCPStore(dist.TCPStore):
        def __init__(self, host_name, port, *rest, is_master=False, **options):
            if is_master and options.get("master_listen_fd") is None and is_loopback(host_name):
                try:
                    listener = socket.create_server((LOOPBACK, port), backlog=4096)
                except OSError as exc:  # (the rendezvous's own except clause takes RuntimeError)
                    raise RuntimeError(f"cannot listen on {LOOPBACK}:{port}: {exc}") from exc
                port = listener.getsockname()[1]
                options["master_listen_fd"] = listener.detach()  # the store owns the socket now
            super().__init__(host_name, port, *rest, is_master=is_master, **options)

    dist.TCPStore = LoopbackTCPStore  # dynamic rendezvous: the workers' shared store
    c10d_rendezvous_backend.TCPStore = LoopbackTCPStore  # the rendezvous's own store


def main(argv: list) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    if args.standalone:
        bind_stores_to_loopback(args)
    quiet_about_ctrl_c()
    try:
        run(args)
    except ChildFailedError as exc:
        print(f"error: {describe_failures(exc.failures, args.max_restarts)}", file=sys.stderr)
        return 2 if user_error(exc.failures) else 1
    except SignalException as exc:  # (Ctrl-C or a kill: the ranks were stopped; `bidirl launch` says what)
        return 128 + int(exc.sigval)
    return 0


def quiet_about_ctrl_c() -> None:
    """torchrun's agent logs a Ctrl-C as a warning per process it stops ("Received 2 death signal", "Sending
    process ... closing signal SIGINT"): the user pressed it, and `bidirl launch` says it once. Other
    signals' lines (a SIGTERM from a scheduler, a failed rank's group stopped) stay, and so does its line
    for a rank it had to kill after its shutdown timeout."""
    import logging
    import signal

    def not_ctrl_c(record: logging.LogRecord) -> bool:  # (by the record's arguments: a Signals enum prints as
        args = record.args if isinstance(record.args, tuple) else ()  # "2" or "Signals.SIGINT" by Python version)
        return not (("death signal" in str(record.msg) or "closing signal" in str(record.msg))
                    and signal.SIGINT in args)

    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(not_ctrl_c)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
