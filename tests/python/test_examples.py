"""The examples run as a user would run them (short, CPU-sized runs here; `-m cuda` runs them on
the GPU), so that a change elsewhere cannot break them unnoticed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def run_example(*args):
    result = subprocess.run([sys.executable, str(EXAMPLES / args[0]), *args[1:]], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_diffusion_unet_tiny_matches_eager():
    pytest.importorskip("diffusers")
    out = run_example("diffusion_unet.py", "--tiny")
    assert "swapped:" in out and "GroupNorm -> mirage.nn.GroupNorm" in out
    error = float(re.search(r"relative L2 error vs \S+ eager: (\S+)", out).group(1))
    # float32 weights on the CPU, float16 on a GPU (plain float16 eager is ~1.7e-3 off float32).
    assert error < (1e-5 if not torch.cuda.is_available() else 3e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_md_benzene_runs_both_integrators_and_writes_a_trajectory(device, tmp_path):
    ase_io = pytest.importorskip("ase.io")
    trajectory = tmp_path / "benzene.traj"
    out = run_example("md_benzene.py", "--device", device, "--ase-steps", "5", "--steps", "20",
                      "--steps-per-replay", "10", "--write-every", "10", "--trajectory", str(trajectory))
    assert out.count("verified:") == 3  # the optimized model against the original, three systems
    drifts = [float(d) for d in re.findall(r"max \|E_total - E_total\(0\)\| (\S+) eV", out)]
    assert len(drifts) == 2 and all(abs(d) < 1e-3 for d in drifts), out
    frames = ase_io.read(str(trajectory), index=":")
    assert len(frames) >= 2 and all(len(f) == 12 for f in frames)
    assert all(torch.isfinite(torch.as_tensor(f.positions)).all() for f in frames)
    # Under the thermostat the integrator's line reports the temperature, not the energy's change.
    out = run_example("md_benzene.py", "--device", device, "--ase-steps", "2", "--steps", "20",
                      "--steps-per-replay", "10", "--write-every", "10", "--langevin", "0.01")
    assert len(re.findall(r"max \|E_total - E_total\(0\)\|", out)) == 1
    assert re.search(r"mean temperature \d+ K \(target", out)


@pytest.mark.parametrize("args, message", [(["--timestep", "0"], "--timestep must be positive (got 0.0)"),
                                           (["--temperature", "nan"], "--temperature must be positive (got nan)"),
                                           (["--steps-per-replay", "0"], "--steps-per-replay must be at least 1")])
def test_md_benzene_refuses_bad_options_by_name(args, message):
    result = subprocess.run([sys.executable, str(EXAMPLES / "md_benzene.py"), *args], capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("device", DEVICES)
def test_the_force_field_guide_opens_with_code_that_runs(device):
    """docs/ff.md's first code block, as a user pastes it (from the repository's root); on the CPU
    without its .cuda() calls."""
    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "ff.md").read_text(), re.DOTALL).group(1)
    if device == "cpu":
        code = code.replace(".cuda()", "")
    code += "\nassert forces.shape == (12, 3) and bool(torch.isfinite(forces).all())\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
