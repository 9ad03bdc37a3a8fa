"""The trainer's memory and numerics on any device: chunked log-probs, fp32 master weights."""

import pytest
import torch

from bidirl.engines.hf_rollout import HFRolloutEngine
from bidirl.engines.tokens import pack, token_logprobs
from bidirl.engines.torch_train import TorchTrainEngine
from bidirl.grpo import assign_advantages
from bidirl.samples import SamplingParams
from tests.builders import small_config, small_model_dir

PROMPTS = ["Calculate 3 + 4.", "Calculate 9 - 2 + 1.", "Question: 1 + 1\nAnswer:"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return small_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def samples(model_dir):
    out = HFRolloutEngine(model_dir).generate(PROMPTS, SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=0))
    for i, s in enumerate(out):
        s.reward = float(i % 2)
    assign_advantages(out)
    return out


def logprobs_and_grads(model_dir, samples, chunk_tokens):
    trainer = TorchTrainEngine(model_dir, small_config())
    ids, attention, mask = pack(samples, trainer.tokenizer.pad_token_id, torch)
    logp = token_logprobs(trainer.model, ids, attention, 0.7, torch, chunk_tokens)
    (logp * mask).sum().backward()
    return logp.detach(), [p.grad.clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("chunk_tokens", [1, 7, 10_000])
def test_log_probs_through_the_head_a_chunk_at_a_time_equal_the_whole_computation_with_their_gradients(
        model_dir, samples, chunk_tokens):
    whole, whole_grads = logprobs_and_grads(model_dir, samples, 0)
    chunked, chunked_grads = logprobs_and_grads(model_dir, samples, chunk_tokens)
    assert torch.allclose(chunked, whole, atol=1e-5)
    for a, b in zip(chunked_grads, whole_grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_a_micro_batch_never_holds_its_full_vocabulary_logits_at_once(model_dir, samples, monkeypatch):
    trainer = TorchTrainEngine(model_dir, small_config("train.logprob_chunk_tokens=8"))
    head, widest = trainer.model.get_output_embeddings(), []
    original = head.forward
    monkeypatch.setattr(head, "forward", lambda h: widest.append(h.shape[0]) or original(h))
    trainer.compute_grads(samples)
    assert widest and max(widest) == 8  # the trainer's gradients go through the head 8 positions at a time
    widest.clear()
    ids, attention, _ = pack(samples, trainer.tokenizer.pad_token_id, torch)
    with torch.no_grad():  # (no recomputation: each position once)
        token_logprobs(trainer.model, ids, attention, 1.0, torch, 8)
    positions = ids.shape[0] * (ids.shape[1] - 1)  # every next-token position of the packed micro-batch
    assert sum(widest) == positions and widest[:-1] == [8] * (len(widest) - 1) and 0 < widest[-1] <= 8


def test_a_bf16_model_trains_on_fp32_master_weights_so_updates_below_bf16_resolution_are_kept(model_dir, samples):
    trainer = TorchTrainEngine(model_dir, small_config("model.dtype=bfloat16", "train.lr=1e-6", "train.lr_warmup_steps=1"))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step(samples)
    moved = [(p.detach() - b) for p, b in zip(trainer.model.parameters(), before)]
    changed = sum(int((m != 0).sum()) for m in moved)
    # the update (~lr = 1e-6 per coordinate) is far below bf16's resolution at these weights (~1e-4 at 0.02) ...
    lost_in_bf16 = sum(int((p.detach().bfloat16() == b.bfloat16()).sum())
                       for p, b in zip(trainer.model.parameters(), before))
    assert lost_in_bf16 > 0.9 * sum(b.numel() for b in before)  # (weights near 0 resolve finer)
    # ... yet the fp32 master weights took it
    assert changed > 0.5 * sum(b.numel() for b in before)


def test_a_bf16_model_computes_its_forward_in_bf16(model_dir, samples, monkeypatch):
    trainer = TorchTrainEngine(model_dir, small_config("model.dtype=bfloat16"))
    seen = []
    head = trainer.model.get_output_embeddings()
    original = head.forward
    monkeypatch.setattr(head, "forward", lambda h: seen.append(original(h).dtype) or original(h))
    trainer.logprobs(samples[:2])
    assert seen and set(seen) == {torch.bfloat16}


def test_gradient_checkpointing_gives_the_same_update(model_dir, samples):
    plain = TorchTrainEngine(model_dir, small_config())
    checkpointed = TorchTrainEngine(model_dir, small_config("train.gradient_checkpointing=true"))
    plain.step(samples)
    checkpointed.step(samples)
    for a, b in zip(plain.model.parameters(), checkpointed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
