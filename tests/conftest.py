"""Shared builders for the tests. The real GSM8K files live in ../shared (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def write_yaml(tmp_path):
    """write_yaml("a: 1") -> path of a YAML file holding that text."""

    def write(text: str, name: str = "pipeline.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
