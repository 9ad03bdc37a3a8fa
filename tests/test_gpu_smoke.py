"""The prepared GPU smoke test runs its CPU-side path here (it has not met a GPU in this repo yet)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "gpu_smoke"))


def test_the_smoke_test_passes_every_check_the_cpu_can_run(tmp_path):
    from smoke import main

    report = main(["--device", "cpu", "--shape", "tiny", "--launch-steps", "2", "--out", str(tmp_path / "smoke.json")])
    assert report["passed"], report
    assert set(report["checks"]) == {"collective", "train_step", "weight_load_checksum", "weight_load_logprobs",
                                     "no_memory_growth", "launch"}
    assert report["weight_load"]["vllm_checksum"] is not None  # read inside vLLM, not assumed
    assert report["launch"]["steps"] == 2 and report["launch"]["workers"] == 2
