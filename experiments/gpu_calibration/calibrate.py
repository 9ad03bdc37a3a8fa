"""Calibrate the analytic performance model on a real accelerator: one prepared script, nothing downloaded.

    python experiments/gpu_calibration/calibrate.py --device cuda --shape 7b --out report.json   # an H200/H100
    python experiments/gpu_calibration/calibrate.py --device cpu --shape tiny                   # the test's check

A random-initialised Qwen2 of the chosen shape, built from a config in bf16 (no weights are fetched),
measured through the same torch path the HF rollout engine uses (``generate`` with a KV cache):

  1. decode step time over running batch sizes and two context lengths (two generated lengths per
     point; the difference is that many decode steps);
  2. forward-only (log-prob) and forward+backward (gradient) tokens/s;
  3. the ceilings: a large device-to-device copy (HBM bandwidth) and a large bf16 matmul (FLOP/s);
then the analytic model of the named hardware (``--hardware``, default H200) is compared with the
measurements and its two free constants are fitted to them: the rollout efficiency (measured decode
step / analytic) and the MFU (measured gradient FLOP/s / peak). Prints the analytic-vs-measured error
per quantity and writes everything as JSON. Well under 10 minutes on one H200 for the 7B shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bidirl.perf.analytic import ARCHITECTURES

SHAPES = {  # Qwen2.5-7B's published architecture, and a tiny one for checking the script on a CPU
    "7b": ARCHITECTURES["7B"],
    "tiny": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=128, vocab_size=512, tie_word_embeddings=False),
}


def timed(torch, device, work, repeats=3) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(shape: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from bidirl.models.footprint import config_from_fields

    config = config_from_fields({**SHAPES[shape], "max_position_embeddings": 4096})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    return torch, model


def decode_points(torch, model, device, batches, contexts, lengths=(8, 24)):
    points = []
    for context in contexts:
        for batch in batches:
            ids = torch.randint(3, model.config.vocab_size, (batch, context), device=device)

            def generate(n):
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, pad_token_id=0)

            short, long_ = (timed(torch, device, lambda n=n: generate(n), repeats=2) for n in lengths)
            points.append({"batch": batch, "context": context + sum(lengths) / 2,
                           "step_s": max(1e-9, (long_ - short) / (lengths[1] - lengths[0]))})
    return points


def token_rates(torch, model, device, batch, length):
    ids = torch.randint(3, model.config.vocab_size, (batch, length), device=device)
    tokens = batch * length

    def forward():
        with torch.no_grad():
            model(input_ids=ids).logits.float().log_softmax(-1)

    def backward():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return tokens / timed(torch, device, forward), tokens / timed(torch, device, backward)


def ceilings(torch, device, copy_bytes, matmul_n):
    source = torch.empty(int(copy_bytes), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_s = timed(torch, device, lambda: target.copy_(source))
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
    matmul_s = timed(torch, device, lambda: a @ a)
    return {"copy_bytes_per_s": 2 * copy_bytes / copy_s, "matmul_flops": 2 * matmul_n ** 3 / matmul_s}


def compare(measured, shape: str, hardware: str):
    """The analytic model of ``hardware`` for this shape against the measurements; fitted constants."""
    from bidirl.models.footprint import config_from_fields, count_model
    from bidirl.perf.analytic import HARDWARE, PerfModel

    spec = count_model(config_from_fields(SHAPES[shape]), shape)  # counted from the config, nothing allocated
    perf = PerfModel(HARDWARE[hardware], spec)
    rows, ratios = [], []
    for p in measured["decode"]:
        a, b = perf.decode_line(p["context"])
        analytic = a + b * p["batch"]
        ratios.append(p["step_s"] / analytic)
        rows.append({"quantity": f"decode step B={p['batch']} ctx={p['context']:.0f}", "analytic": analytic,
                     "measured": p["step_s"]})
    efficiency = statistics.median(ratios)  # the analytic model's rollout_efficiency, fitted
    mfu = 6 * spec.params * measured["train_tokens_per_s"] / perf.hardware.peak_flops
    rows.append({"quantity": "gradient tokens/s (MFU 0.33)", "measured": measured["train_tokens_per_s"],
                 "analytic": 0.33 * perf.hardware.peak_flops / (6 * spec.params)})
    rows.append({"quantity": "HBM bytes/s", "analytic": perf.hardware.hbm_bw, "measured": measured["copy_bytes_per_s"]})
    rows.append({"quantity": "bf16 FLOP/s", "analytic": perf.hardware.peak_flops, "measured": measured["matmul_flops"]})
    for row in rows:
        row["error"] = row["analytic"] / row["measured"] - 1
    return {"rows": rows, "fitted": {"rollout_efficiency": efficiency, "mfu": mfu}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--hardware", default="H200")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    small = args.shape == "tiny"
    torch, model = build(args.shape, args.device)
    report = {"device": args.device, "shape": args.shape,
              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    # (contexts up to 1,024 tokens: 256 sequences of 2,048 hold a 60 GB KV cache, out of memory on an H200)
    report["decode"] = decode_points(torch, model, args.device, (1, 4) if small else (1, 16, 64, 256),
                                     (16,) if small else (256, 1024))
    report["forward_tokens_per_s"], report["train_tokens_per_s"] = token_rates(
        torch, model, args.device, 2 if small else 8, 32 if small else 1024)
    report.update(ceilings(torch, args.device, 1e6 if small else 4e9, 256 if small else 8192))
    report["comparison"] = compare(report, args.shape, args.hardware)
    for row in report["comparison"]["rows"]:
        print(f"{row['quantity']:40s} analytic {row['analytic']:.4g}  measured {row['measured']:.4g}  "
              f"error {row['error']:+.0%}")
    print("fitted:", json.dumps(report["comparison"]["fitted"]))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=2)
    return report


if __name__ == "__main__":
    main()
