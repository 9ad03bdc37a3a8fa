"""DeepSpeed ZeRO engine = torch engine, step for step (DeepSpeed on CPU with gloo, a world of one)."""

import importlib.util

import pytest
import torch

from bidirl.engines.hf_rollout import HFRolloutEngine
from bidirl.samples import SamplingParams
from bidirl.engines.torch_train import TorchTrainEngine
from bidirl.grpo import assign_advantages
from tests.builders import small_config, small_model_dir

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


def scored_samples(model_dir):
    """Two prompts' groups of 4 from the model, rewarded and with their group advantages."""
    samples = HFRolloutEngine(model_dir).generate(["Calculate 3 + 4.", "Calculate 9 - 2."],
                                                  SamplingParams(n=4, max_new_tokens=5, seed=0))
    for i, s in enumerate(samples):
        s.reward = float(i % 3 == 0)
    assign_advantages(samples)
    return samples


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_steps_match_the_torch_engine(tmp_path, stage):
    from bidirl.engines.deepspeed_train import DeepSpeedTrainEngine

    model_dir = small_model_dir(tmp_path)
    samples = scored_samples(model_dir)
    cfg = small_config("train.engine=deepspeed", f"train.zero_stage={stage}", "train.micro_batch_size=3")
    reference, ds = TorchTrainEngine(model_dir, cfg), DeepSpeedTrainEngine(model_dir, cfg)
    for _ in range(2):
        ref_stats, ds_stats = reference.step(samples), ds.step(samples)
        assert ds_stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-6)
    assert ds.version == reference.version == 2
    for (name, a), b in zip(reference.state_dict().items(), ds.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_a_deepspeed_checkpoint_resumes_the_same_training(tmp_path):
    """Save, load into a fresh engine, step both: the same weights (what ``bidirl launch --resume`` relies on)."""
    import copy

    from bidirl.engines.deepspeed_train import DeepSpeedTrainEngine

    model_dir = small_model_dir(tmp_path)
    samples = scored_samples(model_dir)
    cfg = small_config("train.engine=deepspeed", "train.zero_stage=0", "train.micro_batch_size=3")
    trained = DeepSpeedTrainEngine(model_dir, cfg)
    trained.step(copy.deepcopy(samples))
    trained.save(str(tmp_path / "ckpt"))
    resumed = DeepSpeedTrainEngine(model_dir, cfg)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.version == trained.version == 1
    trained.step(copy.deepcopy(samples))
    resumed.step(copy.deepcopy(samples))
    for (name, a), b in zip(trained.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
