"""Single-process torch training engine (the runtime issue adds data parallelism over a group).

``compute_grads`` may be called several times before ``apply_grads`` (gradient accumulation, or
gradients computed for part of a batch); ``step`` is both. The policy version counts optimizer steps.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bidirl.config import PipelineConfig
from bidirl.samples import Sample
from bidirl.engines.tokens import completion_slices, pack, token_logprobs
from bidirl.errors import BidirlError
from bidirl.grpo import k3_kl, policy_loss
from bidirl.models.sources import load_model

OPTIMIZER_FILE = "optimizer.pt"


class TorchTrainEngine:
    def __init__(self, model_path: str, cfg: PipelineConfig, private_group: bool = False):
        import torch  # (private_group concerns engines that join a process group; this one never does)

        self.torch = torch
        self.cfg = cfg
        # fp32 master weights and optimizer state whatever model.dtype says; a bf16/fp16 model.dtype is
        # the compute precision (autocast), so that updates below bf16's resolution (RL learning rates
        # on weights of order 1) are kept rather than rounded away
        self.device = torch.device(cfg.cluster.device_type)  # a worker sees its one GPU as cuda:0
        self.model, self.tokenizer = load_model(model_path, "float32")
        self.model.to(self.device).train()
        if cfg.train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        compute = getattr(torch, cfg.model.dtype)
        self.autocast = (lambda: torch.autocast(cfg.cluster.device_type, dtype=compute)) if compute != torch.float32 \
            else contextlib.nullcontext
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.99),
                                           weight_decay=0.0)
        # Linear warm-up: Adam's first bias-corrected steps move every coordinate by the full lr
        # (sign-SGD), which on a small model wipes out more than the first noisy gradients teach.
        warmup = max(1, cfg.train.lr_warmup_steps)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / warmup))
        self.ref = copy.deepcopy(self.model).eval() if cfg.algorithm.kl_coef > 0 else None
        self.version = 0
        self._pending: Dict[str, float] = {}

    def compute_grads(self, batch: Sequence[Sample], total_tokens: Optional[int] = None,
                      total_sequences: Optional[int] = None) -> Dict[str, float]:
        """Accumulates the gradient of the GRPO loss over ``batch`` (micro-batched).

        ``total_tokens``/``total_sequences`` are those of the whole optimizer batch, so that gradients
        computed for parts of a batch (micro-batches, other devices) add up to the batch gradient.
        """
        total_tokens = total_tokens or sum(len(s.completion_ids) for s in batch)
        total_sequences = total_sequences or len(batch)
        stats: Dict[str, float] = {"loss": 0.0, "kl": 0.0}
        micro = self.cfg.train.micro_batch_size
        for start in range(0, len(batch), micro):
            part = batch[start : start + micro]
            loss, part_stats = self._micro_batch_loss(part, total_tokens, total_sequences)
            self._backward(loss, last=start + micro >= len(batch))
            for key, value in part_stats.items():
                weight = 1.0 if key in ("loss", "kl") else len(part) / len(batch)
                stats[key] = stats.get(key, 0.0) + value * weight
        return stats

    def _micro_batch_loss(self, part: Sequence[Sample], total_tokens: int, total_sequences: int):
        torch = self.torch
        ids, attention, mask = pack(part, self.tokenizer.pad_token_id, torch, self.device)
        logp = self._logprobs(self.model, ids, attention)
        behaviour = torch.zeros(logp.shape, dtype=torch.float32)
        for row, sample in enumerate(part):
            first = len(sample.prompt_ids) - 1
            behaviour[row, first : first + len(sample.logprobs)] = torch.tensor(sample.logprobs)
        behaviour = behaviour.to(self.device)
        adv = torch.tensor([s.advantage for s in part], dtype=torch.float32, device=self.device)
        out = policy_loss(logp, behaviour, adv, mask, self.cfg.algorithm.clip_eps,
                          self.cfg.algorithm.loss_aggregation, total_tokens, total_sequences,
                          self.cfg.algorithm.correction)
        loss, stats = out["loss"], dict(out["stats"])
        if self.ref is not None:
            with torch.no_grad():
                ref_logp = self._logprobs(self.ref, ids, attention)
            kl = k3_kl(logp, ref_logp, mask, self.cfg.algorithm.loss_aggregation, total_tokens, total_sequences)
            loss = loss + self.cfg.algorithm.kl_coef * kl
            stats["kl"] = kl.item()
        stats["loss"] = loss.item()
        return loss, stats

    def _logprobs(self, model: Any, ids: Any, attention: Any) -> Any:
        with self.autocast():
            return token_logprobs(model, ids, attention, self.cfg.rollout.temperature, self.torch,
                                  self.cfg.train.logprob_chunk_tokens)

    def _backward(self, loss: Any, last: bool) -> None:
        loss.backward()

    def _optimizer_step(self) -> float:
        # (0 = no clipping, as DeepSpeed and TRL read it: an infinite bound measures the norm and scales nothing)
        bound = self.cfg.train.max_grad_norm or float("inf")
        grad_norm = self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), bound)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def apply_grads(self) -> Dict[str, float]:
        grad_norm = self._optimizer_step()
        self.version += 1
        return {"grad_norm": grad_norm, "lr": self.schedule.get_last_lr()[0], "version": self.version}

    def step(self, batch: Sequence[Sample]) -> Dict[str, float]:
        return {**self.compute_grads(batch), **self.apply_grads()}

    def zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def parameters(self) -> List[Any]:
        return list(self.model.parameters())

    def logprobs(self, batch: Sequence[Sample]) -> List[List[float]]:
        torch = self.torch
        with torch.no_grad():
            ids, attention, _ = pack(batch, self.tokenizer.pad_token_id, torch, self.device)
            return completion_slices(batch, self._logprobs(self.model, ids, attention))

    def state_dict(self) -> Dict[str, Any]:
        # Tied embeddings appear under both names; rollout engines need lm_head.weight explicitly.
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def training_state(self) -> Dict[str, Any]:
        return {"model": self.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(), "version": self.version}

    def adopt_training_state(self, state: Dict[str, Any]) -> None:
        with self.torch.no_grad():
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.version = int(state["version"])

    def save(self, directory: str) -> None:
        """Model (HF format) + optimizer + version, written to a temp folder and renamed into place."""
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        state = {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(), "version": self.version,
                 "rng": self.torch.get_rng_state()}
        try:
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            self.torch.save(state, tmp / OPTIMIZER_FILE)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # (gone already once renamed)

    def load(self, directory: str) -> None:
        model, _ = load_model(directory, "float32")
        try:
            state = self.torch.load(Path(directory) / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        except Exception as exc:
            raise BidirlError(f"{directory}: corrupt checkpoint ({type(exc).__name__}: {exc})") from None
        self.model.load_state_dict(model.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.version = int(state["version"])
        if "rng" in state:
            self.torch.set_rng_state(state["rng"].cpu())
