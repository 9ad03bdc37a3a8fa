"""Both rollout engines against the torch trainer, on a small random Qwen2 saved to disk."""

import copy
import importlib.util

import pytest
import torch

from bidirl.engines.hf_rollout import HFRolloutEngine
from bidirl.engines.protocols import Generation, HandOver
from bidirl.samples import SamplingParams
from bidirl.engines.torch_train import TorchTrainEngine
from bidirl.errors import BidirlError
from bidirl.grpo import assign_advantages
from tests.builders import small_config, small_model_dir

PROMPTS = ["Calculate 3 + 4.", "Calculate 9 - 2 + 1.", "Question: 1 + 1\nAnswer:"]
PARAMS = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=0)
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return small_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def vllm_engine(model_dir, tmp_path_factory):
    from bidirl.engines.vllm_rollout import VLLMRolloutEngine

    return VLLMRolloutEngine(model_dir, "float32", 0, str(tmp_path_factory.mktemp("vllm-cache")))


def mean_abs_logprob_gap(trainer, samples):
    recomputed = trainer.logprobs(samples)
    gaps = [abs(a - b) for s, r in zip(samples, recomputed) for a, b in zip(s.logprobs, r)]
    return sum(gaps) / len(gaps)


def train_one_step(trainer, samples):
    for i, s in enumerate(samples):
        s.reward = float(i % 2)  # any non-constant reward gives a non-zero gradient
    assign_advantages(samples)
    stats = trainer.step(samples)
    assert stats["grad_norm"] > 0
    return stats


def test_hf_engine_returns_n_samples_per_prompt_with_one_logprob_per_token(model_dir):
    samples = HFRolloutEngine(model_dir).generate(PROMPTS, PARAMS)
    assert len(samples) == len(PROMPTS) * PARAMS.n
    assert sorted({s.prompt_index for s in samples}) == [0, 1, 2]
    for s in samples:
        assert 1 <= len(s.completion_ids) <= PARAMS.max_new_tokens
        assert len(s.logprobs) == len(s.completion_ids) and all(lp <= 0 for lp in s.logprobs)
        assert s.version == 0


def test_hf_engine_logprobs_match_the_trainer_for_fresh_weights(model_dir):
    trainer = TorchTrainEngine(model_dir, small_config())
    samples = HFRolloutEngine(model_dir).generate(PROMPTS, PARAMS)
    assert mean_abs_logprob_gap(trainer, samples) < 1e-4


def test_weight_sync_makes_hf_engine_logprobs_match_the_trained_policy(model_dir):
    trainer, engine = TorchTrainEngine(model_dir, small_config()), HFRolloutEngine(model_dir)
    train_one_step(trainer, engine.generate(PROMPTS, PARAMS))
    stale = engine.generate(PROMPTS, PARAMS)
    assert mean_abs_logprob_gap(trainer, stale) > 1e-3  # the trainer moved away
    engine.update_weights(trainer.state_dict(), trainer.version)
    fresh = engine.generate(PROMPTS, PARAMS)
    assert mean_abs_logprob_gap(trainer, fresh) < 1e-4 and fresh[0].version == 1


def test_the_hf_engine_samples_the_distribution_its_log_probs_describe_whatever_the_models_defaults(model_dir):
    # a hub model's generation_config sets sampling filters (Qwen2.5-Instruct: a repetition penalty of 1.05,
    # top_k 20); transformers fills what generate() is not given from it, so the engine sampled from a
    # filtered distribution while its log-probs (and the trainer's) describe softmax(logits / T)
    engine = HFRolloutEngine(model_dir)
    defaults = engine.model.generation_config
    defaults.repetition_penalty, defaults.top_k, defaults.min_p, defaults.typical_p = 5.0, 1, 0.5, 0.2
    used = []
    prepare = engine.model._prepare_generation_config

    def spy(*args, **kwargs):
        config, model_kwargs = prepare(*args, **kwargs)
        used.append(config)
        return config, model_kwargs

    engine.model._prepare_generation_config = spy
    samples = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=0))
    (config,) = used
    assert config.repetition_penalty == 1.0 and not config.top_k and not config.min_p and config.typical_p == 1.0
    assert mean_abs_logprob_gap(TorchTrainEngine(model_dir, small_config()), samples) < 1e-4


