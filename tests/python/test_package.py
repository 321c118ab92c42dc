import contextlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

import mirage
from mirage.info import registered_ops


# Every operator mirage registers (the public ops and the backward ops autograd calls).
OPS = ["add_layer_norm", "bias_act", "cfconv", "cfconv_backward", "geglu", "group_norm", "layer_norm", "linear",
       "message_passing", "neighbor_list", "painn_energy", "painn_update", "painn_update_backward",
       "painn_update_input", "painn_update_input_backward", "pair_product", "pair_vectors", "pair_vectors_backward",
       "radial_basis", "radial_basis_backward", "radial_cfconv", "radial_cfconv_backward", "schnet_energy",
       "schnet_energy_all_pairs", "schnet_energy_prepare",
       "sender_order", "subpixel_shuffle", "vector_message_passing", "vector_message_passing_backward",
       "verlet_forces_kick", "verlet_forces_kick_drift", "verlet_kick_drift"]


def test_info_lists_build_and_ops():
    out = subprocess.run([sys.executable, "-m", "mirage", "info"], check=True, capture_output=True, text=True).stdout
    lines = out.splitlines()
    built = mirage.build_info()
    assert lines[0] == f"mirage {mirage.__version__}"
    cuda_built = built["cuda_version"] or "none (CPU-only build)"
    assert lines[1] == f"built against: torch {built['torch_version']}, CUDA {cuda_built}"
    assert lines[2] == f"running:       torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"
    archs = ", ".join("sm_" + arch for arch in built["cuda_archs"]) or "none"
    assert lines[3] == f"compiled GPU architectures: {archs}"
    if torch.cuda.is_available():
        assert lines[4].startswith(f"GPU: {torch.cuda.get_device_name()} (sm_")
        overlapped = (built["cuda_version"] and torch.cuda.get_device_capability() >= (9, 0)
                      and os.environ.get("MIRAGE_OVERLAP_LAUNCHES") != "0")
        assert lines[5].startswith("kernel launches: " + ("overlapped (" if overlapped else "plain ("))
    else:
        assert lines[4] == "GPU: none"
        assert lines[5] == "kernel launches: plain (no GPU)"
    assert lines[6] == f"C++ (CMake): find_package(mirage) with CMAKE_PREFIX_PATH={mirage.cmake_prefix_path}"
    assert lines[7] == "ops:" and lines[8:] == [f"  mirage::{op}" for op in OPS]


def test_build_info_matches_running_torch():
    info = mirage.build_info()
    assert info["torch_version"] == torch.__version__
    assert info["version"] == mirage.__version__


@pytest.mark.skipif(not mirage._build_info.WITH_CUDA or not os.environ.get("MIRAGE_CUDA_ARCHS"),
                    reason="a CUDA build made with MIRAGE_CUDA_ARCHS set")
def test_build_info_lists_the_requested_archs():
    assert mirage.build_info()["cuda_archs"] == os.environ["MIRAGE_CUDA_ARCHS"].split(";")


def test_isolated_builds_use_the_torch_the_makefile_installs():
    """`pip install .` compiles against pyproject.toml's build requirement, `make` installs the
    Makefile's TORCH_VERSION: the two must name one torch, or the README's install breaks."""
    root = Path(__file__).resolve().parents[2]
    build = re.search(r'"torch==([^"]+)"', (root / "pyproject.toml").read_text()).group(1)
    make = re.search(r"^TORCH_VERSION \?= (\S+)$", (root / "Makefile").read_text(), re.MULTILINE).group(1)
    assert build == make


def test_the_installed_package_requires_exactly_the_torch_it_was_built_against():
    """A range would let pip keep or install another torch beside the compiled library."""
    release = mirage.build_info()["torch_version"].split("+")[0]
    torch_requirements = [r for r in importlib.metadata.requires("mirage-ops") if re.match(r"torch\b", r)]
    assert torch_requirements == [f"torch=={release}"]


