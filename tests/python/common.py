"""Shared by the tests: devices, dtypes, input makers, the reference comparison, a CPU stand-in
for a CUDA graph."""

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from mirage import graphs

from tolerances import REDUCTION_ERROR_FACTOR, tolerance

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# The force-field ops' activations by name (mirage.ff's), in plain PyTorch: the references.
FF_ACTIVATIONS = {
    "shifted_softplus": lambda v: F.softplus(v) - math.log(2.0),
    "softplus": F.softplus,
    "silu": F.silu,
    "tanh": torch.tanh,
    "gelu": F.gelu,
    "relu": F.relu,
}


# What the force-field ops ask of a cutoff (csrc/ops/checks.cpp, check_cutoff).
CUTOFF_RULE = "cutoff must be finite and > 0, in float32's normal range (1.2e-38 to 3.4e38)"


def randn(*shape, dtype=torch.float32, device="cpu", mean=0.3, std=1.7):
    """Random values away from zero mean and unit scale, so offsets and scales are exercised."""
    return (torch.randn(*shape, dtype=torch.float64) * std + mean).to(dtype=dtype, device=device)


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as x as a non-contiguous view: every other element, along the last
    dimension longer than 1, of a tensor twice as wide (the gaps hold NaN)."""
    dims = [d for d in range(x.dim()) if x.shape[d] > 1]
    if not dims:
        return x
    d = dims[-1]
    shape = list(x.shape)
    shape[d] *= 2
    wide = torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)
    view = wide.narrow(d, 0, shape[d] - 1)[(slice(None),) * d + (slice(None, None, 2),)]
    view.copy_(x)
    assert not view.is_contiguous()
    return view


def assert_error(call, device, message):
    """call(device) raises a RuntimeError whose text contains message."""
    with pytest.raises(RuntimeError) as error:
        call(device)
    assert message in str(error.value)


def assert_first_order_only(output, leaf, parameter_message):
    """output (a scalar) gives its gradient in leaf although a parameter requires grad, but
    raises when asked for the parameters' gradient (message parameter_message) or a second order:
    the contract of the ops with a fused, first-order backward (schnet_energy, cfconv)."""
    grad, = torch.autograd.grad(output, leaf, retain_graph=True)
    assert torch.isfinite(grad).all()
    with pytest.raises(RuntimeError, match=parameter_message):
        output.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(output, leaf, create_graph=True)


def replace_item(index, value):
    """A change for a list argument (the energy ops' weights): item `index` becomes value(item)."""
    def change(items):
        items = list(items)
        items[index] = value(items[index])
        return items
    return change


def _bad_pair(row, value):
    def change(pairs):
        pairs = pairs.clone()
        pairs[row, 3 if row else 5] = value
        return pairs
    return change


def assert_energy_op_cpu_index_errors(call):
    """A whole-model energy op (schnet_energy, painn_energy) on the CPU names an out-of-range pair
    index or atomic number; call(device, **changes) runs it on 7-atom inputs with argument changes."""
    assert_error(lambda d: call(d, pairs=_bad_pair(1, 7)), "cpu", "pairs[1, 3] = 7 is out of range for N=7 rows")
    assert_error(lambda d: call(d, atomic_numbers=lambda z: z + 10), "cpu", "is out of range for embedding's 10 rows")


def assert_energy_op_cuda_index_nans(call):
    """... and on CUDA gives NaN everywhere for the same errors (no host sync to raise)."""
    for changes in (dict(pairs=_bad_pair(0, -1)), dict(atomic_numbers=lambda z: z + 10)):
        energy, grad, grad_positions = call("cuda", **changes)
        assert torch.isnan(energy) and torch.isnan(grad).all() and torch.isnan(grad_positions).all()


def _in_float64(args):
    """A whole-model op's arguments with every floating tensor (the weights' too) in float64."""
    def one(a):
        if isinstance(a, list):
            return [one(x) for x in a]
        return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
    return [one(a) for a in args]


def onto_atoms(grad_vectors, pairs, atoms):
    """d energy / d positions from d energy / d vectors, vectors = r_j - r_i: + onto the senders
    (pairs[1]), - onto the receivers (pairs[0])."""
    out = torch.zeros(atoms, 3, dtype=grad_vectors.dtype, device=grad_vectors.device)
    return out.index_add_(0, pairs[1], grad_vectors).index_add_(0, pairs[0], -grad_vectors)


def assert_energy_op_matches_composite(op, composite, args, name):
    """A whole-model op's (energy, d energy / d vectors, d energy / d positions) on ``args``
    (atomic_numbers, embedding, pairs, vectors, cutoff, ...) against ``composite`` in float64 (its
    vectors' gradient scattered onto the atoms for the third): within float64's tolerance when the
    op ran in float64; in float32, bounded by PyTorch's own float32 error on the same inputs (a
    whole network's worth of rounding). Pairs at or beyond the cutoff get a zero gradient."""
    energy, grad, grad_positions = op(*args)
    dtype, pairs, vectors, cutoff, atoms = args[1].dtype, args[2], args[3], args[4], args[0].shape[0]
    assert energy.shape == () and grad.shape == vectors.shape and grad_positions.shape == (atoms, 3)
    assert energy.dtype == grad.dtype == grad_positions.dtype == dtype
    beyond = vectors.double().norm(dim=1) > cutoff * (1 + 1e-6)  # clear of float32 rounding
    assert (grad[beyond] == 0).all() and (grad[vectors[:, 0] == cutoff] == 0).all()  # padding included
    ref_energy, ref_grad = composite(*_in_float64(args))
    ref_positions = onto_atoms(ref_grad, pairs, atoms)
    if dtype == torch.float64:
        for ours, ref in ((energy, ref_energy), (grad, ref_grad), (grad_positions, ref_positions)):
            torch.testing.assert_close(ours, ref, **tolerance(dtype))
        return
    torch_energy, torch_grad = composite(*args)
    for ours, theirs, ref in ((energy, torch_energy, ref_energy), (grad, torch_grad, ref_grad),
                              (grad_positions, onto_atoms(torch_grad, pairs, atoms), ref_positions)):
        assert_within_pytorch_error(ours, theirs, ref, name)


def assert_within_pytorch_error(ours, theirs, ref, name):
    """ours' max error against the float64 ``ref`` is within REDUCTION_ERROR_FACTOR x PyTorch's own
    (``theirs``, the same computation in ours' dtype) + the dtype's atol, relative to ref's scale:
    the bound for a whole network's worth of float32 rounding."""
    scale = ref.abs().max().item() if ref.numel() else 0.0
    ours_error = (ours.double() - ref).abs().max().item() if ref.numel() else 0.0
    theirs_error = (theirs.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert ours_error <= REDUCTION_ERROR_FACTOR * theirs_error + tolerance(ours.dtype)["atol"] * max(scale, 1.0), \
        (name, ours_error, theirs_error, scale)


def energy_op_opcheck(op, args):
    """torch.library.opcheck of a whole-model op (``op`` an OpOverload) with its vectors requiring
    grad and its activations as the schema's comma-separated string."""
    args = list(args)
    args[3] = args[3].detach().requires_grad_(True)
    args[7] = ",".join(args[7])
    torch.library.opcheck(op, tuple(args))


def assert_energy_op_pairs_beyond_the_cutoff_add_nothing(op, args):
    """Every pair moved past the cutoff: the energy of the atoms alone, a zero gradient."""
    args = list(args)
    cutoff = args[4]
    args[3] = F.normalize(args[3], dim=1) * (1.2 * cutoff)
    energy, grad, grad_positions = op(*args)
    alone = op(args[0], args[1], args[2][:, :0], args[3][:0], *args[4:])[0]
    torch.testing.assert_close(energy, alone, rtol=1e-6, atol=1e-6)
    assert (grad == 0).all() and (grad_positions == 0).all()


def assert_energy_op_replays_new_vectors(op, args, grad_atol):
    """A whole-model op captured in a CUDA graph, replayed on new vectors, against eager calls on
    them. Not bitwise: float atomics add the messages and the senders' gradients in whatever order
    the blocks reach them (two eager calls differ by up to ~4e-7 relative, H200); a replay that
    read stale inputs would be off by far more. grad_atol(want_grad): the gradient's atol."""
    args = list(args)
    static = args[3].clone()
    graph, (energy, *grads) = capture_graph(lambda: op(*args[:3], static, *args[4:]))
    for _ in range(3):
        static.copy_(args[3] * (1 + 0.05 * torch.rand(args[3].shape[0], 1, device="cuda")))
        graph.replay()
        want_energy, *want_grads = op(*args[:3], static, *args[4:])
        torch.testing.assert_close(energy, want_energy, rtol=5e-6, atol=1e-6)
        for grad, want_grad in zip(grads, want_grads):
            torch.testing.assert_close(grad, want_grad, rtol=5e-6, atol=grad_atol(want_grad))


def assert_energy_op_takes_unaligned_weights(op, args, indices, grad_atol):
    """The weights at ``indices`` moved to storage 4 bytes off a 16-byte boundary (the kernels'
    scalar loads): the same outputs as from aligned weights. grad_atol as above."""
    args = list(args)
    want_energy, *want_grads = op(*args)
    weights = list(args[6])
    for index in indices:
        w = weights[index]
        shifted = torch.empty(w.numel() + 1, device="cuda")[1:].view_as(w).copy_(w)
        assert shifted.data_ptr() % 16 != 0
        weights[index] = shifted
    energy, *grads = op(*args[:6], weights, *args[7:])
    torch.testing.assert_close(energy, want_energy, rtol=5e-6, atol=1e-6)
    for grad, want_grad in zip(grads, want_grads):
        torch.testing.assert_close(grad, want_grad, rtol=5e-6, atol=grad_atol(want_grad))


def assert_backward_reads_no_value_of(op, composite, inputs, unread):
    """``op(*leaves)``'s backward keeps none of the leaves at the indices ``unread`` (the op is
    linear in them), and gives ``composite``'s gradients though they change in place after the
    forward (where keeping them failed with "modified by an inplace operation")."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    saved = set()

    def pack(t):
        saved.add(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = op(*leaves)
    assert not {leaves[i].data_ptr() for i in unread} & saved
    with torch.no_grad():
        for i in unread:
            leaves[i].mul_(3.0)
    grad = randn(*y.shape, device=y.device)
    y.backward(grad)
    reference = [t.clone().requires_grad_() for t in inputs]
    composite(*reference).backward(grad)
    for ours, theirs in zip(leaves, reference):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)


def cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(dtype)
    return value


def opcheck(op, args):
    """torch.library.opcheck on a sample as given and again with its floating tensors requiring
    grad (the autograd registration and the backward under AOTAutograd)."""
    torch.library.opcheck(op, args)
    leaves = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                   for a in args)
    torch.library.opcheck(op, leaves)


def assert_matches(got, composite, args, dtype, reduction=False):
    """got == composite(*args) within the dtype's tolerance of the float64 result.

    For reductions also: got's max error <= REDUCTION_ERROR_FACTOR x PyTorch's own same-dtype
    error (composite run with every floating argument in dtype) + atol.
    """
    ref = composite(*[cast(a, torch.float64) for a in args])
    tol = tolerance(dtype)
    assert got.dtype == dtype
    assert got.shape == ref.shape
    torch.testing.assert_close(got.double().cpu(), ref.to(dtype).double().cpu(), **tol)
    if reduction and dtype != torch.float64:
        ours = (got.double() - ref).abs().max().item()
        theirs = (composite(*[cast(a, dtype) for a in args]).double() - ref).abs().max().item()
        assert ours <= REDUCTION_ERROR_FACTOR * theirs + tol["atol"], (ours, theirs)


def assert_close_to(got, want, dtype, magnitude=None):
    """got (dtype) == want (float64) rounded to dtype, within the dtype's tolerance.

    magnitude: the sum of |terms| behind each element of want. A float32 sum of many terms in
    any order (atomics) is off by a few units of float32 rounding of that sum, which can exceed
    the table's tolerance for an element whose terms cancel; the bound allows 4 such units.
    """
    assert got.dtype == dtype
    assert got.shape == want.shape
    got, want = got.double().cpu(), want.to(dtype).double()
    if magnitude is None:
        torch.testing.assert_close(got, want, **tolerance(dtype))
        return
    tol = tolerance(dtype)
    allowed = tol["atol"] + tol["rtol"] * want.abs() + 4 * torch.finfo(dtype).eps * magnitude.double()
    excess = (got - want).abs() - allowed
    worst = int(excess.flatten().argmax()) if excess.numel() else 0
    assert not (excess > 0).any(), (
        f"{int((excess > 0).sum())} of {excess.numel()} elements beyond the bound; worst at flat index "
        f"{worst}: got {got.flatten()[worst].item()}, want {want.flatten()[worst].item()}, "
        f"allowed {allowed.flatten()[worst].item()}")


class OpCounter(TorchDispatchMode):
    """Records the operators that run below it (``calls``: names such as ``"aten.div"``)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


# Operators that write zeros: a backward that should skip an unused gradient must call none.
ZERO_FILLS = frozenset({"aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.fill_", "aten.zero_"})


def skip_unless_whole_model_clusters():
    """For tests of the whole-model ops' limits on Hopper (whole_model_max_pairs, ..._atoms): where
    those ops run as one block (before sm_90, or MIRAGE_CLUSTER_LIMIT=1) the models use their
    one_block_max_pairs and one_block_max_atoms instead (test_ff_optimize.py checks that choice)."""
    from mirage.ff.fused import _whole_model_clusters

    if not _whole_model_clusters(f"cuda:{torch.cuda.current_device()}"):
        pytest.skip("the whole-model ops run as one block on this GPU (limits of their own)")


def energy_forces_and_ops(model, numbers, positions, training):
    """(energy, forces, ops): a force field's call in training or eval mode, with the operators
    its forward and backward ran (OpCounter's ``calls``); positions must require grad."""
    model.train(training)
    with OpCounter() as ops:
        energy = model(numbers, positions)
        forces, = torch.autograd.grad(energy, positions)
    return energy.detach(), -forces, ops.calls


def capture_graph(step):
    """(graph, outputs): ``step()`` warmed up twice on a side stream, then captured in one CUDA
    graph; ``graph.replay()`` recomputes ``outputs`` in place from the tensors ``step`` reads."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


class WrappedForceField(torch.nn.Module):
    """The user's own module around a force field (a fused model, say): any neighbor capacity is the
    inner model's."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        return self.inner(atomic_numbers, positions, cell, pbc)


class MatmulFlagProbe(torch.nn.Module):
    """A harmonic force field that records, at each call, whether TF32 matmuls were allowed: the
    precision a driver ran the model under, which the CPU (no TF32) would not show in its results."""

    def __init__(self):
        super().__init__()
        self.stiffness = torch.nn.Parameter(torch.tensor(0.1))
        self.allowed_tf32 = []

    def forward(self, atomic_numbers, positions, cell=None, pbc=None):
        self.allowed_tf32.append(torch.backends.cuda.matmul.allow_tf32)
        return 0.5 * self.stiffness * (positions ** 2).sum()


def assert_the_model_runs_with_tf32_as(precision, callers, drive):
    """drive(model) (a Calculator's or an MD driver's run at ``precision``) with the caller's TF32
    setting ``callers``: the model saw TF32 allowed exactly for "tf32", and the caller's setting
    came back. The CPU computes the same either way: the flag the model saw is the evidence."""
    probe, matmul = MatmulFlagProbe(), torch.backends.cuda.matmul
    saved, matmul.allow_tf32 = matmul.allow_tf32, callers
    try:
        drive(probe)
        assert matmul.allow_tf32 == callers
    finally:
        matmul.allow_tf32 = saved
    assert probe.allowed_tf32 and set(probe.allowed_tf32) == {precision == "tf32"}


def numpy_rng():
    """A NumPy generator seeded from torch's, so that the test's seed (MIRAGE_TEST_SEED) repeats its draws."""
    import numpy as np

    return np.random.default_rng(int(torch.randint(2**62, ()).item()))


class GraphStandIn:
    """A CPU stand-in for mirage.graphs.CapturedGraph, for GraphCache's ``capture`` argument: the
    inputs copied into static buffers, ``fn`` run on them ``warmup`` times at capture (changing
    what it updates in place, as the real warm-up does) and once a replay, the outputs handed back
    uncopied. It records what the cache did to it: its settings, its replays, its release."""

    live = weakref.WeakSet()  # every stand-in not yet garbage: a released one must go with its last reference

    def __init__(self, fn, args, kwargs, *, pool, copy_outputs, warmup):
        self.fn, self.pool, self.copy_outputs, self.warmup = fn, pool, copy_outputs, warmup
        # Flattened as the cache flattens a call, so that static_inputs line up.
        leaves, self._spec = graphs._tree(args, kwargs)
        self._static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.replays = 0
        for _ in range(warmup):
            self._run()
        GraphStandIn.live.add(self)

    def _run(self):
        args, kwargs = self.static_arguments
        with torch.no_grad():
            return self.fn(*args, **kwargs)

    @property
    def signature(self):  # worked out when asked: tests count the signatures a cache's callers compute
        return graphs.signature(*self.static_arguments)

    @property
    def released(self):
        return self._static is None

    @property
    def static_inputs(self):
        return tuple(leaf for leaf in self._static if isinstance(leaf, torch.Tensor))

    @property
    def static_arguments(self):
        return pytree.tree_unflatten(self._static, self._spec)

    def replay(self):
        assert not self.released, "replayed after reset"
        self.replays += 1
        return self._run()

    def reset(self):
        self._static = None