def test_the_hf_engine_ends_a_completion_at_any_eos_id_the_models_generation_config_lists(model_dir, tmp_path):
    # a hub instruct model lists its turn end beside the tokenizer's EOS (Qwen2.5-Instruct: <|im_end|> and
    # <|endoftext|>); vLLM stops at each of them, and so must this engine, or the two end completions apart
    import json
    import shutil

    greedy = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    (plain,) = HFRolloutEngine(model_dir).generate(PROMPTS[:1], greedy)
    assert len(plain.completion_ids) == 6 and not plain.finished
    listed = tmp_path / "listed"
    shutil.copytree(model_dir, listed)
    config = json.loads((listed / "generation_config.json").read_text())
    turn_end = plain.completion_ids[2]  # (a token this model generates: it stands for the turn end)
    config["eos_token_id"] = [config["eos_token_id"], turn_end]
    (listed / "generation_config.json").write_text(json.dumps(config))
    (ended,) = HFRolloutEngine(str(listed)).generate(PROMPTS[:1], greedy)
    first = plain.completion_ids.index(turn_end)
    assert ended.completion_ids == plain.completion_ids[: first + 1] and ended.finished
    assert ended.logprobs == pytest.approx(plain.logprobs[: first + 1])
    from bidirl.evaluate import _greedy  # held-out evaluation and the TRL peer stop there too

    engine = HFRolloutEngine(str(listed))
    assert _greedy(engine.model, engine.tokenizer, PROMPTS[:1], 6, torch) == [ended.text]


def test_greedy_generation_is_deterministic(model_dir):
    engine = HFRolloutEngine(model_dir)
    greedy = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    assert [s.text for s in engine.generate(PROMPTS, greedy)] == [s.text for s in engine.generate(PROMPTS, greedy)]


