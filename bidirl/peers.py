"""Peer systems that run for real beside bidirl's reproduced baselines: TRL's ``GRPOTrainer``.

``bidirl compare --baselines ...,trl`` runs TRL itself (an optional extra, ``pip install 'bidirl[trl]'``)
on the same base model, problems, reward, group size, prompts per step, learning rate, warm-up,
temperature and number of optimizer steps -- so on the same number of samples -- and evaluates it with
bidirl's own held-out greedy evaluation. TRL generates with transformers (its vLLM colocate mode crashes
at the first weight sync on CPU) in one process, using as many threads as the compared runs have
devices, so it gets the same cores.

Run as ``python -m bidirl.peers FOLDER PIPELINE [key=value ...]``: it writes ``FOLDER/metrics.jsonl``
(the batch reward per step; the held-out accuracy before and after) and ``FOLDER/summary.json`` in the
shape a live run's summary has, which is what the comparison reads.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List

from bidirl.errors import BidirlError

if TYPE_CHECKING:
    from bidirl.config import PipelineConfig

def check_installed(name: str) -> None:
    try:
        __import__(name)
    except ImportError:
        raise BidirlError(f"--baselines {name}: the {name} package is not installed (pip install 'bidirl[{name}]', "
                          f"or pip install trl==1.16.0)") from None


def train_with_trl(cfg: "PipelineConfig", folder: Path, threads: int = 1) -> Dict[str, Any]:
    """TRL's GRPO on ``cfg``'s workload; writes and returns the summary (timed: generate + train)."""
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from bidirl.data import load_problems
    from bidirl.models.sources import load_model, prepare_model
    from bidirl.prompts import PromptBuilder
    from bidirl.reward import numeric_reward

    torch.set_num_threads(threads)
    path = prepare_model(cfg).path
    model, tokenizer = load_model(path, cfg.model.dtype)
    prompt = PromptBuilder.for_run(cfg.data, tokenizer)  # the run's own prompts, few-shot examples included
    rows = [{"prompt": prompt(p), "answer": p.answer} for p in load_problems(cfg.data, "train")]

    def reward(completions: List[str], answer: List[str], **_: object) -> List[float]:
        return [numeric_reward(c, a, cfg.algorithm.format_reward) for c, a in zip(completions, answer)]

    folder.mkdir(parents=True, exist_ok=True)
    accuracy_start = held_out_accuracy(cfg, model, tokenizer)
    group, prompts = cfg.rollout.group_size, cfg.train.prompts_per_step
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=cfg.cluster.device_type == "cpu", use_vllm=False, seed=cfg.seed,
            max_steps=cfg.train.steps, per_device_train_batch_size=prompts * group, num_generations=group,
            steps_per_generation=1, gradient_accumulation_steps=1, max_completion_length=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, learning_rate=cfg.train.lr,
            lr_scheduler_type="constant_with_warmup", warmup_steps=cfg.train.lr_warmup_steps,
            adam_beta2=0.99, weight_decay=0.0, max_grad_norm=cfg.train.max_grad_norm, beta=cfg.algorithm.kl_coef,
            loss_type="dapo" if cfg.algorithm.loss_aggregation == "token_mean" else "grpo",
            scale_rewards="group" if cfg.algorithm.std_normalize else "none",
            logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
        start = time.time()
        trainer.train()
        seconds = time.time() - start
    accuracy_end = held_out_accuracy(cfg, trainer.model, tokenizer)
    samples = cfg.train.steps * prompts * group
    with open(folder / "metrics.jsonl", "w") as out:
        out.write(json.dumps({"step": 0, "time_s": 0.0, "eval_accuracy": accuracy_start}) + "\n")
        for entry in trainer.state.log_history:
            if "reward" in entry and "step" in entry:
                out.write(json.dumps({"step": entry["step"], "reward_mean": entry["reward"]}) + "\n")
        out.write(json.dumps({"step": cfg.train.steps, "time_s": round(seconds, 3),
                              "eval_accuracy": accuracy_end}) + "\n")
    summary = {"status": "ok", "policy": "trl", "devices": 1, "threads": threads, "homes": [],
               "steps": cfg.train.steps, "rl_seconds": round(seconds, 2), "samples_per_s": round(samples / seconds, 2),
               "time_breakdown": {}, "switches": {"count": 0}, "leases": {},
               "accuracy_start": accuracy_start, "accuracy_end": accuracy_end}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def held_out_accuracy(cfg: "PipelineConfig", model: Any, tokenizer: Any) -> float:
    from bidirl.data import load_problems
    from bidirl.evaluate import greedy_accuracy
    from bidirl.prompts import PromptBuilder

    held_out = load_problems(cfg.data, "test")
    prompt = PromptBuilder.for_run(cfg.data, tokenizer)
    return greedy_accuracy(model.eval(), tokenizer, held_out, prompt, cfg.rollout.max_new_tokens).accuracy


def main(argv: List[str]) -> int:
    from bidirl.config import load_config
    from bidirl.runtime_env import prepare_process

    folder, pipeline, *overrides = argv
    cfg = load_config(pipeline, overrides)
    prepare_process(cfg.cluster.device_type)
    try:
        train_with_trl(cfg, Path(folder), threads=max(2, cfg.cluster.devices))
    except BidirlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
