"""``bidirl profile``: measure this machine's devices through the real engines and fit a performance model.

What is measured, on one device in this process, with the pipeline's own engines, model, prompts and
sampling settings (one thread, as each live device worker runs):

* decode: batches of B sequences generated to a fixed length L (EOS ignored) for two lengths, each call
  on prompts not seen before (as a live chunk's are: none served from the prefix cache); the difference
  gives the time of one decode step at batch B and the mean context, the rest the prefill. The sweep
  is taken five times over, each point the median of its passes, so that a slow minute of the host
  falls on every point alike;
* the task's own response lengths: a normal sampled rollout of the prompts the run itself will draw
  first (the run's seeded sampler), ``LENGTH_BATCHES`` whole batches of them, kept as measured groups
  that the simulator replays (with a log-normal fit beside them), and the share of samples the
  trainer will train (groups whose rewards differ). Several batches, so a task whose lengths spread
  10x is measured on more than one batch's draw. (These are the base model's lengths: a live run's
  drift as the policy learns -- cpu-long's 85 -> ~50 tokens in 30 steps -- is not foreseen here);
* training: one optimizer step on a quarter, a half and all of twice the samples a step will train (the
  batch's share in groups whose rewards differ, as just measured; at most the whole batch), and a
  forward-only log-prob pass over the same parts (what recomputing old or reference log-probs costs).
  A live step trains only those groups -- ~10% of a cpu-long batch -- and a line fitted on whole
  batches left its intercept to decide the prediction there (off 2-4x both ways);
* warm-up: a fresh rollout engine's first call (a token or two) and a fresh trainer's first step (one
  micro-batch), each against the same call warm -- what a live device's first chunk and first
  micro-batch of a run cost beyond their steady speed (:func:`first_call`);
* what a live train step costs beyond its gradient passes and optimizer step: each pulled
  micro-batch's round trip through a real c10d store, and the finish's own work (the log-prob probe,
  the gradient gather and put-back, the checksum), through the live worker's code (:func:`step_overhead`);
* what each request costs beyond its prefill and decode steps: chunks generated as a live device does
  it, one in each pass of the decode sweep, against the fits' time for the same lengths, and each
  request's scoring and reply to the controller (:func:`request_overhead`);
* weights: loading a full weight set into the rollout engine, and flattening it for publishing;
* switches, as the live worker does them: into rollout it reloads the weights into the engine (the
  same work as a load, so the same figure), into training it looks up a process group built at
  start-up (nothing to measure: recorded as ~0);
* where the pipeline's devices share one host (CPU devices are processes on one machine, sharing its
  memory bandwidth and caches), how much slower each stage runs while another device works: a
  training step beside a process that decodes, a decode step beside one that trains, and a training
  step beside one that trains too (a lent device joining the step), and a decode step beside one that
  decodes too (both devices of a colocated step generating, or a lent trainer) -- the ``co_running``
  factors, each the median ratio of alternating alone/beside pairs (see :func:`paired_slowdown`),
  training timed on a quarter of the batch (the same micro-batches; the whole one took half of the
  demo's profile). The
  neighbour builds its engines while this process builds its own (nothing is timed until both are
  ready; it idles through every other timing).

Writes ``profile.json`` (raw points, fitted coefficients, each fit's error) and ``profile.png``
(points against the fitted curves), with where the profile's own time went (``meta.seconds``).
``bidirl plan`` and ``bidirl simulate`` (``sim.profile``) use it.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError
from bidirl.perf.fitted import (SWITCH_KEYS, WEIGHT_KEYS, Fit, Profile, fit_decode, fit_line, fit_workload,
                                measured_with)
from bidirl.samples import Sample, SamplingParams

REPEATS = 3  # each timing is the median of this many runs
DECODE_PASSES = 5  # decode steps come from a difference of two timings: more of them, spread in time
TRAIN_REPEATS = 5  # one training step on the same batch varies by +-15% here within a minute
FRESH_PROMPTS = 4096  # distinct prompts the decode timings go through (cpu-long's profile uses ~1,900)
LENGTH_BATCHES = 4  # whole batches of the run's own first prompts whose response lengths are measured


def median_time(work: Callable[[], Any], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


WARMUP_SAMPLING = SamplingParams(n=1, max_new_tokens=2, temperature=1.0, ignore_eos=True)  # a token or two


def first_call(work: Callable[[], Any]) -> "tuple[float, float]":
    """(seconds, warm seconds) of a fresh engine's first call and of the same call after it (median of
    ``REPEATS``). An engine's first call pays a one-time warm-up (about 2 s for the CPU rollout engine,
    measured the same after a one-token call as after a whole chunk: it is not per batch shape), which
    a live device pays on its first chunk or micro-batch of a run."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start, median_time(work)