def test_trainer_checkpoint_round_trips_weights_optimizer_and_version(model_dir, tmp_path):
    trainer = TorchTrainEngine(model_dir, small_config())
    train_one_step(trainer, HFRolloutEngine(model_dir).generate(PROMPTS, PARAMS))
    trainer.save(str(tmp_path / "ckpt"))
    restored = TorchTrainEngine(model_dir, small_config())
    restored.load(str(tmp_path / "ckpt"))
    assert restored.version == 1
    for (name, a), b in zip(trainer.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name
    saved, loaded = trainer.optimizer.state_dict()["state"], restored.optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and saved  # AdamW has moments after a step
    for index, moments in saved.items():  # exp_avg, exp_avg_sq and step, each exactly
        assert moments.keys() == loaded[index].keys()
        assert all(torch.equal(moments[k], loaded[index][k]) for k in moments), index
    # and the schedule goes on where it was: one more step each gives the same weights
    samples = HFRolloutEngine(model_dir).generate(PROMPTS, PARAMS)
    train_one_step(trainer, samples)
    train_one_step(restored, copy.deepcopy(samples))
    for (name, a), b in zip(trainer.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_trainer_that_adopts_anothers_training_state_steps_identically_from_then_on(model_dir):
    import copy
    import io

    primary, newcomer = TorchTrainEngine(model_dir, small_config()), TorchTrainEngine(model_dir, small_config())
    samples = HFRolloutEngine(model_dir).generate(PROMPTS, PARAMS)
    for _ in range(2):
        train_one_step(primary, samples)  # the primary has AdamW moments and a schedule position by now
    buffer = io.BytesIO()
    torch.save(primary.training_state(), buffer)  # what travels between the two processes
    newcomer.adopt_training_state(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert newcomer.version == primary.version == 2
    train_one_step(primary, samples)
    train_one_step(newcomer, copy.deepcopy(samples))
    for (name, a), b in zip(primary.state_dict().items(), newcomer.state_dict().values()):
        assert torch.equal(a, b), name


def test_micro_batches_pulled_by_two_devices_sum_to_the_whole_batch_update(model_dir):
    """Lazy pull: the step's devices compute gradients of different micro-batches; summed (the all-reduce)
    and applied by the primary they give the update of the whole batch on one device, within fp32."""
    whole, primary, helper = (TorchTrainEngine(model_dir, small_config()) for _ in range(3))
    samples = HFRolloutEngine(model_dir).generate(PROMPTS, PARAMS)
    for i, s in enumerate(samples):
        s.reward = float(i % 2)
    assign_advantages(samples)
    tokens, sequences = sum(len(s.completion_ids) for s in samples), len(samples)
    whole.compute_grads(samples, tokens, sequences)
    whole.apply_grads()
    for part, device in ((samples[:4], primary), (samples[4:9], helper), (samples[9:], primary)):  # pulled in turn
        device.compute_grads(part, tokens, sequences)
    for mine, theirs in zip(primary.parameters(), helper.parameters()):
        mine.grad += theirs.grad  # what the all-reduce sums
    primary.apply_grads()
    # fp32 sums in another order differ in the last bits, and AdamW's first step divides each gradient by
    # its own magnitude, which can amplify that for a weight whose gradient is nearly zero. Measured: one
    # weight of 8192 off by 1.9e-6 on one machine. The step moves weights by ~lr = 1e-2, so a micro-batch
    # lost or counted twice shows up far above 1e-5
    for (name, a), b in zip(whole.state_dict().items(), primary.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), name


def test_a_corrupt_checkpoint_is_one_clear_error(model_dir, tmp_path):
    trainer = TorchTrainEngine(model_dir, small_config())
    trainer.save(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "optimizer.pt").write_bytes(b"truncated")
    with pytest.raises(BidirlError, match="corrupt checkpoint"):
        trainer.load(str(tmp_path / "ckpt"))


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_vllm_engine_logprobs_match_the_trainer_for_fresh_weights(model_dir, vllm_engine):
    trainer = TorchTrainEngine(model_dir, small_config())
    samples = vllm_engine.generate(PROMPTS, PARAMS)
    assert len(samples) == len(PROMPTS) * PARAMS.n
    assert mean_abs_logprob_gap(trainer, samples) < 1e-4


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_vllm_in_place_weight_update_tracks_the_trainer_including_tied_embeddings(model_dir, vllm_engine):
    trainer = TorchTrainEngine(model_dir, small_config())
    vllm_engine.update_weights(trainer.state_dict(), 0)
    train_one_step(trainer, vllm_engine.generate(PROMPTS, PARAMS))
    assert mean_abs_logprob_gap(trainer, vllm_engine.generate(PROMPTS, PARAMS)) > 1e-3
    seconds = vllm_engine.update_weights(trainer.state_dict(), trainer.version)
    assert seconds > 0
    fresh = vllm_engine.generate(PROMPTS, PARAMS)
    assert mean_abs_logprob_gap(trainer, fresh) < 1e-4 and fresh[0].version == 1


def test_a_paused_engine_starts_no_new_generation_until_resumed(model_dir):
    import threading

    engine = HFRolloutEngine(model_dir)
    engine.pause()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (engine.generate(PROMPTS[:1], PARAMS), done.set()))
    worker.start()
    assert not done.wait(0.5)
    engine.resume()
    assert done.wait(600)  # a hang guard, not a speed limit
    worker.join()


@pytest.mark.parametrize("source_name,target_name", [("hf", "vllm"), ("vllm", "hf"), ("hf", "hf")])
def test_a_request_stopped_mid_generation_resumes_on_another_engine_intact(model_dir, vllm_engine, source_name,
                                                                            target_name):
    """In-flight migration's data plane: tokens and behaviour log-probs so far unchanged, nothing lost or
    generated twice, each new token with the version of the engine that generated it."""
    if "vllm" in (source_name, target_name) and not HAS_VLLM:
        pytest.skip("vLLM not installed")
    trainer = TorchTrainEngine(model_dir, small_config())
    engines = {"hf": lambda: HFRolloutEngine(model_dir), "vllm": lambda: vllm_engine}
    source, target = engines[source_name](), engines[target_name]()
    source.update_weights(trainer.state_dict(), 3)
    target.update_weights(trainer.state_dict(), 4)  # the same weights, published as a newer version
    stopped = source.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=3, ignore_eos=True))
    assert all(len(s.completion_ids) == 3 and not s.finished for s in stopped)
    resumed = target.continue_samples(stopped, SamplingParams(n=2, max_new_tokens=9))
    assert len(resumed) == len(stopped)  # nothing lost, one continuation each, in order
    for before, after in zip(stopped, resumed):
        assert after.prompt_index == before.prompt_index and after.prompt_ids == before.prompt_ids
        assert after.completion_ids[:3] == before.completion_ids and after.logprobs[:3] == before.logprobs
        assert 3 < len(after.completion_ids) <= 9 and len(after.logprobs) == len(after.completion_ids)
        assert after.versions() == [3] * 3 + [4] * (len(after.completion_ids) - 3)
        assert after.version == 3  # staleness counts the oldest token
        assert after.finished == (after.completion_ids[-1] == target.tokenizer.eos_token_id)
    # every token's behaviour log-prob is the policy's own (nothing generated twice: the trainer scores the
    # very sequence the engines produced, token by token)
    assert mean_abs_logprob_gap(trainer, resumed) < 1e-4
    # a finished sample, or one already at its budget, is returned as it was
    assert target.continue_samples(resumed, SamplingParams(max_new_tokens=9)) == resumed


