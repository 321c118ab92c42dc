"""mirage.ff.optimize and mirage.ff.fused: the fused SchNet/PaiNN against the reference models of
examples/forcefield (energies, forces, cell gradients, force-training gradients), the report, the
refusals (unknown models, structures it cannot rebuild, models whose math differs), the
neighbor-capacity protocol and, on a GPU, CUDA-graph replay."""

import dataclasses
import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirage
import mirage.ff
from mirage.ff import fused as ff_fused
from mirage.ff.precision import matmul_precision

from common import OpCounter, capture_graph
from tolerances import tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from forcefield import models as reference  # noqa: E402
from forcefield.benzene import benzene  # noqa: E402

ff_optimize = importlib.import_module("mirage.ff.optimize")  # the module; mirage.ff.optimize is the function
CUTOFF = 5.0
MODELS = {"SchNet": reference.SchNet, "PaiNN": reference.PaiNN}


# ------------------------------------------------------------------------------------------------
# Helpers


def make_reference(name, dtype=torch.float64, hidden=16, num_interactions=3, num_rbf=12, device="cpu"):
    """A reference model with fresh random weights. In float64 its basis buffer is replaced by the
    exact float64 values: the class builds it in float32 (rounded) before any .double(), which
    alone moves its results by ~1e-7 relative, far above a float64 comparison's tolerance."""
    model = MODELS[name](hidden=hidden, num_interactions=num_interactions, num_rbf=num_rbf, cutoff=CUTOFF)
    for parameter in model.parameters():  # the default init leaves biases small; make them count
        with torch.no_grad():
            parameter.add_(0.1 * torch.randn_like(parameter))
    model = model.to(dtype=dtype, device=device)
    if dtype == torch.float64:
        if name == "SchNet":
            model.centers = torch.linspace(0.0, CUTOFF, num_rbf, dtype=dtype, device=device)
        else:
            model.frequencies = torch.arange(1, num_rbf + 1, dtype=dtype, device=device) * (math.pi / CUTOFF)
    return model


def swapped(model, **kwargs):
    fused = mirage.ff.optimize(model, **kwargs)
    assert fused is not model, str(mirage.ff.report(fused if fused is not model else model))
    assert isinstance(fused, (ff_fused.SchNet, ff_fused.PaiNN))
    return fused


def energy_and_forces(model, z, pos, cell=None, pbc=None):
    pos = pos.detach().clone().requires_grad_(True)
    energy = model(z, pos, cell, pbc)
    (grad,) = torch.autograd.grad(energy, pos)
    return energy.detach(), -grad


def jitter(n, dtype, scale=0.05):
    return (torch.rand(n, 3, dtype=torch.float64) - 0.5).mul(2 * scale).to(dtype)


def system(kind, dtype=torch.float64, device="cpu"):
    """(Z, positions, cell, pbc) with fresh random displacements."""
    cell = pbc = None
    if kind == "benzene":
        z, pos = benzene(dtype=torch.float64)
        pos = pos + jitter(12, torch.float64)
    elif kind == "cluster":
        # 20 atoms spread over ~2 cutoffs: pairs inside and outside the cutoff.
        grid = torch.tensor([[a, b, c] for a in range(5) for b in range(2) for c in range(2)], dtype=torch.float64)
        pos = grid * 2.1 + jitter(20, torch.float64, 0.4)
        z = torch.randint(1, 10, (20,))
    else:
        n = {"orthorhombic": 27, "triclinic": 27, "slab": 27, "small_cell": 8}[kind]
        side = round(n ** (1 / 3))
        frac = torch.tensor([[a, b, c] for a in range(side) for b in range(side) for c in range(side)],
                            dtype=torch.float64)
        frac = (frac + 0.5) / side + jitter(n, torch.float64, 0.04)
        if kind == "orthorhombic":
            cell = torch.diag(torch.tensor([10.5, 11.0, 12.0], dtype=torch.float64))
        elif kind == "small_cell":  # cutoff between half the width and the width: images twice
            cell = torch.tensor([[6.0, 0.0, 0.0], [1.0, 6.2, 0.0], [0.5, 0.8, 6.4]], dtype=torch.float64)
        else:
            cell = torch.tensor([[10.5, 0.0, 0.0], [1.5, 10.4, 0.0], [-1.0, 1.2, 11.0]], dtype=torch.float64)
        pos = frac @ cell
        pos[::4] += cell[0] - 2 * cell[2]  # unwrapped atoms, as MD trajectories have them
        z = torch.randint(1, 10, (n,))
        pbc = torch.tensor([True, True, kind != "slab"])
        cell = cell.to(device, dtype)
    return z.to(device), pos.to(device, dtype), cell, (None if pbc is None else pbc.to(device))


def assert_same(got, expected, dtype, scale=None):
    tol = dict(tolerance(dtype))
    if scale is not None:
        tol["atol"] *= max(scale, 1.0)
    torch.testing.assert_close(got, expected, **tol)


def assert_same_energy_forces(fused, model, z, pos, cell=None, pbc=None):
    energy, forces = energy_and_forces(model, z, pos, cell, pbc)
    fused_energy, fused_forces = energy_and_forces(fused, z, pos, cell, pbc)
    assert int(fused.num_pairs) <= fused.max_pairs, "capacity overflow: the result is not valid"
    assert fused_energy.shape == () and fused_energy.dtype == energy.dtype
    assert forces.abs().max() > 0
    assert_same(fused_energy, energy, pos.dtype, scale=float(energy.abs()))
    assert_same(fused_forces, forces, pos.dtype, scale=float(forces.abs().max()))
    return energy, forces


# ------------------------------------------------------------------------------------------------
# Equivalence


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["benzene", "cluster", "orthorhombic", "triclinic", "slab", "small_cell"])
def test_energy_and_forces_match_the_original(name, dtype, kind):
    model = make_reference(name, dtype)
    fused = swapped(model)
    z, pos, cell, pbc = system(kind, dtype)
    assert_same_energy_forces(fused, model, z, pos, cell, pbc)
    # A second system of another size on the same fused model (its capacity grown if needed).
    z2, pos2, cell2, pbc2 = system("benzene" if kind != "benzene" else "cluster", dtype)
    assert_same_energy_forces(fused, model, z2, pos2, cell2, pbc2)


