"""The project-built CPU default model: a tiny Qwen2 with a byte-level tokenizer.

No model hub is reachable on CPU machines, so bidirl builds its own base model. It is a standard
``transformers`` Qwen2 (so vLLM serves it unchanged) saved in Hugging Face format: ``config.json``,
``model.safetensors``, ``tokenizer.json``/``tokenizer_config.json``.

The tokenizer is Qwen2's own byte-level BPE (backed by ``tokenizers``) with an empty merge list: one
token per byte, plus ``<|endoftext|>`` (id 0) as EOS and pad. Byte tokens keep arithmetic learnable by
a model of a few million parameters, cover any text, and -- because it *is* a ``Qwen2Tokenizer`` --
transformers' AutoTokenizer and vLLM rebuild exactly the same tokenizer from the saved files. (A custom
character-level ``tokenizers`` model would be silently replaced by Qwen2Tokenizer when loaded next to a
Qwen2 config.)
"""

from __future__ import annotations

from pathlib import Path

from bidirl.config import TinyModelConfig

EOS = "<|endoftext|>"


def build_tokenizer():
    """A byte-level ``Qwen2Tokenizer``: id 0 is EOS/pad, ids 1..256 are the bytes."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {EOS: 0}
    for symbol in bytes_to_unicode().values():
        vocab[symbol] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token=EOS, pad_token=EOS
    )
    tokenizer.padding_side = "left"
    tokenizer.model_max_length = 4096
    return tokenizer


VOCAB_SIZE = 257  # EOS + 256 bytes: the size of build_tokenizer()'s vocabulary


def tiny_config(cfg: TinyModelConfig, vocab_size: int = VOCAB_SIZE):
    """The Qwen2 config of the configured shape, with tied embeddings."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        torch_dtype="float32",
    )


def build_model(cfg: TinyModelConfig, vocab_size: int, seed: int):
    """A randomly initialised Qwen2 causal LM of the configured shape."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config(cfg, vocab_size))


def save_hf(model, tokenizer, directory: Path) -> None:
    """Hugging Face layout that both transformers and vLLM load from a local path."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