class AskAfter(HandOver):
    """A hand-over asked for after the engine has polled ``polls`` times (mid-generation, deterministically)."""

    def __init__(self, polls: int, groups: int):
        super().__init__(lambda n, indices, samples: self.handed.append((indices, samples)))
        self.polls, self.groups, self.handed = polls, groups, []

    def _tick(self) -> None:
        self.polls -= 1
        if self.polls == 0:
            self.ask(self.groups)

    def pending(self) -> bool:
        self._tick()
        return super().pending()

    def wanted(self):
        self._tick()
        return super().wanted()


@pytest.mark.parametrize("source_name,target_name", [("vllm", "hf"), ("hf", "vllm")])
def test_groups_asked_for_mid_generation_are_handed_over_with_their_tokens_so_far_and_finish_elsewhere(
        model_dir, vllm_engine, source_name, target_name):
    """The live half of in-flight migration: the source stops the asked groups between two decode steps
    and keeps generating the others; every group comes back exactly once, from one engine or the other,
    and a moved sample continued on the other engine is one sequence the policy could have sampled."""
    if not HAS_VLLM:
        pytest.skip("vLLM not installed")
    trainer = TorchTrainEngine(model_dir, small_config())
    engines = {"hf": lambda: HFRolloutEngine(model_dir), "vllm": lambda: vllm_engine}
    source, target = engines[source_name](), engines[target_name]()
    for engine in (source, target):
        engine.update_weights(trainer.state_dict(), 2)
    params = SamplingParams(n=2, max_new_tokens=12, ignore_eos=True)
    handover = AskAfter(polls=4, groups=2)
    kept = source.generate(PROMPTS, params, handover)
    [(moved_groups, moved)] = handover.handed  # one ask, one answer
    assert len(moved_groups) == 2 and len(moved) == 2 * params.n
    assert sorted(moved_groups + sorted({s.prompt_index for s in kept})) == [0, 1, 2]  # each group once
    assert all(len(s.completion_ids) == 12 for s in kept)
    assert all(0 < len(s.completion_ids) < 12 and not s.finished for s in moved)  # stopped mid-way
    resumed = target.continue_samples(moved, params)
    for before, after in zip(moved, resumed):
        assert after.completion_ids[: len(before.completion_ids)] == before.completion_ids
        assert len(after.completion_ids) == 12 and len(after.logprobs) == 12
    assert mean_abs_logprob_gap(trainer, kept + resumed) < 1e-4
    # an ask after the engine finished is refused (the caller settles it from the engine's result)
    assert not handover.ask(1) and handover.wanted() == []


