"""Every process group a run can need, created once at start-up (never on the critical path).

Groups are raw c10d backends built from the torchrun store (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU, chosen once), not the default group: vLLM, running in-process, creates
its own single-rank default group and must not collide with ours.

Which groups: every subset of devices that contains the primary trainer (a train pool, grown by
lending, always contains the primary; a weight sync is rooted there), twice: once for the main
threads' gradient all-reduce and once for the weight sender/receiver threads, so that the two never
share a group. With more than
``MAX_SUBSET_DEVICES`` devices that is too many, so only contiguous ranges containing the primary are
built and policies must keep pools contiguous. All members build the groups in one canonical order,
so construction cannot deadlock.
"""

from __future__ import annotations

import datetime
import itertools
from typing import Any, Dict, FrozenSet, List, Sequence, Tuple

from bidirl.errors import BidirlError

MAX_SUBSET_DEVICES = 8


def candidate_groups(devices: int, primary: int) -> List[FrozenSet[int]]:
    if devices <= MAX_SUBSET_DEVICES:
        others = [d for d in range(devices) if d != primary]
        subsets = [frozenset((primary, *extra)) for k in range(devices) for extra in itertools.combinations(others, k)]
    else:
        subsets = [frozenset(range(lo, hi + 1)) for lo in range(primary + 1) for hi in range(primary, devices)]
    return sorted((s for s in subsets if len(s) > 1), key=lambda s: (len(s), sorted(s)))


class Groups:
    def __init__(self, store: Any, device: int, devices: int, primary: int, device_type: str, timeout_s: float):
        self.device, self.primary = device, primary
        self.groups: Dict[FrozenSet[int], Any] = {}
        self.weight_groups: Dict[FrozenSet[int], Any] = {}  # used only by the weight sender/receiver threads
        if devices == 1:
            return  # one device: nothing to build, and every "collective" is local
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        for kind, table in (("group", self.groups), ("weights", self.weight_groups)):
            for members in candidate_groups(devices, primary):
                if device not in members:
                    continue
                ranks = sorted(members)
                prefix = dist.PrefixStore(f"{kind}/" + "-".join(map(str, ranks)), store)
                if device_type == "cuda":
                    table[members] = dist.ProcessGroupNCCL(prefix, ranks.index(device), len(ranks))
                else:
                    table[members] = dist.ProcessGroupGloo(prefix, ranks.index(device), len(ranks), timeout)

    def get(self, members: Sequence[int], weights: bool = False) -> Any:
        key = frozenset(members)
        table = self.weight_groups if weights else self.groups
        if key not in table:
            raise BidirlError(f"no process group was built for devices {sorted(key)} (primary {self.primary}); "
                              "with many devices pools must be contiguous ranges containing the primary")
        return table[key]

    def broadcast(self, tensor: Any, members: Sequence[int], root: int, weights: bool = False) -> None:
        if len(set(members)) > 1:
            self.get(members, weights).broadcast(tensor, sorted(set(members)).index(root)).wait()

    def allreduce_sum(self, tensor: Any, members: Sequence[int]) -> None:
        if len(set(members)) > 1:
            self.get(members).allreduce(tensor).wait()

    def broadcast_object(self, obj: Any, members: Sequence[int], root: int) -> Tuple[Any, int]:
        """Any torch-serialisable object from ``root`` to ``members`` (main threads' groups): its size,
        then its bytes; returns (the object, bytes sent). Rare and off the step's critical path (a
        device joining the train pool for good)."""
        import io

        import torch

        size = torch.zeros(1, dtype=torch.int64)
        if self.device == root:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            size[0] = payload.numel()
        self.broadcast(size, members, root)
        if self.device != root:
            payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self.broadcast(payload, members, root)
        if self.device == root:
            return obj, int(size[0])
        return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False), int(size[0])
