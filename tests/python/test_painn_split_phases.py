"""benchmarks/painn_split_phases.py: its stamps still find their places in cuda/painn_split.cu
and its harness still builds against the kernel (both drift silently when the kernel changes,
and the tool runs only on a GPU); on the GPU, a run that gives a time and every phase."""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import skip_unless_whole_model_clusters

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "painn_split_phases.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("painn_split_phases", SCRIPT)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_every_mark_and_cluster_barrier_gets_a_stamp(tmp_path):
    tool = load_tool()
    kernel = (ROOT / "cuda" / "painn_split.cu").read_text()
    stamped = tmp_path / "stamped.cu"
    assert tool.stamped_copy(ROOT / "cuda" / "painn_split.cu", stamped) == []
    text = stamped.read_text()
    barriers = kernel.count("cluster_sync();")
    stamps = len(re.findall(r"stamp\(rank, stamp_at, \d+\);", text))
    assert stamps == 1 + len(tool.MARKS) + barriers  # the start, the marks and each barrier's line
    # A mark the kernel lacks is reported, not silently dropped.
    renamed = tmp_path / "renamed.cu"
    renamed.write_text(kernel.replace("const int np = kept;", "const int kept_pairs = kept;"))
    assert tool.stamped_copy(renamed, tmp_path / "renamed_stamped.cu") == [r"  const int np = kept;"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_stamped_harness_builds(tmp_path):
    tool = load_tool()
    stamped = tmp_path / "stamped.cu"
    tool.stamped_copy(ROOT / "cuda" / "painn_split.cu", stamped)
    subprocess.run(tool.build_command(stamped, tmp_path / "harness", phases=True), check=True)


@pytest.mark.cuda
def test_run_on_the_gpu_gives_times_and_phases():
    skip_unless_whole_model_clusters()
    result = subprocess.run([sys.executable, str(SCRIPT), "--phases", "--rounds", "1"], capture_output=True,
                            text=True, check=True)
    assert re.search(r"round 1, painn_split\.cu: [0-9.]+ us a call in graphs of 20", result.stdout), result.stdout
    assert "gradient off the first build's by 0.0e+00" in result.stdout
    phases = re.findall(r"^\s+\d+\s+([0-9.]+)\s+[0-9.]+\s+line \d+:", result.stdout, re.MULTILINE)
    assert len(phases) > 20 and all(float(us) >= 0 for us in phases) and sum(map(float, phases)) > 10, result.stdout
