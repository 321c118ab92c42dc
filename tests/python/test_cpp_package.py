"""find_package(mirage) from a LibTorch program, as a user builds one against the installed package.

Configures, builds and runs a small CMake project outside the repository: one program calls the
C++ API (mirage::group_norm on CPU tensors, checked against ATen's composite), another only loads
TorchScript modules that call mirage's ops (a scripted group norm, and a model mirage.optimize
returned, traced), and it uses no mirage symbol, so it needs the --no-as-needed link that
mirage::mirage carries; it is linked with --as-needed and again behind what TorchConfig's
targets put on the line. Also: a torch beside mirage other than
the one it was built against is refused at configure time.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import mirage
from common import randn

CMAKE_LISTS = """
cmake_minimum_required(VERSION 3.24)
project(mirage_consumer CXX)
find_package(mirage 0.1 REQUIRED)
add_executable(call_api call_api.cpp)
target_link_libraries(call_api PRIVATE mirage::mirage)
add_library(load_script_main OBJECT load_script.cpp)
target_link_libraries(load_script_main PRIVATE mirage::mirage)
add_executable(load_script $<TARGET_OBJECTS:load_script_main>)
# As toolchains that link --as-needed by default do (Ubuntu's): mirage::mirage must undo it.
target_link_options(load_script PRIVATE LINKER:--as-needed)
target_link_libraries(load_script PRIVATE mirage::mirage)
# A program linking torch and mirage through one interface target of its own: ahead of mirage's,
# what TorchConfig's targets put on the line (a library bound to --no-as-needed, then --as-needed).
add_library(torch_like INTERFACE)
target_link_libraries(torch_like INTERFACE "-Wl,--no-as-needed,@C10@" "-Wl,--as-needed")
add_library(dependencies INTERFACE)
target_link_libraries(dependencies INTERFACE torch_like mirage::mirage)
add_executable(load_script_after_torch $<TARGET_OBJECTS:load_script_main>)
target_link_libraries(load_script_after_torch PRIVATE dependencies)
"""

CALL_API = r"""
#include <cstdio>
#include <ATen/ATen.h>
#include <mirage/mirage.h>

int main() {
  const at::Tensor x = at::randn({2, 12, 5, 7}), weight = at::randn({12}), bias = at::randn({12});
  const at::Tensor fused = mirage::group_norm(x, 3, weight, bias, 1e-5, "silu");
  const at::Tensor reference = at::silu(at::group_norm(x, 3, weight, bias, 1e-5));
  const double error = (fused - reference).abs().max().item<double>();
  std::printf("mirage %s, max error %.3g\n", mirage::build_info().version.c_str(), error);
  return error < 1e-5 ? 0 : 1;
}
"""

LOAD_SCRIPT = r"""
#include <cstdio>
#include <torch/script.h>

// Calls no mirage function: only the linked libmirage registers the ops the module calls. The
// module is the scripted group norm, or a traced model holding an example input and its output.
int main(int argc, char** argv) {
  if (argc != 2) return 2;
  torch::jit::Module module = torch::jit::load(argv[1]);
  at::Tensor x, expected;
  if (module.hasattr("expected")) {
    x = module.attr("example").toTensor();
    expected = module.attr("expected").toTensor();
  } else {
    const at::Tensor weight = module.attr("weight").toTensor(), bias = module.attr("bias").toTensor();
    x = at::randn({2, weight.size(0), 4, 3});
    expected = at::silu(at::group_norm(x, 4, weight, bias, 1e-5));
  }
  const at::Tensor y = module.forward({x}).toTensor();
  const double error = (y - expected).abs().max().item<double>();
  std::printf("loaded module, max error %.3g\n", error);
  return error < 1e-5 ? 0 : 1;
}
"""


class GroupNormSiLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(randn(8))
        self.bias = nn.Parameter(randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mirage.group_norm(x, 4, self.weight, self.bias, 1e-5, "silu")


class TracedWithExample(nn.Module):
    """A model to trace, with an example input and the model's output for it as buffers, which
    the C++ program reads back to check the traced module."""

    def __init__(self, model: nn.Module, example: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("example", example)
        with torch.no_grad():
            self.register_buffer("expected", model(example))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _optimized_and_traced(path: Path) -> None:
    """mirage.optimize of a small Conv-BN-SiLU + GroupNorm-SiLU net, traced with torch.jit.trace and saved."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.GroupNorm(2, 8), nn.SiLU())
    optimized = mirage.optimize(net.eval(), dtype=torch.float32, verbose=False)
    assert mirage.report(optimized).counts == {"conv_bn_silu": 1, "group_norm_silu": 1}
    example = TracedWithExample(optimized, randn(2, 3, 6, 5))
    with torch.no_grad():
        traced = torch.jit.trace(example, (example.example,))
    assert "mirage::group_norm" in str(traced.inlined_graph)
    traced.save(str(path))


