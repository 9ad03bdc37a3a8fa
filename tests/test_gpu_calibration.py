"""The prepared GPU calibration script runs its CPU-side path here (it has not met a GPU in this repo yet)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "gpu_calibration"))


def test_the_calibration_script_measures_fits_and_compares_on_a_tiny_shape(tmp_path):
    from calibrate import main

    report = main(["--device", "cpu", "--shape", "tiny", "--out", str(tmp_path / "report.json")])
    assert (tmp_path / "report.json").stat().st_size > 0
    assert len(report["decode"]) == 2 and all(p["step_s"] > 0 for p in report["decode"])
    assert report["train_tokens_per_s"] > 0 and report["copy_bytes_per_s"] > 0 and report["matmul_flops"] > 0
    quantities = [row["quantity"] for row in report["comparison"]["rows"]]
    assert any(q.startswith("decode step") for q in quantities) and "HBM bytes/s" in quantities
    assert report["comparison"]["fitted"]["rollout_efficiency"] > 0