class PartClock:
    """Seconds spent in each part of the profile, in order."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}
        self._since = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = round(now - self._since, 2)
        self._since = now


def batch_sizes(cfg: PipelineConfig) -> List[int]:
    """Running batches to measure: up to the largest chunk a device generates at once, in prompt groups."""
    largest = max(1, cfg.launch.chunk_groups)
    sizes = sorted({max(1, largest // 16), max(1, largest // 4), max(1, largest // 2), largest})
    return sizes


def shares_a_host(cfg: PipelineConfig) -> bool:
    """CPU devices of one run are processes on one machine: they slow each other down (GPUs hardly do)."""
    return cfg.cluster.device_type == "cpu" and cfg.cluster.devices > 1


def sampling_of(cfg: PipelineConfig) -> SamplingParams:
    """The pipeline's rollout sampling settings."""
    return SamplingParams(n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                          temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)


def rollout_batch(cfg: PipelineConfig, rollout: Any, problems: list) -> "Dict[int, List[Sample]]":
    """One sampled group per problem, rewarded, by group."""
    from bidirl.prompts import PromptBuilder
    from bidirl.reward import numeric_reward

    prompt = PromptBuilder.for_run(cfg.data, rollout.tokenizer)
    samples: List[Sample] = rollout.generate([prompt(p) for p in problems], sampling_of(cfg))
    by_group: Dict[int, List[Sample]] = {}
    for sample in samples:
        sample.reward = numeric_reward(sample.text, problems[sample.prompt_index].answer)
        by_group.setdefault(sample.prompt_index, []).append(sample)
    return by_group


def trainable(by_group: "Dict[int, List[Sample]]", std_normalize: bool) -> List[Sample]:
    """The batch with its advantages; every sample informative (a zero advantage gets +-1), so a training
    step on it trains what it says."""
    from bidirl.grpo import assign_advantages

    for group in by_group.values():
        assign_advantages(group, std_normalize)
        for i, sample in enumerate(group):
            sample.advantage = sample.advantage or (1.0 if i % 2 else -1.0)
    return [s for group in by_group.values() for s in group]


