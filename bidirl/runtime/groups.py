"""The communicators of a run: a bounded set, built eagerly, in one canonical order, on the threads
that use them.

Groups are raw c10d backends built from the torchrun store (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU, chosen once), not the default group: vLLM, running in-process, creates
its own single-rank default group and must not collide with ours.

Which communicators (:func:`communicators`), for N devices and the primary trainer P::

    weights   all N devices       weight sender/receiver threads: each version is broadcast from P to all
    home      the starting train pool   main threads: the all-reduce of the home trainers' gradients
    pair P-d  for every d != P    main threads: a lent device's gradients to P, a joining trainer's state,
                                  and the home reduction once re-planning has changed the train pool

so N + 1 in all, at most N + 1 on the primary and at most 3 on any other device (8 devices: 9;
32: 33; 1024: 1025), whatever devices are lent: pools may be any subset, and no communicator is
created after start-up. A step's gradients (:meth:`Groups.reduce_step`): each lent device sends its
sum to P over its pair, P adds them in device order, then the home trainers all-reduce over ``home``
(or, if re-planning changed who they are, P gathers and returns the sum over the pairs).

Eager and ordered. Each family is built by the thread that uses it, in the canonical order of
:func:`communicators`, and each communicator is used once (a one-element all-reduce) right after it
is built. Because every rank walks the same total order, the first use of the lowest communicator not
yet done always has all its members arriving: construction cannot deadlock. NCCL connects on first
use, so this moves every connection to start-up, on the right thread. The two families never run
at the same time on a device: the controller holds a step's reduction (and any other main-thread
transfer) until the weight broadcast in flight has been received everywhere, and publishes a
version only after the step that made it (:class:`~bidirl.runtime.controller.Controller`). The
configured ``launch.collective_timeout_s`` applies to every communicator.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, FrozenSet, List, Sequence, Tuple

from bidirl.errors import BidirlError

WEIGHTS, HOME, PAIR = "weights", "home", "pair"
MAIN_FAMILY, WEIGHTS_FAMILY = (HOME, PAIR), (WEIGHTS,)


def communicators(devices: int, primary: int, train_homes: Sequence[int]) -> List[Tuple[str, FrozenSet[int]]]:
    """Every communicator of a run, in the one order all ranks build them."""
    if devices == 1:
        return []
    out = [(WEIGHTS, frozenset(range(devices)))]
    if len(train_homes) > 1:
        out.append((HOME, frozenset(train_homes)))
    return out + [(PAIR, frozenset((primary, d))) for d in range(devices) if d != primary]


class Groups:
    """One device's communicators of one family (``MAIN_FAMILY`` or ``WEIGHTS_FAMILY``), built and first
    used by the constructing thread."""

    def __init__(self, store: Any, device: int, devices: int, primary: int, train_homes: Sequence[int],
                 device_type: str, timeout_s: float, family: Tuple[str, ...] = MAIN_FAMILY):
        import torch

        self.torch, self.device, self.primary = torch, device, primary
        self.tensor_device = "cuda" if device_type == "cuda" else "cpu"  # NCCL moves device tensors only
        self.home = frozenset(train_homes)
        self.built: Dict[Tuple[str, FrozenSet[int]], Any] = {}
        for kind, members in communicators(devices, primary, train_homes):
            if kind in family and device in members:
                self.built[(kind, members)] = _build(store, kind, members, device, device_type, timeout_s)
                self._first_use(self.built[(kind, members)])

    def _first_use(self, group: Any) -> None:
        group.allreduce(self.torch.zeros(1, device=self.tensor_device)).wait()

    def get(self, kind: str, members: Sequence[int]) -> Any:
        key = (kind, frozenset(members))
        if key not in self.built:
            raise BidirlError(f"no {kind} communicator for devices {sorted(key[1])} on device {self.device} "
                              "(only those of groups.communicators exist)")
        return self.built[key]

    def _over_pair(self, tensor: Any, other: int, root: int) -> None:
        """``root``'s tensor into the other's (the same shape): a broadcast over the primary's pair with ``other``."""
        self.get(PAIR, (self.primary, other)).broadcast(tensor, sorted((self.primary, other)).index(root)).wait()

    def _add_at_primary(self, grads: Any, senders: Sequence[int]) -> None:
        """Primary: each sender's gradients added to its own, in device order; a sender: its part sent."""
        if self.device != self.primary:
            self._over_pair(grads, self.device, self.device)
            return
        buffer = self.torch.empty_like(grads)
        for sender in senders:
            self._over_pair(buffer, sender, sender)
            grads.add_(buffer)

    # ---- weights (the sender/receiver threads' family) ----------------------------------------
    def broadcast_weights(self, tensor: Any, devices: int) -> None:
        if devices > 1:
            self.get(WEIGHTS, range(devices)).broadcast(tensor, self.primary).wait()

    # ---- a step's gradients (main threads) ---------------------------------------------------
    def reduce_step(self, grads: Any, members: Sequence[int], lent: Sequence[int]) -> None:
        """Sums a flat gradient over the step's devices; afterwards every *home* trainer of the step
        holds the sum (a lent device's buffer is left as it was: it only gave). The order of addition is
        fixed: the primary adds the lent devices' gradients in device order, then the home trainers
        all-reduce."""
        lent = sorted(set(lent) & set(members))
        homes = sorted(set(members) - set(lent))
        if self.device in lent or self.device == self.primary:
            self._add_at_primary(grads, lent)
        if self.device in lent or len(homes) < 2:
            return
        if frozenset(homes) == self.home:
            self.get(HOME, homes).allreduce(grads).wait()
            return
        self._star_allreduce(grads, homes)  # the train pool changed since start-up (re-planning)

    def _star_allreduce(self, grads: Any, homes: List[int]) -> None:
        """The parts to the primary, the sum back to each (in device order)."""
        others = [d for d in homes if d != self.primary]
        self._add_at_primary(grads, others)
        for receiver in (others if self.device == self.primary else [self.device]):
            self._over_pair(grads, receiver, self.primary)

    def broadcast_object(self, obj: Any, other: int, root: int) -> Tuple[Any, int]:
        """Any torch-serialisable object between the primary and ``other`` over their pair, from ``root``;
        returns (the object, bytes sent). Rare and off the step's critical path (a device joining the
        train pool for good)."""
        import io

        torch = self.torch
        size = torch.zeros(1, dtype=torch.int64, device=self.tensor_device)
        if self.device == root:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(self.tensor_device)
            size[0] = payload.numel()
        self._over_pair(size, other, root)
        if self.device != root:
            payload = torch.empty(int(size[0]), dtype=torch.uint8, device=self.tensor_device)
        self._over_pair(payload, other, root)
        if self.device == root:
            return obj, int(size[0])
        # tensors land where this worker keeps its state (the sender's cuda:0 is this worker's own GPU too)
        return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location=self.tensor_device,
                          weights_only=True), int(size[0])


def _build(store: Any, kind: str, members: FrozenSet[int], device: int, device_type: str, timeout_s: float) -> Any:
    import torch.distributed as dist

    ranks = sorted(members)
    prefix = dist.PrefixStore(f"{kind}/" + "-".join(map(str, ranks)), store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, ranks.index(device), len(ranks), options)
    return dist.ProcessGroupGloo(prefix, ranks.index(device), len(ranks), timeout)
