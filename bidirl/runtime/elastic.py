"""torchrun, as ``bidirl launch`` runs it: ``python -m bidirl.runtime.elastic <torchrun arguments>``.

The same elastic agent (restarts after a dead process included), but when the worker group finally
fails it ends with one line per failed rank -- which process, how it died, how to resume -- instead of
torchrun's multi-line report and traceback. A rank that failed on a user error has already printed its
own ``error (rank R): ...`` line; since a restart would meet that error again, the attempts torchrun
still starts end at once (``bidirl.runtime.main.FATAL_KEY``), and the launch exits with code 2.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict


def describe_failures(failures: Dict[int, object], restarts: int) -> str:
    """One line: every failed rank (0 is the controller, R > 0 device R - 1, its pool from the run's
    ``devices.json``) and how it ended."""
    run = os.environ.get("BIDIRL_RUN_PATH", "")
    tail = f"; their output is above, and the run's checkpoints (if any) resume with --resume {run}" if run else ""
    if stopped_on_an_error(failures):
        return (f"the runtime stopped on the error above, which a restart cannot fix (any restart that followed "
                f"ended at once){tail.replace('their output is above, and ', '')}")
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
    """Did the group end on a rank's BidirlError (bad input, a full disk: exit code 2), every other rank
    stopped by torchrun or ending at once because of it (``bidirl.runtime.main.FATAL_KEY``)?"""
    codes = [getattr(f, "exitcode", None) for f in failures.values()]
    return 2 in codes and all(code in (2, -15) for code in codes)


def _roles(run: str) -> Dict[int, str]:
    try:
        with open(os.path.join(run, "devices.json")) as f:
            devices = json.load(f)
    except (OSError, ValueError):
        return {}
    return {d["rank"]: f", {d['home']} pool" + (", the primary trainer" if d["primary"] else "") for d in devices}


def main(argv: list) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as exc:
        print(f"error: {describe_failures(exc.failures, args.max_restarts)}", file=sys.stderr)
        return 2 if stopped_on_an_error(exc.failures) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
