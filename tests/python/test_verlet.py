"""mirage::verlet_kick_drift, mirage::verlet_forces_kick and mirage::verlet_forces_kick_drift
(the two in one kernel) against the velocity-Verlet steps written in PyTorch (what mirage.ff.md
ran before), in float64."""

import pytest
import torch

import mirage
from common import DEVICES, assert_error, capture_graph, randn, strided
from tolerances import tolerance


def kick_drift_reference(positions, velocities, forces, inverse_masses, kick, drift):
    v = velocities.double() + kick * forces.double() * inverse_masses.double().reshape(-1, 1)
    return positions.double() + drift * v, v


def forces_kick_reference(velocities, grad, inverse_masses, kick):
    forces = -grad.double()
    return forces, velocities.double() + kick * forces * inverse_masses.double().reshape(-1, 1)


def make_state(atoms, dtype, device, masses_shape="column"):
    positions = randn(atoms, 3, dtype=dtype, device=device, std=5.0)
    velocities = randn(atoms, 3, dtype=dtype, device=device, std=0.05)
    forces = randn(atoms, 3, dtype=dtype, device=device)
    inverse_masses = 1.0 / (1.0 + 100.0 * torch.rand(atoms, dtype=dtype, device=device))
    if masses_shape == "column":
        inverse_masses = inverse_masses[:, None]
    return positions, velocities, forces, inverse_masses


def force_call(forces, model_dtype):
    """A force call's (grad, model_energy) in model_dtype and an energy slot in the state's dtype;
    forces and the energy slot are NaN, as they are written, never read."""
    grad = randn(*forces.shape, dtype=model_dtype, device=forces.device)
    model_energy = randn(1, dtype=model_dtype, device=forces.device)
    forces.fill_(float("nan"))
    return grad, model_energy, torch.full((), float("nan"), dtype=forces.dtype, device=forces.device)


def every_state(test):
    """Parametrizes a test over devices, state and model dtypes, sizes and inverse-mass shapes."""
    for name, values in reversed([("device", DEVICES), ("state_dtype", [torch.float64, torch.float32]),
                                  ("model_dtype", [torch.float32, torch.float64]), ("atoms", [1, 7, 769]),
                                  ("masses_shape", ["column", "flat"])]):
        test = pytest.mark.parametrize(name, values)(test)
    return test


def assert_state_close(got, want, dtype):
    """One rounding of the state's dtype on values of the reference's size (a sum of two terms)."""
    assert got.dtype == dtype
    torch.testing.assert_close(got.double().cpu(), want.cpu(), **tolerance(dtype))


@every_state
def test_kick_drift_matches_pytorch(device, state_dtype, model_dtype, atoms, masses_shape):
    positions, velocities, forces, inverse_masses = make_state(atoms, state_dtype, device, masses_shape)
    want_positions, want_velocities = kick_drift_reference(positions, velocities, forces, inverse_masses, 0.25, 0.5)
    out = mirage.ops.verlet_kick_drift(positions, velocities, forces, inverse_masses, 0.25, 0.5, model_dtype)
    assert_state_close(positions, want_positions, state_dtype)
    assert_state_close(velocities, want_velocities, state_dtype)
    # The returned positions: the new state's, rounded to the model's dtype, in a tensor of their own.
    assert out.dtype == model_dtype and out.shape == (atoms, 3) and out.data_ptr() != positions.data_ptr()
    assert torch.equal(out, positions.to(model_dtype))


@every_state
def test_forces_kick_matches_pytorch(device, state_dtype, model_dtype, atoms, masses_shape):
    _, velocities, forces, inverse_masses = make_state(atoms, state_dtype, device, masses_shape)
    grad, model_energy, energy = force_call(forces, model_dtype)
    want_forces, want_velocities = forces_kick_reference(velocities, grad, inverse_masses, 0.125)
    mirage.ops.verlet_forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses, 0.125)
    assert torch.equal(forces, -grad.to(state_dtype))
    assert torch.equal(energy, model_energy.reshape(()).to(state_dtype))
    assert_state_close(velocities, want_velocities, state_dtype)
    assert_state_close(forces, want_forces, state_dtype)


