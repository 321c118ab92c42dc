"""Typed wrappers of the ``torch.ops.mirage`` operators.

Every op accepts float32, float16 and bfloat16 inputs (float64 too on the CPU), accumulates in
float32 (float64 on the CPU reference), returns new tensors (but the MD state updates
``verlet_kick_drift``, ``verlet_forces_kick`` and ``verlet_forces_kick_drift``, which work in place, and
``schnet_energy_all_pairs``' optional pair count), and raises
``RuntimeError`` naming the op and the argument on bad input. Weights and biases may be in the input's dtype or float32.
The force-field ops are the exception on dtypes: ``neighbor_list`` takes float32 positions
(float64 too on the CPU), ``cfconv``, ``radial_cfconv``, ``schnet_energy`` (and its
``schnet_energy_prepare`` and ``schnet_energy_all_pairs``) and ``painn_energy`` take float32 (float64 too on
the CPU), and the MD state updates (``verlet_*``)
take float32 or float64 on every device and compute in the state's dtype; ``neighbor_list``, ``pair_vectors``, ``radial_basis``,
``cfconv`` and ``radial_cfconv`` run in float32 under autocast (the message passing ops run in the autocast dtype, like a matmul).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import numbers
import operator
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor


def _tensors_required(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper whose None (or a list, an array: anything but a tensor) in place of a required
    tensor argument (annotated ``Tensor``) raises the op's own error (``mirage::<op>: <argument>
    must be a tensor, got None``, as the raw op does for None) before the wrapper's Python reads
    the tensor: a dozen wrappers look at their tensors' dtypes or devices before they call the op,
    and would fail with an AttributeError."""
    parameters = list(inspect.signature(fn).parameters.values())
    required = [(index, p.name) for index, p in enumerate(parameters) if p.annotation == "Tensor"]
    missing = inspect.Parameter.empty  # not passed: Python's own TypeError says so at the call

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for index, name in required:
            value = args[index] if index < len(args) else kwargs.get(name, missing)
            # Tensor-like: torch.fx's proxies trace through (a model calling mirage's ops is traced).
            if value is not missing and not torch.overrides.is_tensor_like(value):
                got = "None" if value is None else type(value).__name__
                raise RuntimeError(f"mirage::{fn.__name__}: {name} must be a tensor, got {got}")
        return fn(*args, **kwargs)

    return checked


def _plain_bool(value: Any) -> bool:
    """A Python or NumPy bool."""
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def _is_bool(value: Any) -> bool:
    """A Python, NumPy or tensor bool, which PyTorch's schemas would take as 1 or 1.0."""
    return _plain_bool(value) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)


def _integer(value: Any, where: str) -> int:
    """``value`` as an int (ints, NumPy ints, integer 0-dim tensors); a float, a bool or anything
    else raises, naming ``where`` (``"mirage::op: argument"``), where ``int()`` would truncate 4.7
    to 4 and the operators would take True as 1."""
    try:
        if _is_bool(value):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{where} must be an int, got {type(value).__name__} {value!r}") from None


def _real(value: Any, where: str) -> Any:
    """``value`` as the operators' float argument: Python and NumPy reals, or a real 0-dim tensor
    (passed on as it is); a bool or anything else raises, naming ``where``
    (``"mirage::op: argument"``), where the operators would take True as 1.0."""
    if not _is_bool(value):
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_complex:
            return value
        if isinstance(value, numbers.Real):  # Python's and NumPy's; never a tensor
            try:
                return float(value)
            except OverflowError:  # an int (or Fraction) past float's range: 10**400
                raise TypeError(f"{where} must be a real number within float's range, got {type(value).__name__} "
                                f"2**{int(abs(value)).bit_length() - 1} or more") from None
    raise TypeError(f"{where} must be a real number, got {type(value).__name__} {value!r}")


def _boolean(value: Any, where: str) -> bool:
    """``value`` as a bool (Python's or NumPy's); anything else raises, naming ``where``, where the
    operators' schemas would take 0.5 as True (and a string failed in PyTorch's argument parser)."""
    if _plain_bool(value):
        return bool(value)
    raise TypeError(f"{where} must be True or False, got {type(value).__name__} {value!r}")


def _names(names: Union[str, Sequence[str]]) -> str:
    """A list of names as the operators take it: one comma-separated string."""
    return names if isinstance(names, str) else ",".join(names)


@_tensors_required
def group_norm(
    x: Tensor,
    num_groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    activation: str = "none",
) -> Tensor:
    """GroupNorm with an optional fused activation: ``act(F.group_norm(x, ...))``.

    Args:
        x: ``(N, C, *)``. NCHW-contiguous or channels-last (4-D and 5-D) input is read in
            place; other strides are copied first.
        num_groups: divides ``C``.
        weight, bias: ``(C,)`` or None.
        eps: added to the variance.
        activation: ``"none"`` or ``"silu"`` (applied after the affine).

    Returns:
        ``x``'s shape and dtype, in ``x``'s memory format (channels-last stays channels-last).
    """
    return torch.ops.mirage.group_norm(x, _integer(num_groups, "mirage::group_norm: num_groups"), weight, bias,
                                       _real(eps, "mirage::group_norm: eps"), activation)


@_tensors_required
def layer_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    residual: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """LayerNorm over the last dimension, with an optional fused residual add.

    Args:
        x: ``(*, D)``; on CUDA, ``D`` up to 16384.
        weight, bias: ``(D,)`` or None.
        eps: added to the variance.
        residual: None, or a tensor of ``x``'s shape and dtype.

    Returns:
        Without ``residual``: ``F.layer_norm(x, (D,), weight, bias, eps)``.
        With it: ``(layer_norm(x + residual), x + residual)``, the sum rounded to ``x``'s dtype
        (the pre-norm transformer step: the sum is the next residual stream).
    """
    if residual is None:
        return torch.ops.mirage.layer_norm(x, weight, bias, _real(eps, "mirage::layer_norm: eps"))
    return torch.ops.mirage.add_layer_norm(x, residual, weight, bias, _real(eps, "mirage::add_layer_norm: eps"))


@_tensors_required
def geglu(x: Tensor, approximate: str = "none") -> Tensor:
    """The GEGLU gate of diffusers' feed-forward: ``a * F.gelu(b, approximate)``.

    Args:
        x: ``(*, 2H)``; ``a, b = x.chunk(2, dim=-1)``.
        approximate: ``"none"`` (erf GELU) or ``"tanh"``.

    Returns:
        ``(*, H)`` in ``x``'s dtype.
    """
    return torch.ops.mirage.geglu(x, approximate)


@_tensors_required
def bias_act(
    x: Tensor,
    bias: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    activation: str = "none",
    scale: float = 1.0,
) -> Tensor:
    """A convolution's epilogue in one pass: ``(activation(x + bias) + residual) * scale``.

    PyTorch adds a convolution's bias in a kernel of its own after cuDNN's, and the activation
    and a residual add are one more pass each; this is all of them in one read of ``x`` (and
    ``residual``) and one write. Arithmetic in float32, rounded once.

    Args:
        x: ``(N, C, *)``, float32/float16/bfloat16 (float64 on the CPU); NCHW or channels-last.
        bias: None, ``(C,)`` (a convolution's bias) or ``(N, C)`` (a per-sample shift, e.g. a
            bias plus a time embedding), in ``x``'s dtype or float32.
        residual: None, or a tensor of ``x``'s shape and dtype, added after the activation.
        activation: ``"none"``, ``"silu"``, ``"gelu"``, ``"gelu_tanh"`` or ``"relu"``.
        scale: multiplies the result (e.g. ``1 / output_scale_factor``).

    Returns:
        ``x``'s shape and dtype, in ``x``'s memory format (channels-last stays channels-last).
    """
    return torch.ops.mirage.bias_act(x, bias, residual, activation, _real(scale, "mirage::bias_act: scale"))