def test_the_torch_pin_drops_only_the_local_label():
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("torch_pin", root / "build_support" / "torch_pin.py")
    torch_pin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_pin)
    assert torch_pin.torch_requirement("2.14.1") == "torch==2.14.1"
    assert torch_pin.torch_requirement("2.14.1+cu130") == "torch==2.14.1"
    assert torch_pin.torch_requirement("2.15.0.dev20261201+cpu") == "torch==2.15.0.dev20261201"
    # PEP 440: a pin without a local label accepts every local build of that release, and no other.
    pin = Requirement(torch_pin.torch_requirement("2.14.1+cu130")).specifier
    assert pin.contains("2.14.1+cpu") and pin.contains("2.14.1") and not pin.contains("2.14.10")


def test_the_sdist_leaves_the_torch_requirement_to_each_wheel_built_from_it(tmp_path):
    """METADATA 2.2: a field the sdist does not mark Dynamic must be the same in every wheel built
    from it, and installers may trust the sdist's; the pin is the torch of each wheel's build."""
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", f"from scikit_build_core.build import build_sdist; build_sdist({str(tmp_path)!r})"],
                   cwd=root, check=True, capture_output=True)
    sdist, = tmp_path.glob("mirage_ops-*.tar.gz")
    with tarfile.open(sdist) as archive:
        info = archive.extractfile(next(m for m in archive.getmembers() if m.name.endswith("/PKG-INFO"))).read().decode()
    fields = [line for line in info.splitlines() if line.startswith(("Requires-Dist: torch", "Dynamic:"))]
    assert "Dynamic: Requires-Dist" in fields and any(f.startswith("Requires-Dist: torch==") for f in fields)


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without a GPU")
def test_demo_on_cuda_without_a_gpu_says_so():
    run = subprocess.run([sys.executable, "-m", "mirage", "demo", "--device", "cuda"], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--device cuda: no CUDA GPU is available to this torch" in run.stderr


@pytest.mark.parametrize("device, message", [("cpux", "--device 'cpux' is not a torch device"),
                                             ("meta", "--device meta: the demo runs on cuda or cpu")])
def test_demo_refuses_other_devices_by_name(device, message):
    run = subprocess.run([sys.executable, "-m", "mirage", "demo", "--device", device], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr and message in run.stderr


def _op_wrappers():
    """mirage.ops's functions that take a required tensor (annotated ``Tensor``), with its names."""
    for name, fn in sorted(vars(mirage.ops).items()):
        if inspect.isfunction(fn) and fn.__module__ == "mirage.ops" and not name.startswith("_"):
            parameters = inspect.signature(fn).parameters.values()
            tensors = [p.name for p in parameters if p.annotation == "Tensor"]
            if tensors:
                yield name, fn, tensors


@pytest.mark.parametrize("name", [name for name, _, _ in _op_wrappers()])
def test_every_wrapper_names_a_missing_tensor(name):
    # None where a tensor is required: the dispatcher's own message ("tensor does not have a
    # device") names neither the op nor the argument. A list: the wrappers that read a dtype or a
    # shape first raised AttributeError ("'list' object has no attribute 'dim'").
    # The wrappers check in Python, so under inference mode too (which skips the Autograd kernels
    # that check raw torch.ops calls).
    _, fn, tensors = next(entry for entry in _op_wrappers() if entry[0] == name)
    for missing in tensors:
        for mode in (torch.enable_grad, torch.inference_mode):
            for wrong, got in ((None, "None"), ([[1.0]], "list")):
                with mode(), pytest.raises(RuntimeError, match=rf"^mirage::{name}: {missing} must be a tensor, got {got}$"):
                    fn(**{tensor: wrong if tensor == missing else torch.zeros(1) for tensor in tensors})


# The ops with no Autograd kernel of mirage's own (no gradient formula), called with None for a
# tensor, raise PyTorch's own error (docs/ops.md).
def _placeholder(argument):
    """A value of the argument's type for a call that must fail before any kernel reads it."""
    kind = str(argument.type)
    if kind.startswith("Optional[") or kind.endswith("?"):
        return None
    return {"Tensor": torch.ones(2, 3), "int": 1, "float": 1.0, "bool": False, "str": "none",
            "ScalarType": torch.float32, "List[Tensor]": []}[kind]


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode", "autocast"])
@pytest.mark.parametrize("name", [n.split("::")[1] for n in registered_ops()])
def test_every_raw_op_names_a_missing_tensor(name, mode):
    """torch.ops.mirage.<op> with None for a `Tensor` argument names the op and the argument in
    every mode: under grad mode each Autograd kernel checks (before torch::autograd::Function
    rejects the undefined tensor with "tensor does not have a device"), and each op's BackendSelect
    kernel checks in every mode, inference mode (which skips Autograd) and ops without a gradient
    formula included; under autocast, whose kernels run first, too (painn_update's once asked
    PyTorch for the dtype of the None). With every tensor None, the call has no backend at all."""
    op = getattr(torch.ops.mirage, name)
    arguments = op.default._schema.arguments
    context = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[mode]
    tensors = [index for index, argument in enumerate(arguments) if str(argument.type) == "Tensor"]
    assert tensors, name
    with context():
        for index in tensors:
            values = [None if i == index else _placeholder(a) for i, a in enumerate(arguments)]
            with pytest.raises(RuntimeError, match=rf"^mirage::{name}: {arguments[index].name} must be a tensor, got None$"):
                op(*values)
        first = arguments[tensors[0]].name
        with pytest.raises(RuntimeError, match=rf"^mirage::{name}: {first} must be a tensor, got None$"):
            op(*[None if i in tensors else _placeholder(a) for i, a in enumerate(arguments)])


def test_integer_arguments_are_not_truncated():
    pairs = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(TypeError, match=r"^mirage::sender_order: num_nodes must be an int, got float 4.7$"):
        mirage.ops.sender_order(pairs, 4.7)
    assert mirage.ops.sender_order(pairs, torch.tensor(2)).shape == (0,)  # an integer tensor is an int
    with pytest.raises(TypeError, match=r"^mirage.ops.radial_cfconv_supported: hidden must be an int, got float"):
        mirage.ops.radial_cfconv_supported(20, 64.5, 64, "cpu")
    with pytest.raises(TypeError, match=r"^mirage.ops.fused_filter_supported: basis must be an int, got str"):
        mirage.ops.fused_filter_supported(128, "20", "cpu")


@pytest.mark.parametrize("call, where", [
    (lambda flag: mirage.ops.group_norm(torch.randn(1, 4, 2), flag), "mirage::group_norm: num_groups"),
    (lambda flag: mirage.ops.neighbor_list(torch.randn(5, 3), 2.0, max_pairs=flag), "mirage::neighbor_list: max_pairs"),
    (lambda flag: mirage.ops.radial_basis(torch.rand(5), "gaussian", flag, 5.0, "cosine"), "mirage::radial_basis: num"),
    (lambda flag: mirage.ops.sender_order(torch.zeros(2, 3, dtype=torch.long), flag),
     "mirage::sender_order: num_nodes"),
])
def test_wrappers_refuse_a_bool_for_a_count(call, where):
    # PyTorch's schemas read True as 1: neighbor_list kept 1 pair, group_norm ran one group.
    for flag in (True, torch.tensor(True)):
        with pytest.raises(TypeError, match=f"^{where} must be an int, got"):
            call(flag)


@pytest.mark.parametrize("call, where", [
    (lambda flag: mirage.ops.neighbor_list(torch.randn(5, 3), 2.0, max_pairs=8, half=flag), "mirage::neighbor_list: half"),
    (lambda flag: mirage.ops.cfconv(*[torch.zeros(1)] * 5, None, torch.zeros(1), None, tf32=flag), "mirage::cfconv: tf32"),
])
def test_wrappers_take_only_a_bool_for_a_flag(call, where):
    # PyTorch's schemas read 0.5 as True, and a string failed in its argument parser, unnamed.
    for wrong, got in ((0.5, "float 0.5"), ("no", "str 'no'")):
        with pytest.raises(TypeError, match=f"^{where} must be True or False, got {got}$"):
            call(wrong)


_T = torch.zeros(1)
_REAL_ARGUMENTS = [
    (mirage.ops.group_norm, dict(x=_T, num_groups=1), "eps", "group_norm"),
    (mirage.ops.layer_norm, dict(x=_T), "eps", "layer_norm"),
    (mirage.ops.layer_norm, dict(x=_T, residual=_T), "eps", "add_layer_norm"),
    (mirage.ops.bias_act, dict(x=_T), "scale", "bias_act"),
    (mirage.ops.neighbor_list, dict(positions=_T, max_pairs=4), "cutoff", "neighbor_list"),
    (mirage.ops.radial_basis, dict(distances=_T, kind="gaussian", num=2, cutoff_fn="cosine"), "cutoff", "radial_basis"),
    (mirage.ops.painn_update_input, dict(s=_T, vv=_T), "eps", "painn_update_input"),
    (mirage.ops.schnet_energy, dict(atomic_numbers=_T, embedding=_T, pairs=_T, vectors=_T, num_rbf=2, weights=[],
                                    activations=[]), "cutoff", "schnet_energy"),
    (mirage.ops.schnet_energy_all_pairs, dict(atomic_numbers=_T, embedding=_T, positions=_T, num_rbf=2, weights=[],
                                              activations=[]), "cutoff", "schnet_energy_all_pairs"),
    (mirage.ops.schnet_energy_prepare, dict(embedding=_T, num_rbf=2, weights=[], activations=[]), "cutoff",
     "schnet_energy_prepare"),
    (mirage.ops.painn_energy, dict(atomic_numbers=_T, embedding=_T, pairs=_T, vectors=_T, cutoff=5.0, num_rbf=2,
                                   weights=[], activations=[]), "norm_eps", "painn_energy"),
    (mirage.ops.painn_energy, dict(atomic_numbers=_T, embedding=_T, pairs=_T, vectors=_T, num_rbf=2, weights=[],
                                   activations=[]), "cutoff", "painn_energy"),
    (mirage.ops.radial_cfconv, dict(x=_T, distances=_T, pairs=_T, weight1=_T, bias1=_T, weight2=_T, bias2=_T),
     "cutoff", "radial_cfconv"),
    (mirage.ops.verlet_kick_drift, dict(positions=_T, velocities=_T, forces=_T, inverse_masses=_T, drift=1.0), "kick",
     "verlet_kick_drift"),
    (mirage.ops.verlet_kick_drift, dict(positions=_T, velocities=_T, forces=_T, inverse_masses=_T, kick=1.0), "drift",
     "verlet_kick_drift"),
    (mirage.ops.verlet_forces_kick, dict(velocities=_T, forces=_T, energy=_T, grad=_T, model_energy=_T,
                                         inverse_masses=_T), "kick", "verlet_forces_kick"),
    (mirage.ops.verlet_forces_kick_drift, dict(positions=_T, velocities=_T, forces=_T, energy=_T, grad=_T,
                                               model_energy=_T, inverse_masses=_T, drift=1.0), "kick",
     "verlet_forces_kick_drift"),
    (mirage.ops.verlet_forces_kick_drift, dict(positions=_T, velocities=_T, forces=_T, energy=_T, grad=_T,
                                               model_energy=_T, inverse_masses=_T, kick=1.0), "drift",
     "verlet_forces_kick_drift"),
]


@pytest.mark.parametrize("wrapper, arguments, name, op", _REAL_ARGUMENTS,
                         ids=[f"{op}-{name}" for _, _, name, op in _REAL_ARGUMENTS])
def test_wrappers_refuse_a_bool_or_a_string_for_a_real(wrapper, arguments, name, op):
    # PyTorch's schemas read True as 1.0: neighbor_list listed the pairs closer than 1.
    for value in (True, torch.tensor(True), "5.0", torch.ones(2)):
        with pytest.raises(TypeError, match=f"^mirage::{op}: {name} must be a real number, got"):
            wrapper(**arguments, **{name: value})
    # An int past float's range: Python's OverflowError named neither.
    with pytest.raises(TypeError, match=f"^mirage::{op}: {name} must be a real number within float's range, "
                                        r"got int 2\*\*1328 or more"):
        wrapper(**arguments, **{name: 10**400})


def test_real_arguments_take_numpy_floats_ints_and_0_dim_tensors():
    np = pytest.importorskip("numpy")
    positions = torch.tensor([[0.0, 0.0, 0.0], [1.5, 0.0, 0.0], [0.0, 2.5, 0.0]])
    for cutoff in (2.0, 2, np.float32(2.0), np.int64(2), torch.tensor(2.0)):
        assert mirage.ops.neighbor_list(positions, cutoff, max_pairs=8).num_pairs.item() == 2, cutoff
    assert mirage.ops.neighbor_list(positions, 3.0, max_pairs=8).num_pairs.item() == 6  # every pair both ways


def test_counts_take_numpy_integers_and_refuse_bools():
    """Every count argument is read by one rule (mirage._arguments.count): NumPy's integers are
    ints, True is not 1 (the MD driver refused it while optimize, GraphCache and GroupNorm took it)."""
    np = pytest.importorskip("numpy")
    cache = mirage.graphs.GraphCache(lambda x: x, np.int64(3))
    assert cache.max_entries == 3 and type(cache.max_entries) is int
    assert mirage.nn.GroupNorm(np.int32(2), 4).num_groups == 2
    with pytest.raises(ValueError, match=r"^mirage.graphs.GraphCache: max_entries must be an int >= 1, got True$"):
        mirage.graphs.GraphCache(lambda x: x, True)
    with pytest.raises(ValueError, match=r"^mirage.nn.GroupNorm: num_groups must be an int >= 1, got True$"):
        mirage.nn.GroupNorm(True, 4)
    with pytest.raises(ValueError, match=r"^mirage.optimize: max_graphs must be an int >= 1, got True$"):
        mirage.optimize(torch.nn.Linear(2, 2), max_graphs=True, verbose=False)


# Inference tensors (frozen features made under torch.inference_mode) beside trainable parameters:
# PyTorch's composite saves its own intermediate for the backward (the activation, the sum with
# the residual, the gathered rows), mirage's ops save their inputs, which autograd refused for
# inference tensors.
_RING = torch.tensor([[0, 1, 2], [1, 2, 0]])  # three nodes, pairs (i, j) in a ring
_FEEDS_TRAINABLE = {
    "linear": (lambda x, p: mirage.ops.linear(x, p, input_activation="silu"),
               lambda x, p: torch.nn.functional.linear(torch.nn.functional.silu(x), p), (8, 16)),
    "bias_act": (lambda x, p: mirage.ops.bias_act(x, p, activation="silu"),
                 lambda x, p: torch.nn.functional.silu(x + p[:, None, None]), (16,)),
    "layer_norm": (lambda x, p: mirage.ops.layer_norm(x, p, residual=x)[0],
                   lambda x, p: torch.nn.functional.layer_norm(x + x, (16,), p), (16,)),
    # Messages of frozen features x (node i of 3 gets x[j] * filter over the pairs (i, j)).
    "message_passing": (lambda x, p: mirage.ops.message_passing(x[:, 0, 0], p, _RING),
                        lambda x, p: torch.zeros_like(x[:, 0, 0]).index_add(0, _RING[0], x[_RING[1], 0, 0] * p),
                        (3, 16)),
}


@pytest.mark.parametrize("name", sorted(_FEEDS_TRAINABLE))
def test_inference_tensors_feed_trainable_parameters(name):
    fused, composite, shape = _FEEDS_TRAINABLE[name]
    with torch.inference_mode():
        x = torch.randn(3, 16, 4, 16, dtype=torch.float64)
    parameter = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    got, expected = fused(x, parameter), composite(x, parameter)
    torch.testing.assert_close(got, expected)
    grad = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, parameter, grad), torch.autograd.grad(expected, parameter, grad))
    # Held as they are, not copied: a call that records no backward (no_grad) runs the same ops
    # on an inference tensor as on another.
    ops_run = []
    for features in (x, x.clone()):
        with torch.no_grad(), torch.profiler.profile() as profile:
            fused(features, parameter)
        ops_run.append(sorted(event.name for event in profile.events()))
    assert ops_run[0] == ops_run[1]
