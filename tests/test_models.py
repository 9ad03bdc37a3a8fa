import json
from pathlib import Path

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
    problems = first.info["eval_problems"]  # its held-out evaluation when built, each problem right or wrong
    assert not first.reused and problems == cfg.data.eval_size
    assert first.info["accuracy"] * problems == pytest.approx(round(first.info["accuracy"] * problems), abs=1e-2)
    second = prepare_model(cfg)
    assert second.reused and second.path == first.path and second.info == first.info


def test_a_reused_base_model_says_what_its_recorded_accuracy_was_measured_on(tmp_path):
    # a later run may evaluate with another data.eval_size or rollout.max_new_tokens: the cache entry keeps
    # the build's own settings with its accuracy, and says so when it is reused
    prepare_model(_tiny_pipeline(tmp_path))
    said = []
    reused = prepare_model(_tiny_pipeline(tmp_path, "rollout.max_new_tokens=6", "data.eval_size=4"), report=said.append)
    assert reused.reused and reused.info["eval_max_new_tokens"] == 4
    assert said == [f"reusing cached base model {reused.path} (held-out accuracy {reused.info['accuracy']:.1%} when "
                    f"built, on {reused.info['eval_problems']} problems, max_new_tokens 4)"]


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


def test_two_builds_of_one_cache_entry_at_once_keep_the_first_finished_where_it_is(tmp_path):
    # (every node's launcher prepares its model, and on a shared filesystem they build into one cache: the
    # first run to finish may be loading from its entry while the other finishes building)
    from bidirl.models.cache import read_info, write_entry

    entry = tmp_path / "cache" / "tiny-entry"

    def build(folder: Path, name: str) -> dict:
        (folder / "config.json").write_text("{}")
        return {"source": name}

    def built_while_another_finished(folder: Path) -> dict:
        write_entry(entry, lambda other: build(other, "first"))
        in_place["inode"] = entry.stat().st_ino
        return build(folder, "second")

    in_place = {}
    second = write_entry(entry, built_while_another_finished)
    assert second.path == str(entry) and second.info["source"] == read_info(entry)["source"] == "first"
    assert entry.stat().st_ino == in_place["inode"]  # the same folder, never taken away
    assert [p.name for p in entry.parent.iterdir()] == ["tiny-entry"]  # and the second build's folder is gone


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


# ---- sizes counted from a config, nothing allocated ------------------------------------------------

@pytest.mark.parametrize("preset", ["1.5B", "7B", "8B", "14B", "32B"])
def test_the_analytic_presets_are_the_sizes_counted_from_their_published_architectures(preset):
    from bidirl.models.footprint import config_from_fields, count_model
    from bidirl.perf.analytic import ARCHITECTURES, MODELS

    counted = count_model(config_from_fields(ARCHITECTURES[preset]), preset)
    assert MODELS[preset].params == pytest.approx(counted.params, rel=1e-4)
    assert MODELS[preset].kv_bytes_per_token == counted.kv_bytes_per_token
    assert MODELS[preset].buffer_bytes == counted.buffer_bytes and MODELS[preset].layers == counted.layers
    widths = ("hidden_size", "intermediate_size", "vocab_size")
    assert [getattr(MODELS[preset], w) for w in widths] == [getattr(counted, w) for w in widths]


def test_a_model_folder_counted_without_weights_has_exactly_the_parameters_of_the_loaded_model(tmp_path):
    from bidirl.models.footprint import model_spec_of
    from tests.builders import small_model_dir

    folder = small_model_dir(tmp_path / "model")
    model, _ = load_model(folder)
    spec = model_spec_of(load_config(None, []), folder)
    assert spec.params == sum(p.numel() for p in model.parameters())  # tied embeddings once, biases, norms
    assert spec.kv_bytes_per_token == 2 * 2 * SMALL.num_kv_heads * (SMALL.hidden_size // SMALL.num_heads) * 2
    pipeline = model_spec_of(load_config(None, ["model.tiny.hidden_size=64", "model.tiny.num_layers=2",
                                                "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
                                                "model.tiny.intermediate_size=128"]), "pipeline")
    assert pipeline.params == spec.params  # the project-built model's own config, never built


def test_the_planner_checks_memory_with_the_counted_size_of_the_pipelines_model(tmp_path):
    from bidirl.planner import plan
    from bidirl.sim.run import perf_model

    big = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
           "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256}  # a 70B shape
    (tmp_path / "config.json").write_text(json.dumps(big))
    cfg = load_config("pipelines/sim-32gpu.yaml", [f"sim.model={tmp_path}", "sim.hardware=H20", "cluster.devices=4"])
    assert perf_model(cfg).model.params == pytest.approx(70.6e9, rel=0.01)
    for policy in ("sync", "areal"):
        with pytest.raises(BidirlError, match="does not fit"):
            plan(cfg, policy)


@pytest.mark.parametrize("value,message", [
    ("7b", "key 'sim.model' must be one of 1.5B, 7B"),
])
def test_an_unknown_model_size_is_one_line_naming_the_key(value, message):
    with pytest.raises(BidirlError, match=message):
        load_config("pipelines/sim-32gpu.yaml", [f"sim.model={value}"])


def test_a_model_config_that_is_not_one_is_one_line_naming_the_file(tmp_path):
    from bidirl.models.footprint import model_spec_of

    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(BidirlError, match="needs 'model_type'"):
        model_spec_of(load_config(None, []), str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BidirlError, match="not a readable model config"):
        model_spec_of(load_config(None, []), str(tmp_path))


def test_a_hub_model_is_resolved_once_to_a_local_folder_from_the_cache_so_no_worker_downloads(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    save_hf(build_model(SMALL, len(build_tokenizer()), seed=0), build_tokenizer(), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    prepared = prepare_model(load_config(None, ["model.source=org/tiny"]))
    assert prepared.path == str(snapshot) and prepared.source == "org/tiny"
    assert load_model(prepared.path)[0] is not None


def test_a_hub_model_neither_reachable_nor_cached_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(BidirlError, match="'org/absent': cannot fetch it from the hub or find it in the local cache"):
        prepare_model(load_config(None, ["model.source=org/absent"]))
