import json

import pytest
import torch

from bidirl.config import load_config
from bidirl.errors import BidirlError
from bidirl.models.sources import INFO_FILE, load_model, prepare_model
from bidirl.models.tiny import build_model, build_tokenizer, save_hf
from tests.builders import SMALL


def _tiny_pipeline(tmp_path, *extra):
    return load_config(None, [
        f"model.cache_dir={tmp_path / 'cache'}", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
        "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=128",
        "model.tiny.sft_steps=3", "model.tiny.sft_batch_size=8", "model.tiny.sft_examples=64",
        "data.eval_size=8", "rollout.max_new_tokens=4", "logging.progress=false", *extra,
    ])


def test_tokenizer_round_trips_any_text_one_token_per_byte():
    tokenizer = build_tokenizer()
    text = "Question: Calculate 12 + 5.\nAnswer: 17 £"
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text.encode()) and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 0


def test_saved_tiny_model_reloads_with_transformers_and_gives_identical_logits(tmp_path):
    tokenizer = build_tokenizer()
    model = build_model(SMALL, len(tokenizer), seed=0).eval()
    save_hf(model, tokenizer, tmp_path)
    reloaded, reloaded_tokenizer = load_model(str(tmp_path))
    ids = tokenizer(["Calculate 3 + 4.", "1 - 1"], padding=True, return_tensors="pt")
    assert reloaded_tokenizer(["Calculate 3 + 4."]).input_ids == tokenizer(["Calculate 3 + 4."]).input_ids
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, reloaded(**ids).logits)
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"


def test_tiny_base_model_is_built_once_and_reused_from_cache(tmp_path):
    cfg = _tiny_pipeline(tmp_path)
    first = prepare_model(cfg)
    assert not first.reused and 0.0 <= first.info["accuracy"] <= 1.0
    second = prepare_model(cfg)
    assert second.reused and second.path == first.path and second.info == first.info


def test_a_changed_model_config_builds_a_new_cache_entry(tmp_path):
    first = prepare_model(_tiny_pipeline(tmp_path))
    other = prepare_model(_tiny_pipeline(tmp_path, "model.tiny.sft_steps=4"))
    assert other.path != first.path and not other.reused


def test_a_half_written_cache_entry_is_rebuilt_not_trusted(tmp_path):
    cfg = _tiny_pipeline(tmp_path)
    path = prepare_model(cfg).path
    (tmp_path / "cache" / path.split("/")[-1] / INFO_FILE).unlink()
    rebuilt = prepare_model(cfg)
    assert rebuilt.path == path and not rebuilt.reused
    assert json.loads((tmp_path / "cache" / path.split("/")[-1] / INFO_FILE).read_text())["source"] == "tiny"


def test_corrupt_weights_give_one_clear_error(tmp_path):
    tokenizer = build_tokenizer()
    save_hf(build_model(SMALL, len(tokenizer), seed=0), tokenizer, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(BidirlError, match=r"corrupt or unreadable model files"):
        load_model(str(tmp_path))


def test_a_local_folder_without_config_is_not_a_model(tmp_path):
    cfg = load_config(None, [f"model.source={tmp_path}"])
    with pytest.raises(BidirlError, match="no config.json"):
        prepare_model(cfg)


def test_a_missing_local_model_path_is_named(tmp_path):
    cfg = load_config(None, [f"model.source={tmp_path / 'nowhere'}"])
    with pytest.raises(BidirlError, match="no such model folder"):
        prepare_model(cfg)
