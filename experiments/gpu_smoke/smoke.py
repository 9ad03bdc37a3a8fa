"""The GPU path's smoke test: one command, one GPU, nothing downloaded, under 10 minutes.

    python experiments/gpu_smoke/smoke.py --device cuda --out smoke.json     # a GPU machine
    python experiments/gpu_smoke/smoke.py --device cpu --shape tiny          # its CPU-side path (the test)

A random-initialised Qwen2 of the chosen shape (``1.5b``: Qwen2.5-1.5B's architecture; ``tiny``) is
written to a temporary folder, then, on one device, with the project's own engines:

  1. a collective works (NCCL on cuda, gloo on cpu: a world of one on an in-process store);
  2. in-process vLLM starts at ``--memory-fraction`` and the free device memory drops by about it;
  3. one train step runs beside it on the same device (bf16 autocast on fp32 master weights,
     gradient checkpointing, chunked log-probs); peak memory recorded;
  4. an in-place weight load: a weight's checksum in vLLM equals the trainer's, and the trainer's
     log-probs of freshly generated tokens agree with vLLM's;
  5. three switch cycles (train step, then load into vLLM): no memory growth, median times;
  6. ``bidirl launch`` end to end with one worker per visible GPU (2 workers need 2 GPUs: NCCL refuses
     two ranks on one device), a few steps.

Writes a JSON report with every figure and a pass/fail per check. The CPU run checks everything the
CPU can (no free-memory drop, process RSS instead of device memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bidirl.perf.analytic import ARCHITECTURES

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

SHAPES = {
    "1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": ARCHITECTURES["7B"],
    "tiny": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=128, vocab_size=257, tie_word_embeddings=True),
}
PROMPTS = ["Calculate 3 + 4 =", "Calculate 9 - 2 + 1 =", "Calculate 5 + 5 - 3 =", "Calculate 8 - 6 ="]


def memory(torch, device: str) -> dict:
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return {"free": free, "total": total, "allocated": torch.cuda.memory_allocated()}
    import psutil

    return {"free": None, "total": None, "allocated": psutil.Process().memory_info().rss}


def write_model(shape: str, folder: Path, dtype: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from bidirl.models.footprint import config_from_fields
    from bidirl.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    fields = {**SHAPES[shape], "max_position_embeddings": 4096, "pad_token_id": 0, "eos_token_id": 0, "bos_token_id": 0}
    fields["vocab_size"] = max(fields["vocab_size"], len(tokenizer))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_from_fields(fields)).to(getattr(torch, dtype))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


def check_collective(torch, device: str) -> dict:
    import datetime

    import torch.distributed as dist

    store, tensor = dist.HashStore(), torch.ones(4, device=device)
    if device == "cuda":
        group = dist.ProcessGroupNCCL(store, 0, 1)
    else:
        group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=60))
    group.allreduce(tensor).wait()
    return {"backend": "nccl" if device == "cuda" else "gloo", "ok": tensor.tolist() == [1.0] * 4}


def vllm_weight_sum(llm, name: str):
    """A weight's sum inside vLLM's model, read in process; None where this vLLM hides it."""
    def read(worker):
        for n, p in worker.model_runner.model.named_parameters():
            if n == name:
                return float(p.float().sum())
        return None

    try:
        return llm.collective_rpc(read)[0]
    except Exception:  # internal layout differs across vLLM versions
        return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="1.5b")
    parser.add_argument("--memory-fraction", type=float, default=0.35)
    parser.add_argument("--launch-steps", type=int, default=3)
    parser.add_argument("--out", default="smoke.json")
    args = parser.parse_args(argv)

    import torch

    from bidirl.config import load_config
    from bidirl.engines.build import build_rollout_engine, build_train_engine
    from bidirl.grpo import assign_advantages
    from bidirl.samples import SamplingParams

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    report: dict = {"device": args.device, "shape": args.shape, "checks": {}}
    checks = report["checks"]
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_model(args.shape, Path(scratch) / "model", dtype)
        report["collective"] = check_collective(torch, args.device)
        checks["collective"] = report["collective"]["ok"]

        cfg = load_config(None, [f"model.source={folder}", f"cluster.device_type={args.device}", f"model.dtype={dtype}",
                                 "rollout.engine=vllm", "rollout.max_new_tokens=16", "rollout.max_model_len=1024",
                                 f"rollout.gpu_memory_utilization={args.memory_fraction}", "train.micro_batch_size=8",
                                 "train.gradient_checkpointing=true", "train.lr=1e-5", "train.lr_warmup_steps=1",
                                 "logging.progress=false", "logging.wandb_mode=disabled",
                                 f"model.cache_dir={scratch}/cache"])
        before = memory(torch, args.device)
        start = time.perf_counter()
        rollout = build_rollout_engine(cfg, folder)
        after = memory(torch, args.device)
        report["vllm"] = {"start_s": round(time.perf_counter() - start, 2), "configured_fraction": args.memory_fraction}
        if args.device == "cuda":
            share = (before["free"] - after["free"]) / before["total"]
            report["vllm"]["free_memory_drop_fraction"] = round(share, 3)
            checks["vllm_memory_fraction"] = abs(share - args.memory_fraction) < 0.1

        train = build_train_engine(cfg, folder)
        params = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, seed=0)
        samples = rollout.generate(PROMPTS, params)
        for i, s in enumerate(samples):
            s.reward = float(i % 2)
        assign_advantages(samples)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        stats = train.step(samples)
        report["train_step"] = {"seconds": round(time.perf_counter() - start, 3), "grad_norm": stats["grad_norm"],
                                "peak_allocated": torch.cuda.max_memory_allocated() if args.device == "cuda" else None}
        checks["train_step"] = stats["grad_norm"] > 0

        load_s = rollout.update_weights(train.state_dict(), train.version)
        name = "model.embed_tokens.weight"
        trainer_sum = float(dict(train.model.named_parameters())[name].detach().to(getattr(torch, dtype)).float().sum())
        served_sum = vllm_weight_sum(rollout.llm, name)
        fresh = rollout.generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=1))
        recomputed = train.logprobs(fresh)
        gaps = [abs(a - b) for s, r in zip(fresh, recomputed) for a, b in zip(s.logprobs, r)]
        gap = sum(gaps) / max(1, len(gaps))
        report["weight_load"] = {"seconds": round(load_s, 4), "trainer_checksum": trainer_sum,
                                 "vllm_checksum": served_sum, "mean_abs_logprob_gap": round(gap, 5)}
        checks["weight_load_checksum"] = (served_sum is None
                                          or abs(served_sum - trainer_sum) <= 1e-3 * max(1.0, abs(trainer_sum)))
        checks["weight_load_logprobs"] = gap < (0.05 if dtype == "bfloat16" else 1e-3)

        cycles = []
        for _ in range(3):
            t0 = time.perf_counter()
            train.step(samples)
            t1 = time.perf_counter()
            rollout.update_weights(train.state_dict(), train.version)
            cycles.append({"to_train_s": t1 - t0, "to_rollout_s": time.perf_counter() - t1,
                           "allocated": memory(torch, args.device)["allocated"]})
        growth = cycles[-1]["allocated"] - cycles[0]["allocated"]
        report["switch_cycles"] = {"train_step_median_s": round(statistics.median(c["to_train_s"] for c in cycles), 4),
                                   "load_median_s": round(statistics.median(c["to_rollout_s"] for c in cycles), 4),
                                   "memory_growth_bytes": growth}
        checks["no_memory_growth"] = growth <= (64 << 20 if args.device == "cuda" else 256 << 20)
        del rollout, train
        if args.device == "cuda":
            torch.cuda.empty_cache()

        workers = torch.cuda.device_count() if args.device == "cuda" else 2
        bidirl = str(Path(sys.executable).with_name("bidirl"))
        command = [bidirl, "launch", str(PIPELINES / "cpu-tiny.yaml"), f"model.source={folder}", f"model.dtype={dtype}",
                   f"cluster.device_type={args.device}", f"cluster.devices={workers}", "rollout.engine=vllm",
                   "rollout.max_model_len=1024", f"rollout.gpu_memory_utilization={args.memory_fraction}",
                   "train.gradient_checkpointing=true", f"launch.mode={'async' if workers > 1 else 'sync'}",
                   f"train.steps={args.launch_steps}", "train.prompts_per_step=16", "train.micro_batch_size=16",
                   "launch.chunk_groups=8", "logging.eval_every=0", "logging.wandb_mode=disabled",
                   "logging.progress=false", f"output_dir={scratch}/runs", f"model.cache_dir={scratch}/cache"]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        summaries = list(Path(scratch, "runs").glob("*/summary.json"))
        summary = json.loads(summaries[0].read_text()) if summaries else {}
        report["launch"] = {"workers": workers, "returncode": done.returncode,
                            "seconds": round(time.perf_counter() - start, 1),
                            "steps": summary.get("steps"), "samples_per_s": summary.get("samples_per_s"),
                            "stderr_tail": done.stderr[-2000:] if done.returncode else ""}
        checks["launch"] = done.returncode == 0 and summary.get("steps") == args.launch_steps
    report["passed"] = all(checks.values())
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"checks": checks, "passed": report["passed"]}, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