@pytest.mark.parametrize("dtype,device", [(torch.float64, "cpu"), (torch.float32, "cpu"),
                                          pytest.param(torch.float32, "cuda", marks=pytest.mark.cuda)])
def test_painn_fused_filters_match_the_original(dtype, device):
    # From fused_filters_min_pairs of capacity on (large systems) each interaction's filter is
    # formed inside vector_message_passing (its filter_weight) instead of one batched GEMM for
    # all; the small systems above never reach it. The basis' gradients (one a layer) are
    # mirage::linear's.
    model = make_reference("PaiNN", dtype, device=device)
    fused = swapped(model)
    z, pos, cell, pbc = system("triclinic", dtype, device)
    fused.fused_filters_min_pairs = 1
    activity = torch.profiler.ProfilerActivity.CUDA if device == "cuda" else torch.profiler.ProfilerActivity.CPU
    with OpCounter() as ops, torch.profiler.profile(activities=[activity]) as prof:
        per_layer = energy_and_forces(fused, z, pos, cell, pbc)
        if device == "cuda":
            torch.cuda.synchronize()
    assert "aten.bmm" not in ops.calls and "aten.mm" not in ops.calls, ops.calls
    if device == "cuda":  # the kernels formed the filters themselves (no GEMM inside the op either)
        names = [e.name for e in prof.events()]
        assert sum("forward_kernel<float, 4, true" in n for n in names) == 3, names
    fused.fused_filters_min_pairs = 2**62
    with OpCounter() as ops:
        batched = energy_and_forces(fused, z, pos, cell, pbc)
    assert "aten.bmm" in ops.calls
    for got, want in zip(per_layer, batched):
        assert_same(got, want, dtype, scale=float(want.abs().max()))
    if device == "cpu":  # against the original too (on the GPU its sums run in another order)
        fused.fused_filters_min_pairs = 1
        assert_same_energy_forces(fused, model, z, pos, cell, pbc)


@pytest.mark.parametrize("name", MODELS)
def test_default_size(name):
    model = MODELS[name]().float()  # hidden 128, 20 basis functions, 3 interactions
    fused = swapped(model)
    for kind in ("benzene", "triclinic"):
        fused.max_pairs = None
        assert_same_energy_forces(fused, model, *system(kind, torch.float32))


@pytest.mark.parametrize("name", MODELS)
def test_strided_positions_and_one_atom(name):
    model = make_reference(name)
    fused = swapped(model)
    z, pos, cell, pbc = system("triclinic")
    wide = torch.randn(pos.shape[0], 6, dtype=pos.dtype)
    wide[:, ::2] = pos
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    assert_same(fused(z, strided, cell, pbc), model(z, pos, cell, pbc), torch.float64)
    fused.max_pairs = None
    one = fused(z[:1], pos[:1])
    assert int(fused.num_pairs) == 0
    assert_same(one, model(z[:1], pos[:1]), torch.float64)


@pytest.mark.parametrize("name", MODELS)
def test_cell_gradient(name):
    """Stress-like derivative with respect to the cell at fixed Cartesian positions."""
    model = make_reference(name)
    fused = swapped(model)
    z, pos, cell, pbc = system("triclinic")
    grads = []
    for m in (model, fused):
        c = cell.clone().requires_grad_(True)
        p = pos.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(m(z, p, c, pbc), (p, c)))
    assert grads[0][1].abs().max() > 0
    for got, expected in zip(grads[1], grads[0]):
        assert_same(got, expected, torch.float64, scale=float(expected.abs().max()))


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float64),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", MODELS)
def test_force_training_gradients(name, device, dtype):
    """Double backward: the gradient of a force loss with respect to every parameter (training
    mode, so on CUDA the layer-by-layer ops and their double backward kernels)."""
    model = make_reference(name, dtype=dtype, device=device)
    fused = swapped(model)
    assert fused.training
    z, pos, cell, pbc = system("orthorhombic", dtype=dtype, device=device)
    target = torch.randn_like(pos) * 0.01
    grads = []
    for m in (model, fused):
        p = pos.clone().requires_grad_(True)
        energy = m(z, p, cell, pbc)
        (forces,) = torch.autograd.grad(-energy, p, create_graph=True)
        loss = ((forces - target) ** 2).sum() + 0.1 * energy**2
        grads.append(dict(zip([n for n, _ in m.named_parameters()], torch.autograd.grad(loss, list(m.parameters())))))
    assert grads[0].keys() == grads[1].keys()
    for key, expected in grads[0].items():
        scale = float(expected.abs().max())
        if dtype == torch.float64:
            assert_same(grads[1][key], expected, dtype, scale=scale)
        else:  # two float32 computations (sums in other orders) of a second derivative
            torch.testing.assert_close(grads[1][key], expected, rtol=1e-4, atol=1e-4 * max(scale, 1.0))


# ------------------------------------------------------------------------------------------------
# What optimize returns


