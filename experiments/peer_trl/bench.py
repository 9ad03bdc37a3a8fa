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
import time
from typing import List

os.environ.setdefault("WANDB_MODE", "disabled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="pipelines/cpu-tiny.yaml")
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
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from bidirl.data import load_problems
    from bidirl.models.sources import load_model, prepare_model
    from bidirl.prompts import format_prompt
    from bidirl.reward import numeric_reward

    model, tokenizer = load_model(prepare_model(cfg).path, cfg.model.dtype)
    train = load_problems(cfg.data, "train")
    rows = [{"prompt": format_prompt(p, cfg.data.prompt_style, tokenizer), "answer": p.answer} for p in train]

    def reward(completions: List[str], answer: List[str], **_: object) -> List[float]:
        return [numeric_reward(c, a, cfg.algorithm.format_reward) for c, a in zip(completions, answer)]

    group, prompts = cfg.rollout.group_size, cfg.train.prompts_per_step
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, use_vllm=False, seed=cfg.seed, max_steps=cfg.train.steps,
            per_device_train_batch_size=prompts * group, num_generations=group, steps_per_generation=1,
            gradient_accumulation_steps=1, max_completion_length=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, learning_rate=cfg.train.lr,
            lr_scheduler_type="constant_with_warmup", warmup_steps=cfg.train.lr_warmup_steps,
            adam_beta2=0.99, weight_decay=0.0, max_grad_norm=cfg.train.max_grad_norm, beta=cfg.algorithm.kl_coef,
            loss_type="dapo" if cfg.algorithm.loss_aggregation == "token_mean" else "grpo",
            scale_rewards="group" if cfg.algorithm.std_normalize else "none",
            logging_steps=max(1, cfg.train.steps // 10), report_to=[], save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
        start = time.time()
        trainer.train()  # generate + train; evaluation below is outside the timed span
        seconds = time.time() - start
    return {"system": "TRL GRPOTrainer (transformers generate)", "seconds": seconds,
            "samples": cfg.train.steps * prompts * group, "accuracy_start": _accuracy(cfg, load_model(
                prepare_model(cfg).path, cfg.model.dtype)[0], tokenizer),
            "accuracy_end": _accuracy(cfg, trainer.model, tokenizer)}


def _accuracy(cfg, model, tokenizer) -> float:
    from bidirl.data import load_problems
    from bidirl.evaluate import greedy_accuracy
    from bidirl.prompts import format_prompt

    held_out = load_problems(cfg.data, "test")
    prompt = lambda p: format_prompt(p, cfg.data.prompt_style, tokenizer)  # noqa: E731
    return greedy_accuracy(model.eval(), tokenizer, held_out, prompt, cfg.rollout.max_new_tokens).accuracy


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