@_tensors_required
def linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    input_activation: str = "none",
) -> Tensor:
    """``activation(x) @ weight.T + bias + residual``: ``torch.nn.functional.linear`` with a residual
    add (and an activation of its input), in one pass over the output.

    On CUDA this is one cuBLASLt matmul whose epilogue adds ``bias`` and ``residual`` (PyTorch
    spends a second kernel and a full read and write of the output on the residual add). The
    products are summed in float32 (TF32 for float32 input when
    ``torch.backends.cuda.matmul.allow_tf32`` is set, as for PyTorch's matmuls) and the result is
    rounded once. The first eager call of each problem shape times cuBLASLt's candidate
    algorithms on the real operands and keeps the fastest for the process; inside a CUDA graph
    capture, with no earlier eager call, the heuristic's first choice runs. Up to 8 rows (a
    diffusion model's time embedding) with a row-major weight run in one kernel of mirage's own
    instead, the activation applied as ``x`` is read; past that the activation is a pass of its
    own. That kernel sums float32 input in full float32 whatever the TF32 setting (more precise,
    not less).

    Args:
        x: ``(*, K)``, float32/float16/bfloat16 (float64 on the CPU); rows with a stride are read
            in place, other layouts are copied first.
        weight: ``(N, K)`` in ``x``'s dtype; row-major and column-major (a transposed ``(K, N)``
            matrix) weights are read in place.
        bias: None or ``(N,)`` in ``x``'s dtype.
        residual: None or ``(*, N)`` (the output's shape) in ``x``'s dtype; rows that repeat (an
            expanded ``(N,)`` bias) are read in place by the few-rows kernel.
        input_activation: ``"none"``, ``"silu"``, ``"gelu"``, ``"gelu_tanh"`` or ``"relu"``,
            applied to ``x`` first and rounded to its dtype, as ``F.silu(x)`` etc. would be.

    Returns:
        ``(*, N)``, contiguous, in ``x``'s dtype.
    """
    return torch.ops.mirage.linear(x, weight, bias, residual, input_activation)


class NeighborList(NamedTuple):
    """The fixed-capacity outputs of :func:`neighbor_list` (``P = max_pairs``)."""

    pairs: Tensor  #: ``(2, P)`` int64: row 0 the center atom ``i``, row 1 the neighbor ``j``
    shifts: Tensor  #: ``(P, 3)``: ``S @ cell`` for the integer image ``S`` of ``j``
    distances: Tensor  #: ``(P,)``: ``|positions[j] - positions[i] + shift|``
    num_pairs: Tensor  #: ``(1,)`` int64: the true count, which may exceed ``P``


# _FOLDED_TAPS[parity][offset]: the 3x3 kernel's taps along one axis that read the small image's
# pixel at that offset (0: the row or column before, 1: the pixel's own) after nearest 2x upsampling.
_FOLDED_TAPS = (((0,), (1, 2)), ((0, 1), (2,)))


