"""DeepSpeed ZeRO training engine: the torch engine's loss, DeepSpeed's backward and optimizer step.

Runs on CPU with gloo (DeepSpeed picks its CPU accelerator) and on GPUs with NCCL. The optimizer is
torch's AdamW handed to ``deepspeed.initialize`` -- DeepSpeed's own CPU Adam would JIT-compile for
minutes. For the same reason its CPU shared-memory all-reduce is never built (``skip_shm_comm``).
Micro-batches accumulate into one optimizer step by marking only the last backward of a
batch as the gradient-accumulation boundary, so the GRPO batch semantics are the torch engine's.

Without a process group (a single process, as in the synchronous loop) one is created over the
loopback with world size 1. In the hot-switch runtime every device worker gets its own world-1
DeepSpeed engine (``private_group``): the runtime all-reduces gradients itself over its pre-built
train groups, because train-pool membership changes at run time and DeepSpeed's data-parallel group
cannot. There ZeRO stage 0 works (gradients stay in ``param.grad``); stages 1-3 keep gradients in
DeepSpeed's own partitions and are refused by ``bidirl launch``. ``train.zero_stage`` selects ZeRO 0-3.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Dict

from bidirl.config import PipelineConfig
from bidirl.engines.torch_train import TorchTrainEngine
from bidirl.errors import BidirlError


class DeepSpeedTrainEngine(TorchTrainEngine):
    def __init__(self, model_path: str, cfg: PipelineConfig, private_group: bool = False):
        super().__init__(model_path, cfg)
        try:
            import deepspeed
        except ImportError:
            raise BidirlError("train.engine=deepspeed needs DeepSpeed: pip install deepspeed") from None
        if cfg.cluster.device_type == "cpu":
            skip_shm_comm(deepspeed)
        _ensure_process_group(cfg.cluster.device_type, deepspeed, private_group)
        config: Dict[str, Any] = {
            "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.train.max_grad_norm,
            "zero_optimization": {"stage": cfg.train.zero_stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, self.schedule = deepspeed.initialize(
            model=self.model, optimizer=self.optimizer, lr_scheduler=self.schedule, config=config)

    def _backward(self, loss: Any, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)

    def _optimizer_step(self) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def state_dict(self) -> Dict[str, Any]:
        if self.cfg.train.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
                return {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        return super().state_dict()


def skip_shm_comm(deepspeed: Any) -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce as its communication backend
    starts (about 50 s of g++ on a machine that has not built it before), and only its inference kernels
    call it (``inference_all_reduce``): ZeRO's reduces go through torch.distributed (gloo), and the
    runtime reduces its own train groups. Marked incompatible, DeepSpeed does not build it."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _ensure_process_group(device_type: str, deepspeed: Any, private: bool = False) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if private:  # a world of one on an in-process store (tcp:// would join torchrun's agent store)
        dist.init_process_group("gloo" if device_type == "cpu" else "nccl", store=dist.HashStore(),
                                rank=0, world_size=1)
        return
    if "RANK" not in os.environ:  # a lone process: a world of one on the loopback
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
    deepspeed.init_distributed(dist_backend="gloo" if device_type == "cpu" else "nccl")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