def test_an_ask_for_groups_the_hf_engine_has_not_started_yet_hands_them_over_empty(model_dir):
    """HF generates a chunk in calls of ``max_batch`` sequences: an ask may reach prompts of a later call,
    which go over as empty samples (continued elsewhere from their prompt)."""
    source = HFRolloutEngine(model_dir)
    source.max_batch = 2  # one prompt (n = 2) per call
    params = SamplingParams(n=2, max_new_tokens=8, ignore_eos=True)
    handover = AskAfter(polls=3, groups=2)  # asked during the first call: one group started, two not
    kept = source.generate(PROMPTS, params, handover)
    [(moved_groups, moved)] = handover.handed
    assert moved_groups == [0, 1] and sorted({s.prompt_index for s in kept}) == [2]
    assert [len(s.completion_ids) for s in moved if s.prompt_index == 1] == [0, 0]  # not started
    assert all(0 < len(s.completion_ids) < 8 for s in moved if s.prompt_index == 0)  # stopped mid-way
    resumed = HFRolloutEngine(model_dir).continue_samples(moved, params)
    assert all(len(s.completion_ids) == 8 for s in resumed + kept)


def test_vllm_reports_each_group_once_as_its_last_sample_ends_and_returns_only_the_rest(model_dir, vllm_engine):
    """What lets a live step stream from a chunk still generating: every group goes to ``done`` exactly
    once, whole (n samples, each ended), and is neither returned nor handed over afterwards."""
    if not HAS_VLLM:
        pytest.skip("vLLM not installed")
    trainer = TorchTrainEngine(model_dir, small_config())
    vllm_engine.update_weights(trainer.state_dict(), 5)
    reported = []
    left = vllm_engine.generate(PROMPTS, PARAMS, done=reported.append)
    assert left == []  # nothing to stop it: every group ended, and was reported
    assert sorted(group[0].prompt_index for group in reported) == [0, 1, 2]
    for group in reported:
        assert len(group) == PARAMS.n and len({s.prompt_index for s in group}) == 1
        assert all(s.finished or len(s.completion_ids) == PARAMS.max_new_tokens for s in group)
        assert all(len(s.logprobs) == len(s.completion_ids) and s.version == 5 for s in group)
    assert mean_abs_logprob_gap(trainer, [s for group in reported for s in group]) < 1e-4


def test_with_hand_overs_and_reports_together_each_group_comes_back_once_moved_mid_way_or_whole(model_dir,
                                                                                                 vllm_engine):
    """The two ways a group leaves a chunk still generating: asked for mid-way (its tokens so far), or
    reported whole once its last sample ends -- never both, never neither. (Every sample here runs the
    same 12 tokens, so the groups not asked for end together, after the ask; the order in which a group
    reported done meets a later ask is the controller's to settle: ``tests/test_controller.py``.)"""
    if not HAS_VLLM:
        pytest.skip("vLLM not installed")
    params = SamplingParams(n=2, max_new_tokens=12, ignore_eos=True)
    handover, reported = AskAfter(polls=4, groups=2), []
    kept = vllm_engine.generate(PROMPTS, params, handover, done=reported.append)
    [(moved_groups, moved)] = handover.handed
    assert len(moved_groups) == 2 and all(0 < len(s.completion_ids) < 12 for s in moved)  # stopped mid-way
    assert kept == [] and [len(g) for g in reported] == [params.n]  # the third, whole, as it ended
    # a moved sample carries its text so far, as a returned one does (one that had ended is rewarded on it)
    assert all(s.text == vllm_engine.tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in moved)
    assert all(len(s.completion_ids) == 12 for s in reported[0])
    assert sorted(moved_groups + [reported[0][0].prompt_index]) == [0, 1, 2]  # each group once