@_tensors_required
def subpixel_weight(weight: Tensor) -> Tensor:
    """A 3x3 convolution kernel that follows nearest 2x upsampling, as four 2x2 kernels on the
    small image, one per output parity: the ``weight`` of :func:`subpixel_shuffle`'s convolution.

    Nearest upsampling repeats each pixel twice per axis, so at an even output row the kernel's
    top row reads the row above and its middle and bottom rows both read the pixel's own row;
    at an odd row the top and middle rows read the own row and the bottom row the one below.
    Summing the taps that read the same pixel leaves 2x2 taps (4 of 9 multiply-adds per output
    pixel). Summed in float32 (float64 for float64 weights) and rounded once to ``weight``'s
    dtype; differentiable.

    Args:
        weight: ``(C_out, C_in, 3, 3)``.

    Returns:
        ``(4 * C_out, C_in, 2, 2)``: the kernels of parities (0, 0), (0, 1), (1, 0), (1, 1), in
        ``weight``'s dtype and memory format.
    """
    # RuntimeError, as the operators raise for bad tensors.
    if weight.dim() != 4 or weight.shape[-2:] != (3, 3):
        raise RuntimeError(f"mirage.ops.subpixel_weight: weight must be (C_out, C_in, 3, 3), got {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise RuntimeError(f"mirage.ops.subpixel_weight: weight must be floating point, got {weight.dtype}")
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    c_out, c_in = weight.shape[:2]
    layout = (torch.channels_last if weight.is_contiguous(memory_format=torch.channels_last)
              and not weight.is_contiguous() else torch.contiguous_format)
    folded = torch.empty(4 * c_out, c_in, 2, 2, dtype=weight.dtype, device=weight.device, memory_format=layout)
    parts = folded.view(2, 2, c_out, c_in, 2, 2)  # [row parity, column parity, out, in, row tap, column tap]
    # One (C_out, C_in) sum at a time, written into the result, so that the temporaries are a
    # few such slices: an einsum formed the whole fold in float32 at once, beside the weight's
    # float32 copy, and its batched matmul took a cuBLAS workspace of the stream (32 MiB on an H200).
    # Views are taken of a copy: not of a weight whose storage was made under inference mode.
    source = weight.clone()
    for p, q, a, b in itertools.product(range(2), repeat=4):
        taps = [source[:, :, y, x].to(compute) for y in _FOLDED_TAPS[p][a] for x in _FOLDED_TAPS[q][b]]
        parts[p, q, :, :, a, b] = functools.reduce(torch.add, taps)
    return folded


@_tensors_required
def subpixel_shuffle(x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Nearest 2x upsampling followed by a 3x3 convolution, without the upsampled image: given
    ``x = conv2d(image, subpixel_weight(w), padding=1)``, returns ``conv2d(interpolate(image,
    scale_factor=2, mode="nearest"), w, bias, padding=1)``.

    ``out[n, c, 2i+p, 2j+q] = x[n, (2p+q) C + c, i+p, j+q] + bias[c]``: the four parities of
    ``x`` interleaved (parity ``(p, q)`` shifted by ``(p, q)``, since its 2x2 window starts one
    row and column later), with the bias added in float32 and rounded once. One pass that reads
    about what it writes; the convolution does 4 of the 9 multiply-adds per output pixel.

    Args:
        x: ``(N, 4C, H+1, W+1)``, float32/float16/bfloat16 (float64 on the CPU); read
            channels-last (other layouts are copied to it first).
        bias: None or ``(C,)`` in ``x``'s dtype or float32.

    Returns:
        ``(N, C, 2H, 2W)`` in ``x``'s dtype, channels-last.
    """
    return torch.ops.mirage.subpixel_shuffle(x, bias)


@_tensors_required
def neighbor_list(
    positions: Tensor,
    cutoff: float,
    cell: Optional[Tensor] = None,
    pbc: Optional[Tensor] = None,
    batch: Optional[Tensor] = None,
    max_pairs: int = -1,
    half: bool = False,
    method: str = "auto",
) -> NeighborList:
    """Every pair of atoms closer than ``cutoff``, periodic images included, in fixed capacity.

    A pair ``(i, j, S)`` is listed when ``d = |r_j - r_i + S @ cell| < cutoff`` (strictly), ``S``
    an integer vector (zero on open axes) and ``(i, j, S) != (i, i, 0)``. With ``half=False``
    (the default) the list is full: both ``(i, j, S)`` and ``(j, i, -S)``, as message passing
    with ``index_add`` over ``pairs[0]`` wants. Nothing syncs with the host, so the op can run
    inside a CUDA graph; when there are more pairs than ``max_pairs``, the first ``max_pairs`` are
    stored and ``num_pairs`` (on the device) says how many there are.

    Args:
        positions: ``(N, 3)`` float32 (float64 too on the CPU), Cartesian; they may lie outside
            the cell (unwrapped MD trajectories), up to 2^24 cell widths along periodic axes.
        cutoff: finite, > 0.
        cell: None (open boundaries), ``(3, 3)`` whose rows are the lattice vectors, or with
            ``batch`` ``(M, 3, 3)``, one per molecule. Any triclinic cell; it must be
            non-singular, and a periodic axis must be at least ``cutoff / 32`` thick. Cutoffs
            beyond half the box (or the box) are handled: every image within reach is listed.
        pbc: None (every axis of ``cell`` periodic) or a bool tensor ``(3,)``, or ``(M, 3)`` with
            ``batch``. Needs ``cell``.
        batch: None (one molecule) or ``(N,)`` int64 molecule index per atom, sorted; pairs never
            cross molecules. With ``cell`` its values index the rows of ``cell``.
        max_pairs: capacity ``P``; -1 means ``N * (N - 1)``, which no open-boundary system
            exceeds (periodic ones may list an atom's own images).
        half: list one of ``(i, j, S)`` and ``(j, i, -S)``: the one with ``i < j``, or for
            ``i == j`` the one whose first non-zero component of ``S`` is positive.
        method: how the CUDA kernel searches: ``"auto"`` (a cell list from 1024 atoms of one
            molecule, else every pair of each molecule), ``"direct"`` or ``"cell_list"`` (one
            molecule only). The CPU reference always compares every pair.

    Returns:
        :class:`NeighborList` ``(pairs, shifts, distances, num_pairs)``. Stored pairs are grouped
        by ``i`` in ascending order, deterministically (the order within a group depends on the
        device and method). Entries from ``num_pairs`` on are padding: ``pairs = (0, 0)``,
        ``shifts = (cutoff, 0, 0)``, ``distances = cutoff``; they index a valid atom (safe for
        ``index_add``/``gather``), ``r_j - r_i + shift`` has length ``cutoff`` (no zero vector to
        normalize), and every cutoff function gives them weight zero. ``arange(P) < num_pairs``
        masks them exactly; ``distances < cutoff`` can also drop a real pair within float32's
        rounding of the cutoff, whose stored distance equals it. ``distances`` (and ``shifts``, when a
        ``cell`` is given) are differentiable with respect to ``positions`` and ``cell``, to
        any order.

    Invalid values (non-finite positions or cell, a singular cell, a cutoff spanning more than
    32 cell widths on a periodic axis, positions beyond 2^24 cell widths, an unsorted ``batch``
    or one that names no cell): the CPU
    raises ``RuntimeError``; CUDA, which never reads values on the host, writes NaN shifts and
    distances in every entry and ``num_pairs = -1``.
    """
    return NeighborList(*torch.ops.mirage.neighbor_list(
        positions, _real(cutoff, "mirage::neighbor_list: cutoff"), cell, pbc, batch,
        _integer(max_pairs, "mirage::neighbor_list: max_pairs"), _boolean(half, "mirage::neighbor_list: half"),
        method))


@_tensors_required
def radial_basis(distances: Tensor, kind: str, num: int, cutoff: float, cutoff_fn: str) -> Tensor:
    """A radial basis times a cutoff envelope, in one pass: ``basis_k(d) * f(d)``.

    Kinds (``c = cutoff``, ``k = 0 .. num - 1``):
        ``"gaussian"``: ``exp(-(d - mu_k)^2 / (2 delta^2))``, centers ``mu_k = k * delta`` evenly
        over ``[0, c]``, width the spacing ``delta = c / (num - 1)`` (``c`` when ``num == 1``), as
        SchNet's (schnetpack's GaussianRBF).
        ``"bessel"``: ``sqrt(2 / c) * sin(n pi d / c) / d`` with ``n = k + 1`` (DimeNet), and its
        limit ``sqrt(2 / c) * n pi / c`` at ``d = 0``.
        ``"none"``: 1, so the output is the cutoff function alone (a model's envelope, fused).

    Cutoff functions (zero from ``d = c`` on, so ``neighbor_list`` padding gets weight zero):
        ``"cosine"``: ``0.5 * (cos(pi d / c) + 1)``.
        ``"polynomial"``: DimeNet's envelope with ``p = 6``: ``1 - 28 x^6 + 48 x^7 - 21 x^8``,
        ``x = d / c`` (value, first and second derivatives vanish at the cutoff).
        ``"none"``: 1 everywhere (beyond the cutoff too).

    Args:
        distances: any shape ``(*)``; float32, float16 or bfloat16 (float64 too on the CPU). The
            output has its dtype; arithmetic is float32 (float64 on the CPU). Under autocast it
            runs in float32.
        kind, num, cutoff, cutoff_fn: as above; ``num > 0``, ``cutoff`` finite and > 0, in float32's normal range.

    Returns:
        ``(*, num)``. Differentiable in ``distances`` to any order; NaN distances give NaN rows.
        The first-order backward is a fused kernel of its own
        (``torch.ops.mirage.radial_basis_backward(grad, distances, kind, num, cutoff,
        cutoff_fn)``, forces' hot path); higher orders recompute with PyTorch ops.
    """
    return torch.ops.mirage.radial_basis(distances, kind, _integer(num, "mirage::radial_basis: num"),
                                       _real(cutoff, "mirage::radial_basis: cutoff"), cutoff_fn)


@_tensors_required
def message_passing(x: Tensor, filter: Tensor, pairs: Tensor) -> Tensor:
    """Sums filtered neighbor features into each receiver: SchNet's continuous-filter convolution.

    ``out[i] = sum over p with pairs[0, p] == i of x[pairs[1, p]] * filter[p]``, i.e.
    ``torch.zeros_like(x).index_add_(0, pairs[0], x[pairs[1]] * filter)`` without the ``[P, F]``
    intermediate. Pairs may come in any order and repeat (``neighbor_list``'s receiver-sorted
    order is the fast case on CUDA).

    Args:
        x: ``(N, F)`` node features; float32, float16 or bfloat16 (float64 too on the CPU).
        filter: ``(P, F)`` per-pair weights, x's dtype.
        pairs: ``(2, P)`` int64; row 0 the receivers ``i``, row 1 the senders ``j`` (as
            ``neighbor_list`` returns them). ``P`` may be 0; ``N`` only when ``P`` is.

    Returns:
        ``(N, F)`` in x's dtype, accumulated in float32 (float64 on the CPU). Differentiable in
        ``x`` and ``filter`` to any order (the gradients are ``message_passing`` and
        ``pair_product`` again). Under autocast it runs in the autocast dtype. Indices outside
        ``[0, N)``: the CPU raises ``RuntimeError``; CUDA, which never reads them on the host,
        skips those pairs and returns an all-NaN output.
    """
    return torch.ops.mirage.message_passing(x, filter, pairs)


@_tensors_required
def pair_product(a: Tensor, b: Tensor, pairs: Tensor) -> Tensor:
    """The product of the two ends' features for every pair: ``a[pairs[0]] * b[pairs[1]]``.

    The gradient of ``message_passing`` with respect to its filter (and the op whose gradients
    are ``message_passing``).

    Args:
        a: ``(N, F)``; float32, float16 or bfloat16 (float64 too on the CPU).
        b: ``(N, F)``, a's dtype.
        pairs: ``(2, P)`` int64; ``P`` may be 0; ``N`` only when ``P`` is.

    Returns:
        ``(P, F)`` in a's dtype (each product rounded once). Differentiable in ``a`` and ``b`` to
        any order; under autocast it runs in the autocast dtype. Indices outside ``[0, N)``: the
        CPU raises ``RuntimeError``; CUDA writes NaN to the rows of those pairs.
    """
    return torch.ops.mirage.pair_product(a, b, pairs)


@_tensors_required
def sender_order(pairs: Tensor, num_nodes: int, num_pairs: Optional[Tensor] = None) -> Tensor:
    """The pairs' indices grouped by sender, for the backwards that scatter onto the senders.

    :func:`neighbor_list` sorts its pairs by receiver, so a forward sums each receiver's run of
    pairs in registers; the backwards of :func:`pair_vectors`, :func:`vector_message_passing`,
    :func:`cfconv` and :func:`radial_cfconv` scatter onto the senders, and on CUDA walk a long
    list in sender order to do the same (an order the backward otherwise sorts itself: ~18 µs a
    list of 174k pairs on an H200, a few times per force call). Form it once per pair list and
    pass it as each op's ``sender_order``::

        order = mirage.ops.sender_order(pairs, positions.shape[0])
        vectors, distances = mirage.ops.pair_vectors(positions, pairs, shifts, sender_order=order)

    The ops need only a permutation of the pairs to sum correctly (the grouping is for speed), and
    check on the GPU, without a host sync, that the order handed to them is one (a 64-bit hash sum
    that a non-permutation matches with probability ~2^-64) and, for an op given ``num_pairs``,
    that it keeps the counted pairs before the count: one that fails turns the op's gradients NaN,
    as an out-of-range index does; the CPU raises. Without ``num_pairs``, an order of another pair
    list of the same length is a permutation too: correct, only slower.

    Args:
        pairs: ``(2, P)`` int64, row 1 the senders.
        num_nodes: ``N``; senders outside ``[0, N)`` come after the others.
        num_pairs: None, or :func:`neighbor_list`'s count (one int64 on ``pairs``' device): the
            padding, pairs from it on, then comes last, as :func:`cfconv`'s ``num_pairs`` needs
            (an order formed without it fails cfconv's check there). A negative count or one
            past ``P`` (neighbor_list's NaN and overflow cases) counts every pair.

    Returns:
        int32 ``(P,)``: the pair indices with non-decreasing senders, in no particular order
        within a sender's run on CUDA (stable on the CPU); ``(0,)`` for lists shorter than 8,192
        pairs, which the backwards walk in their own order (passing it is the same as None).
    """
    return torch.ops.mirage.sender_order(pairs, _integer(num_nodes, "mirage::sender_order: num_nodes"),
                                          num_pairs)


@_tensors_required
def vector_message_passing(
    x: Tensor,
    filter: Tensor,
    vectors: Tensor,
    directions: Tensor,
    pairs: Tensor,
    filter_weight: Optional[Tensor] = None,
    sender_order: Optional[Tensor] = None,
    num_pairs: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """PaiNN's message step, fused: scalar and vector messages summed into their receivers.

    For each pair ``p = (i, j) = (pairs[0, p], pairs[1, p])`` (``i`` receives from ``j``, as
    :func:`neighbor_list` lists them), with ``m = x[j] * filter[p]`` split into ``(m_s, m_vv,
    m_vs)``, each ``F`` wide::

        scalar[i]    += m_s
        vector[i, c] += vectors[j, c] * m_vv + m_vs * directions[p, c]

    This is ``PaiNNMessage`` of examples/forcefield/models.py without its residual adds.

    With ``filter_weight`` (``(3F, K)``, an ``nn.Linear`` weight), ``filter`` is that Linear's
    input, a ``(P, K)`` basis, and the filter is ``filter @ filter_weight.T``: PaiNN's filter
    (a bias rides as a basis column of ones, or of the cutoff when the cutoff multiplies the
    basis). On CUDA the kernels then form the filter where they use it, never writing the
    ``(P, 3F)`` tensor, when they can (:func:`fused_filter_supported`: float32, ``F % 4 == 0``,
    ``K <= 32``, 16-byte aligned ``x`` and ``vectors`` rows); otherwise a GEMM forms it first.
    The same sums either way, to float32 rounding.

    Args:
        x: ``(N, 3F)`` node features (PaiNN's ``phi(s)``), parts in the order ``(s, vv, vs)``;
            float32, float16 or bfloat16 (float64 too on the CPU).
        filter: ``(P, 3F)`` pair filter, cutoff already multiplied in, same part order; or with
            ``filter_weight`` the ``(P, K)`` basis it maps.
        vectors: ``(N, 3, F)`` vector features.
        directions: ``(P, 3)`` unit vectors ``r_ij / |r_ij|``.
        pairs: ``(2, P)`` int64; any order, repeats allowed. The floating inputs share ``x``'s
            dtype and device; strided inputs are copied to contiguous first.
        filter_weight: None, or the ``(3F, K)`` weight that forms the filter from the basis.
        sender_order: None, or :func:`sender_order` of these pairs, formed once and passed to
            every op over the same list: the CUDA backward then reads it instead of sorting the
            list itself.
        num_pairs: None, or :func:`neighbor_list`'s count: the pairs from it on are padding and
            skipped, as :func:`cfconv`'s (no messages; their ``filter`` and ``directions``
            gradients 0).

    Returns:
        ``(scalar, vector)``: ``(N, F)`` and ``(N, 3, F)`` in ``x``'s dtype, summed in float32
        (float64 on the CPU). Differentiable in ``x``, ``filter``, ``vectors``, ``directions``
        and ``filter_weight``, to second order (forces and force training); the first-order
        backward is a fused kernel of its own (``torch.ops.mirage.vector_message_passing_backward``,
        which with ``filter_weight`` forms the filter again and returns the basis' gradient; where
        the weight's gradient is wanted, autograd forms the filter by a matmul first and takes
        both from the formed filter's gradient).
        Under autocast it runs in the autocast dtype (every floating input cast to it).

    An index outside ``[0, N)``: the CPU raises ``RuntimeError``; CUDA, which never reads
    indices on the host, skips the pair and writes NaN to every output (gradients too).
    """
    return torch.ops.mirage.vector_message_passing(x, filter, vectors, directions, pairs, filter_weight, sender_order,
                                                   num_pairs)


def fused_filter_supported(features: int, basis: int, device: Union[str, torch.device]) -> bool:
    """Whether :func:`vector_message_passing`'s CUDA kernels form a float32 filter of ``3F``
    (``features`` = F) columns from a basis of ``basis`` = K columns on ``device`` themselves (F
    a multiple of 4, K <= 32, the weight within the GPU's shared memory), given 16-byte aligned
    rows. False on the CPU and without a CUDA build."""
    where = "mirage.ops.fused_filter_supported: "
    return _fused_filter_supported_on(_integer(features, where + "features"), _integer(basis, where + "basis"),
                                      _device_name(device))


def _device_name(device: Union[str, torch.device]) -> str:
    """The device as the support checks' caches key it: "cuda" is the current GPU, by its index
    (GPU 0 where there is none: the checks then answer False, as for any missing GPU, where
    asking for the current one raised "Found no NVIDIA driver")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return str(device)


@functools.lru_cache(maxsize=None)  # models ask on every forward
def _fused_filter_supported_on(features: int, basis: int, device: str) -> bool:
    from . import _C

    return bool(_C.fused_filter_supported(features, basis, device))


@_tensors_required
def pair_vectors(positions: Tensor, pairs: Tensor, shifts: Optional[Tensor] = None,
                 sender_order: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The pair geometry of a force field, fused: for ``p = (i, j) = (pairs[0, p], pairs[1, p])``::

        vectors[p]   = positions[j] - positions[i] + shifts[p]
        distances[p] = |vectors[p]|

    :func:`neighbor_list`'s pairs and shifts give the vectors from each atom to its neighbors'
    periodic images (its padding entries a distance of exactly the cutoff).

    Args:
        positions: ``(N, 3)`` float32 (float64 too on the CPU).
        pairs: ``(2, P)`` int64 on ``positions``' device; any order, repeats allowed.
        shifts: None or ``(P, 3)`` in ``positions``' dtype. Strided inputs are copied to
            contiguous first.
        sender_order: None, or :func:`sender_order` of these pairs, formed once and passed to
            every op over the same list: the CUDA backward then reads it instead of sorting the
            list itself.

    Returns:
        ``(vectors, distances)``: ``(P, 3)`` and ``(P,)``. Differentiable in ``positions`` and
        ``shifts`` to second order; the positions' first-order gradient is a fused op of its own
        (``torch.ops.mirage.pair_vectors_backward(grad_vectors, grad_distances, positions, pairs,
        shifts, sender_order)``, either gradient None where the energy does not use that output; a
        scatter with float32 atomics on CUDA, so its low bits vary from run to run). The
        distances' gradient is 0 where a distance is 0, as ``torch.linalg.vector_norm``'s. Under
        autocast it runs in float32.

    An index outside ``[0, N)``: the CPU raises ``RuntimeError``; CUDA, which never reads indices
    on the host, writes NaN to that pair's vector and distance, and the backward writes NaN to
    every atom's gradient.
    """
    return torch.ops.mirage.pair_vectors(positions, pairs, shifts, sender_order)


@_tensors_required
def painn_update_input(s: Tensor, vv: Tensor, eps: float) -> Tensor:
    """The input of PaiNN's update MLP, fused: ``[s, sqrt(sum_c vv[:, c]**2 + eps)]``.

    This is ``torch.cat([s, torch.sqrt(vv.square().sum(dim=1) + eps)], dim=-1)`` (PaiNN's
    ``|V v|``, the ``eps`` keeping its gradient finite where ``V v`` vanishes) in one kernel.

    Args:
        s: ``(N, F)`` scalar features; float32, float16 or bfloat16 (float64 too on the CPU).
        vv: ``(N, 3, F)`` (PaiNN's ``V v``) in ``s``'s dtype and on its device; strided inputs
            are copied to contiguous first.
        eps: 0 or a normal float32 (``1.2e-38`` to ``3.4e38``; CUDA computes in float32).

    Returns:
        ``(N, 2F)`` in ``s``'s dtype, computed in float32 (float64 on the CPU) and rounded once.
        Differentiable in ``s`` and ``vv`` to second order; the first-order backward in ``vv`` is
        a fused kernel of its own (``torch.ops.mirage.painn_update_input_backward``). Under
        autocast it runs in the widest dtype of its inputs, as PyTorch's elementwise ops do.
    """
    return torch.ops.mirage.painn_update_input(s, vv, _real(eps, "mirage::painn_update_input: eps"))


@_tensors_required
def painn_update(s: Tensor, v: Tensor, uv: Tensor, vv: Tensor, a: Tensor) -> Tuple[Tensor, Tensor]:
    """PaiNN's gated update after its MLP, fused. With ``a`` split into ``(a_vv, a_sv, a_ss)``,
    each ``F`` wide::

        s_out = s + a_ss + a_sv * (uv * vv).sum(dim=1)
        v_out = v + a_vv.unsqueeze(1) * uv

    (``PaiNNUpdate`` of examples/forcefield/models.py after its MLP: five of PyTorch's kernels
    forward and about fifteen backward become one each.)

    Args:
        s: ``(N, F)`` scalar features; float32, float16 or bfloat16 (float64 too on the CPU).
        v: ``(N, 3, F)`` vector features.
        uv: ``(N, 3, F)``, PaiNN's ``U v``.
        vv: ``(N, 3, F)``, PaiNN's ``V v``.
        a: ``(N, 3F)``, the update MLP's output, parts in the order ``(a_vv, a_sv, a_ss)``.
            All in ``s``'s dtype and on its device; strided inputs are copied to contiguous first.

    Returns:
        ``(s_out, v_out)``: ``(N, F)`` and ``(N, 3, F)`` in ``s``'s dtype, computed in float32
        (float64 on the CPU) and rounded once. Differentiable in every input to second order; the
        first-order backward is a fused kernel of its own
        (``torch.ops.mirage.painn_update_backward``). Under autocast it runs in the widest dtype of
        its inputs, as PyTorch's elementwise ops do.
    """
    return torch.ops.mirage.painn_update(s, v, uv, vv, a)


@_tensors_required
def schnet_energy(
    atomic_numbers: Tensor,
    embedding: Tensor,
    pairs: Tensor,
    vectors: Tensor,
    cutoff: float,
    num_rbf: int,
    weights: Sequence[Tensor],
    activations: Union[str, Sequence[str]],
    prepared: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """A whole SchNet energy and its gradient in the pair vectors, in one op (two CUDA kernels, one
    with ``prepared``).

    Computes, with ``d = |vectors|``, a Gaussian basis of ``num_rbf`` centers evenly over
    ``[0, cutoff]`` (width their spacing; the cutoff for one center) and the cosine cutoff
    ``cos^2(pi d / 2 cutoff)`` (zero from ``cutoff`` on)::

        x = embedding[atomic_numbers]
        per interaction: x += f2out(sum over pairs (i <- j) of in2f(x)[j] * filter(basis) * fcut)
        energy = readout(x).sum()

    with ``filter``, ``f2out`` and ``readout`` each ``Linear, activation, Linear``. This is
    ``mirage.ff.fused.SchNet`` (and ``examples/forcefield/models.py``'s SchNet) end to end. On CUDA it
    is two launches: the filter networks over many blocks, then one thread-block cluster (Hopper;
    one block before it) for the rest of the model, forward and backward; fast for molecules of up
    to a few thousand pairs and slower than the layer-by-layer model beyond that
    (docs/perf/forcefield.md).

    Args:
        atomic_numbers: ``(N,)`` int64, rows of ``embedding``.
        embedding: ``(Z, F)``; float32 (float64 too on the CPU). Every weight has its dtype and
            device.
        pairs: ``(2, P)`` int64; row 0 the receivers ``i``, row 1 the senders ``j``, any order.
        vectors: ``(P, 3)``, ``r_j - r_i`` plus the cell shift; pairs at or past the cutoff (the
            neighbor list's padding) add nothing.
        cutoff: in the units of ``vectors``, > 0.
        num_rbf: basis size, the filters' input width.
        weights: per interaction ``filter.0.weight [H, R], filter.0.bias [H], filter.2.weight
            [M, H], filter.2.bias [M], in2f.weight [M, F], in2f.bias [M], f2out.0.weight [K, M],
            f2out.0.bias [K], f2out.2.weight [F, K], f2out.2.bias [F]`` (a bias may be empty,
            ``[0]`` for a Linear without one), then ``readout.0.weight [Kr, F], readout.0.bias
            [Kr], readout.2.weight [1, Kr], readout.2.bias [1]``; 1 to 8 interactions.
        activations: ``interactions + 2`` names (a sequence, or one comma-separated string) from
            ``shifted_softplus, softplus, silu, tanh, gelu, relu``: the filters', each
            interaction's ``f2out``, the readout's.
        prepared: :func:`schnet_energy_prepare`'s output for this same embedding and weights, or
            None. With it the filters and their distance derivatives come from its tables, the
            atoms' first ``h`` from its rows by species, and CUDA runs one kernel instead of two
            (a few µs less a call on small molecules); the embedding and weights must not have
            changed since it was made (it is not checked: the results would be those of the
            ones it was made from, in its filters, first ``h`` and the backward's products).

    Returns:
        ``(energy, grad_vectors, grad_positions)``: a 0-dim tensor, ``d energy / d vectors``
        ``(P, 3)`` and the same scattered onto the atoms, ``d energy / d positions`` ``(N, 3)``
        through ``vectors = r_j - r_i (+ shift)`` (the forces without autograd; the stress needs
        ``grad_vectors``), in the embedding's dtype. Differentiable in ``vectors`` (first order:
        forces and stress); asking for a gradient in the embedding or weights, or for a second order, raises
        ``RuntimeError``. No autocast policy: it runs in the dtype it is given. Indices outside
        their range: the CPU raises ``RuntimeError``; CUDA returns NaN everywhere.
    """
    return torch.ops.mirage.schnet_energy(atomic_numbers, embedding, pairs, vectors,
                                          _real(cutoff, "mirage::schnet_energy: cutoff"),
                                          _integer(num_rbf, "mirage::schnet_energy: num_rbf"),
                                          list(weights), _names(activations), prepared)


@_tensors_required
def schnet_energy_all_pairs(
    atomic_numbers: Tensor,
    embedding: Tensor,
    positions: Tensor,
    cutoff: float,
    num_rbf: int,
    weights: Sequence[Tensor],
    activations: Union[str, Sequence[str]],
    prepared: Optional[Tensor] = None,
    num_pairs: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`schnet_energy` over every pair of atoms of an open system (no cell), the neighbor
    search inside the op: for small molecules, where :func:`neighbor_list`, the pair count's copy
    and :func:`pair_vectors` are kernels of a few µs each beside the model's one
    (``mirage.ff.md`` on benzene: docs/perf/forcefield.md). On CUDA each block of the cluster
    kernel forms its atoms' pair vectors ``r_j - r_i`` from the positions and keeps those within
    ``cutoff``. The search is quadratic in the atoms: for molecules, not for large systems
    (:func:`neighbor_list` and :func:`schnet_energy` there); ``N (N - 1)`` x the message width x
    the interactions must stay below 2^31, as :func:`schnet_energy`'s pairs (its kernels count in
    32 bits).

    Args:
        positions: ``(N, 3)``, in the embedding's dtype and device.
        num_pairs: a one-element int64 tensor on that device, or None; written in place with the
            number of pairs (``i != j``, both orders) closer than ``cutoff``, as
            :func:`neighbor_list` counts them, or -1 where a position is not finite (or, on CUDA,
            an atomic number is out of range).
        atomic_numbers, embedding, cutoff, num_rbf, weights, activations, prepared: as
            :func:`schnet_energy`'s.

    Returns:
        ``(energy, grad_positions)``: a 0-dim tensor and ``d energy / d positions`` ``(N, 3)``,
        equal to :func:`schnet_energy`'s on every pair ``(i, j)``, ``i != j``, with vectors
        ``positions[j] - positions[i]``. Differentiable in ``positions`` (first order), with
        :func:`schnet_energy`'s errors for the rest.
    """
    return torch.ops.mirage.schnet_energy_all_pairs(atomic_numbers, embedding, positions,
                                                    _real(cutoff, "mirage::schnet_energy_all_pairs: cutoff"),
                                                    _integer(num_rbf, "mirage::schnet_energy_all_pairs: num_rbf"),
                                                    list(weights), _names(activations), prepared, num_pairs)


@_tensors_required
def schnet_energy_prepare(embedding: Tensor, cutoff: float, num_rbf: int, weights: Sequence[Tensor],
                          activations: Union[str, Sequence[str]]) -> Tensor:
    """What :func:`schnet_energy` would form from its weights in every call, formed once: each
    interaction's filter network tabulated over the distance, the atom-wise weights transposed
    for the backward, and the first interaction's ``in2f`` of every embedding row (an atom's
    first features depend on its species alone; summed in float64, rounded once). For a run of
    many calls with the same embedding and weights (``mirage.ff.md`` prepares them at the start
    of each run). Arguments as :func:`schnet_energy`'s.

    The tables are ``radial_cfconv``'s (docs/ops.md): the filters times the cosine cutoff, and
    their slopes, as piecewise quintics over 1,024 pieces of ``[0, cutoff]`` for 20 Gaussians,
    formed in float64 and rounded once; within float32 rounding of the network for the models
    measured. They need a smooth filter activation (not ``relu``) and a filter width ``M`` that
    is a multiple of 4; CUDA also needs the table kernel's shared memory
    (:func:`radial_cfconv_supported`). Otherwise ``RuntimeError``.

    Returns:
        a 1-D tensor in the embedding's dtype and device (about 10 MiB for SchNet's 3 interactions
        of 128), to pass as :func:`schnet_energy`'s ``prepared``. Not differentiable.
    """
    return torch.ops.mirage.schnet_energy_prepare(embedding, _real(cutoff, "mirage::schnet_energy_prepare: cutoff"),
                                                  _integer(num_rbf, "mirage::schnet_energy_prepare: num_rbf"),
                                                  list(weights), _names(activations))


@_tensors_required
def painn_energy(
    atomic_numbers: Tensor,
    embedding: Tensor,
    pairs: Tensor,
    vectors: Tensor,
    cutoff: float,
    num_rbf: int,
    weights: Sequence[Tensor],
    activations: Union[str, Sequence[str]],
    norm_eps: float = 1e-8,
) -> Tuple[Tensor, Tensor, Tensor]:
    """A whole PaiNN energy and its gradient in the pair vectors, in one op (two CUDA kernels).

    Computes, with ``d = |vectors|``, ``u = vectors / d``, the sinc basis ``sqrt(2 / cutoff)
    sin(n pi d / cutoff) / d`` (n = 1..num_rbf) and the cosine cutoff ``fcut = (cos(pi d /
    cutoff) + 1) / 2`` (zero from ``cutoff`` on)::

        s = embedding[atomic_numbers]; v = 0                          # [N, F], [N, 3, F]
        per interaction:
            x = phi(s)[j] * filter(basis) * fcut, split into (x_s, x_vv, x_vs)   # [P, F] each
            s_i += sum over pairs (i <- j) of x_s
            v_i += sum over pairs of v_j x_vv + x_vs u
            a = mlp([s, sqrt(sum over xyz of (V v)^2 + norm_eps)]), split into (a_vv, a_sv, a_ss)
            v += a_vv (U v); s += a_sv <U v, V v> + a_ss
        energy = readout(s).sum()

    with ``phi``, ``mlp`` and ``readout`` each ``Linear, activation, Linear``, ``filter`` a Linear
    and ``U``, ``V`` Linears without bias. This is ``mirage.ff.fused.PaiNN`` (and
    ``examples/forcefield/models.py``'s PaiNN) end to end. On CUDA it is two launches: the
    weights transposed for the backward over many blocks, then one thread-block cluster (Hopper;
    one block before it) for the whole model, forward and backward;
    meant for molecules of up to a few hundred pairs (docs/perf/forcefield.md).

    Args:
        atomic_numbers: ``(N,)`` int64, rows of ``embedding``.
        embedding: ``(Z, F)``; float32 (float64 too on the CPU). Every weight has its dtype and
            device.
        pairs: ``(2, P)`` int64; row 0 the receivers ``i``, row 1 the senders ``j``, any order.
        vectors: ``(P, 3)``, ``r_j - r_i`` plus the cell shift; pairs at or past the cutoff (the
            neighbor list's padding) add nothing.
        cutoff: in the units of ``vectors``, > 0.
        num_rbf: basis size, the filters' input width.
        weights: per interaction ``phi.0.weight [H, F], phi.0.bias [H], phi.2.weight [3F, H],
            phi.2.bias [3F], filter.weight [3F, R], filter.bias [3F], U.weight [F, F], V.weight
            [F, F], mlp.0.weight [K, 2F], mlp.0.bias [K], mlp.2.weight [3F, K], mlp.2.bias [3F]`` (a
            bias may be empty, ``[0]``), then ``readout.0.weight [Kr, F], readout.0.bias [Kr],
            readout.2.weight [1, Kr], readout.2.bias [1]``; 1 to 8 interactions.
        activations: ``2 * interactions + 1`` names (a sequence, or one comma-separated string)
            from ``shifted_softplus, softplus, silu, tanh, gelu, relu``: each interaction's
            ``phi``, then each interaction's ``mlp``, then the readout's.
        norm_eps: added under the square root of ``|V v|``, > 0.

    Returns:
        ``(energy, grad_vectors, grad_positions)``: a 0-dim tensor, ``d energy / d vectors``
        ``(P, 3)`` and the same scattered onto the atoms, ``d energy / d positions`` ``(N, 3)``
        through ``vectors = r_j - r_i (+ shift)`` (the forces without autograd; the stress needs
        ``grad_vectors``), in the embedding's dtype. Differentiable in ``vectors`` (first order:
        forces and stress); asking for a gradient in the embedding or weights, or for a second order, raises
        ``RuntimeError``. No autocast policy: it runs in the dtype it is given. Indices outside
        their range: the CPU raises ``RuntimeError``; CUDA returns NaN everywhere.
    """
    return torch.ops.mirage.painn_energy(atomic_numbers, embedding, pairs, vectors,
                                         _real(cutoff, "mirage::painn_energy: cutoff"),
                                         _integer(num_rbf, "mirage::painn_energy: num_rbf"),
                                         list(weights), _names(activations),
                                         _real(norm_eps, "mirage::painn_energy: norm_eps"))


@_tensors_required
def cfconv(
    x: Tensor,
    basis: Tensor,
    envelope: Tensor,
    pairs: Tensor,
    weight1: Tensor,
    bias1: Optional[Tensor],
    weight2: Tensor,
    bias2: Optional[Tensor],
    activation: str = "shifted_softplus",
    tf32: Optional[bool] = None,
    sender_order: Optional[Tensor] = None,
    num_pairs: Optional[Tensor] = None,
) -> Tensor:
    """SchNet's continuous-filter convolution with its filter network fused in.

    With ``filters[p] = weight2 @ act(weight1 @ basis[p] + bias1) + bias2`` (the filter network,
    ``Linear, activation, Linear``)::

        out[i] = sum over p with pairs[0, p] == i of x[pairs[1, p]] * filters[p] * envelope[p]

    i.e. ``message_passing(x, filter_net(basis) * envelope[:, None], pairs)``. On CUDA one kernel
    computes the filters on tensor cores a tile of pairs at a time and scatters the messages,
    so none of the ``[P, H]`` intermediates goes to memory: for the larger systems, where the
    filter network dominates a SchNet step (docs/perf/forcefield.md).

    Precision on CUDA: by default each float32 operand of the products is split into two TF32
    parts and three tensor-core products are added (float32 accuracy, docs/ops.md); with ``tf32``
    the operands are rounded to TF32 once (3x fewer products; forces ~1e-3 relative off).

    Args:
        x: ``(N, M)`` sender features; float32 (float64 too on the CPU). The floating inputs
            share its dtype and device.
        basis: ``(P, R)`` radial basis per pair.
        envelope: ``(P,)`` the cutoff function per pair (0 drops a pair's message).
        pairs: ``(2, P)`` int64; row 0 the receivers ``i``, row 1 the senders ``j``, any order
            (receiver-sorted, as ``neighbor_list`` returns them, is the fast case).
        weight1, bias1: the first Linear, ``(H, R)`` and ``(H,)`` or None.
        weight2, bias2: the second Linear, ``(M, H)`` and ``(M,)`` or None.
        activation: between them; one of ``shifted_softplus, softplus, silu, tanh, gelu, relu``.
        tf32: TF32 products; None (default) follows PyTorch's float32 matmul setting when called
            (:func:`tf32_matmuls`; ``mirage.ff.Calculator(precision="tf32")`` sets it), so a
            captured CUDA graph keeps the choice made at capture, and torch.compile the choice
            made at compile time (it recompiles when the setting changes).
        sender_order: None, or :func:`sender_order` of these pairs, formed once and passed to
            every op over the same list: the CUDA backward then reads it instead of sorting the
            list itself.
        num_pairs: None, or :func:`neighbor_list`'s count (one int64 on ``pairs``' device): the
            pairs from it on are its padding and are skipped, neither summed nor differentiated
            (their gradients are 0; ``torch.ops.mirage.cfconv``'s filters there too), so a pass
            costs the pairs there are, not the capacity. A negative count or one past ``P``
            (neighbor_list's NaN and overflow cases) counts every pair. A ``sender_order`` must
            then come from :func:`sender_order` with the same ``num_pairs``.

    Returns:
        ``(N, M)`` in x's dtype (float32 under autocast). Differentiable in ``x``, ``basis`` and
        ``envelope`` (first order: forces and stress) through a fused backward op
        (``torch.ops.mirage.cfconv_backward``); asking for a gradient in the weights or for a
        second order raises ``RuntimeError``. CUDA takes ``H == M`` of 64 or 128 and
        ``R <= 64`` where the GPU has the shared memory (:func:`cfconv_supported`) and raises
        ``RuntimeError`` otherwise. Under autocast it runs in float32 (floating inputs cast to
        float32), as PyTorch's float32-list ops do. Indices outside ``[0, N)``: the CPU raises
        ``RuntimeError``; CUDA returns NaN everywhere (gradients too).
    """
    tf32 = tf32_matmuls() if tf32 is None else _boolean(tf32, "mirage::cfconv: tf32")
    return torch.ops.mirage.cfconv(x, basis, envelope, pairs, weight1, bias1, weight2, bias2, activation, tf32,
                                   sender_order, num_pairs)[0]


@_tensors_required
def radial_cfconv(
    x: Tensor,
    distances: Tensor,
    pairs: Tensor,
    weight1: Tensor,
    bias1: Optional[Tensor],
    weight2: Tensor,
    bias2: Optional[Tensor],
    activation: str = "shifted_softplus",
    basis: str = "gaussian",
    cutoff: float = 5.0,
    envelope: str = "cosine",
    sender_order: Optional[Tensor] = None,
) -> Tensor:
    """:func:`cfconv` whose filters are a function of the pair's distance: with ``b`` the basis
    ``radial_basis(distances, basis, R, cutoff, "none")`` (``R`` from ``weight1``) and ``e`` the
    cutoff function ``envelope`` (as :func:`radial_basis` applies it)::

        filters(d) = (weight2 @ act(weight1 @ b(d) + bias1) + bias2) * e(d)
        out[i]     = sum over p with pairs[0, p] == i of x[pairs[1, p]] * filters(distances[p])

    The filters come from a table of the network that each call builds in float64: quintic
    pieces over ``[0, cutoff)`` matching the network's value and first two derivatives at their
    ends, 32 pieces per unit of the basis' resolution (1,024 for SchNet's 20 Gaussians), whose
    error is below float32 rounding for the models in the tests (docs/ops.md). Forward and
    backward are then passes over the pairs with no products.

    Args:
        x, pairs, weight1, bias1, weight2, bias2, sender_order: as :func:`cfconv`.
        distances: ``(P,)`` pair distances, x's dtype and device; pairs at or past the cutoff add
            nothing, negative or NaN distances give NaN.
        activation: as :func:`cfconv`, less ``"relu"`` (not smooth: a table cannot interpolate it).
        basis: ``"gaussian"`` or ``"bessel"``, :func:`radial_basis`' functions.
        cutoff: finite and > 0, in float32's normal range, the basis' and the envelope's.
        envelope: ``"cosine"`` or ``"polynomial"``, :func:`radial_basis`' cutoff functions (the
            filters must vanish at the cutoff).

    Returns:
        ``(N, M)`` in x's dtype (float32 under autocast). Differentiable in ``x`` and
        ``distances`` (first order) through ``torch.ops.mirage.radial_cfconv_backward``; asking
        for a gradient in the weights or for a second order raises ``RuntimeError``.
        ``torch.ops.mirage.radial_cfconv`` also returns the table ``(intervals, 6, M)``, which
        the backward reads. CUDA takes ``M`` a multiple of 4 (:func:`radial_cfconv_supported`).
        Indices outside ``[0, N)``: the CPU raises ``RuntimeError``; CUDA returns NaN everywhere
        (gradients too).
    """
    return torch.ops.mirage.radial_cfconv(x, distances, pairs, weight1, bias1, weight2, bias2, activation, basis,
                                          _real(cutoff, "mirage::radial_cfconv: cutoff"), envelope, sender_order)[0]


@_tensors_required
def verlet_kick_drift(positions: Tensor, velocities: Tensor, forces: Tensor, inverse_masses: Tensor, kick: float,
                      drift: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """A velocity-Verlet kick and drift of an MD state, in place, in one kernel::

        velocities += kick * forces * inverse_masses
        positions  += drift * velocities

    (``mirage.ff.md``'s step before the force call: ``kick = dt / 2``, ``drift = dt``. A ``kick``
    of 0 leaves the velocities untouched.)

    Args:
        positions, velocities: ``(N, 3)`` float32 or float64, contiguous; updated in place.
        forces: ``(N, 3)``; inverse_masses: ``(N,)`` or ``(N, 1)``; both in ``positions``' dtype
            and on its device (strided ones are copied to contiguous first).
        kick, drift: the two time factors (ASE units: Å, eV, amu and ASE's time unit).
        dtype: the dtype of the returned positions, float32 or float64 (the model's).

    Returns:
        The updated positions as a new ``(N, 3)`` tensor in ``dtype``, for the force call. Not
        differentiable. On CUDA the products may be fused into multiply-adds, so the state can
        differ from the PyTorch composite's in the last bit.
    """
    return torch.ops.mirage.verlet_kick_drift(positions, velocities, forces, inverse_masses,
                                              _real(kick, "mirage::verlet_kick_drift: kick"),
                                              _real(drift, "mirage::verlet_kick_drift: drift"), dtype)


@_tensors_required
def verlet_forces_kick(velocities: Tensor, forces: Tensor, energy: Tensor, grad: Tensor, model_energy: Tensor,
                       inverse_masses: Tensor, kick: float, pair_count: Optional[Tensor] = None,
                       pair_count_range: Optional[Tensor] = None) -> None:
    """A force call's result taken into an MD state, then a velocity-Verlet kick, in place, in one
    kernel::

        forces      = -grad
        energy      = model_energy
        velocities += kick * forces * inverse_masses
        pair_count_range = [max(pair_count_range[0], pair_count), min(pair_count_range[1], pair_count)]

    (``mirage.ff.md``'s step after the force call: ``kick = dt / 2``. A ``kick`` of 0 leaves the
    velocities untouched: ``mirage.ff.md`` takes its first forces that way. The range is its
    check of the model's neighbor capacity over a replay's steps, ``model.num_pairs`` folded in.)

    Args:
        velocities, forces: ``(N, 3)`` float32 or float64, contiguous; updated in place.
        energy: ``()`` in their dtype; written.
        grad: ``(N, 3)`` float32 or float64, the energy's gradient in the positions, and
            model_energy: one floating-point element (the model's energy), on the state's device;
            stored rounded once to the state's dtype.
        inverse_masses: ``(N,)`` or ``(N, 1)`` in the state's dtype.
        kick: the time factor.
        pair_count, pair_count_range: both None, or one int64 element and an int64 ``(2,)``
            (contiguous, updated in place), on the state's device.

    Not differentiable; returns nothing.
    """
    torch.ops.mirage.verlet_forces_kick(velocities, forces, energy, grad, model_energy, inverse_masses,
                                        _real(kick, "mirage::verlet_forces_kick: kick"), pair_count, pair_count_range)


@_tensors_required
def verlet_forces_kick_drift(positions: Tensor, velocities: Tensor, forces: Tensor, energy: Tensor, grad: Tensor,
                             model_energy: Tensor, inverse_masses: Tensor, kick: float, drift: float,
                             dtype: torch.dtype = torch.float32, pair_count: Optional[Tensor] = None,
                             pair_count_range: Optional[Tensor] = None) -> Tensor:
    """:func:`verlet_forces_kick` then :func:`verlet_kick_drift` with the same ``kick``, in one
    kernel: the end of one velocity-Verlet step and the start of the next (``mirage.ff.md``
    between the steps of a replay, ``kick = dt / 2``: one kernel a step fewer)::

        forces      = -grad
        energy      = model_energy
        velocities += kick * forces * inverse_masses      (the force call's half kick)
        velocities += kick * forces * inverse_masses      (the next step's)
        positions  += drift * velocities
        pair_count_range as verlet_forces_kick folds it

    Args: as the two ops take them; ``grad`` must be in ``dtype`` (the model's: the one kernel
    reads it and writes the returned positions), and ``positions`` may share no memory with the
    other tensors.

    Returns:
        The updated positions as a new ``(N, 3)`` tensor in ``dtype``. Not differentiable.
    """
    return torch.ops.mirage.verlet_forces_kick_drift(positions, velocities, forces, energy, grad, model_energy,
                                                     inverse_masses, _real(kick, "mirage::verlet_forces_kick_drift: kick"),
                                                     _real(drift, "mirage::verlet_forces_kick_drift: drift"), dtype,
                                                     pair_count, pair_count_range)


# torch.compile cannot trace the precision getters (they are C functions): it runs this at
# compile time instead and bakes the answer into the graph. That is sound because dynamo guards
# every graph on the global TF32 setting and recompiles when it changes
# (tests/python/test_cfconv.py checks both).
@torch.compiler.assume_constant_result
def tf32_matmuls() -> bool:
    """Whether PyTorch lets float32 CUDA matmuls use TF32 now: ``torch.backends.cuda.matmul``'s
    ``fp32_precision`` (inheriting ``torch.backends.fp32_precision`` while ``"none"``), which
    ``allow_tf32 = True`` and ``torch.set_float32_matmul_precision("high")`` set as well; on
    torch before 2.9, ``allow_tf32``. Read through the newer API where it exists: the legacy
    getter raises once both have been used."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        return bool(matmul.allow_tf32)
    precision = matmul.fp32_precision
    if precision == "none":
        precision = torch.backends.fp32_precision
    return precision == "tf32"


@torch.compiler.assume_constant_result  # a property of the device and the sizes, fixed per process
def cfconv_supported(num_rbf: int, hidden: int, width: int, device: Union[str, torch.device]) -> bool:
    """Whether :func:`cfconv` runs a filter network of ``num_rbf`` inputs, ``hidden`` units and
    ``width`` outputs on ``device`` (False for sizes below 1): on the CPU always; on CUDA when ``hidden == width`` is 64 or
    128, ``num_rbf <= 64`` and the GPU has TF32 tensor cores (sm_80 on) and the shared memory per
    block the kernels keep their operands in: 147-205 KiB at width 128 (R from 1 to 64: Hopper's
    227 KiB takes them all, an A100's 163 KiB R <= 24, RTX 30xx-40xx's 99 KiB none), 63-105 KiB at width 64."""
    return _supported("cfconv_supported", num_rbf, hidden, width, device)


@torch.compiler.assume_constant_result
def radial_cfconv_supported(num_rbf: int, hidden: int, width: int, device: Union[str, torch.device]) -> bool:
    """Whether :func:`radial_cfconv` runs a filter network of these sizes on ``device`` (False for
    sizes below 1 or ``num_rbf`` above 1,024, the filter table's bound): on the CPU otherwise
    always; on CUDA for ``width`` a multiple of 4 where the table kernel's shared memory (about
    ``216 * (num_rbf + hidden) + 45,000`` bytes) fits the device's."""
    return _supported("radial_cfconv_supported", num_rbf, hidden, width, device)


def _supported(check: str, num_rbf: int, hidden: int, width: int, device: Union[str, torch.device]) -> bool:
    where = f"mirage.ops.{check}: "
    return _supported_on(check, *(_integer(value, where + name) for value, name in
                                  ((num_rbf, "num_rbf"), (hidden, "hidden"), (width, "width"))), _device_name(device))


@functools.lru_cache(maxsize=None)  # models ask on every forward
def _supported_on(check: str, num_rbf: int, hidden: int, width: int, device: str) -> bool:
    from . import _C

    return bool(getattr(_C, check)(num_rbf, hidden, width, device))
