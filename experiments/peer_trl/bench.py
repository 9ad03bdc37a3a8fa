"""bidirl's synchronous GRPO vs TRL's GRPOTrainer, side by side in one run, at equal samples.

Both start from the same cached tiny base model and see the same prompts-per-step x group-size samples
for the same number of optimizer steps; both are evaluated by bidirl.evaluate.greedy_accuracy on the
same held-out problems. TRL generates with transformers on the CPU (its vLLM colocate mode crashes at
the first weight sync on CPU), bidirl with the engine named in the pipeline (vLLM by default here).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import List

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

os.environ.setdefault("WANDB_MODE", "disabled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default=str(PIPELINES / "cpu-tiny.yaml"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("overrides", nargs="*", help="key=value overrides for both systems")
    args = parser.parse_args()

    from bidirl.config import load_config
    from bidirl.runtime_env import prepare_process

    overrides = [f"train.steps={args.steps}", "logging.wandb_mode=disabled", "logging.progress=false",
                 f"logging.eval_every={args.steps}", *args.overrides]
    cfg = load_config(args.pipeline, overrides)
    prepare_process(cfg.cluster.device_type)
    rows = [run_bidirl(cfg), run_trl(cfg)]
    print_table(rows, cfg)


def run_bidirl(cfg) -> dict:
    from bidirl.models.sources import prepare_model
    from bidirl.rundir import RunDir
    from bidirl.runtime.local import train_in_process

    model = prepare_model(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(cfg, root=tmp)
        result = train_in_process(cfg, run, model.path)
        run.close()
    seconds = result["rl_seconds"]  # generate + train + sync; engine start-up and evaluations excluded
    samples = cfg.train.steps * cfg.train.prompts_per_step * cfg.rollout.group_size
    return {"system": f"bidirl sync ({cfg.rollout.engine})", "seconds": seconds, "samples": samples,
            "accuracy_start": result["accuracy_start"], "accuracy_end": result["accuracy_end"]}


def run_trl(cfg) -> dict:
    import torch

    from bidirl.peers import train_with_trl

    with tempfile.TemporaryDirectory() as tmp:
        summary = train_with_trl(cfg, Path(tmp), threads=torch.get_num_threads())
    return {"system": "TRL GRPOTrainer (transformers generate)", "seconds": summary["rl_seconds"],
            "samples": cfg.train.steps * cfg.train.prompts_per_step * cfg.rollout.group_size,
            "accuracy_start": summary["accuracy_start"], "accuracy_end": summary["accuracy_end"]}


def print_table(rows: List[dict], cfg) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GRPO peers: {cfg.train.steps} steps x {cfg.train.prompts_per_step} prompts x "
                        f"{cfg.rollout.group_size} samples, same base model and reward")
    for column in ("system", "seconds", "samples/s", "ratio", "greedy acc. start", "greedy acc. end"):
        table.add_column(column)
    base = rows[-1]["samples"] / rows[-1]["seconds"]
    for row in rows:
        rate = row["samples"] / row["seconds"]
        table.add_row(row["system"], f"{row['seconds']:.1f}", f"{rate:.1f}", f"{rate / base:.2f}x",
                      f"{row['accuracy_start']:.1%}", f"{row['accuracy_end']:.1%}")
    Console().print(table)


if __name__ == "__main__":
    main()
