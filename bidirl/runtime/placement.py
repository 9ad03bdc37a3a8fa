"""Which accelerator each torchrun process owns: one GPU per device worker, none for the controller.

torchrun gives every node's processes a contiguous block of global ranks. Rank 0 is the controller, so
the node whose block starts at 0 runs one process more than it has workers. ``bidirl launch`` starts
that node with ``cluster.devices_per_node + 1`` processes and the others with ``devices_per_node``
(static rendezvous, so ``--node-rank 0`` is the node that gets rank 0). A worker's GPU is its local
rank, less one on the controller's node::

    node 0 (ranks 0..4):   rank 0 controller -   rank 1 device 0 gpu 0   ...   rank 4 device 3 gpu 3
    node 1 (ranks 5..8):   rank 5 device 4 gpu 0   ...                          rank 8 device 7 gpu 3

Each worker then sees only its GPU (``CUDA_VISIBLE_DEVICES``), as ``cuda:0``: the trainer, vLLM's
in-process executor and DeepSpeed (``LOCAL_RANK=0``) cannot open another device by accident. The
controller sees none. Pure logic here; :func:`claim` is the one place that touches the environment.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional, Sequence

from bidirl.errors import BidirlError


@dataclass(frozen=True)
class Placement:
    rank: int
    local_rank: int
    node_first_rank: int  # the first global rank on this process's node
    device: Optional[int]  # the worker's device index (rank - 1); None for the controller
    gpu: Optional[int]  # the local accelerator index it owns; None for the controller and on CPU

    @property
    def is_controller(self) -> bool:
        return self.device is None


def place(rank: int, local_rank: int, device_type: str) -> Placement:
    """The placement of one process from its torchrun ranks."""
    first = rank - local_rank
    device = None if rank == 0 else rank - 1
    gpu = None
    if device is not None and device_type == "cuda":
        gpu = local_rank - 1 if first == 0 else local_rank  # the controller holds local rank 0 on its node
    return Placement(rank, local_rank, first, device, gpu)


def placement_from_environment(device_type: str, env: Mapping[str, str] = os.environ) -> Placement:
    return place(int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])), device_type)


def claim(placement: Placement, device_type: str, env: MutableMapping[str, str] = os.environ,
          visible: Optional[int] = None) -> None:
    """Makes the process see only its own accelerator; before anything initialises CUDA.

    ``visible``: how many GPUs the node has (``torch.cuda.device_count()`` before masking)."""
    if device_type != "cuda":
        return
    if placement.is_controller:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the controller schedules; it never allocates device memory
        return
    listed = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    available = len(listed) if listed else visible
    if available is not None and placement.gpu >= available:
        extra = " (this node also runs the controller, rank 0: give it one process more than it has GPUs)" \
            if placement.node_first_rank == 0 else ""
        raise BidirlError(f"device {placement.device} (rank {placement.rank}, local rank {placement.local_rank}) "
                          f"needs GPU {placement.gpu} but this node has {available}{extra}")
    env["CUDA_VISIBLE_DEVICES"] = listed[placement.gpu] if listed else str(placement.gpu)
    env["LOCAL_RANK"] = "0"  # DeepSpeed and vLLM pick the device from it: the only visible one


def gpus_on_this_node() -> Optional[int]:
    """NVIDIA GPUs the driver lists, read without initialising CUDA (torch caches its count once asked,
    which would survive the masking); None where the driver is absent."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return None


def check_node(workers_here: int, controller_here: bool, gpus: Optional[int],
               visible: Optional[str] = None) -> None:
    """Before torchrun starts: this node's device workers each need a GPU of their own (the controller
    needs none). ``gpus``: the driver's count (None: unknown, nothing to check); ``visible``:
    ``CUDA_VISIBLE_DEVICES`` if set, which narrows it."""
    listed = [d for d in (visible or "").split(",") if d.strip()]
    available = len(listed) if visible is not None and visible.strip() else gpus
    if available is None or workers_here <= available:
        return
    extra = " (one more process runs the controller, which uses no GPU)" if controller_here else ""
    raise BidirlError(f"this node would run {workers_here} device workers{extra} but has {available} "
                      f"GPU{'s' if available != 1 else ''}{' visible (CUDA_VISIBLE_DEVICES)' if listed else ''}: "
                      "lower cluster.devices or --nproc-per-node, or add nodes (--nnodes)")


def describe(placement: Placement, device_type: str) -> str:
    """One row of the start-up mapping table, as the worker sees itself."""
    where = f"gpu {placement.gpu} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})" \
        if device_type == "cuda" else "cpu"
    return f"device {placement.device}: rank {placement.rank} on {socket.gethostname()}, {where}"


def mapping_table(rows: Sequence[str]) -> str:
    return "device placement:\n" + "\n".join(f"  {row}" for row in rows)