def profile_devices(cfg: PipelineConfig, out: Path, advance: Callable[..., None] = lambda *a, **k: None) -> Profile:
    import torch

    from bidirl.data import PromptSampler, load_problems
    from bidirl.engines.build import build_rollout_engine, build_train_engine
    from bidirl.models.sources import prepare_model
    from bidirl.prompts import PromptBuilder

    model = prepare_model(cfg)  # before the thread change: a base model is built as `bidirl run` builds it
    parts = PartClock()  # where the profile's own time goes (profile.json's meta)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a live device worker runs
    problems = load_problems(cfg.data, "train")
    groups = min(len(problems), batch_groups(cfg))
    # the other device of this host (co-running factors, below) builds its engines while this process
    # builds its own: nothing is timed before both are ready, and it idles through every timing until then
    neighbour = (Neighbour(cfg, model.path, problems[: min(cfg.launch.chunk_groups, groups)])
                 if shares_a_host(cfg) else None)
    try:
        if neighbour is not None:
            neighbour.start()
        rollout = build_rollout_engine(cfg, model.path)
        trainer = build_train_engine(cfg, model.path)
        prompt = PromptBuilder.for_run(cfg.data, rollout.tokenizer)
        G = cfg.rollout.group_size
        if neighbour is not None:
            neighbour.wait_ready()
        parts.lap("engines")
        warmup = {"rollout": first_call(lambda: rollout.generate([prompt(problems[0])], WARMUP_SAMPLING))}
        advance()

        # decode steps: two generated lengths per batch; the difference is (L2 - L1) decode steps. Lengths
        # stay inside the model's context window (prompt included), which a long-response task nears.
        fresh = FreshPrompts([prompt(p) for p in problems[:FRESH_PROMPTS]], rollout.tokenizer)
        room = context_window(model.path) - fresh.longest - 1
        # (a wide difference: two generate calls' overheads do not cancel exactly, and 12 steps of
        # difference left the fit 30-40% off on a long-response task)
        short = max(4, min(cfg.rollout.max_new_tokens, room // 6))
        long_ = max(4 * short, min(4 * cfg.rollout.max_new_tokens, room // 2))
        longest = min(4 * long_, room)
        largest = max(batch_sizes(cfg))
        points = [(g, (short, long_)) for g in batch_sizes(cfg)]
        if longest > long_:
            points.append((largest, (long_, longest)))  # a longer context too

        def decode_step(groups: int, short: int, long_: int) -> "tuple[float, Dict[int, float], Dict[int, float]]":
            """(seconds per decode step, and by length: the call's seconds, its prompts' mean tokens): one
            call of each length, each on prompts the engine has not seen (a prompt seen before is served
            from the prefix cache, and the two calls' prefill would differ)."""
            seconds, prompt_tokens = {}, {}
            for length in (short, long_):
                texts, tokens = fresh.next(groups)
                fixed = SamplingParams(n=G, max_new_tokens=length, temperature=1.0, ignore_eos=True)
                start = time.perf_counter()
                rollout.generate(texts, fixed)
                seconds[length], prompt_tokens[length] = time.perf_counter() - start, statistics.mean(tokens)
            return max(1e-9, (seconds[long_] - seconds[short]) / (long_ - short)), seconds, prompt_tokens

        # the sweep is taken DECODE_PASSES times over and each point is the median of its passes: this
        # machine's speed drifts by 15% within minutes, and a point timed in one stretch (as all five
        # repeats once were) took a slow minute alone -- one profile's largest batch read 37.6 ms where
        # the same engine read 26-29 ms later in the same profile, and the fit's batch term followed it.
        # Each pass also generates one chunk as a live device does (sampled lengths, EOS), on problems the
        # engine has not seen (the split's last: the timings above go through its first), which the fits
        # are checked against below -- in the same minutes as the points they are fitted to
        chunk = min(cfg.launch.chunk_groups, groups)
        unseen = problems[-DECODE_PASSES * chunk:]  # (a split smaller than that: all of it)
        real_chunks: List["tuple[float, List[Sample], list]"] = []  # (seconds, samples, problems)
        passes: List[List[Any]] = [[] for _ in points]
        for index in range(DECODE_PASSES):
            for timings, (running, (short, long_)) in zip(passes, points):
                timings.append(decode_step(running, short, long_))
            part = unseen[index * chunk:(index + 1) * chunk] or unseen[:chunk]
            start = time.perf_counter()
            generated = rollout.generate([prompt(p) for p in part], sampling_of(cfg))
            real_chunks.append((time.perf_counter() - start, generated, part))
            advance()
        decode_points, prefill_points = [], []
        for timings, (running, (short, long_)) in zip(passes, points):  # (not ``groups``: the whole batch, below)
            step = statistics.median(t[0] for t in timings)
            mean_prompt = statistics.mean(t[2][n] for t in timings for n in (short, long_))
            decode_points.append({"batch": running * G, "context": mean_prompt + (short + long_) / 2, "step_s": step})
            if short == points[0][1][0]:
                short_prompt = statistics.mean(t[2][short] for t in timings)
                prefill_points.append({"tokens": short_prompt * running * G,
                                       "seconds": max(0.0, statistics.median(t[1][short] for t in timings) - short * step)})
        parts.lap("decode")
        decode = fit_decode(decode_points)
        prefill = fit_line(prefill_points, "tokens", "seconds", ("fixed_s", "per_token"))
        prefill.coefficients["per_token"] = max(0.0, prefill.coefficients["per_token"])

        # the task's own response lengths, on the prompts the run will draw first (its seeded sampler),
        # and samples to train on: from one whole batch of the run, so the training points can span the
        # step the run will train (a fit extrapolated far from its points misleads)
        drawn = PromptSampler(problems, cfg.seed).next(LENGTH_BATCHES * groups)
        by_group = rollout_batch(cfg, rollout, drawn)
        # prompt lengths too: of the prompts the run draws, not of the decode timings' (the split's first
        # few, counted once per batch size: 19.8 tokens where the run's prompts average 22.1 on cpu-tiny,
        # so every trained sample was predicted ~9% short)
        workload = fit_workload([[len(s.completion_ids) for s in g] for g in by_group.values()],
                                statistics.mean(len(g[0].prompt_ids) for g in by_group.values()),
                                cfg.rollout.max_new_tokens, [[s.reward for s in g] for g in by_group.values()])
        samples = trainable({i: by_group[i] for i in sorted(by_group)[:groups]}, cfg.algorithm.std_normalize)
        parts.lap("lengths")
        advance()

        # training: one optimizer step on increasing parts of the batch, and a forward-only log-prob pass,
        # spanning what a step trains (its informative samples) from half to twice as many
        first = samples[: min(len(samples), cfg.train.micro_batch_size)]  # one live micro-batch
        warmup["train"] = first_call(lambda: trainer.step(first))
        train_points, logprob_points = [], []
        for size in training_sizes(len(samples), workload["informative"]):
            part = samples[:size]
            tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in part)
            train_points.append({"tokens": tokens, "seconds": median_time(lambda: trainer.step(part), TRAIN_REPEATS)})
            logprob_points.append({"tokens": tokens, "seconds": median_time(lambda: trainer.logprobs(part), 2)})
            advance()
        train = fit_line(train_points, "tokens", "seconds", ("fixed_s", "per_token_s"))
        logprob = fit_line(logprob_points, "tokens", "seconds", ("fixed_s", "per_token_s"))
        overhead = step_overhead(cfg, trainer, samples)
        parts.lap("train")

        # what a request costs beyond its prefill and decode steps: the real chunks against the fits, and
        # each request's scoring and reply to the controller
        prefill = Fit({"per_token": prefill.coefficients["per_token"]}, prefill.error, prefill.points)
        capacity = max(p["batch"] for p in decode_points)
        fits_so_far = Profile(cfg.cluster.device_type, decode, prefill, train, dict.fromkeys(WEIGHT_KEYS, 0.0),
                              dict.fromkeys(SWITCH_KEYS, 0.0), capacity, workload)
        requests = request_overhead(cfg, real_chunks, fits_so_far, rollout.version)
        parts.lap("requests")
        advance()

        # devices sharing this host: each stage alone and beside a neighbour process doing the other, in
        # alternating pairs (this machine's speed drifts by more than the effect within minutes)
        co_running = None
        if neighbour is not None:
            decode_groups, (short, long_) = points[len(batch_sizes(cfg)) - 1]  # the largest batch, usual context
            # a slowdown is a property of the micro-batches' kernels beside the neighbour, and a whole batch
            # is the same micro-batches over again: one micro-batch (at most the batch), twice per timing,
            # measures the same factor (the whole batch, once per timing, took 2.5 of the demo profile's
            # 6 minutes)
            part = samples[: min(len(samples), cfg.train.micro_batch_size)]

            def train_step() -> float:
                return median_time(lambda: trainer.step(part), 2)

            def decode_timing() -> float:  # (twice per length, not five times: the pairs' median repeats it)
                return statistics.median(decode_step(decode_groups, short, long_)[0] for _ in range(2))

            decode_beside = paired_slowdown(decode_timing, neighbour, TRAIN)
            train_beside_decode = paired_slowdown(train_step, neighbour, DECODE)
            train_beside_train = paired_slowdown(train_step, neighbour, TRAIN)
            # and decoding beside decoding: both devices of a colocated step, or a lent trainer, generate
            decode_beside_decode = paired_slowdown(decode_timing, neighbour, DECODE)
            neighbour.close()
            co_running = {"decode": decode_beside["factor"], "train": train_beside_decode["factor"],
                          "train_beside_train": train_beside_train["factor"],
                          "decode_beside_decode": decode_beside_decode["factor"],
                          "pairs": {"decode": decode_beside, "train": train_beside_decode,
                                    "train_beside_train": train_beside_train,
                                    "decode_beside_decode": decode_beside_decode}}
            parts.lap("co_running")
        advance()

        # weights and switches
        state = trainer.state_dict()
        load_s = median_time(lambda: rollout.update_weights(state, rollout.version + 1))
        params = trainer.parameters()
        publish_s = median_time(lambda: torch.nn.utils.parameters_to_vector(params).detach().clone())
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        to_train_s = median_time(lambda: None)  # a lookup of pre-built groups: nothing to move
        parts.lap("weights")
        advance()
    finally:
        torch.set_num_threads(threads)
        if neighbour is not None:
            neighbour.close()
    profile = Profile(
        device=cfg.cluster.device_type, decode=decode, prefill=prefill, train=train,
        weights={"load_s": load_s, "publish_s": publish_s, "bytes": float(weight_bytes)},
        switch={"to_rollout_s": load_s, "to_train_s": to_train_s}, capacity=capacity, workload=workload,
        meta={"model": model.path, "rollout_engine": cfg.rollout.engine, "train_engine": cfg.train.engine,
              **measured_with(cfg),
              "threads": 1, "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": parts.seconds},
        logprob=logprob, co_running=co_running, requests=requests, step_overhead=overhead,
        warmup={**{f"{stage}_s": max(0.0, cold - warm) for stage, (cold, warm) in warmup.items()},
                "timings": {stage: {"first_s": cold, "warm_s": warm} for stage, (cold, warm) in warmup.items()}})
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "profile.json.tmp"
    tmp.write_text(profile.to_json())
    tmp.replace(out / "profile.json")
    plot_profile(profile, out / "profile.png")
    return profile


def request_overhead(cfg: PipelineConfig, chunks: List["tuple[float, List[Sample], list]"], fits: Profile,
                     version: int) -> Dict[str, Any]:
    """Seconds per request beyond what the decode and prefill fits charge: chunks generated as a live device
    does it -- (seconds, samples, problems), timed in the decode sweep's passes -- each against the time
    the fits give the very lengths it drew, the median gap per request (never below 0); plus what a live
    device does with each sample outside the engine, scoring its answer and carrying it to the controller
    encoded as its reply is (median of ``REPEATS``, on the last chunk).

    The gap is real where the fits are extrapolated (a task capped at 40 tokens decodes at contexts
    below the sweep's; its chunks ran 10-30% over the fits) and noise where they are not. Its chunks are
    timed in the same minutes as the decode points: timed apart, after them, the gap read 0, 2.7 and
    9.8 ms per request in three profiles of one task minutes apart (this machine's speed drifts by
    15-30%)."""
    from bidirl.reward import numeric_reward
    from bidirl.runtime import protocol as msg
    from bidirl.runtime.wire import decode, encode
    from bidirl.sim.costs import generation_seconds

    model, workload = fits.model(), fits.measured_workload()
    points = [{"sequences": len(samples), "measured_s": seconds,
               "modelled_s": generation_seconds(model, workload, [len(s.completion_ids) for s in samples],
                                                cfg.rollout.group_size)}
              for seconds, samples, _ in chunks]
    gap = statistics.median((p["measured_s"] - p["modelled_s"]) / p["sequences"] for p in points)
    _, samples, problems = chunks[-1]

    def own_work() -> None:
        for sample in samples:
            sample.reward = numeric_reward(sample.text, problems[sample.prompt_index].answer)
        decode(encode(msg.ChunkGenerated(chunk=0, samples=samples, version=version)))

    own = median_time(own_work) / len(samples)
    return {"per_request_s": max(0.0, gap) + own, "beyond_fits_s": gap, "own_work_s": own, "points": points}


def step_overhead(cfg: PipelineConfig, trainer: Any, samples: List[Sample]) -> Dict[str, Any]:
    """What a live train step costs beyond its gradient passes and optimizer step (what the train fit
    times), through the live runtime's own code: each pulled micro-batch's round trip -- the command
    with its samples to the device and the reply back, over a real c10d store as the
    :class:`~bidirl.runtime.mailbox.Mailbox` carries them -- and the finish's own work: the log-prob
    probe, the gradients gathered into one flat buffer and put back, the weights' checksum, and the
    finish command's round trip. (The reduction between devices is the model's all-reduce term.)"""
    import torch
    from torch.distributed import TCPStore

    from bidirl.runtime import protocol as msg
    from bidirl.runtime.batches import PROBE_SAMPLES
    from bidirl.runtime.mailbox import Mailbox
    from bidirl.runtime.worker import flat_gradients, mean_logprob_gap, set_gradients, weights_checksum

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # (a free port)
    controller, device = Mailbox(host), Mailbox(TCPStore("127.0.0.1", host.port, is_master=False))
    part = tuple(samples[: cfg.train.micro_batch_size])
    tokens = sum(len(s.completion_ids) for s in part)

    def round_trip(command: Any, reply: Any) -> None:
        controller.send(0, command)
        device.next_command(0)
        device.post(reply)
        controller.next_event()

    per_micro_batch = median_time(lambda: round_trip(msg.ComputeGrads(step=0, samples=part, total_tokens=tokens,
                                                                      total_sequences=len(part)),
                                                     msg.GradsComputed(step=0, compute_s=0.0)), REPEATS)
    params, probe = trainer.parameters(), [s for s in samples[:PROBE_SAMPLES] if s.completion_ids]
    trainer.compute_grads(list(part))

    def finish() -> None:
        round_trip(msg.FinishStep(step=0, members=(0,), probe=tuple(probe)), msg.StepDone(version=1, reduce_s=0.0))
        if probe:
            mean_logprob_gap(trainer, probe)
        set_gradients(params, flat_gradients(torch, params))
        weights_checksum(torch, params)

    finish_s = median_time(finish, REPEATS)
    trainer.zero_grads()
    return {"per_micro_batch_s": per_micro_batch, "finish_s": finish_s, "micro_batch_samples": len(part)}


def training_sizes(batch: int, informative: float) -> List[int]:
    """Samples in each timed training step: a quarter, a half and all of twice the ``informative`` share
    of a ``batch`` (at most the batch), so the fitted line spans the steps a run will train."""
    top = min(batch, max(2, round(2 * informative * batch)))
    return [max(1, top // 4), max(1, top // 2), top]  # (two alike on a tiny batch: still two distinct sizes)


def batch_groups(cfg: PipelineConfig) -> int:
    """Prompt groups in the batch the profile samples: one whole training batch, and at least the largest
    chunk (so the training points span the step the run will train)."""
    return max(cfg.train.prompts_per_step, max(batch_sizes(cfg)))


IDLE, TRAIN, DECODE = 0, 1, 2  # what the neighbour process does (a shared integer)
CO_RUNNING_PAIRS = 4  # alone/beside pairs per factor, alternating order; the factor is their median ratio


def paired_slowdown(measure: Callable[[], float], neighbour: "Neighbour", work: int,
                    pairs: int = CO_RUNNING_PAIRS) -> Dict[str, Any]:
    """How much slower ``measure`` runs while the neighbour does ``work`` than while it idles.

    Measured as pairs taken back to back, alone-beside then beside-alone (so a steady drift of this
    machine's speed cancels within each pair), and summarised by the median of the pairs' ratios: one
    sequential alone-then-beside measurement read 0.90-1.52 on this machine minutes apart."""
    alone, beside = [], []
    for pair in range(pairs):
        for doing in ((IDLE, work) if pair % 2 == 0 else (work, IDLE)):
            neighbour.set(doing)
            (beside if doing == work else alone).append(measure())
    neighbour.set(IDLE)
    ratios = [b / a for a, b in zip(alone, beside)]
    return {"factor": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios],
            "alone_s": alone, "beside_s": beside}


class Neighbour:
    """Another device of the same host, in its own process with one thread (as a live worker runs),
    with both engines resident: it idles, trains (steps the trainer in a loop on one sampled batch) or
    decodes (generates the task's batches in a loop), as :meth:`set` says. The process lives from
    :meth:`start` to :meth:`close`."""

    START_S = 600.0  # building the engines in a fresh process: well under a minute here
    SET_S = 600.0  # the longest a switch waits for the neighbour's current iteration to end

    def __init__(self, cfg: PipelineConfig, model_path: str, problems: list):
        context = multiprocessing.get_context("spawn")
        self.ready, self.stop = context.Event(), context.Event()
        self.work, self.doing = context.Value("i", IDLE), context.Value("i", -1)
        self.process = context.Process(target=neighbour_loop, daemon=True,
                                       args=(cfg, model_path, problems, self.ready, self.stop, self.work, self.doing))
        self.started = False

    def start(self) -> None:
        """Starts the process, which builds its engines; returns at once."""
        self.process.start()
        self.started = True

    def wait_ready(self) -> None:
        """Returns once the neighbour's engines are built and warm, and it idles."""
        deadline = time.monotonic() + self.START_S
        while not self.ready.wait(1.0):
            if not self.process.is_alive():
                raise BidirlError(f"the profile's neighbour process (the other stage on this host) exited with "
                                  f"code {self.process.exitcode} before it started working")
            if time.monotonic() > deadline:
                self.close()
                raise BidirlError(f"the profile's neighbour process (the other stage on this host) did not start "
                                  f"working within {self.START_S:.0f} s")

    def set(self, work: int) -> None:
        """From now on the neighbour does ``work``; returns once it does (idle: its last iteration ended)."""
        self.work.value = work
        deadline = time.monotonic() + self.SET_S
        while self.doing.value != work:
            if not self.process.is_alive() or time.monotonic() > deadline:
                raise BidirlError(f"the profile's neighbour process (the other stage on this host) stopped "
                                  f"answering (exit code {self.process.exitcode})")
            time.sleep(0.002)

    def close(self) -> None:
        """Stops the process (again: nothing; never started: nothing)."""
        if not self.started or not self.process.is_alive():
            return
        self.stop.set()
        self.process.join(60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


def neighbour_loop(cfg: PipelineConfig, model_path: str, problems: list, ready: Any, stop: Any,
                   work: Any, doing: Any) -> None:
    import torch

    from bidirl.engines.build import build_rollout_engine, build_train_engine
    from bidirl.runtime_env import prepare_process

    torch.set_num_threads(1)
    prepare_process(cfg.cluster.device_type)
    rollout = build_rollout_engine(cfg, model_path)
    by_group = rollout_batch(cfg, rollout, problems)  # also the warm-up of its first (slower) calls
    trainer, samples = build_train_engine(cfg, model_path), trainable(by_group, cfg.algorithm.std_normalize)
    trainer.step(samples)
    ready.set()
    while not stop.is_set():
        doing.value = now = work.value  # said before the iteration: idle is said once the last one ended
        if now == TRAIN:
            trainer.step(samples)
        elif now == DECODE:
            rollout_batch(cfg, rollout, problems)
        else:
            time.sleep(0.002)


class FreshPrompts:
    """The task's prompts in turn, each handed out once (then round again), with their token counts: what a
    live chunk sees, prompts the rollout engine's prefix cache does not hold yet. (A long profile of a
    small task can come round again; only its prefill points then read a little low.)"""

    def __init__(self, prompts: List[str], tokenizer: Any):
        self.prompts, self.cursor = prompts, 0
        self.tokens = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
        self.longest = max(self.tokens)  # what bounds a decode timing's length, with the context window

    def next(self, count: int) -> "tuple[List[str], List[int]]":
        indices = [(self.cursor + i) % len(self.prompts) for i in range(count)]
        self.cursor = (self.cursor + count) % len(self.prompts)
        return [self.prompts[i] for i in indices], [self.tokens[i] for i in indices]


def context_window(model_path: str) -> int:
    """Tokens the model can attend over (its config's ``max_position_embeddings``; 32k if it names none)."""
    import json

    config = (json.loads((Path(model_path) / "config.json").read_text())
              if (Path(model_path) / "config.json").is_file() else {})
    return int(config.get("max_position_embeddings") or 32768)


def plot_profile(profile: Profile, path: Path) -> Path:
    """Measured points against the fitted lines: decode step vs batch, and prefill, training and
    forward-only log-probs vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = [(profile.prefill, "prefill"), (profile.train, "train step")]
    if profile.logprob is not None:
        fits.append((profile.logprob, "forward-only log-probs"))
    fig, axes = plt.subplots(1, 1 + len(fits), figsize=(4.7 * (1 + len(fits)), 4))
    d = profile.decode.coefficients
    pts = profile.decode.points
    axes[0].plot([p["batch"] for p in pts], [1000 * p["step_s"] for p in pts], "o", label="measured")
    xs = sorted(p["batch"] for p in pts)
    ctx = statistics.mean(p["context"] for p in pts)
    axes[0].plot(xs, [1000 * (d["a"] + d["b"] * x + d["c"] * x * ctx) for x in xs], "-",
                 label=f"fit (error {profile.decode.error:.0%})")
    axes[0].set(xlabel="running sequences", ylabel="decode step (ms)", title="decode")
    key = "tokens"
    for ax, (fit, title) in zip(axes[1:], fits):
        points = fit.points
        ys = [p["seconds"] for p in points]
        ax.plot([p[key] for p in points], ys, "o", label="measured")
        c = fit.coefficients
        slope = c.get("per_token", c.get("per_token_s", 0.0))
        xs = sorted(p[key] for p in points)
        ax.plot(xs, [c.get("fixed_s", 0.0) + slope * x for x in xs], "-", label=f"fit (error {fit.error:.0%})")
        ax.set(xlabel=key, ylabel="seconds", title=title)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def progress_steps(cfg: PipelineConfig) -> int:
    """The ``advance()`` calls of :func:`profile_devices`: start-up, each decode pass, the lengths, each
    training size (:func:`training_sizes`: 3), the requests, the hosts' co-running and the weights."""
    return 1 + DECODE_PASSES + 1 + 3 + 1 + 1 + 1


def summary_line(profile: Profile) -> str:
    w, d, t = profile.workload or {}, profile.decode.coefficients, profile.train.coefficients
    co = profile.co_running
    beside = (f"; beside the other stage on this host: decode x{co['decode']:.2f}, train x{co['train']:.2f}"
              + (f" (beside training x{co['train_beside_train']:.2f})" if "train_beside_train" in co else "")
              + (f", decode beside decoding x{co['decode_beside_decode']:.2f}" if "decode_beside_decode" in co else "")
              if co else "")
    return (f"decode step {1000 * d['a']:.2f} ms + {1000 * d['b']:.4f} ms/sequence (fit error {profile.decode.error:.0%}); "
            f"train {1000 * t['per_token_s']:.3f} ms/token + {t['fixed_s']:.3f} s (error {profile.train.error:.0%}); "
            f"load {1000 * profile.weights['load_s']:.1f} ms; responses mean {w.get('mean_tokens', 0):.1f} tokens"
            + (f"; {1000 * profile.requests['per_request_s']:.2f} ms per request beyond decode and prefill"
               if profile.requests else "")
            + (f"; per micro-batch {1000 * profile.step_overhead['per_micro_batch_s']:.1f} ms, per step "
               f"{1000 * profile.step_overhead['finish_s']:.1f} ms beyond the gradient passes"
               if profile.step_overhead else "")
            + (f"; first use warm-up: rollout {profile.warmup['rollout_s']:.2f} s, train {profile.warmup['train_s']:.2f} s"
               if profile.warmup else "") + beside
            + took(profile.meta.get("seconds") or {}))


def took(seconds: Dict[str, float]) -> str:
    """``; measured in 362 s (longest: co_running 181 s)``, from the profile's own clock (if it has one)."""
    if not seconds:
        return ""
    longest = max(seconds, key=seconds.get)
    return f"; measured in {sum(seconds.values()):.0f} s (longest: {longest} {seconds[longest]:.0f} s)"
