import os
import subprocess
import sys

import pytest
import torch

import mirage


def test_info_lists_build_and_ops():
    out = subprocess.run([sys.executable, "-m", "mirage", "info"], check=True, capture_output=True, text=True).stdout
    assert f"mirage {mirage.__version__}" in out
    assert f"torch {torch.__version__}" in out
    for op in ("mirage::group_norm", "mirage::layer_norm", "mirage::add_layer_norm", "mirage::geglu", "mirage::bias_act",
               "mirage::subpixel_shuffle"):
        assert op in out


def test_build_info_matches_running_torch():
    info = mirage.build_info()
    assert info["torch_version"] == torch.__version__
    assert info["version"] == mirage.__version__


@pytest.mark.skipif(not mirage._build_info.WITH_CUDA or not os.environ.get("MIRAGE_CUDA_ARCHS"),
                    reason="a CUDA build made with MIRAGE_CUDA_ARCHS set")
def test_build_info_lists_the_requested_archs():
    assert mirage.build_info()["cuda_archs"] == os.environ["MIRAGE_CUDA_ARCHS"].split(";")


def test_mismatched_torch_is_refused_with_rebuild_advice():
    with pytest.raises(ImportError, match=r"built against torch 2\.0\.0, but torch .* is installed\. Rebuild"):
        mirage._check_torch_version("2.0.0", torch.__version__)
    mirage._check_torch_version(torch.__version__, torch.__version__)


def test_demo_runs_on_cpu():
    out = subprocess.run([sys.executable, "-m", "mirage", "demo", "--device", "cpu"],
                         check=True, capture_output=True, text=True).stdout
    assert "swapped 8 modules" in out
    error = float(out.split("max abs error vs the original: ")[1].split()[0])
    assert error < 1e-4