@pytest.mark.parametrize("name", MODELS)
def test_parameters_are_shared_and_the_original_untouched(name):
    model = make_reference(name, num_interactions=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused = swapped(model)
    assert type(model) is MODELS[name]
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    # Shared, not copied; the same names as the reference's.
    original = dict(model.named_parameters())
    assert dict(fused.named_parameters()).keys() == original.keys()
    for key, parameter in fused.named_parameters():
        assert parameter is original[key]
    z, pos, cell, pbc = system("benzene")
    energy = fused(z, pos)
    with torch.no_grad():
        model.readout[2].bias.add_(1.0)
    assert_same(fused(z, pos), energy + 12.0, torch.float64)  # 12 atoms, one output bias each
    assert_same(fused(z, pos), model(z, pos), torch.float64)


def with_atom_reference(name):
    """A reference model whose energy adds per-element reference energies, zero before training
    (a subclass, as users extend the models they train)."""
    base = MODELS[name]

    class WithAtomReference(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.atomref = nn.Embedding(100, 1)
            nn.init.zeros_(self.atomref.weight)

        def forward(self, atomic_numbers, positions, cell=None, pbc=None):
            return super().forward(atomic_numbers, positions, cell, pbc) + self.atomref(atomic_numbers).sum()

    return WithAtomReference(hidden=16, num_interactions=2, num_rbf=12, cutoff=CUTOFF).double()


@pytest.mark.parametrize("name", ["SchNet", "PaiNN"])
def test_parameters_the_fused_model_would_not_use_leave_it_alone(name):
    # Zero at the time of optimize, the extra term passes the probe; it must still not be dropped.
    model = with_atom_reference(name)
    assert mirage.ff.optimize(model) is model
    assert "mirage's model would not use atomref.weight" in str(mirage.ff.report(model))
    # A trainable basis: the fused model computes the basis itself.
    trainable = make_reference(name, num_interactions=2)
    basis = "centers" if name == "SchNet" else "frequencies"
    setattr(trainable, basis, nn.Parameter(getattr(trainable, basis).clone()))
    assert mirage.ff.optimize(trainable) is trainable
    assert f"mirage's model would not use {basis}" in str(mirage.ff.report(trainable))


@pytest.mark.parametrize("signature", ["extra", "renamed"])
def test_a_forward_taking_other_arguments_is_left_alone(signature):
    class Extra(MODELS["SchNet"]):
        def forward(self, atomic_numbers, positions, cell=None, pbc=None, return_atomic=False):
            return super().forward(atomic_numbers, positions, cell, pbc)

    class Renamed(MODELS["SchNet"]):
        def forward(self, numbers, positions, box=None, pbc=None):
            return super().forward(numbers, positions, box, pbc)

    model = {"extra": Extra, "renamed": Renamed}[signature](hidden=16, num_interactions=2, num_rbf=12, cutoff=CUTOFF)
    assert mirage.ff.optimize(model) is model
    assert "mirage's model takes (atomic_numbers, positions, cell, pbc)" in str(mirage.ff.report(model))


def test_optimizing_a_fused_model_returns_it_with_its_report(capfd):
    fused = swapped(make_reference("SchNet", num_interactions=2))
    before = str(mirage.ff.report(fused))
    assert mirage.ff.optimize(fused) is fused
    assert str(mirage.ff.report(fused)) == before
    assert "already mirage's fused SchNet" in capfd.readouterr().err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_painn_norm_eps_is_taken_from_the_model(device):
    """A PaiNN whose updates smooth |V v| with another norm_eps (here one-element tensors, one per
    update): the fused model computes with it, on the GPU as mirage::painn_energy (benzene,
    float32, eval). The same model with the default 1e-8 gives other forces, so a fused model
    that ignored the setting would fail."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    model = make_reference("PaiNN", dtype, hidden=64 if device == "cuda" else 16, device=device).eval()
    z, pos, _, _ = system("benzene", dtype, device)
    _, default_forces = energy_and_forces(model, z, pos)
    for update in model.updates:
        update.norm_eps = torch.tensor(0.05, dtype=torch.float64)
    fused = swapped(model)
    assert fused.norm_eps == 0.05 and "norm_eps=0.05" in repr(fused)
    assert "(norm_eps 0.05)" in str(mirage.ff.report(fused))
    energy, forces = energy_and_forces(model, z, pos)
    with OpCounter() as ops:
        fused_energy, fused_forces = energy_and_forces(fused, z, pos)
    # On the GPU as the whole-model op where it runs as a cluster (sm_90 on); before, PaiNN's layers.
    whole_model = device == "cuda" and mirage.ff.fused._whole_model_clusters(f"cuda:{torch.cuda.current_device()}")
    assert ("mirage.painn_energy" in ops.calls) == whole_model, ops.calls
    scale = float(forces.abs().max())
    tol = dict(tolerance(dtype)) if device == "cpu" else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_energy, energy, rtol=tol["rtol"], atol=tol["atol"] * max(float(energy.abs()), 1.0))
    torch.testing.assert_close(fused_forces, forces, rtol=tol["rtol"], atol=tol["atol"] * scale)
    assert (default_forces - forces).abs().max() > 100 * tol["atol"] * scale


@pytest.mark.cuda
@pytest.mark.parametrize("clusters", [True, False], ids=["cluster", "one_block"])
def test_whole_model_limits_follow_how_the_gpu_runs_the_op(monkeypatch, clusters):
    """Benzene (12 atoms, 132 pairs) in eval mode: the whole-model ops within the limits of the
    way the GPU runs them, a cluster from sm_90 on (SchNet 2,560 pairs and 64 atoms, PaiNN 320 and
    18), one block before (SchNet 132 and 12, PaiNN none: docs/perf/forcefield.md)."""
    monkeypatch.setattr(mirage.ff.fused, "_whole_model_clusters", lambda device: clusters)
    for name, op in (("SchNet", "mirage.schnet_energy_all_pairs"), ("PaiNN", "mirage.painn_energy")):
        fused = swapped(make_reference(name, torch.float32, device="cuda").eval())
        z, pos, _, _ = system("benzene", torch.float32, "cuda")
        energy_and_forces(fused, z, pos)  # sizes the capacity
        with OpCounter() as ops:
            energy_and_forces(fused, z, pos)
        assert (op in ops.calls) == (clusters or name == "SchNet"), (name, fused.max_pairs)


def test_painn_norm_eps_from_sizes():
    fused = ff_fused.PaiNN(hidden=16, num_rbf=8, norm_eps=0.01)
    assert fused.norm_eps == 0.01 and not fused.norm_eps_assumed
    with pytest.raises(ValueError, match=r"mirage.ff.fused.PaiNN: norm_eps must be a finite number > 0, got -1.0"):
        ff_fused.PaiNN(norm_eps=-1.0)


class UpdateWithoutNormEps(reference.PaiNNUpdate):
    """PaiNN's update as models that keep no norm_eps write it: 1e-8 in the forward."""

    def forward(self, s, v):
        uv, vv = self.U(v), self.V(v)
        a = self.mlp(torch.cat([s, torch.sqrt((vv**2).sum(dim=1) + 1e-8)], dim=-1))
        a_vv, a_sv, a_ss = torch.split(a, self.hidden, dim=-1)
        return s + a_sv * (uv * vv).sum(dim=1) + a_ss, v + a_vv[:, None, :] * uv


def test_painn_without_norm_eps_is_reported_as_assumed():
    model = make_reference("PaiNN")
    for update in model.updates:
        update.__class__ = UpdateWithoutNormEps
        del update.norm_eps
    fused = swapped(model)
    assert fused.norm_eps == 1e-8 and fused.norm_eps_assumed
    assert "(norm_eps 1e-08, assumed: the model keeps none)" in str(mirage.ff.report(fused))


# The ways users turn TF32 on: the legacy call, the legacy flag, the newer flag alone (after which
# PyTorch's legacy getter raises, since the two APIs disagree).
TF32_SETTINGS = {
    "set_float32_matmul_precision": lambda: torch.set_float32_matmul_precision("high"),
    "allow_tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "fp32_precision": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
}


@pytest.fixture
def default_matmul_flags():
    yield
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.fp32_precision = "none"


def _flags():
    matmul = torch.backends.cuda.matmul
    try:
        legacy = matmul.allow_tf32
    except RuntimeError:
        legacy = "unreadable"
    return matmul.fp32_precision, legacy


@pytest.mark.parametrize("setting", [None, *TF32_SETTINGS, "ieee"])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_matmul_precision_agrees_inside_and_restores(setting, precision, default_matmul_flags):
    if setting == "ieee":
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    elif setting is not None:
        TF32_SETTINGS[setting]()
    before = _flags()
    with matmul_precision(precision):
        # both APIs agree: the legacy getter reads, and mirage's reading says the same
        assert _flags() == ("tf32" if precision == "tf32" else "ieee", precision == "tf32")
        assert mirage.ops.tf32_matmuls() == (precision == "tf32")
    after = _flags()
    assert after[0] == before[0]
    assert after[1] == before[1] or (before[1] == "unreadable" and after[1] == (before[0] == "tf32"))


@pytest.mark.cuda
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("setting", TF32_SETTINGS)
@pytest.mark.parametrize("name", MODELS)
def test_optimize_with_tf32_on(name, setting, training, default_matmul_flags):
    # With TF32 matmuls allowed the original's and the fused model's products round differently
    # (1e-3 of the forces); the probe compares at full precision, so the swap happens (in training
    # mode through mirage's linear op, which reads the setting), and the setting comes back after.
    model = make_reference(name, torch.float32, hidden=64, device="cuda").train(training)
    TF32_SETTINGS[setting]()
    before = _flags()
    fused = swapped(model)
    assert _flags() == before
    z, pos, _, _ = system("benzene", torch.float32, "cuda")
    energy_and_forces(fused, z, pos)  # mirage's ops run under the caller's setting, whichever API set it


@pytest.mark.parametrize("name", MODELS)
def test_optimize_under_autocast(name):
    # The reference models as written fail under autocast (index_add_ of bfloat16 into float32);
    # the probe compares in the model's dtype all the same, so the swap happens.
    model = make_reference(name, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = swapped(model)
    z, pos, cell, pbc = system("benzene", torch.float32)
    assert_same_energy_forces(fused, model, z, pos, cell, pbc)


def test_optimize_under_no_grad_and_inference_mode():
    model = make_reference("SchNet")
    with torch.no_grad():
        assert isinstance(mirage.ff.optimize(model), ff_fused.SchNet)
    with torch.inference_mode():
        fused = mirage.ff.optimize(model)
    assert isinstance(fused, ff_fused.SchNet)
    assert_same_energy_forces(fused, model, *system("benzene"))


@pytest.mark.parametrize("name,kind", [("SchNet", "message_passing"), ("PaiNN", "vector_message_passing")])
def test_report_counts_what_was_swapped(name, kind):
    count = int(torch.randint(1, 5, ()))
    fused = swapped(make_reference(name, num_interactions=count))
    result = mirage.ff.report(fused)
    updates = {"painn_update": count} if name == "PaiNN" else {}
    linears = (6 if name == "PaiNN" else 3) * count + 2  # one entry per Linear: phi, U, V, mlp / in2f, f2out; readout
    assert result.counts == {"neighbor_list": 1, "radial_basis": 1, "batched_filters": 1, kind: count,
                             **updates, "linear": linears}
    assert result.style == f"{name}-style" and result.left_alone == []
    text = str(result)
    assert f"{count} x {kind}" in text and "mirage::neighbor_list" in text and "mirage::radial_basis" in text
    assert f"{linears} x linear" in text and "mirage::linear" in text
    assert "the activations (computed by name, not by the model's activation modules)" in text
    if name == "PaiNN":
        assert f"{count} x painn_update" in text and "mirage::painn_update" in text
    # The probe's numbers, one line per system.
    assert "open cluster" in text and "periodic box" in text and "slab periodic along a and b" in text
    assert len(result.verification) == 3


@pytest.mark.parametrize("name", MODELS)
def test_direct_call_on_a_larger_system_grows_the_capacity(name, capfd):
    # The first call chooses max_pairs for a small molecule (all of its 6 pairs); a direct call on
    # benzene (~132 pairs) must not return the energy of a pair list cut at 6.
    reference = make_reference(name)
    fused = swapped(reference)
    water = torch.tensor([[0.0, 0.0, 0.12], [0.0, 0.76, -0.47], [0.0, -0.76, -0.47]], dtype=torch.float64)
    assert_same_energy_forces(fused, reference, torch.tensor([8, 1, 1]), water)
    assert fused.max_pairs == 6
    z, pos, _, _ = system("benzene")
    assert_same_energy_forces(fused, reference, z, pos)
    found = int(fused.num_pairs)
    assert 6 < found <= fused.max_pairs  # 132 less the H-H pairs the jitter took past the cutoff
    assert f"{found} neighbor pairs exceed the capacity of 6 (max_pairs); growing it to" in capfd.readouterr().err


@pytest.mark.parametrize("name", MODELS)
def test_forward_calls_mirage_ops_and_never_syncs(name):
    fused = swapped(make_reference(name))
    z, pos, cell, pbc = system("triclinic")
    fused(z, pos, cell, pbc)  # chooses max_pairs (one host read, this once)
    # What a CUDA graph of the forward records: _energy, the forward less its capacity check.
    with OpCounter() as forward:
        energy = fused._energy(z, pos.requires_grad_(True), cell, pbc)
    with OpCounter() as backward:
        torch.autograd.grad(energy, pos)
    calls = forward.calls
    # radial_basis twice: the basis, and the cosine cutoff (kind "none"); each one fused backward.
    assert calls.count("mirage.neighbor_list") == 1 and calls.count("mirage.radial_basis") == 2
    assert backward.calls.count("mirage.radial_basis_backward") == 2
    # .item() (a host sync) and nonzero (data-dependent shape) cannot be captured in a graph.
    assert not {"aten._local_scalar_dense", "aten.nonzero"} & set(calls + backward.calls)
    # A call outside a capture reads the atomic numbers' range and the pair count back (the
    # input and capacity checks), no more.
    with OpCounter() as checked:
        again = fused(z, pos, cell, pbc)
    torch.testing.assert_close(again, energy, rtol=0, atol=0)
    assert sorted(set(checked.calls) - set(calls)) == ["aten._local_scalar_dense", "aten.aminmax"]
    assert checked.calls.count("aten.aminmax") == 1
    assert calls.count("mirage.message_passing" if name == "SchNet" else "mirage.vector_message_passing") == 3
    # Every Linear runs through mirage::linear (3 interactions: SchNet's in2f and f2out, 3 each;
    # PaiNN's phi, U, V and update MLP, 6 each; 2 in the readout). The backward computes x's
    # gradients only, by mirage::linear: the parameters require grad, but forces ask for the
    # positions alone, so no weight-gradient matmul runs, and neither do the x gradients of the
    # first Linears, which read the embedding alone (SchNet's first in2f, PaiNN's first phi).
    assert calls.count("mirage.linear") == {"SchNet": 11, "PaiNN": 20}[name]
    assert all(p.requires_grad for p in fused.parameters())
    assert backward.calls.count("mirage.linear") == {"SchNet": 10, "PaiNN": 18}[name]
    assert "aten.mm" not in backward.calls
    if name == "PaiNN":
        # Each update's norm, cat and gating are mirage's kernels, forward and backward.
        for op in ("painn_update_input", "painn_update"):
            assert calls.count(f"mirage.{op}") == 3 and backward.calls.count(f"mirage.{op}_backward") == 3
        assert not {"aten.sqrt", "aten.addcmul"} & set(calls)


# ------------------------------------------------------------------------------------------------
# Refusals


class Pairwise(nn.Module):
    """A force field mirage does not know."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, z, pos, cell=None, pbc=None):
        d = torch.cdist(pos, pos)
        return self.head(self.embedding(z)).sum() + torch.exp(-d).sum()


def test_unknown_model_passes_through():
    model = Pairwise()
    assert mirage.ff.optimize(model) is model
    text = str(mirage.ff.report(model))
    assert "not recognised" in text and "untouched" in text
    with pytest.raises(ValueError, match="strict=True.*not recognised"):
        mirage.ff.optimize(model, strict=True)


def uneven_centers(model):
    model.centers = model.centers ** 1.1 / CUTOFF**0.1
    return "`centers` is not"


def relu6_filter(model):
    model.interactions[1].filter[1] = nn.ReLU6()
    return "interactions.1.filter.1 (ReLU6) computes none of the activations"


def linear_subclass(model):
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    old = model.interactions[0].in2f
    new = Scaled(old.in_features, old.out_features, bias=False).double()
    model.interactions[0].in2f = new
    return "interactions.0.in2f is a Scaled, not an nn.Linear"


def missing_readout(model):
    del model.readout
    return "has no submodule `readout`"


def painn_width(model):
    model.updates[2].U = nn.Linear(16, 8, bias=False).double()
    return "updates.2.U gives 8 features, expected 16"


def painn_norm_eps_differ(model):
    model.updates[1].norm_eps = 1e-3
    return "the updates' norm_eps differ"


def painn_norm_eps_zero(model):
    for update in model.updates:
        update.norm_eps = 0.0
    return "updates.0.norm_eps must be a finite number > 0, got 0.0"


def painn_norm_eps_list(model):
    for update in model.updates:
        update.norm_eps = [1e-3]
    return "updates.0.norm_eps must be a finite number > 0, got [0.001]"


def painn_norm_eps_missing_on_one(model):
    for update in model.updates[1:]:
        update.norm_eps = 1e-8
    del model.updates[0].norm_eps
    return "the updates' norm_eps differ (updates.0: none, updates.1: 1e-08, updates.2: 1e-08)"


@pytest.mark.parametrize("change", [uneven_centers, relu6_filter, linear_subclass, missing_readout, painn_width,
                                    painn_norm_eps_differ, painn_norm_eps_zero, painn_norm_eps_list,
                                    painn_norm_eps_missing_on_one])
def test_structure_it_cannot_rebuild_is_left_alone(change):
    model = make_reference("PaiNN" if change.__name__.startswith("painn") else "SchNet")
    reason = change(model)
    assert mirage.ff.optimize(model) is model
    result = mirage.ff.report(model)
    assert result.style in ("SchNet-style", "PaiNN-style") and not result.swaps
    assert reason in result.left_alone[0][1], result.left_alone
    assert reason in str(result)
    with pytest.raises(ValueError, match="strict=True") as error:
        mirage.ff.optimize(model, strict=True)
    assert reason in str(error.value)


class PolynomialCutoffSchNet(reference.SchNet):
    """Same modules as SchNet, another cutoff function in the forward."""

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        i, j, vec = reference.radius_graph(positions, self.cutoff, cell, pbc)
        d = vec.norm(dim=-1)
        rbf = torch.exp(-((d[:, None] - self.centers) ** 2) / (2 * self.width**2))
        x = d / self.cutoff
        fcut = 1 - 28 * x**6 + 48 * x**7 - 21 * x**8
        h = self.embedding(atomic_numbers)
        for interaction in self.interactions:
            h = h + interaction(h, rbf, fcut, i, j)
        return self.readout(h).sum()


class ChargedPaiNN(reference.PaiNN):
    """PaiNN plus a term of its own: a small harmonic restraint."""

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        return super().forward(atomic_numbers, positions, cell, pbc) + 1e-3 * (positions**2).sum()


@pytest.mark.parametrize("cls", [PolynomialCutoffSchNet, ChargedPaiNN])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_model_whose_math_differs_is_refused_by_the_probe(cls, dtype):
    model = cls(hidden=16, num_rbf=12, cutoff=CUTOFF).to(dtype)
    assert mirage.ff.optimize(model) is model
    result = mirage.ff.report(model)
    assert not result.swaps
    assert "does not compute the same energy/forces" in result.left_alone[0][1]
    assert "relative difference" in result.left_alone[0][1]


def all_periodic(pbc):
    return pbc | pbc.any()  # one periodic axis makes all three periodic


def open_unless_all_periodic(pbc):
    return pbc & pbc.all()  # mixed periodicity read as open


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("misread", [all_periodic, open_unless_all_periodic])
def test_fused_model_wrong_only_for_mixed_pbc_is_refused(name, misread, monkeypatch):
    """A fused model with the kind of bug the slab probe is there for: right for open and fully
    periodic systems, wrong for a slab."""

    class Misread(getattr(ff_fused, name)):
        def forward(self, atomic_numbers, positions, cell=None, pbc=None):
            pbc = None if pbc is None else misread(torch.as_tensor(pbc))
            return super().forward(atomic_numbers, positions, cell, pbc)

    model = make_reference(name)
    replacement = f"mirage.ff.fused.{name}"
    recognizers = tuple(dataclasses.replace(r, build=Misread.from_model) if r.replacement == replacement else r
                        for r in ff_optimize.RECOGNIZERS)
    with monkeypatch.context() as patch:
        patch.setattr(ff_optimize, "RECOGNIZERS", recognizers)
        assert mirage.ff.optimize(model) is model
    result = mirage.ff.report(model)
    assert not result.swaps
    # The probe stops at the first mismatch: the cluster and the box passed, the slab did not.
    assert "does not compute the same energy/forces: slab periodic along a and b (18 atoms)" in \
        result.left_alone[0][1], result.left_alone
    swapped(model)  # the same model, mirage's fused one without the bug: accepted


def test_model_that_fails_on_the_probe_is_left_alone():
    class OnlyHydrogen(reference.SchNet):
        def forward(self, atomic_numbers, positions, cell=None, pbc=None):
            if (atomic_numbers != 1).any():
                raise RuntimeError("hydrogen only")
            return super().forward(atomic_numbers, positions, cell, pbc)

    model = OnlyHydrogen(hidden=16, num_rbf=12)
    assert mirage.ff.optimize(model) is model
    assert "the model itself failed on the probe" in str(mirage.ff.report(model))
    assert "hydrogen only" in str(mirage.ff.report(model))


@pytest.mark.parametrize("shape", [(1,), (1, 1)])  # `readout(x).sum(0)` of [N, 1]; a batch of one's [B, 1]
@pytest.mark.parametrize("name", MODELS)
def test_an_energy_of_one_element_keeps_its_shape(name, shape):
    class ShapeOne(MODELS[name]):
        def forward(self, atomic_numbers, positions, cell=None, pbc=None):
            return super().forward(atomic_numbers, positions, cell, pbc).reshape(shape)

    model = make_reference(name)
    model.__class__ = ShapeOne
    fused = swapped(model)
    z, pos, cell, pbc = system("triclinic")
    energy, forces = energy_and_forces(model, z, pos, cell, pbc)
    fused_energy, fused_forces = energy_and_forces(fused, z, pos, cell, pbc)
    assert energy.shape == fused_energy.shape == shape
    assert_same(fused_energy, energy, pos.dtype, scale=float(energy.abs()))
    assert_same(fused_forces, forces, pos.dtype, scale=float(forces.abs().max()))
    assert fused(z[:0], pos[:0]).shape == shape  # no atoms: the same shape

    class PerAtom(MODELS[name]):
        def forward(self, atomic_numbers, positions, cell=None, pbc=None):
            return super().forward(atomic_numbers, positions, cell, pbc).expand(positions.shape[0])

    model.__class__ = PerAtom
    assert mirage.ff.optimize(model) is model
    assert "its energy has shape [12], where mirage's models return one energy" in str(mirage.ff.report(model))

    class Changing(MODELS[name]):  # one shape for open systems, another for periodic ones
        def forward(self, atomic_numbers, positions, cell=None, pbc=None):
            energy = super().forward(atomic_numbers, positions, cell, pbc)
            return energy.reshape(shape) if cell is None else energy

    model.__class__ = Changing
    assert mirage.ff.optimize(model) is model
    assert f"its energy's shape changes with the system: {list(shape)}, then [] for the probe triclinic" in \
        str(mirage.ff.report(model))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_models_are_left_alone_with_the_way_out(name, dtype):
    model = make_reference(name, dtype)
    assert mirage.ff.optimize(model) is model
    reason = f"its parameters are {str(dtype).replace('torch.', '')}: mirage's fused models run float32 or float64"
    assert reason in str(mirage.ff.report(model)) and "precision='bf16-mixed'" in str(mirage.ff.report(model))
    with pytest.raises(ValueError, match=reason):
        mirage.ff.optimize(model, strict=True)


def test_a_model_without_parameters_is_left_alone():
    class Shaped(nn.Module):  # a reference model's attribute names, no network
        def __init__(self):
            super().__init__()
            self.embedding, self.interactions, self.cutoff = nn.Identity(), nn.Identity(), 5.0

        def forward(self, atomic_numbers, positions, cell=None, pbc=None):
            return positions.sum()

    model = Shaped()
    assert mirage.ff.optimize(model) is model
    assert "it has no parameters" in str(mirage.ff.report(model))


def test_torch_compile_takes_the_whole_model_choice_as_a_constant():
    # The device query behind the choice is C++: traced into through its cache, it broke
    # fullgraph compiles of the fused models on CUDA (H200, 2026-11-30).
    def choose(x):
        return x + 1 if mirage.ff.fused._whole_model_clusters("cpu") else x - 1

    torch.testing.assert_close(torch.compile(choose, fullgraph=True)(torch.ones(2)), choose(torch.ones(2)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", ["SchNet", "PaiNN"])
def test_a_system_without_atoms_has_no_energy(device, name):
    # As the reference models: their sum over no atoms. The neighbor list's padding pair (0, 0)
    # once raised "pairs[0, 0] = 0 is out of range for N=0 rows".
    dtype = torch.float64 if device == "cpu" else torch.float32
    model = make_reference(name, dtype, device=device).eval()
    fused = swapped(model)
    z = torch.zeros(0, dtype=torch.int64, device=device)
    for m in (model, fused):
        positions = torch.zeros(0, 3, dtype=dtype, device=device, requires_grad=True)
        energy = m(z, positions)
        # Connected to every parameter, as the reference's sum is: no allow_unused needed.
        grad, *parameter_grads = torch.autograd.grad(energy, [positions, *m.parameters()])
        assert energy.item() == 0.0 and energy.dtype == dtype and grad.shape == (0, 3)
        assert all(not g.any() for g in parameter_grads)
    got = fused.energy_and_gradient(z, torch.zeros(0, 3, dtype=dtype, device=device))
    assert got is None or (got[0].item() == 0.0 and got[1].shape == (0, 3))


def test_bad_arguments():
    model = make_reference("SchNet")
    with pytest.raises(TypeError, match="mirage.ff.optimize: model must be an nn.Module"):
        mirage.ff.optimize(lambda z, pos: pos.sum())
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="mirage.ff.optimize: max_pairs must be None or an int >= 1"):
            mirage.ff.optimize(model, max_pairs=bad)
    with pytest.raises(ValueError, match="mirage.ff.report: this SchNet was not returned by mirage.ff.optimize"):
        mirage.ff.report(make_reference("SchNet"))
    fused = swapped(model)
    with pytest.raises(ValueError, match="mirage.ff.fused.SchNet: max_pairs must be None or an int >= 1"):
        fused.max_pairs = 0
    z, pos, cell, pbc = system("triclinic")
    with pytest.raises(ValueError, match="mirage.ff.fused.SchNet: pbc was given without a cell"):
        fused(z, pos, None, pbc)
    with pytest.raises(ValueError, match="mirage.ff.fused.SchNet: pbc must have 3 flags, got 2"):
        fused(z, pos, cell, torch.tensor([True, True]))
    with pytest.raises(ValueError, match="positions are float32 but the model's parameters are float64; pass"):
        fused(z, pos.float())
    with pytest.raises(ValueError, match=r"mirage.ff.fused.SchNet: positions must be \[N, 3\], got \[27, 2\]"):
        fused(z, pos[:, :2])
    with pytest.raises(ValueError, match=r"atomic_numbers must be \[N\] for positions \[N, 3\] \(N = 27\), got \[26\]"):
        fused(z[1:], pos)
    for bad in (-1, 100):
        bad_z = torch.cat([z[:-1], torch.tensor([bad])])  # the replaced last atom may have held z's extreme
        with pytest.raises(ValueError, match=rf"atomic numbers must be in \[0, 100\) \(the embedding's rows, max_z\), "
                                             rf"got {int(bad_z.min())} to {int(bad_z.max())}"):
            fused(bad_z, pos)
    with pytest.raises(ValueError, match="mirage.ff.fused.Activation: name must be one of"):
        ff_fused.Activation("swish")


# ------------------------------------------------------------------------------------------------
# Boundaries and capacity


@pytest.mark.parametrize("name", MODELS)
def test_boundaries_read_like_the_reference(name):
    model = make_reference(name)
    fused = swapped(model)
    z, pos, cell, pbc = system("triclinic")
    open_energy = model(z, pos)
    # No pbc: open boundaries whatever the cell (as the reference). pbc all False: open too, even
    # with ASE's zero cell for molecules; flags as a list work like a tensor.
    for args in ((cell, None), (torch.zeros(3, 3, dtype=pos.dtype), [False, False, False]),
                 (cell, torch.tensor([False, False, False]))):
        fused.max_pairs = None
        assert_same(fused(z, pos, *args), open_energy, torch.float64)
    fused.max_pairs = None
    assert_same(fused(z, pos, cell, [True, True, False]), model(z, pos, cell, torch.tensor([True, True, False])),
                torch.float64)


@pytest.mark.parametrize("name", MODELS)
def test_capacity_protocol(name):
    model = make_reference(name)
    fused = swapped(model)
    assert fused.max_pairs is None and fused.num_pairs.shape == (1,) and fused.num_pairs.dtype == torch.int64
    assert "num_pairs" in dict(fused.named_buffers())
    # A small open molecule: every pair, which no geometry of it can exceed.
    z, pos, _, _ = system("benzene")
    fused(z, pos)
    assert fused.max_pairs == 12 * 11 and int(fused.num_pairs) > 0
    # A periodic box: the first forward counts and keeps headroom.
    fused.max_pairs = None
    z, pos, cell, pbc = system("triclinic")
    expected = model(z, pos, cell, pbc)
    fused(z, pos, cell, pbc)
    count = int(fused.num_pairs)
    assert count == reference.radius_graph(pos, CUTOFF, cell, pbc)[0].numel()
    assert count < fused.max_pairs <= 2 * count + 64
    # Too small: the forward a CUDA graph records (_energy) reports it in num_pairs (the result
    # is not valid; the caller checks); a direct call grows the capacity and computes again.
    fused.max_pairs = count // 2
    fused._energy(z, pos, cell, pbc)
    assert int(fused.num_pairs) == count > fused.max_pairs
    assert_same(fused(z, pos, cell, pbc), expected, torch.float64)
    assert int(fused.num_pairs) == count <= fused.max_pairs
    # The capacity given to optimize is the one used.
    assert swapped(model, max_pairs=count + 5).max_pairs == count + 5


@pytest.mark.parametrize("name", MODELS)
def test_fused_model_from_sizes_loads_a_reference_state_dict(name):
    # Checkpoints go both ways, strictly: the fused model computes the reference's basis buffer
    # (centers or frequencies) and carries it in its state dict, checked on load.
    model = make_reference(name, hidden=8, num_interactions=2, num_rbf=6)
    cls = getattr(ff_fused, name)
    fused = cls(hidden=8, num_interactions=2, num_rbf=6, cutoff=CUTOFF).double()
    fused.load_state_dict(model.state_dict())
    assert_same_energy_forces(fused, model, *system("cluster"))
    saved = fused.state_dict()
    assert saved.keys() == model.state_dict().keys() and saved[fused.basis_key].dtype == torch.float64
    again = make_reference(name, hidden=8, num_interactions=2, num_rbf=6)
    again.load_state_dict(saved)
    assert_same_energy_forces(fused, again, *system("cluster"))
    other = make_reference(name, hidden=8, num_interactions=2, num_rbf=7).state_dict()
    other = {k: v for k, v in other.items() if k == fused.basis_key or v.shape == saved[k].shape}
    with pytest.raises(RuntimeError, match=rf"{fused.basis_key}: the checkpoint's basis \(7 values"):
        fused.load_state_dict(other, strict=False)


# ------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.cuda
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["benzene", "cluster", "triclinic"])
def test_cuda_matches_the_original_on_the_gpu(name, kind):
    model = make_reference(name, torch.float32, hidden=64, device="cuda")
    fused = swapped(model)
    z, pos, cell, pbc = system(kind, torch.float32, "cuda")
    energy, forces = energy_and_forces(model, z, pos, cell, pbc)
    fused_energy, fused_forces = energy_and_forces(fused, z, pos, cell, pbc)
    # The GPU's float32 neighbor search and reductions order sums differently from PyTorch's.
    scale = float(forces.abs().max())
    torch.testing.assert_close(fused_energy, energy, rtol=1e-4, atol=1e-4 * max(float(energy.abs()), 1.0))
    torch.testing.assert_close(fused_forces, forces, rtol=1e-4, atol=1e-4 * scale)
    assert fused.num_pairs.device.type == "cuda"


@pytest.mark.cuda
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["benzene", "triclinic"])
def test_cuda_graph_energy_and_forces_replay(name, kind):
    model = make_reference(name, torch.float32, hidden=64, device="cuda")
    fused = swapped(model)
    z, pos, cell, pbc = system(kind, torch.float32, "cuda")
    static_pos = pos.clone()

    def step():
        p = static_pos.detach().requires_grad_(True)
        energy = fused(z, p, cell, pbc)
        (grad,) = torch.autograd.grad(energy, p)
        return energy.detach(), -grad

    graph, (graph_energy, graph_forces) = capture_graph(step)
    for _ in range(3):
        moved = pos + 0.05 * torch.randn_like(pos)
        static_pos.copy_(moved)
        graph.replay()
        eager_energy, eager_forces = energy_and_forces(fused, z, moved, cell, pbc)
        reference_energy, _ = energy_and_forces(model, z, moved, cell, pbc)
        torch.testing.assert_close(graph_energy, eager_energy, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(graph_forces, eager_forces, rtol=1e-5, atol=1e-5 * float(eager_forces.abs().max()))
        torch.testing.assert_close(graph_energy, reference_energy, rtol=1e-4, atol=1e-4)
        assert int(fused.num_pairs) <= fused.max_pairs


@pytest.mark.cuda
def test_painn_filters_are_gemms_where_the_kernels_cannot_form_them():
    # Under autocast the messages run in bfloat16, which the kernels do not form filters in: each
    # layer's filter is then its own GEMM (not a GEMM inside the op, forward and backward).
    model = make_reference("PaiNN", torch.float32, device="cuda")
    fused = swapped(model)
    z, pos, cell, pbc = system("triclinic", torch.float32, "cuda")
    fused.fused_filters_min_pairs = 1
    with OpCounter() as ops, torch.autocast("cuda", dtype=torch.bfloat16):
        energy_and_forces(fused, z, pos, cell, pbc)
    assert "aten.bmm" not in ops.calls and ops.calls.count("aten.mm") >= 3, ops.calls


@pytest.mark.parametrize("name", MODELS)
def test_models_with_hooks_are_left_alone(name):
    # weight_norm recomputes readout.0's weight in a pre-hook, which the fused model would not run:
    # it read the weight as the model's last forward left it.
    model = make_reference(name)
    torch.nn.utils.weight_norm(model.readout[0])
    assert mirage.ff.optimize(model) is model
    report = str(mirage.ff.report(model))
    assert "left alone; the model was returned untouched" in report
    assert "readout.0: has forward hooks, which mirage's model would not run" in report
    patched = make_reference(name)
    inner = patched.readout[0].forward
    patched.readout[0].forward = lambda x: inner(x) * 2.0  # as LoRA patchers do: the type stays
    assert mirage.ff.optimize(patched) is patched
    assert "readout.0: has a forward set on the instance, which mirage's model would not run" \
        in str(mirage.ff.report(patched))
    logged = make_reference(name)
    logged.register_forward_hook(lambda module, args, out: None)
    assert mirage.ff.optimize(logged) is logged
    with pytest.raises(ValueError, match=r"strict=True.*left alone; not swapped(.|\n)*\(model\): has forward hooks"):
        mirage.ff.optimize(logged, strict=True)


def test_strict_says_not_swapped():
    with pytest.raises(ValueError) as error:
        mirage.ff.optimize(nn.Linear(2, 2), strict=True)
    assert "not recognised" in str(error.value) and "not swapped" in str(error.value)
    assert "returned untouched" not in str(error.value)


@pytest.mark.parametrize("name", MODELS)
def test_whole_model_op_only_for_interactions_of_one_width(name):
    model = make_reference(name, dtype=torch.float32)
    assert swapped(model)._whole_model_structure()
    wider = make_reference(name, dtype=torch.float32)
    if name == "SchNet":  # one interaction's f2out twice as wide inside
        wider.interactions[1].f2out = nn.Sequential(nn.Linear(16, 32), wider.interactions[1].f2out[1], nn.Linear(32, 16))
    else:  # one message's phi
        wider.messages[1].phi = nn.Sequential(nn.Linear(16, 32), wider.messages[1].phi[1], nn.Linear(32, 48))
    fused = swapped(wider)  # the layer-by-layer path takes it; the whole-model ops refuse it
    assert not fused._whole_model_structure()


def test_pytorch_geometric_shifted_softplus_is_recognised():
    class PygShiftedSoftplus(nn.Module):  # PyTorch Geometric's: log 2 rounded to float32
        def __init__(self):
            super().__init__()
            self.shift = torch.log(torch.tensor(2.0)).item()

        def forward(self, x):
            return F.softplus(x) - self.shift

    assert ff_fused.identify_activation(PygShiftedSoftplus(), "filter.1") == "shifted_softplus"


@pytest.mark.parametrize("name", MODELS)
def test_the_models_training_flags_are_left_alone(name):
    model = make_reference(name)
    model.train()
    model.readout.eval()  # a mixed state mirage must not change on the model passed in
    flags = {module_name: module.training for module_name, module in model.named_modules()}
    swapped(model)
    assert {module_name: module.training for module_name, module in model.named_modules()} == flags


def test_a_wrapped_model_is_named_in_the_report():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = make_reference("SchNet")

        def forward(self, *args):
            return self.model(*args)

    wrapper = Wrapper()
    assert mirage.ff.optimize(wrapper) is wrapper
    assert str(mirage.ff.report(wrapper)).endswith(
        "a recognised model sits at `model`: optimize that one (mirage.ff.optimize(model.model)) and put the "
        "result in its place")
    wrapper.model = swapped(wrapper.model)  # what the report says works
