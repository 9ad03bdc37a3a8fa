"""A hot device worker: rollout engine and training engine both resident, role changed in place.

The worker is a loop over its command queue (see :mod:`bidirl.runtime.mailbox`)::

    loop:  wait for my next command             <- unblocked by the controller's send
           generate | train | sync | switch | evaluate | stop
           post what happened (timings, samples, stats)

Gradients. Members of a train step compute gradients on their slice (scaled by the whole batch's token
count, so slices add up) and all-reduce them over the pre-built group of exactly those members. Every
*home* trainer then applies the same optimizer step to its replica (data parallelism: they stay
identical); a lent rollout device only contributed gradients and keeps no optimizer state, so the
train pool stays the one source of versions.

Weights, in two phases so that trainers never wait for a rollout device's safe point:
  * ``publish`` (primary, main thread): snapshot the parameters and hand them to a sender thread that
    broadcasts them over a dedicated weights group; the main thread goes straight on training.
  * every other member's *receiver thread* takes part in that broadcast into a staging buffer, whatever
    the main thread is doing (generating, say), and reports ``staged``.
  * ``load`` (main thread, at the next safe point = between commands): copy the staged weights into
    the training model and, if serving rollout, into the rollout engine in place.
A device serving training reloads its rollout engine only when it switches back, and only if the
version changed. Switching never touches the disk, restarts nothing and creates no process group.
"""

from __future__ import annotations

import dataclasses
import threading
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
                 store: Any = None, rollout: Any = None, receiver_mailbox: Any = None):
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
        self.train = build_train_engine(cfg, model_path, private_group=store is not None)
        self.params = [p for p in self.train.model.parameters()]
        self.home = plan["roles"][device]
        self.staged: Dict[int, Any] = {}  # version -> flat weights received in the background
        self.staged_ready = threading.Condition()
        if device == self.primary:
            self.save_snapshot(0)  # the starting point of the learning curve
        self.side_mailbox = receiver_mailbox  # own store connection for the sender/receiver thread
        self.receiver: Any = None
        if device != self.primary and devices > 1:
            self.receiver = threading.Thread(target=self.receive_weights, args=(receiver_mailbox,), daemon=True)
            self.receiver.start()
        self.mailbox.post({"op": "ready", "device": device, "startup_s": time.perf_counter() - start,
                           "groups_s": groups_s})

    def run(self) -> None:
        while self.serve_one(self.mailbox.next_command(self.device)):
            pass

    def serve_one(self, command: Dict[str, Any]) -> bool:
        """Runs one command and posts its reply; False after ``stop``."""
        if command["op"] == "stop":
            if self.receiver is not None:  # it got its own stop; a thread blocked in C++ at exit aborts
                self.receiver.join(timeout=self.cfg.launch.collective_timeout_s)
            self.mailbox.post({"op": "stopped", "device": self.device})
            return False
        handlers = {"generate": self.generate, "train": self.train_step, "publish": self.publish,
                    "load": self.load, "switch": self.switch, "evaluate": self.evaluate, "checkpoint": self.checkpoint}
        start = time.perf_counter()
        reply = handlers[command["op"]](command)
        if reply is not None:  # publish answers from its sender thread instead
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
        self.groups.allreduce_sum(grads, members)
        reduce_s = time.perf_counter() - reduce_start
        if self.home != "train":  # a lent rollout device: gradients given, no optimizer state to step
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

    def publish(self, command: Dict[str, Any]) -> None:
        """Primary: broadcast a snapshot of the weights from a sender thread; return at once."""
        flat = self.torch.nn.utils.parameters_to_vector(self.params).detach().clone()

        def send() -> None:
            start = time.perf_counter()
            self.groups.broadcast(flat, command["members"], self.primary, weights=True)
            self.side_mailbox.post({"op": "staged", "device": self.device, "version": command["version"],
                                    "transfer_s": time.perf_counter() - start})

        threading.Thread(target=send, daemon=True).start()
        return None

    def receive_weights(self, mailbox: Any) -> None:
        """Receiver thread: joins each weight broadcast into a staging buffer, whatever the main thread does."""
        numel = sum(p.numel() for p in self.params)
        while True:
            command = mailbox.next_weights_command(self.device)
            if command["op"] == "stop":
                return
            flat = self.torch.empty(numel, dtype=self.params[0].dtype)
            start = time.perf_counter()
            self.groups.broadcast(flat, command["members"], self.primary, weights=True)
            with self.staged_ready:
                self.staged[command["version"]] = flat
                self.staged_ready.notify_all()
            mailbox.post({"op": "staged", "device": self.device, "version": command["version"],
                          "transfer_s": time.perf_counter() - start})

    def load(self, command: Dict[str, Any]) -> Dict[str, Any]:
        """Apply a staged version (the safe point is now: between commands)."""
        version = command["version"]
        with self.staged_ready:
            self.staged_ready.wait_for(lambda: version in self.staged, timeout=self.cfg.launch.collective_timeout_s)
            flat = self.staged.pop(version)
            for old in [v for v in self.staged if v < version]:
                del self.staged[old]
        start = time.perf_counter()
        with self.torch.no_grad():
            self.torch.nn.utils.vector_to_parameters(flat, self.params)
        self.train.version = version
        rollout_s = self.load_rollout() if self.role == "rollout" else 0.0
        return {"op": "load_done", "version": version, "copy_s": time.perf_counter() - start - rollout_s,
                "load_s": rollout_s}

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