def joining(*generations):
    """A ``joins`` for ``serve``: the first generation at once, each later one after one more decode step
    (the engine polls until it gets None, then steps, then polls again)."""
    queue = []
    for generation in generations:
        queue += [generation, None]

    def joins():
        return queue.pop(0) if queue else None

    return joins


def recorded(name, params, prompts, events):
    return Generation(prompts, params, over=lambda samples: events.append(("over", name, samples)),
                      done=lambda group: events.append(("done", name, group)))


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_a_chunk_that_comes_while_another_generates_joins_its_running_batch_and_ends_on_its_own(model_dir,
                                                                                               vllm_engine):
    """Continuous batching, live: a generation handed to ``serve`` while another decodes joins the running
    batch (between two decode steps) instead of waiting for it, and each ends by itself -- the short one
    joined second ends first. Every group comes back once, whole, with the policy's own log-probs."""
    trainer = TorchTrainEngine(model_dir, small_config())
    vllm_engine.update_weights(trainer.state_dict(), 7)
    long, short = (SamplingParams(n=2, max_new_tokens=t, ignore_eos=True) for t in (12, 4))
    events = []
    first, second = recorded("long", long, PROMPTS, events), recorded("short", short, PROMPTS[:2], events)
    vllm_engine.serve(joining(first, second))
    assert (first.joined, first.shared, second.joined, second.shared) == (False, True, True, True)
    overs = [(name, samples) for kind, name, samples in events if kind == "over"]
    assert overs == [("short", []), ("long", [])]  # joined later, ended first; every group went to done
    groups = {name: [g for kind, n, g in events if kind == "done" and n == name] for name in ("long", "short")}
    assert sorted(g[0].prompt_index for g in groups["long"]) == [0, 1, 2]
    assert sorted(g[0].prompt_index for g in groups["short"]) == [0, 1]
    for name, params in (("long", long), ("short", short)):
        for group in groups[name]:
            assert len(group) == params.n and len({s.prompt_index for s in group}) == 1
            assert all(len(s.completion_ids) == len(s.logprobs) == params.max_new_tokens for s in group)
            assert all(s.version == 7 for s in group)
    assert mean_abs_logprob_gap(trainer, [s for gs in groups.values() for g in gs for s in g]) < 1e-4


def test_the_hf_engine_serves_generations_one_after_the_other(model_dir):
    """A static batch cannot take new requests: the HF engine runs each generation whole, then polls for
    the next, and each still ends through its own ``over``."""
    engine, events = HFRolloutEngine(model_dir), []
    first, second = (SamplingParams(n=2, max_new_tokens=t, ignore_eos=True) for t in (6, 3))
    generations = [recorded("first", first, PROMPTS, events), recorded("second", second, PROMPTS[:1], events)]
    queued = iter(generations)
    engine.serve(lambda: next(queued, None))
    assert not any(g.joined or g.shared for g in generations)  # (each had the engine to itself)
    assert [(kind, name) for kind, name, _ in events] == [("over", "first"), ("over", "second")]
    assert [len(s.completion_ids) for s in events[0][2]] == [6] * 6
    assert [len(s.completion_ids) for s in events[1][2]] == [3] * 2


def test_a_gradient_clip_of_0_clips_nothing_as_deepspeed_and_trl_read_it(model_dir):
    samples = HFRolloutEngine(model_dir).generate(PROMPTS, PARAMS)
    unclipped, unbounded = (TorchTrainEngine(model_dir, small_config(f"train.max_grad_norm={bound}")) for bound in (0, 1e9))
    start = [p.detach().clone() for p in unclipped.parameters()]
    for trainer in (unclipped, unbounded):
        train_one_step(trainer, copy.deepcopy(samples))
    assert any(not p.equal(q) for p, q in zip(unclipped.parameters(), start))  # (a clip at 0 would zero the step)
    assert all(p.equal(q) for p, q in zip(unclipped.parameters(), unbounded.parameters()))
