"""A hot device worker: rollout engine and training engine both resident, role changed in place.

The worker is a loop over its command queue (see :mod:`bidirl.runtime.mailbox`)::

    loop:  wait for my next command             <- unblocked by the controller's send
           generate | train | sync | switch | evaluate | stop
           post what happened (timings, samples, stats)

Weights. Every device's training model receives every weight sync (a broadcast rooted at the primary
trainer into the model's parameters), so it is always current; a device serving rollout also reloads
its rollout engine in place right after the sync. A device serving training leaves its rollout engine
alone and reloads it only when it switches back, and only if the version changed. Switching therefore
never touches the disk, never restarts anything and never creates a process group.

Gradients. Members of a train step compute gradients on their slice (scaled by the whole batch's token
count, so slices add up), sum them into the primary trainer (``reduce`` over the pre-built group of
exactly those members), and only the primary applies the optimizer: it is the one source of versions.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Dict

from bidirl.config import PipelineConfig
from bidirl.engines import build_rollout_engine, build_train_engine
from bidirl.engines.protocols import SamplingParams
from bidirl.reward import numeric_reward
from bidirl.runtime.groups import Groups


class Worker:
    def __init__(self, cfg: PipelineConfig, mailbox: Any, device: int, devices: int, model_path: str,
                 store: Any = None, rollout: Any = None):
        import torch

        self.torch, self.device, self.cfg = torch, device, cfg
        self.mailbox = mailbox
        plan = self.mailbox.read("plan")
        self.primary, self.role, self.run_path = plan["primary"], plan["roles"][device], Path(plan["run_path"])
        start = time.perf_counter()
        self.groups = Groups(store, device, devices, self.primary, cfg.cluster.device_type,
                             cfg.launch.collective_timeout_s)
        groups_s = time.perf_counter() - start
        own_seed = dataclasses.replace(cfg, seed=cfg.seed + 1000 * device)  # distinct sampling per device
        self.rollout = rollout or build_rollout_engine(own_seed, model_path)
        self.train = build_train_engine(cfg, model_path)
        self.params = [p for p in self.train.model.parameters()]
        if device == self.primary:
            self.save_snapshot(0)  # the starting point of the learning curve
        self.mailbox.post({"op": "ready", "device": device, "startup_s": time.perf_counter() - start,
                           "groups_s": groups_s})

    def run(self) -> None:
        while self.serve_one(self.mailbox.next_command(self.device)):
            pass

    def serve_one(self, command: Dict[str, Any]) -> bool:
        """Runs one command and posts its reply; False after ``stop``."""
        if command["op"] == "stop":
            self.mailbox.post({"op": "stopped", "device": self.device})
            return False
        handlers = {"generate": self.generate, "train": self.train_step, "sync": self.sync,
                    "switch": self.switch, "evaluate": self.evaluate, "checkpoint": self.checkpoint}
        start = time.perf_counter()
        reply = handlers[command["op"]](command)
        self.mailbox.post({**reply, "device": self.device, "seconds": time.perf_counter() - start})
        return True

    # ---- commands -----------------------------------------------------------------------------
    def generate(self, command: Dict[str, Any]) -> Dict[str, Any]:
        assert self.role == "rollout", f"device {self.device} asked to generate while serving {self.role}"
        samples = self.rollout.generate(command["prompts"], SamplingParams(**command["params"]))
        for sample in samples:
            sample.reward = numeric_reward(sample.text, command["answers"][sample.prompt_index],
                                           self.cfg.algorithm.format_reward)
            sample.extra["group"] = command["first_group"] + sample.prompt_index
        return {"op": "chunk_done", "chunk": command["chunk"], "samples": samples, "version": self.rollout.version}

    def train_step(self, command: Dict[str, Any]) -> Dict[str, Any]:
        assert self.role == "train", f"device {self.device} asked to train while serving {self.role}"
        torch, members = self.torch, command["members"]
        gap = self.logprob_gap(command.get("probe") or [])
        compute_start = time.perf_counter()
        stats = (self.train.compute_grads(command["samples"], command["total_tokens"], command["total_sequences"])
                 if command["samples"] else {})
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        compute_s = time.perf_counter() - compute_start
        reduce_start = time.perf_counter()
        self.groups.reduce_sum(grads, members, self.primary)
        reduce_s = time.perf_counter() - reduce_start
        if self.device != self.primary:
            self.train.optimizer.zero_grad(set_to_none=True)
            return {"op": "train_done", "compute_s": compute_s, "reduce_s": reduce_s}
        offset = 0
        for p in self.params:
            p.grad = grads[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        stats.update(self.train.apply_grads(), **gap)
        if command.get("snapshot"):
            self.save_snapshot(self.train.version)
        return {"op": "train_done", "version": self.train.version, "stats": stats,
                "compute_s": compute_s, "reduce_s": reduce_s}

    def sync(self, command: Dict[str, Any]) -> Dict[str, Any]:
        torch = self.torch
        flat = torch.nn.utils.parameters_to_vector(self.params).detach().contiguous()
        start = time.perf_counter()
        self.groups.broadcast(flat, command["members"], self.primary)
        transfer_s = time.perf_counter() - start
        if self.device != self.primary:
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(flat, self.params)
            self.train.version = command["version"]
        load_s = self.load_rollout() if self.role == "rollout" else 0.0
        return {"op": "sync_done", "version": self.train.version, "transfer_s": transfer_s, "load_s": load_s}

    def switch(self, command: Dict[str, Any]) -> Dict[str, Any]:
        start = time.perf_counter()
        self.role = command["role"]
        load_s = self.load_rollout() if self.role == "rollout" else 0.0
        join_start = time.perf_counter()
        if self.role == "train" and self.device != self.primary:
            self.groups.get([self.primary, self.device])  # pre-built at start: joining is a lookup
        join_s = time.perf_counter() - join_start
        return {"op": "switch_done", "role": self.role, "load_s": load_s, "join_s": join_s,
                "switch_s": time.perf_counter() - start, "version": self.train.version}

    def evaluate(self, command: Dict[str, Any]) -> Dict[str, Any]:
        from bidirl.runtime.evaluation import evaluate_snapshots

        return {"op": "eval_done", "results": evaluate_snapshots(self.cfg, self.rollout, self.train, command["snapshots"])}

    def checkpoint(self, command: Dict[str, Any]) -> Dict[str, Any]:
        self.train.save(command["path"])  # HF weights + optimizer + version, written atomically
        return {"op": "checkpoint_done", "path": command["path"], "version": self.train.version}

    # ---- checks -------------------------------------------------------------------------------
    def logprob_gap(self, probe: list) -> Dict[str, float]:
        """Mean |trainer - behaviour| log-prob on a few samples of the batch, before the step.

        For samples generated with the weights being trained (staleness 0) it is zero up to numerics:
        a live check that weight syncs reach the rollout engines."""
        fresh = [s for s in probe if s.version == self.train.version and s.completion_ids]
        if not fresh:
            return {}
        recomputed = self.train.logprobs(fresh)
        gaps = [abs(a - b) for s, lp in zip(fresh, recomputed) for a, b in zip(lp, s.logprobs)]
        return {"fresh_logp_gap": sum(gaps) / len(gaps)}

    # ---- helpers ------------------------------------------------------------------------------
    def load_rollout(self) -> float:
        """Loads the training model's weights into the rollout engine, in place, if they changed."""
        if self.rollout.version == self.train.version:
            return 0.0
        return self.rollout.update_weights(self.train.state_dict(), self.train.version)

    def save_snapshot(self, version: int) -> None:
        path = self.run_path / "snapshots" / f"v{version:05d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        self.torch.save({k: v.clone() for k, v in self.train.state_dict().items()}, tmp)
        tmp.replace(path)