@every_state
def test_forces_kick_drift_is_forces_kick_then_kick_drift(device, state_dtype, model_dtype, atoms, masses_shape):
    positions, velocities, forces, inverse_masses = make_state(atoms, state_dtype, device, masses_shape)
    grad, model_energy, energy = force_call(forces, model_dtype)
    count_range = torch.tensor([0, 2**62], device=device)  # as mirage.ff.md starts a replay: both move
    two = [t.clone() for t in (positions, velocities, forces, energy, count_range)]
    mirage.ops.verlet_forces_kick(two[1], two[2], two[3], grad, model_energy, inverse_masses, 0.125,
                                  torch.tensor([11], device=device), two[4])
    two_out = mirage.ops.verlet_kick_drift(two[0], two[1], two[2], inverse_masses, 0.125, 0.25, model_dtype)
    want_forces, want_velocities = forces_kick_reference(velocities, grad, inverse_masses, 0.125)
    want_positions, want_velocities = kick_drift_reference(positions, want_velocities, want_forces, inverse_masses,
                                                           0.125, 0.25)
    out = mirage.ops.verlet_forces_kick_drift(positions, velocities, forces, energy, grad, model_energy,
                                              inverse_masses, 0.125, 0.25, model_dtype,
                                              torch.tensor([11], device=device), count_range)
    assert torch.equal(forces, -grad.to(state_dtype)) and torch.equal(forces, two[2])
    assert torch.equal(energy, model_energy.reshape(()).to(state_dtype))
    assert count_range.tolist() == [11, 11] == two[4].tolist()
    for got, two_ops, want in ((positions, two[0], want_positions), (velocities, two[1], want_velocities)):
        assert_state_close(got, want, state_dtype)
        assert_state_close(got, two_ops.double(), state_dtype)
    assert out.dtype == model_dtype and out.shape == (atoms, 3) and torch.equal(out, positions.to(model_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_read_only_inputs(device):
    """forces, inverse masses and grad may be views; only the state written in place must be contiguous."""
    positions, velocities, forces, inverse_masses = make_state(33, torch.float64, device)
    want_positions, want_velocities = kick_drift_reference(positions, velocities, forces, inverse_masses, 0.5, 1.0)
    mirage.ops.verlet_kick_drift(positions, velocities, strided(forces), strided(inverse_masses.reshape(-1)), 0.5, 1.0)
    assert_state_close(positions, want_positions, torch.float64)
    assert_state_close(velocities, want_velocities, torch.float64)
    grad = randn(33, 3, device=device)
    energy = torch.zeros((), dtype=torch.float64, device=device)
    _, want_velocities = forces_kick_reference(velocities, grad, inverse_masses, 0.5)
    mirage.ops.verlet_forces_kick(velocities, forces, energy, strided(grad), randn(1, 1, device=device)[:, 0],
                                  inverse_masses, 0.5)
    assert torch.equal(forces, -grad.double())
    assert_state_close(velocities, want_velocities, torch.float64)
    grad = randn(33, 3, dtype=torch.float64, device=device)
    want_forces, want_velocities = forces_kick_reference(velocities, grad, inverse_masses, 0.5)
    want_positions, want_velocities = kick_drift_reference(positions, want_velocities, want_forces, inverse_masses,
                                                           0.5, 1.0)
    mirage.ops.verlet_forces_kick_drift(positions, velocities, forces, energy, strided(grad),
                                        randn(1, 1, device=device)[:, 0], strided(inverse_masses.reshape(-1)), 0.5,
                                        1.0, torch.float64)
    assert torch.equal(forces, -grad)
    assert_state_close(positions, want_positions, torch.float64)
    assert_state_close(velocities, want_velocities, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_model_energy_is_rounded_once_to_the_state(device):
    """A float32 model may sum its energy in float64: the state keeps every bit of it."""
    _, velocities, forces, inverse_masses = make_state(4, torch.float64, device)
    energy = torch.zeros((), dtype=torch.float64, device=device)
    model_energy = torch.tensor(1.0 + 1e-12, dtype=torch.float64, device=device)
    mirage.ops.verlet_forces_kick(velocities, forces, energy, randn(4, 3, device=device), model_energy,
                                  inverse_masses, 0.5)
    assert energy.item() == 1.0 + 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_a_kick_of_zero_leaves_the_velocities(device):
    """mirage.ff.md takes its first forces with a kick of 0: infinite forces must not turn the
    velocities into NaN (0 * Inf)."""
    positions, velocities, forces, inverse_masses = make_state(3, torch.float64, device)
    forces[1, 2] = float("inf")
    before = velocities.clone()
    want_positions = positions + 0.5 * before
    mirage.ops.verlet_kick_drift(positions, velocities, forces, inverse_masses, 0.0, 0.5)
    assert torch.equal(velocities, before)
    torch.testing.assert_close(positions, want_positions, **tolerance(torch.float64))
    grad = randn(3, 3, device=device)
    grad[0, 0] = float("-inf")
    mirage.ops.verlet_forces_kick(velocities, forces, torch.zeros((), dtype=torch.float64, device=device), grad,
                                  randn(1, device=device), inverse_masses, 0.0)
    assert torch.equal(velocities, before) and forces[0, 0] == float("inf")
    want_positions = positions + 0.5 * before
    mirage.ops.verlet_forces_kick_drift(positions, velocities, forces,
                                        torch.zeros((), dtype=torch.float64, device=device), grad,
                                        randn(1, device=device), inverse_masses, 0.0, 0.5)
    assert torch.equal(velocities, before) and forces[0, 0] == float("inf")
    torch.testing.assert_close(positions, want_positions, **tolerance(torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_reduced_precision_model_energy_is_taken(device):
    """A model under bfloat16 autocast may return a bfloat16 energy: it is taken as it is."""
    _, velocities, forces, inverse_masses = make_state(4, torch.float64, device)
    energy = torch.zeros((), dtype=torch.float64, device=device)
    model_energy = torch.tensor(-3.125, dtype=torch.bfloat16, device=device)
    mirage.ops.verlet_forces_kick(velocities, forces, energy, randn(4, 3, device=device), model_energy,
                                  inverse_masses, 0.5)
    assert energy.item() == -3.125
    positions = randn(4, 3, dtype=torch.float64, device=device)
    mirage.ops.verlet_forces_kick_drift(positions, velocities, forces, energy, randn(4, 3, device=device),
                                        model_energy * 2, inverse_masses, 0.5, 1.0)
    assert energy.item() == -6.25


@pytest.mark.parametrize("device", DEVICES)
def test_no_atoms(device):
    positions, velocities, forces, inverse_masses = make_state(0, torch.float64, device)
    out = mirage.ops.verlet_kick_drift(positions, velocities, forces, inverse_masses, 0.5, 1.0)
    assert out.shape == (0, 3) and out.dtype == torch.float32
    energy = torch.zeros((), dtype=torch.float64, device=device)
    mirage.ops.verlet_forces_kick(velocities, forces, energy, torch.empty(0, 3, device=device),
                                  torch.tensor([2.5], device=device), inverse_masses, 0.5)
    assert energy.item() == 2.5
    out = mirage.ops.verlet_forces_kick_drift(positions, velocities, forces, energy, torch.empty(0, 3, device=device),
                                              torch.tensor([3.5], device=device), inverse_masses, 0.5, 1.0)
    assert energy.item() == 3.5 and out.shape == (0, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_propagates(device):
    positions, velocities, forces, inverse_masses = make_state(5, torch.float64, device)
    forces[2, 1] = float("nan")
    out = mirage.ops.verlet_kick_drift(positions, velocities, forces, inverse_masses, 0.5, 1.0)
    assert torch.isnan(velocities[2, 1]) and torch.isnan(positions[2, 1]) and torch.isnan(out[2, 1])
    assert torch.isfinite(out[[0, 1, 3, 4]]).all() and torch.isfinite(out[2, [0, 2]]).all()
    grad = randn(5, 3, device=device)
    grad[4, 0] = float("inf")
    energy = torch.zeros((), dtype=torch.float64, device=device)
    mirage.ops.verlet_forces_kick(velocities, forces, energy, grad, torch.tensor(float("nan"), device=device),
                                  inverse_masses, 0.5)
    assert forces[4, 0] == float("-inf") and torch.isinf(velocities[4, 0]) and torch.isnan(energy)
    grad[4, 0] = float("nan")
    out = mirage.ops.verlet_forces_kick_drift(positions, velocities, forces, energy, grad, randn(1, device=device),
                                              inverse_masses, 0.5, 1.0)
    assert torch.isnan(forces[4, 0]) and torch.isnan(velocities[4, 0]) and torch.isnan(out[4, 0])
    assert torch.isfinite(out[[0, 1, 3]]).all() and torch.isfinite(energy)


@pytest.mark.parametrize("device", DEVICES)
def test_forces_kick_folds_the_pair_count_into_its_range(device):
    # mirage.ff.md's capacity check: the running [max, min] of the model's pair count over a replay.
    _, velocities, forces, inverse_masses = make_state(5, torch.float64, device)
    energy = torch.zeros((), dtype=torch.float64, device=device)
    count_range = torch.tensor([0, 2**62], device=device)
    seen = []
    for count in [130, 132, 7, 131, -1, 2**40]:
        # The count as the model keeps it: a [1] buffer, here a view of one at an offset.
        pair_count = torch.tensor([0, count], device=device)[1:]
        mirage.ops.verlet_forces_kick(velocities, forces, energy, randn(5, 3, device=device), randn(1, device=device),
                                      inverse_masses, 0.5, pair_count, count_range)
        seen.append(count)
        assert count_range.tolist() == [max(seen), min(seen)]
    # Without them the range is left alone and the state steps as before.
    grad = randn(5, 3, device=device)
    want_forces, want_velocities = forces_kick_reference(velocities, grad, inverse_masses, 0.5)
    mirage.ops.verlet_forces_kick(velocities, forces, energy, grad, randn(1, device=device), inverse_masses, 0.5)
    assert count_range.tolist() == [2**40, -1]
    assert_state_close(velocities, want_velocities, torch.float64)
    assert_state_close(forces, want_forces, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masses_shape", ["column", "flat"])
def test_opcheck(device, state_dtype, model_dtype, masses_shape):
    """Every sample as given (the ops write their state in place, so not with requires_grad)."""
    positions, velocities, forces, inverse_masses = make_state(7, state_dtype, device, masses_shape)
    torch.library.opcheck(torch.ops.mirage.verlet_kick_drift,
                          (positions, velocities, forces, inverse_masses, 0.5, 1.0, model_dtype))
    energy = torch.zeros((), dtype=state_dtype, device=device)
    torch.library.opcheck(torch.ops.mirage.verlet_forces_kick,
                          (velocities, forces, energy, randn(7, 3, dtype=model_dtype, device=device),
                           randn(1, dtype=model_dtype, device=device), inverse_masses, 0.5))
    torch.library.opcheck(torch.ops.mirage.verlet_forces_kick,
                          (velocities, forces, energy, randn(7, 3, dtype=model_dtype, device=device),
                           randn(1, dtype=model_dtype, device=device), inverse_masses, 0.5,
                           torch.tensor([42], device=device), torch.tensor([0, 2**62], device=device)))
    for counting in ((), (torch.tensor([42], device=device), torch.tensor([0, 2**62], device=device))):
        torch.library.opcheck(torch.ops.mirage.verlet_forces_kick_drift,
                              (positions, velocities, forces, energy, randn(7, 3, dtype=model_dtype, device=device),
                               randn(1, dtype=model_dtype, device=device), inverse_masses, 0.5, 1.0, model_dtype,
                               *counting))


def md_steps(positions, velocities, forces, energy, inverse_masses, steps):
    """Velocity-Verlet with a harmonic force on each coordinate (grad = x), float32 'model'."""
    for _ in range(steps):
        x = mirage.ops.verlet_kick_drift(positions, velocities, forces, inverse_masses, 0.05, 0.1)
        mirage.ops.verlet_forces_kick(velocities, forces, energy, x, 0.5 * (x * x).sum(), inverse_masses, 0.05)


def md_steps_joined(positions, velocities, forces, energy, inverse_masses, steps):
    """md_steps with each step's end and the next's start in one op, as mirage.ff.md runs them."""
    x = mirage.ops.verlet_kick_drift(positions, velocities, forces, inverse_masses, 0.05, 0.1)
    for _ in range(steps - 1):
        x = mirage.ops.verlet_forces_kick_drift(positions, velocities, forces, energy, x, 0.5 * (x * x).sum(),
                                                inverse_masses, 0.05, 0.1)
    mirage.ops.verlet_forces_kick(velocities, forces, energy, x, 0.5 * (x * x).sum(), inverse_masses, 0.05)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True])
def test_joined_steps_match_the_separate_ones(device, compiled):
    state = make_state(9, torch.float64, device)
    energy = torch.zeros((), dtype=torch.float64, device=device)
    separate = [t.clone() for t in state[:3]] + [energy.clone()]
    md_steps(*separate, state[3], 4)
    (torch.compile(md_steps_joined, fullgraph=True) if compiled else md_steps_joined)(*state[:3], energy, state[3], 4)
    for got, want in zip(state[:3], separate):
        assert_state_close(got, want, torch.float64)
    torch.testing.assert_close(energy, separate[3], **tolerance(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_steps_match_eager(device):
    state = make_state(9, torch.float64, device)
    energy = torch.zeros((), dtype=torch.float64, device=device)
    eager = [t.clone() for t in state[:3]] + [energy.clone()]
    md_steps(eager[0], eager[1], eager[2], eager[3], state[3], 3)
    compiled = torch.compile(md_steps, fullgraph=True)
    compiled(state[0], state[1], state[2], energy, state[3], 3)
    for got, want in zip(state[:3], eager):
        assert_state_close(got, want, torch.float64)
    # The float32 "model" energy is a sum the compiler may order differently.
    torch.testing.assert_close(energy, eager[3], **tolerance(torch.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("steps_of", [md_steps, md_steps_joined])
def test_cuda_graph_replays_advance_the_state(steps_of):
    """Each replay advances the captured buffers from where the last left them, as eager steps do."""
    positions, velocities, forces, inverse_masses = make_state(12, torch.float64, "cuda")
    energy = torch.zeros((), dtype=torch.float64, device="cuda")
    state = (positions, velocities, forces, energy)
    graph, _ = capture_graph(lambda: steps_of(*state, inverse_masses, 2))
    eager = [t.clone() for t in state]  # where the warm-up calls left the state (capturing runs nothing)
    for _ in range(3):
        graph.replay()
        steps_of(*eager, inverse_masses, 2)
    torch.cuda.synchronize()
    for got, want in zip(state, eager):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def kick_drift_call(**changes):
    def call(device):
        args = dict(zip(("positions", "velocities", "forces", "inverse_masses"), make_state(4, torch.float64, device)))
        args.update(kick=0.5, drift=1.0, dtype=torch.float32)
        args.update({k: (v(device) if callable(v) else v) for k, v in changes.items()})
        return torch.ops.mirage.verlet_kick_drift(**args)
    return call


def forces_kick_call(**changes):
    def call(device):
        _, velocities, forces, inverse_masses = make_state(4, torch.float64, device)
        args = dict(velocities=velocities, forces=forces, energy=torch.zeros((), dtype=torch.float64, device=device),
                    grad=randn(4, 3, device=device), model_energy=randn(1, device=device),
                    inverse_masses=inverse_masses, kick=0.5)
        args.update({k: (v(device) if callable(v) else v) for k, v in changes.items()})
        return torch.ops.mirage.verlet_forces_kick(**args)
    return call


# A float32 state, whose kernels and references take a step's scale as a float32.
FLOAT32 = {name: (lambda d: torch.zeros(4, 3, device=d)) for name in ("positions", "velocities", "forces")}
FLOAT32.update(inverse_masses=lambda d: torch.ones(4, device=d), energy=lambda d: torch.zeros((), device=d))


def float32_state(*names):
    return {name: FLOAT32[name] for name in names}


KICK_DRIFT_ERRORS = [
    (dict(positions=lambda d: torch.zeros(4, 3, dtype=torch.float16, device=d)), "positions must be float32 or float64"),
    (dict(positions=lambda d: torch.zeros(4, 2, dtype=torch.float64, device=d)), "positions must be [N, 3]"),
    (dict(positions=lambda d: torch.zeros(3, 4, dtype=torch.float64, device=d).t()), "positions must be contiguous"),
    (dict(velocities=lambda d: torch.zeros(4, 3, dtype=torch.float32, device=d)), "velocities must have positions' dtype"),
    (dict(velocities=lambda d: torch.zeros(5, 3, dtype=torch.float64, device=d)), "velocities must have shape [N, 3]"),
    (dict(velocities=lambda d: torch.zeros(3, 4, dtype=torch.float64, device=d).t()), "velocities must be contiguous"),
    (dict(forces=lambda d: torch.zeros(4, 3, dtype=torch.float32, device=d)), "forces must have positions' dtype"),
    (dict(forces=lambda d: torch.zeros(4, dtype=torch.float64, device=d)), "forces must have shape [N, 3]"),
    (dict(inverse_masses=lambda d: torch.ones(4, 3, dtype=torch.float64, device=d)),
     "inverse_masses must be [N] or [N, 1] with N = 4"),
    (dict(inverse_masses=lambda d: torch.ones(4, dtype=torch.float32, device=d)), "inverse_masses must have positions' dtype"),
    (dict(dtype=torch.float16), "dtype must be float32 or float64"),
    # A step of NaN or an infinity would write NaN over the whole state.
    (dict(kick=float("nan")), "kick must be finite, got nan"),
    (dict(drift=float("-inf")), "drift must be finite, got -inf"),
    # Finite as a double, but not in the state's float32: the error was PyTorch's "value cannot be
    # converted to type float without overflow", naming neither the op nor the argument.
    (dict(float32_state("positions", "velocities", "forces", "inverse_masses"), kick=1e39),
     "kick must be finite as a float32 (the state's dtype), got 1e+39"),
    (dict(float32_state("positions", "velocities", "forces", "inverse_masses"), drift=-1e39),
     "drift must be finite as a float32 (the state's dtype), got -1e+39"),
]

FORCES_KICK_ERRORS = [
    (dict(velocities=lambda d: torch.zeros(4, 3, dtype=torch.int64, device=d)), "velocities must be float32 or float64"),
    (dict(velocities=lambda d: torch.zeros(4, 2, dtype=torch.float64, device=d)), "velocities must be [N, 3]"),
    (dict(velocities=lambda d: torch.zeros(3, 4, dtype=torch.float64, device=d).t()), "velocities must be contiguous"),
    (dict(forces=lambda d: torch.zeros(4, 1, dtype=torch.float64, device=d)), "forces must have shape [N, 3]"),
    (dict(inverse_masses=lambda d: torch.ones(4, dtype=torch.float32, device=d)),
     "inverse_masses must have velocities' dtype"),
    (dict(forces=lambda d: torch.zeros(4, 3, dtype=torch.float32, device=d)), "forces must have velocities' dtype"),
    (dict(forces=lambda d: torch.zeros(3, 4, dtype=torch.float64, device=d).t()), "forces must be contiguous"),
    (dict(energy=lambda d: torch.zeros(1, dtype=torch.float64, device=d)), "energy must have shape []"),
    (dict(energy=lambda d: torch.zeros((), dtype=torch.float32, device=d)), "energy must have velocities' dtype"),
    (dict(grad=lambda d: torch.zeros(4, 3, dtype=torch.float16, device=d)), "grad must be float32 or float64"),
    (dict(grad=lambda d: torch.zeros(5, 3, device=d)), "grad must have velocities' shape"),
    (dict(model_energy=lambda d: torch.zeros(2, device=d)), "model_energy must have one element"),
    (dict(model_energy=lambda d: torch.zeros(1, dtype=torch.int64, device=d)), "model_energy must be floating point"),
    (dict(kick=float("inf")), "kick must be finite, got inf"),
    (dict(float32_state("velocities", "forces", "inverse_masses", "energy"), kick=1e39),
     "kick must be finite as a float32 (the state's dtype), got 1e+39"),
    (dict(inverse_masses=lambda d: torch.ones(5, 1, dtype=torch.float64, device=d)),
     "inverse_masses must be [N] or [N, 1] with N = 4"),
    (dict(pair_count=lambda d: torch.tensor([3], device=d)),
     "pair_count and pair_count_range must both be given or both be None"),
    (dict(pair_count_range=lambda d: torch.tensor([0, 9], device=d)),
     "pair_count and pair_count_range must both be given or both be None"),
    (dict(pair_count=lambda d: torch.tensor([3], dtype=torch.int32, device=d),
          pair_count_range=lambda d: torch.tensor([0, 9], device=d)), "pair_count must be int64"),
    (dict(pair_count=lambda d: torch.tensor([3, 4], device=d),
          pair_count_range=lambda d: torch.tensor([0, 9], device=d)), "pair_count must have one element"),
    (dict(pair_count=lambda d: torch.tensor([3], device=d),
          pair_count_range=lambda d: torch.tensor([0.0, 9.0], device=d)), "pair_count_range must be int64"),
    (dict(pair_count=lambda d: torch.tensor([3], device=d),
          pair_count_range=lambda d: torch.tensor([0, 9, 1], device=d)), "pair_count_range must be [2]"),
    (dict(pair_count=lambda d: torch.tensor([3], device=d),
          pair_count_range=lambda d: torch.tensor([0, 5, 9, 6], device=d)[::2]), "pair_count_range must be contiguous"),
]


def forces_kick_drift_call(**changes):
    def call(device):
        positions, velocities, forces, inverse_masses = make_state(4, torch.float64, device)
        args = dict(positions=positions, velocities=velocities, forces=forces,
                    energy=torch.zeros((), dtype=torch.float64, device=device), grad=randn(4, 3, device=device),
                    model_energy=randn(1, device=device), inverse_masses=inverse_masses, kick=0.5, drift=1.0,
                    dtype=torch.float32)
        args.update({k: (v(device) if callable(v) else v) for k, v in changes.items()})
        return torch.ops.mirage.verlet_forces_kick_drift(**args)
    return call


# What the joined op checks beyond the two ops' checks (which it runs under its own name: a sample of each).
FORCES_KICK_DRIFT_ERRORS = [
    (dict(positions=lambda d: torch.zeros(4, 2, dtype=torch.float64, device=d)), "positions must be [N, 3]"),
    (dict(forces=lambda d: torch.zeros(3, 4, dtype=torch.float64, device=d).t()), "forces must be contiguous"),
    (dict(energy=lambda d: torch.zeros(1, dtype=torch.float64, device=d)), "energy must have shape []"),
    (dict(dtype=torch.float16), "dtype must be float32 or float64"),
    (dict(kick=float("nan")), "kick must be finite, got nan"),
    (dict(drift=float("inf")), "drift must be finite, got inf"),
    (dict(pair_count=lambda d: torch.tensor([3], device=d)),
     "pair_count and pair_count_range must both be given or both be None"),
    (dict(grad=lambda d: torch.zeros(4, 3, dtype=torch.float64, device=d)),
     "grad must have dtype's dtype (the model's, Float), got Double"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("changes,message", FORCES_KICK_DRIFT_ERRORS)
def test_forces_kick_drift_bad_input(device, changes, message):
    assert_error(forces_kick_drift_call(**changes), device, "mirage::verlet_forces_kick_drift: " + message)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("changes,message", KICK_DRIFT_ERRORS)
def test_kick_drift_bad_input(device, changes, message):
    assert_error(kick_drift_call(**changes), device, "mirage::verlet_kick_drift: " + message)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("changes,message", FORCES_KICK_ERRORS)
def test_forces_kick_bad_input(device, changes, message):
    assert_error(forces_kick_call(**changes), device, "mirage::verlet_forces_kick: " + message)


def shared(device):
    """State rows to take overlapping views of (rows 0-3 and 2-5 share two)."""
    return torch.zeros(9, 3, dtype=torch.float64, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call,message", [
    (lambda d: (lambda b: torch.ops.mirage.verlet_kick_drift(b[:4], b[:4], randn(4, 3, dtype=torch.float64, device=d),
                                                             torch.ones(4, dtype=torch.float64, device=d), 0.5, 0.1,
                                                             torch.float32))(shared(d)),
     "mirage::verlet_kick_drift: positions (updated in place) must not share memory with velocities"),
    (lambda d: (lambda b: torch.ops.mirage.verlet_kick_drift(b[:4], b[2:6], randn(4, 3, dtype=torch.float64, device=d),
                                                             torch.ones(4, dtype=torch.float64, device=d), 0.5, 0.1,
                                                             torch.float32))(shared(d)),
     "mirage::verlet_kick_drift: positions (updated in place) must not share memory with velocities"),
    (lambda d: (lambda b: torch.ops.mirage.verlet_kick_drift(b[:4], b[5:9], b[2:6],
                                                             torch.ones(4, dtype=torch.float64, device=d), 0.5, 0.1,
                                                             torch.float32))(shared(d)),
     "mirage::verlet_kick_drift: positions (updated in place) must not share memory with forces"),
    (lambda d: (lambda b: torch.ops.mirage.verlet_forces_kick(
        b[:4], b[5:9], torch.zeros((), dtype=torch.float64, device=d), b[2:6].float(), randn(1, device=d),
        torch.ones(4, dtype=torch.float64, device=d), 0.5))(shared(d)), None),  # grad a copy: runs
    (lambda d: (lambda b: torch.ops.mirage.verlet_forces_kick(
        b[:4], b[2:6], torch.zeros((), dtype=torch.float64, device=d), randn(4, 3, device=d), randn(1, device=d),
        torch.ones(4, dtype=torch.float64, device=d), 0.5))(shared(d)),
     "mirage::verlet_forces_kick: velocities (updated in place) must not share memory with forces"),
    (lambda d: (lambda b: torch.ops.mirage.verlet_forces_kick(
        b[:4], b[5:9], torch.zeros((), dtype=torch.float64, device=d), b[1:5], randn(1, device=d),
        torch.ones(4, dtype=torch.float64, device=d), 0.5))(shared(d)),
     "mirage::verlet_forces_kick: velocities (updated in place) must not share memory with grad"),
    # A strided view, whose overlap PyTorch cannot work out: inverse_masses a column of velocities.
    (lambda d: (lambda v: torch.ops.mirage.verlet_forces_kick(
        v, torch.zeros(3, 3, dtype=torch.float64, device=d), torch.zeros((), dtype=torch.float64, device=d),
        torch.ones(3, 3, dtype=torch.float64, device=d), torch.zeros((), device=d), v[:, 0], 1.0))(
        torch.arange(1.0, 10.0, dtype=torch.float64, device=d).reshape(3, 3)),
     "mirage::verlet_forces_kick: velocities (updated in place) must not share memory with inverse_masses"),
    (lambda d: (lambda b: forces_kick_drift_call(positions=b[:4], grad=b[2:6].float())(d))(shared(d)), None),
    (lambda d: (lambda b: forces_kick_drift_call(positions=b[:4], velocities=b[5:9], dtype=torch.float64,
                                                 grad=b[1:5])(d))(shared(d)),
     "mirage::verlet_forces_kick_drift: positions (updated in place) must not share memory with grad"),
    (lambda d: (lambda b: forces_kick_drift_call(positions=b[:4], forces=b[3:7])(d))(shared(d)),
     "mirage::verlet_forces_kick_drift: positions (updated in place) must not share memory with forces"),
    (lambda d: (lambda b: forces_kick_drift_call(positions=b[:4], energy=b[1, 1])(d))(shared(d)),
     "mirage::verlet_forces_kick_drift: positions (updated in place) must not share memory with energy"),
    # The pair count's range in the state's memory (an int64 view of it): one thread would fold the
    # count into it while the others update the state.
    (lambda d: (lambda b: forces_kick_drift_call(positions=b[:4], pair_count=torch.tensor([3], device=d),
                                                 pair_count_range=b[:1].view(-1).view(torch.int64)[:2])(d))(
        shared(d)), "mirage::verlet_forces_kick_drift: positions (updated in place) must not share memory with "
                    "pair_count_range"),
    (lambda d: (lambda b: forces_kick_call(velocities=lambda _: b[:4], pair_count=lambda _: b[2:4].view(-1).view(
        torch.int64)[:1], pair_count_range=lambda _: torch.tensor([0, 9], device=d))(d))(shared(d)),
     "mirage::verlet_forces_kick: velocities (updated in place) must not share memory with pair_count"),
    (lambda d: (lambda b: forces_kick_call(forces=lambda _: b[5:9], grad=lambda _: b[:4],
                                           pair_count=lambda _: torch.tensor([3], device=d),
                                           pair_count_range=lambda _: b[:1].view(-1).view(torch.int64)[:2])(d))(
        shared(d)), "mirage::verlet_forces_kick: pair_count_range (updated in place) must not share memory with grad"),
])
def test_state_sharing_memory_is_refused(device, call, message):
    if message is None:
        call(device)
    else:
        assert_error(call, device, message)


@pytest.mark.cuda
def test_inputs_on_another_device_are_refused():
    assert_error(kick_drift_call(velocities=lambda d: torch.zeros(4, 3, dtype=torch.float64)), "cuda",
                 "mirage::verlet_kick_drift: velocities must be on positions' device")
    assert_error(kick_drift_call(forces=lambda d: torch.zeros(4, 3, dtype=torch.float64)), "cuda",
                 "mirage::verlet_kick_drift: forces must be on positions' device")
    assert_error(kick_drift_call(inverse_masses=lambda d: torch.ones(4, dtype=torch.float64)), "cuda",
                 "mirage::verlet_kick_drift: inverse_masses must be on positions' device")
    assert_error(forces_kick_call(grad=lambda d: torch.zeros(4, 3)), "cuda",
                 "mirage::verlet_forces_kick: grad must be on velocities' device")
    assert_error(forces_kick_call(model_energy=lambda d: torch.zeros(1)), "cuda",
                 "mirage::verlet_forces_kick: model_energy must be on velocities' device")
    assert_error(forces_kick_call(energy=lambda d: torch.zeros((), dtype=torch.float64)), "cuda",
                 "mirage::verlet_forces_kick: energy must be on velocities' device")
    assert_error(forces_kick_call(inverse_masses=lambda d: torch.ones(4, dtype=torch.float64)), "cuda",
                 "mirage::verlet_forces_kick: inverse_masses must be on velocities' device")
    assert_error(forces_kick_call(pair_count=lambda d: torch.tensor([3]),
                                  pair_count_range=lambda d: torch.tensor([0, 9], device=d)), "cuda",
                 "mirage::verlet_forces_kick: pair_count must be on velocities' device")
    assert_error(forces_kick_call(pair_count=lambda d: torch.tensor([3], device=d),
                                  pair_count_range=lambda d: torch.tensor([0, 9])), "cuda",
                 "mirage::verlet_forces_kick: pair_count_range must be on velocities' device")
    assert_error(forces_kick_drift_call(grad=lambda d: torch.zeros(4, 3)), "cuda",
                 "mirage::verlet_forces_kick_drift: grad must be on velocities' device")
    assert_error(forces_kick_drift_call(forces=lambda d: torch.zeros(4, 3, dtype=torch.float64)), "cuda",
                 "mirage::verlet_forces_kick_drift: forces must be on positions' device")


# The tensors each op writes in place (pair_count_range, int64, cannot require grad), with a call
# that passes a given one for it.
WRITTEN = [
    ("verlet_kick_drift", kick_drift_call, "positions"),
    ("verlet_kick_drift", kick_drift_call, "velocities"),
    ("verlet_forces_kick", forces_kick_call, "velocities"),
    ("verlet_forces_kick", forces_kick_call, "forces"),
    ("verlet_forces_kick", forces_kick_call, "energy"),
    ("verlet_forces_kick_drift", forces_kick_drift_call, "positions"),
    ("verlet_forces_kick_drift", forces_kick_drift_call, "velocities"),
    ("verlet_forces_kick_drift", forces_kick_drift_call, "forces"),
    ("verlet_forces_kick_drift", forces_kick_drift_call, "energy"),
]


def requiring_grad(name, leaf):
    """A float64 state tensor for `name` that requires grad: a leaf, or computed from one."""
    def make(device):
        t = torch.zeros((), dtype=torch.float64, device=device) if name == "energy" else \
            randn(4, 3, dtype=torch.float64, device=device)
        t.requires_grad_()
        return t if leaf else t * 1.0
    return make


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("leaf", [True, False])
@pytest.mark.parametrize("op,call,name", WRITTEN)
def test_a_written_tensor_that_requires_grad_is_refused(device, leaf, op, call, name):
    """Not differentiable: a state that requires grad would keep a graph that no longer describes
    its values (a non-leaf was overwritten silently before). Under no_grad the same call runs."""
    given = call(**{name: requiring_grad(name, leaf)})
    assert_error(given, device, f"mirage::{op}: {name} requires grad, but it is written in place and the Verlet "
                                "ops are not differentiable")
    with torch.no_grad():
        given(device)


@pytest.mark.parametrize("device", DEVICES)
def test_read_only_inputs_that_require_grad_are_constants(device):
    """What mirage.ff.md passes: the model's energy and its gradient, which may require grad. The
    state written from them does not."""
    model_energy = randn(1, device=device).requires_grad_()
    grad = randn(4, 3, device=device).requires_grad_()
    positions = forces_kick_drift_call(model_energy=model_energy, grad=grad)(device)
    assert not positions.requires_grad
    assert not kick_drift_call(forces=randn(4, 3, dtype=torch.float64, device=device).requires_grad_())(
        device).requires_grad


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_written_tensors_are_versioned_once(device):
    """Each tensor written in place is one version later, as after one of PyTorch's in-place ops
    (the CUDA and Meta kernels had left every version as it was); read-only inputs are not."""
    positions, velocities, forces, inverse_masses = make_state(4, torch.float64, device)
    energy = torch.zeros((), dtype=torch.float64, device=device)
    grad, model_energy = randn(4, 3, device=device), randn(1, device=device)
    pair_count, pair_count_range = torch.tensor([3], device=device), torch.tensor([0, 9], device=device)
    everything = [positions, velocities, forces, energy, grad, model_energy, inverse_masses, pair_count,
                  pair_count_range]

    def versions_after(call, written):
        before = [t._version for t in everything]
        call()
        return [t._version - b for t, b in zip(everything, before)] == [int(any(t is w for w in written)) for t in everything]

    assert versions_after(lambda: mirage.ops.verlet_kick_drift(positions, velocities, forces, inverse_masses, 0.5, 1.0),
                          [positions, velocities])
    assert versions_after(lambda: mirage.ops.verlet_forces_kick(velocities, forces, energy, grad, model_energy,
                                                                inverse_masses, 0.5, pair_count, pair_count_range),
                          [velocities, forces, energy, pair_count_range])
    assert versions_after(lambda: mirage.ops.verlet_forces_kick_drift(
        positions, velocities, forces, energy, grad, model_energy, inverse_masses, 0.5, 1.0, torch.float32,
        pair_count, pair_count_range), [positions, velocities, forces, energy, pair_count_range])


@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_that_saved_the_state_refuses_to_backpropagate_after_a_step(device):
    positions, velocities, forces, inverse_masses = make_state(4, torch.float64, device)
    weight = randn(4, 3, dtype=torch.float64, device=device).requires_grad_()
    loss = (weight * positions).sum()  # saves positions for weight's gradient
    torch.ops.mirage.verlet_kick_drift(positions, velocities, forces, inverse_masses, 0.5, 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
