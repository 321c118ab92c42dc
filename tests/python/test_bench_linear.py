"""benchmarks/bench_linear.py on the GPU: every shape timed for mirage (its timed choice, the tiled
kernel and cuBLASLt alone) and PyTorch, mirage's results within float32's error of float64."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.cuda
def test_run_times_every_shape(tmp_path):
    out = tmp_path / "linear.json"
    subprocess.run([sys.executable, "bench_linear.py", "--json", str(out)], cwd=ROOT / "benchmarks", check=True)
    result = json.loads(out.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_linear import SHAPES
    assert [row["shape"] for row in result["rows"]] == [shape[0] for shape in SHAPES]
    for row in result["rows"]:
        assert row["mirage us"] > 0 and row["F.linear us"] > 0 and row["cuBLASLt us"] > 0
        assert row["tiled us"] is None or row["tiled us"] > 0
        # Inputs ~N(0, 1), K <= 1280 of them: float32's rounding stays far below 1e-3.
        assert float(row["max error"]) < 1e-3, row
    # The tiled column is there where the kernel ran (the profiler's kernel names say): on the
    # 3,000-atom products, not on the few-rows kernel's 2 rows nor the narrow kernel's basis gradient.
    tiled = {row["shape"]: row["tiled us"] for row in result["rows"]}
    assert tiled["3,000 atoms, 128x128"] is not None and tiled["3,000 atoms, 128x128, x grad"] is not None
    assert tiled["time embedding"] is None and tiled["PaiNN basis grad, 3,000 atoms"] is None