def _cmake(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["cmake", *args], cwd=cwd, capture_output=True, text=True, timeout=900)


def _configure(source: Path, build: Path, prefix: str) -> subprocess.CompletedProcess:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    launcher = [f"-DCMAKE_CXX_COMPILER_LAUNCHER={shutil.which('ccache')}"] if shutil.which("ccache") else []
    return _cmake("-S", str(source), "-B", str(build), *generator, *launcher, f"-DCMAKE_PREFIX_PATH={prefix}",
                  "-DCMAKE_BUILD_TYPE=Release", cwd=source)


def _write(directory: Path, files: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))


def test_package_files_installed():
    config = Path(mirage.cmake_prefix_path) / "mirage" / "mirageConfig.cmake"
    assert config.is_file(), f"{config} missing: rebuild mirage (pip install --no-build-isolation -e .)"
    assert (config.parent / "mirageConfigVersion.cmake").is_file()
    header = Path(mirage.cmake_prefix_path).parents[1] / "include" / "mirage" / "mirage.h"
    assert header.read_text() == (Path(__file__).parents[2] / "csrc" / "include" / "mirage" / "mirage.h").read_text()
    assert f"CMAKE_PREFIX_PATH={mirage.cmake_prefix_path}" in mirage.info()


def test_find_package_builds_and_runs_a_libtorch_program(tmp_path):
    source = tmp_path / "consumer"
    c10 = Path(torch.__file__).parent / "lib" / "libc10.so"
    _write(source, {"CMakeLists.txt": CMAKE_LISTS.replace("@C10@", str(c10)), "call_api.cpp": CALL_API,
                    "load_script.cpp": LOAD_SCRIPT})
    build = tmp_path / "build"
    configured = _configure(source, build, mirage.cmake_prefix_path)
    assert configured.returncode == 0, configured.stdout + configured.stderr
    built = _cmake("--build", str(build), cwd=source)
    assert built.returncode == 0, built.stdout + built.stderr

    ran = subprocess.run([str(build / "call_api")], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"mirage {mirage.__version__}" in ran.stdout

    scripted, traced = tmp_path / "group_norm_silu.pt", tmp_path / "optimized_traced.pt"
    torch.jit.script(GroupNormSiLU()).save(str(scripted))
    _optimized_and_traced(traced)  # what optimize returns, traced for LibTorch (docs/optimize.md)
    for program in ("load_script", "load_script_after_torch"):
        for module in (scripted, traced):
            ran = subprocess.run([str(build / program), str(module)], capture_output=True, text=True, timeout=120)
            assert ran.returncode == 0, f"{program} {module.name}: {ran.stdout}{ran.stderr}"


def test_find_package_refuses_another_torch(tmp_path):
    # The installed config in a site-packages whose torch is another version, and the torch it was
    # built against gone (as after an isolated build): refused, naming both places.
    site = tmp_path / "site-packages"
    config_dir = site / "mirage" / "share" / "cmake" / "mirage"
    shutil.copytree(Path(mirage.cmake_prefix_path) / "mirage", config_dir)
    config = config_dir / "mirageConfig.cmake"
    # (An isolated build's config names no such place: its torch was a temporary copy.)
    built_torch = os.path.dirname(torch.__file__)
    config.write_text(config.read_text().replace(f'"{built_torch}"', f'"{tmp_path / "gone"}"'))
    _write(site / "torch", {"version.py": "__version__ = '1.0.0'\n"})
    source = tmp_path / "consumer"
    _write(source, {"CMakeLists.txt": "cmake_minimum_required(VERSION 3.24)\nproject(c CXX)\n"
                                      "find_package(mirage REQUIRED)\n"})
    configured = _configure(source, tmp_path / "build", str(site / "mirage" / "share" / "cmake"))
    assert configured.returncode != 0
    output = " ".join((configured.stdout + configured.stderr).split())
    assert f"was built against torch {torch.__version__}, which is not where it looked" in output
    assert f"{site / 'torch'} (1.0.0)" in output


@pytest.mark.skipif(sys.platform != "linux", reason="the config names Linux shared libraries")
@pytest.mark.parametrize("library", ["libmirage.so", mirage._C.__file__])
def test_library_finds_torch_beside_it(library):
    # Loaded outside Python's import order (no torch imported first), libmirage and mirage._C find
    # torch's libraries through their run paths: pip's layout relative to themselves, which
    # survives an isolated build.
    library = Path(mirage.cmake_prefix_path).parents[1] / Path(library).name
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "$ORIGIN/../torch/lib" in dynamic
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    resolved = subprocess.run(["ldd", str(library)], capture_output=True, text=True, env=env).stdout
    assert "not found" not in resolved, resolved
