"""benchmarks/bench_neighbor_list.py on the GPU: both searches timed at two box sizes (one each
side of the "auto" switch point), listing the same pairs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.cuda
def test_run_times_both_searches_and_they_agree(tmp_path):
    out = tmp_path / "nl.json"
    subprocess.run([sys.executable, "bench_neighbor_list.py", "--sides", "4,8", "--json", str(out)],
                   cwd=ROOT / "benchmarks", check=True)
    rows = json.loads(out.read_text())["rows"]
    assert [row["atoms"] for row in rows] == [192, 1536]
    for row in rows:
        assert row["same pairs"] is True
        assert row["pairs"] > 40 * row["atoms"]  # water's density at a 5 A cutoff: ~46 per atom
        assert row["direct us"] > 0 and row["cell_list us"] > 0
