"""CUDA-graph capture for any callable: static buffers, a bounded per-signature cache, one pool.

A CUDA graph replays a recorded sequence of kernels with one launch, removing the per-kernel
CPU and launch overhead that dominates small-batch inference. It reads its inputs from, and
writes its outputs to, the fixed addresses used at capture ("static buffers"): each call copies
the new inputs into the static input buffers, replays, and hands the outputs back.

Outputs policy: by default (``copy_outputs=True``) every output tensor is cloned out of its
static buffer after the replay, so callers may keep outputs across calls. With
``copy_outputs=False`` the static buffers themselves are returned (no copy); they are
overwritten by the next replay, and in a :class:`GraphCache` by the next replay of *any* of its
graphs, because all of its graphs share one memory pool.

Graphs are for inference: the callable runs under ``torch.no_grad()``, and inputs that require
grad while grad mode is on are refused. CUDA autocast is part of a graph's signature: a graph
captured inside ``torch.autocast("cuda")`` serves calls made under the same autocast dtype only,
and records its own casts (its warm-up and capture run with autocast's cache of cast weights off,
whose copies autocast frees when its block ends).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Sequence, Set, Tuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ._arguments import count, flag, function

__all__ = ["CaptureError", "CapturedGraph", "GraphCache", "GraphCacheStats", "capture", "signature"]

# Non-tensor leaves a graph takes: immutable plain values (and NumPy scalars, _numpy_scalar). It is
# keyed on input ones by value and returns output ones as they were at capture. Any other object
# could hold tensors that the graph reads or writes at their captured addresses, with no static
# buffer of their own.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size, enum.Enum,
                torch.memory_format, torch.layout)
# Held by every capture and every call of a CapturedGraph or GraphCache in the process: a call's
# input copies, replay and output clones are not interleaved with another thread's (graphs share
# static buffers and pools), and one capture runs at a time (PyTorch captures in its global mode,
# and a capture turns the garbage collector off for the process). Reentrant: a captured function
# may call another graph's cache (which replays, or raises if it would capture inside a capture).
_LOCK = threading.RLock()


def progress(message: str) -> None:
    """One progress line on stderr, for work long enough that a user wonders what happens."""
    print(f"mirage: {message}", file=sys.stderr, flush=True)


def _leaves(tree: Any, root: str) -> Tuple[List[Any], List[str], pytree.TreeSpec]:
    """Leaves of ``tree``, their names for messages (``root[0]['x']``) and the spec.

    Pytree nodes registered without key functions (diffusers' output classes) have no paths;
    then the leaves are numbered: ``root (leaf 2)``.
    """
    try:
        with_paths, spec = pytree.tree_flatten_with_path(tree)
    except ValueError:
        leaves, spec = pytree.tree_flatten(tree)
        return leaves, [f"{root} (leaf {i})" for i in range(len(leaves))], spec
    return [leaf for _, leaf in with_paths], [root + pytree.keystr(path) for path, _ in with_paths], spec


def _flatten(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[List[Any], List[str], pytree.TreeSpec]:
    """Leaves of ``(args, kwargs)``, their names (``args[0]``, ``kwargs['x'][1]``) and the spec.

    kwargs are sorted by name so that the same arguments in another order share a signature.
    The names cost more than the flattening (their paths): a call that replays a graph takes
    :func:`_tree`, and names are worked out only for a message.
    """
    arguments = _arguments(args, kwargs)
    leaves, spec = pytree.tree_flatten(arguments)
    # Named argument by argument, so that one without paths numbers only its own leaves.
    named = [*((f"args[{i}]", arg) for i, arg in enumerate(arguments[0])),
             *((f"kwargs[{key!r}]", value) for key, value in arguments[1].items())]
    names = [name for root, arg in named for name in _leaves(arg, root)[1]]
    return leaves, names, spec


def _arguments(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    return tuple(args), dict(sorted(kwargs.items()))


def _tree(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[List[Any], pytree.TreeSpec]:
    """:func:`_flatten` without the names: the leaves and spec every replayed call needs."""
    return pytree.tree_flatten(_arguments(args, kwargs))


def _numpy_scalar(leaf: Any) -> bool:
    """A NumPy scalar (``np.int64(3)``, ``np.float32``, ``np.bool_``): immutable, so keyed by its
    value like a Python number. NumPy need not be imported: without it there are none."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(leaf, numpy.generic)


def _strided_tensor(leaf: Any) -> bool:
    return isinstance(leaf, Tensor) and not leaf.is_nested and leaf.layout == torch.strided


def _key_kind(leaf: Any) -> str:
    """"tensor", "value" (a plain value, keyed by type and value) or "refused"."""
    if _strided_tensor(leaf):
        return "tensor"
    if isinstance(leaf, _VALUE_TYPES) or _numpy_scalar(leaf):
        return "value"
    return "refused"


def _leaf_key(leaf: Any) -> Hashable:
    kind = _key_kind(leaf)
    if kind == "tensor":
        return ("tensor", tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device)
    if kind == "refused":
        raise TypeError(leaf)  # _signature_of names the argument
    # The type separates values that compare equal (1, 1.0 and True, np.int64(1)); floats by
    # their bits, so that NaN is equal to itself and -0.0 differs from 0.0.
    value = leaf.item() if _numpy_scalar(leaf) else leaf
    if isinstance(value, float):
        return ("float", type(leaf), value.hex())
    if isinstance(value, complex):
        return ("complex", type(leaf), value.real.hex(), value.imag.hex())
    return ("value", type(leaf), value)


def _autocast_state() -> Tuple[Any, ...]:
    """CUDA autocast as a graph records it: off, or on with its dtype."""
    if torch.is_autocast_enabled("cuda"):
        return (True, torch.get_autocast_dtype("cuda"))
    return (False,)


class _Signature(tuple):
    """A signature whose hash is computed once: hashing a pytree spec walks the whole tree, and a
    cache hashes its key on every lookup. Equal to (and hashed like) the plain tuple."""

    def __new__(cls, items: Tuple[Any, ...]) -> "_Signature":
        key = super().__new__(cls, items)
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash


def _signature_of(leaves: Sequence[Any], spec: pytree.TreeSpec, args: Sequence[Any], kwargs: Dict[str, Any],
                  who: str) -> Hashable:
    try:
        return _Signature((spec, tuple(_leaf_key(leaf) for leaf in leaves), _autocast_state()))
    except TypeError as error:
        failure = error
    for leaf, name in zip(leaves, _flatten(args, kwargs)[1]):  # which argument: names for the message
        if _key_kind(leaf) != "refused":
            continue
        if isinstance(leaf, Tensor):
            raise ValueError(f"{who}: argument {name} is a {'nested' if leaf.is_nested else leaf.layout} tensor; "
                             "a graph copies its inputs into dense (strided) static buffers, so pass dense tensors "
                             "(.to_dense(), or the nested tensor's components)") from None
        raise ValueError(
            f"{who}: argument {name} is a {type(leaf).__name__}, which is neither a tensor nor a plain value "
            "(a number, a string, a bool, None, a dtype, a device, an enum, a memory format, a layout); a graph is "
            "chosen by its inputs' shapes and by the values of its other arguments, and would read tensors held "
            "inside an object at their captured addresses, so pass tensors as arguments (or in tuples, lists, "
            "dicts) and settings as plain values"
        ) from None
    raise failure


def signature(args: Sequence[Any], kwargs: Dict[str, Any], who: str = "mirage.graphs") -> Hashable:
    """The key that decides which graph serves a call.

    Tensors contribute their shape, strides (memory layout), dtype and device; every other
    argument its type and value; the nesting of containers contributes too, and so does CUDA
    autocast (off, or its dtype).

    Args:
        args, kwargs: the call's arguments.
        who: the name used in error messages.

    Returns:
        A hashable key; two calls with equal keys can replay the same graph.

    Raises:
        ValueError: an argument is neither a dense tensor nor a plain value (a number, NumPy's
            included, a string, a bool, None, a dtype, a device, an enum, a memory format, a layout).
    """
    return _signature_of(*_tree(args, kwargs), args, kwargs, who)


def _keyed(args: Sequence[Any], kwargs: Dict[str, Any], who: str) -> Tuple[List[Any], Hashable]:
    """The call's leaves and :func:`signature` from one flattening, refusing inputs that require
    grad (:func:`_refuse_grad`): what each call of a graph or a cache does first."""
    leaves, spec = _tree(args, kwargs)
    key = _signature_of(leaves, spec, args, kwargs, who)
    if torch.is_grad_enabled() and any(isinstance(leaf, Tensor) and leaf.requires_grad for leaf in leaves):
        _refuse_grad(*_flatten(args, kwargs)[:2], who)
    return leaves, key


class _StreamOrder:
    """Orders the calls of graphs that share static buffers or a memory pool across CUDA streams:
    a call on another stream than the last one's first waits for everything queued there (the
    last replay still reading its inputs, writing the pool), as one stream would. Calls on one
    stream, the usual case, pay a stream query."""

    def __init__(self) -> None:
        self._last: Optional[torch.cuda.Stream] = None

    def join(self, leaves: Sequence[Any]) -> None:
        device = next((leaf.device for leaf in leaves if isinstance(leaf, Tensor) and leaf.is_cuda), None)
        if device is None:  # no CUDA input: the graph is on the current device (_capture_device)
            if not torch.cuda.is_initialized():  # no graph at all (the tests' CPU stand-in)
                return
            device = torch.device("cuda", torch.cuda.current_device())
        stream = torch.cuda.current_stream(device)
        if self._last is not None and self._last != stream:
            stream.wait_stream(self._last)
        self._last = stream


def _load(buffers: Sequence[Tensor], leaves: Sequence[Any]) -> None:
    """Copies a call's tensors (its leaves, in flattening order) into a graph's static input
    buffers, one per tensor, skipping any that already is its buffer."""
    tensors = (leaf for leaf in leaves if isinstance(leaf, Tensor))
    for buffer, tensor in zip(buffers, tensors):
        if tensor is not buffer:
            buffer.copy_(tensor)


def _difference(captured: Hashable, given: Hashable, args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    """The first argument in which two signatures differ, both ways, for an error message."""
    (captured_spec, captured_keys, captured_autocast), (given_spec, given_keys, given_autocast) = captured, given
    if captured_autocast != given_autocast:
        def autocast(state: Tuple[Any, ...]) -> str:
            return (f"under CUDA autocast to {str(state[1]).replace('torch.', '')}" if state[0]
                    else "without CUDA autocast")

        return f"called {autocast(given_autocast)}, captured {autocast(captured_autocast)}"
    if captured_spec != given_spec:
        return f"called with ({_describe(args, kwargs)}), whose structure (containers, keyword names) is not the captured one's"

    def shown(key: Tuple[Any, ...]) -> str:
        if key[0] == "tensor":
            _, shape, stride, dtype, device = key
            return f"a {str(dtype).replace('torch.', '')}{list(shape)} tensor on {device} with strides {stride}"
        if key[0] == "float":
            value = float.fromhex(key[2])
        elif key[0] == "complex":
            value = complex(float.fromhex(key[2]), float.fromhex(key[3]))
        else:
            value = key[2]
        return f"{key[1].__name__} {value!r}"

    names = _flatten(args, kwargs)[1]
    index = next(i for i, (a, b) in enumerate(zip(captured_keys, given_keys)) if a != b)
    return f"argument {names[index]} is {shown(given_keys[index])}, captured as {shown(captured_keys[index])}"


def _describe(args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    """A short human-readable signature: tensors as ``name: dtype[shape]``."""
    leaves, names, _ = _flatten(args, kwargs)
    parts = [
        f"{name}: {str(leaf.dtype).replace('torch.', '')}{list(leaf.shape)}"
        for leaf, name in zip(leaves, names)
        if isinstance(leaf, Tensor)
    ]
    return ", ".join(parts) or "no tensor inputs"


def _refuse_grad(leaves: Sequence[Any], names: Sequence[str], who: str) -> None:
    if not torch.is_grad_enabled():
        return
    for leaf, name in zip(leaves, names):
        if isinstance(leaf, Tensor) and leaf.requires_grad:
            raise ValueError(
                f"{who}: input {name} requires grad while grad mode is on; CUDA graphs here are for "
                "inference only: call under torch.no_grad() or torch.inference_mode(), or pass "
                f"{name}.detach()"
            )


def _capture_device(leaves: Sequence[Any], names: Sequence[str], who: str) -> torch.device:
    if not torch.cuda.is_available():  # first: "move it to the GPU" would be advice that cannot be followed
        raise RuntimeError(f"{who}: CUDA is not available; CUDA graphs need a CUDA GPU")
    device = None
    for leaf, name in zip(leaves, names):
        if not isinstance(leaf, Tensor):
            continue
        if leaf.device.type != "cuda":
            raise ValueError(
                f"{who}: input {name} is on {leaf.device}; a CUDA graph reads its inputs from GPU "
                f"memory, so move it to the GPU ({name}.cuda())"
            )
        if device is not None and leaf.device != device:
            raise ValueError(f"{who}: inputs are on several GPUs ({device} and {leaf.device} for {name}); "
                             "one graph runs on one GPU")
        device = leaf.device
    return device if device is not None else torch.device("cuda", torch.cuda.current_device())


def _uncached_autocast() -> Any:
    """Under CUDA autocast: the same autocast with its cache of cast weights off, so that a graph
    records the casts it reads (a cached copy is freed when the user's autocast block ends, and a
    replay would read freed memory). Otherwise nothing."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


class CaptureError(RuntimeError):
    """A callable could not be captured in a CUDA graph (host synchronisation, CPU tensors, shapes
    that depend on values). A RuntimeError, so that callers may catch it by type and say what to
    do instead."""


class CapturedGraph:
    """One CUDA graph of ``fn`` for one input signature (see :func:`capture`).

    Calling it copies the inputs into the static input buffers, replays the graph and returns
    ``fn``'s outputs (cloned, unless ``copy_outputs=False``; see the module's outputs policy).

    Attributes:
        signature: the :func:`signature` of the inputs it was captured for.
        capture_seconds: wall time of the warm-up and the capture.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Dict[str, Any],
        *,
        pool: Any = None,
        copy_outputs: bool = True,
        warmup: int = 3,
    ) -> None:
        who = "mirage.graphs.capture"
        function(fn, f"{who}: fn")
        copy_outputs = flag(copy_outputs, f"{who}: copy_outputs")
        # The first calls run lazy initialisation (cuBLAS handles, autotuning) that must not be captured.
        warmup = count(warmup, f"{who}: warmup")
        leaves, names, spec = _flatten(args, kwargs)
        _refuse_grad(leaves, names, who)
        self.signature = signature(args, kwargs, who)
        device = _capture_device(leaves, names, who)
        self.copy_outputs = copy_outputs
        self._order = _StreamOrder()
        self._fn_name = getattr(fn, "__qualname__", type(fn).__name__)
        tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        # preserve_format keeps the caller's strides for dense inputs; expanded (stride 0) inputs
        # get a dense buffer, which any input of the same shape can be copied into. Normal (not
        # inference) tensors, so that later calls may copy into them outside torch.inference_mode.
        with torch.inference_mode(False):
            self._static_inputs = [torch.empty_like(leaves[i], memory_format=torch.preserve_format)
                                   for i in tensor_slots]
        static_leaves = list(leaves)
        for slot, buffer in zip(tensor_slots, self._static_inputs):
            buffer.copy_(leaves[slot])
            static_leaves[slot] = buffer
        static_args, static_kwargs = pytree.tree_unflatten(static_leaves, spec)
        self._static_arguments = (static_args, static_kwargs)

        start = time.perf_counter()
        with _LOCK, torch.cuda.device(device), torch.no_grad(), _uncached_autocast():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn(*static_args, **static_kwargs)
            torch.cuda.current_stream().wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            # No garbage collection during the capture: a CUDA graph of earlier work collected
            # from a dead reference cycle is destroyed by a CUDA call that invalidates any capture
            # in progress (torch.cuda.graph no longer collects before it begins, unless
            # torch.compiler.config.force_cudagraph_gc). The suspected cause of MD captures that
            # failed on an H200 with cudaErrorStreamCaptureInvalidated and a warning of a graph
            # reset during capture, after other tests had run in the process.
            collecting = gc.isenabled()
            gc.disable()
            try:
                # A capture stream of the graph's own device (torch.cuda.graph's default is one
                # stream per process, made on whichever device was current at the first capture).
                with torch.cuda.graph(self._graph, pool=pool, stream=torch.cuda.Stream(device)):
                    outputs = fn(*static_args, **static_kwargs)
            except RuntimeError as error:
                raise CaptureError(
                    f"{who}: capturing {self._fn_name} failed: {error}\nA CUDA graph cannot contain host "
                    "synchronisation (.item(), .cpu(), printing a tensor), CPU tensors or shapes that "
                    "depend on tensor values; run such code without a graph"
                ) from error
            finally:
                if collecting:
                    gc.enable()
            torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start

        self._static_outputs, output_names, self._output_spec = _leaves(outputs, "output")
        for leaf, name in zip(self._static_outputs, output_names):
            if not isinstance(leaf, Tensor) and _key_kind(leaf) != "value":
                raise ValueError(
                    f"{who}: {self._fn_name} returned a {type(leaf).__name__} at {name}; "
                    "it may hold tensors that every replay overwrites, so only tensors, plain values and "
                    "containers of them (tuples, lists, dicts, registered pytree nodes) can be returned"
                )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replays the graph on new inputs of the captured signature; returns ``fn``'s outputs."""
        who = "mirage.graphs.CapturedGraph"
        leaves, key = _keyed(args, kwargs, who)
        if key != self.signature:
            raise ValueError(
                f"{who}: {_difference(self.signature, key, args, kwargs)}, which differs from the captured "
                "signature (tensor shapes, strides, dtypes, devices and the other arguments' values must match); "
                "capture a new graph, or use mirage.graphs.GraphCache to do so automatically"
            )
        with _LOCK:
            self._order.join(leaves)
            _load(self._static_inputs, leaves)
            return self.replay()

    @property
    def static_inputs(self) -> Tuple[Tensor, ...]:
        """The static input buffers, one per tensor argument in call order (see :meth:`replay`)."""
        return tuple(self._static_inputs)

    @property
    def static_arguments(self) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """``(args, kwargs)`` as the graph reads them: the captured call's structure with the static
        input buffers in place of its tensors (:attr:`static_inputs`, by name). For a caller whose
        data lives in those buffers, updated in place by each replay, and who finds them there
        rather than by their order (mirage.ff.md's state dict)."""
        return self._static_arguments

    def replay(self) -> Any:
        """Replays on what the static input buffers hold now; returns ``fn``'s outputs as a call does.

        For callers on a hot path that write their inputs straight into :attr:`static_inputs`
        (``copy_`` with ``non_blocking=True`` from pinned memory, say) and so skip the per-call
        signature check and input copies of a call.
        """
        with _LOCK:
            if self._graph is None:
                raise RuntimeError("mirage.graphs: this CapturedGraph was reset (evicted) and cannot replay; capture again")
            self._graph.replay()
            outputs = [leaf.clone() if self.copy_outputs and isinstance(leaf, Tensor) else leaf
                       for leaf in self._static_outputs]
        return pytree.tree_unflatten(outputs, self._output_spec)

    def reset(self) -> None:
        """Releases the graph and its static buffers (their memory returns to the allocator)."""
        if self._graph is not None:
            self._graph.reset()
        self._graph = None
        self._static_inputs = []
        self._static_outputs = []
        self._static_arguments = ((), {})


def capture(
    fn: Callable[..., Any],
    *example_inputs: Any,
    pool: Any = None,
    copy_outputs: bool = True,
    warmup: int = 3,
    **example_kwargs: Any,
) -> CapturedGraph:
    """Captures ``fn(*example_inputs, **example_kwargs)`` as one CUDA graph.

    The inputs are copied into static buffers; ``fn`` runs ``warmup`` times on a side stream
    (lazy initialisation must not land in the graph), then once under capture.

    Args:
        fn: the callable; it must be capturable (no host synchronisation, no CPU tensors, no
            shapes that depend on tensor values). It runs under ``torch.no_grad()``.
        example_inputs, example_kwargs: arguments of the shape, dtype, device and strides of
            later calls; tensors must be on one CUDA device. Non-tensor arguments are fixed.
        pool: a memory pool (``torch.cuda.graph_pool_handle()``) to share with other graphs.
        copy_outputs: clone the outputs after each replay (see the module's outputs policy).
        warmup: eager calls before the capture. ``pool``, ``copy_outputs`` and ``warmup`` are
            this function's own keywords, not passed to ``fn``.

    Returns:
        A :class:`CapturedGraph`; call it with new inputs of the same signature.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: a CPU input, inputs on several GPUs, an input that requires grad under grad
            mode, an argument that is neither a dense tensor nor a plain value, ``warmup`` not an
            int >= 1, or an output that is not a tensor, a plain value or a container of them.
        RuntimeError: no CUDA, or ``fn`` cannot be captured.
    """
    return CapturedGraph(fn, example_inputs, example_kwargs, pool=pool, copy_outputs=copy_outputs, warmup=warmup)


@dataclass(frozen=True)
class GraphCacheStats:
    """Counters of a :class:`GraphCache`: calls served by an existing graph (hits), calls that
    captured a new one (misses), graphs released to stay within ``max_entries`` (evictions), the
    graphs held now (entries) and the total capture time."""

    hits: int
    misses: int
    evictions: int
    entries: int
    max_entries: int
    capture_seconds: float

    def __str__(self) -> str:
        return (f"{self.entries}/{self.max_entries} graphs held, {self.hits} hits, {self.misses} captures "
                f"({self.capture_seconds:.1f} s), {self.evictions} evictions")


class GraphCache:
    """Calls ``fn`` through one CUDA graph per input signature, capturing each on first use.

    The signature (:func:`signature`) covers the tensors' shapes, strides, dtypes and devices and
    the other arguments' values. At most ``max_entries`` graphs are held; a new signature beyond
    that evicts the least recently used graph, releasing its graph and buffers. All graphs share
    one memory pool, so their intermediate tensors occupy the same memory.

    A caller that replays one signature many times on a hot path may skip the per-call signature
    and pytree work: :meth:`prepare` once, then write into the graph's ``static_inputs`` and
    :meth:`replay`, checking :meth:`holds` (evictions, :meth:`clear`) before each replay.

    Args:
        fn: the callable (see :func:`capture`).
        max_entries: graphs held at most (>= 1).
        copy_outputs: clone outputs after each replay (see the module's outputs policy).
        warmup: eager calls before each capture.
        verbose: print a progress line on stderr for each capture, with its time.
        capture: builds one graph: ``capture(fn, args, kwargs, pool=, copy_outputs=, warmup=)``
            returning an object with :class:`CapturedGraph`'s ``static_inputs``, ``replay()`` and
            ``reset()``. Defaults to :class:`CapturedGraph`; tests pass a CPU stand-in.
        new_pool: makes the shared pool on the first capture; defaults to
            ``torch.cuda.graph_pool_handle``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        max_entries: int = 8,
        *,
        copy_outputs: bool = True,
        warmup: int = 3,
        verbose: bool = True,
        capture: Callable[..., Any] = CapturedGraph,
        new_pool: Callable[[], Any] = torch.cuda.graph_pool_handle,
    ) -> None:
        self.fn = function(fn, "mirage.graphs.GraphCache: fn")
        self.max_entries = count(max_entries, "mirage.graphs.GraphCache: max_entries")
        self.copy_outputs = flag(copy_outputs, "mirage.graphs.GraphCache: copy_outputs")
        self.warmup = count(warmup, "mirage.graphs.GraphCache: warmup")
        self.verbose = flag(verbose, "mirage.graphs.GraphCache: verbose")
        self._capture = capture
        self._new_pool = new_pool
        self._pool: Any = None
        self._entries: "OrderedDict[Hashable, Any]" = OrderedDict()
        self.hits = self.misses = self.evictions = 0
        self.capture_seconds = 0.0
        self._fresh: Set[Hashable] = set()  # keys of graphs captured by prepare() and not replayed yet
        self._order = _StreamOrder()  # the graphs share one pool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` by replaying the graph for this signature (captured if new)."""
        # The arguments are flattened once a call: the graph is replayed through the capture
        # protocol (static_inputs, replay), not called, which would flatten them again.
        leaves, key = _keyed(args, kwargs, "mirage.graphs.GraphCache")
        with _LOCK:
            self._order.join(leaves)
            entry = self._entries.get(key)
            if entry is None:
                entry = self._capture_new(key, args, kwargs)
            else:
                self._count_replay(key)
            _load(entry.static_inputs, leaves)
            return entry.replay()

    def prepare(self, *args: Any, **kwargs: Any) -> Tuple[Hashable, Any]:
        """The key and the graph for this call's signature, captured from these arguments if new.

        For a caller that replays one graph many times through :meth:`replay`, writing its inputs
        into the graph's ``static_inputs`` itself: the signature is computed here once, not per
        call. A capture counts as a miss (and the first :meth:`replay` after it as part of that
        call, not as a hit), as in a call.
        """
        key = signature(args, kwargs, "mirage.graphs.GraphCache")
        with _LOCK:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._capture_new(key, args, kwargs)
                self._fresh.add(key)
        return key, entry

    def holds(self, key: Hashable, entry: Any) -> bool:
        """Whether ``entry`` (from :meth:`prepare`) is still held: not evicted, not cleared."""
        return self._entries.get(key) is entry

    def replay(self, key: Hashable, entry: Any) -> Any:
        """Replays ``entry`` (from :meth:`prepare`, still held) on its static inputs as they are.

        Raises:
            RuntimeError: the graph was evicted or cleared since (check :meth:`holds`, prepare again).
        """
        with _LOCK:
            if self._entries.get(key) is not entry:
                raise RuntimeError("mirage.graphs.GraphCache.replay: this graph was evicted or cleared; prepare again")
            self._count_replay(key)
            return entry.replay()

    def _count_replay(self, key: Hashable) -> None:
        """A replay of a held graph: a hit, but for the first one after prepare() captured it."""
        if key in self._fresh:
            self._fresh.discard(key)
        else:
            self.hits += 1
        self._entries.move_to_end(key)

    def _capture_new(self, key: Hashable, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        if self._pool is None:
            self._pool = self._new_pool()
        start = time.perf_counter()
        entry = self._capture(self.fn, args, kwargs, pool=self._pool, copy_outputs=self.copy_outputs,
                              warmup=self.warmup)
        seconds = time.perf_counter() - start
        # Evicted only once the new graph exists, so that a capture that fails (fn raises, a CPU
        # input) costs the cache no graph; the intermediates live in the shared pool either way,
        # so the evicted graph's own buffers (inputs and outputs) are all this keeps a while longer.
        while len(self._entries) >= self.max_entries:
            self._evict_oldest()
        self.misses += 1
        self.capture_seconds += seconds
        self._entries[key] = entry
        if self.verbose:
            progress(f"captured CUDA graph {len(self._entries)}/{self.max_entries} for "
                     f"({_describe(args, kwargs)}) in {seconds:.2f} s")
        return entry

    def _evict_oldest(self) -> None:
        key, entry = self._entries.popitem(last=False)
        self._fresh.discard(key)
        entry.reset()
        self.evictions += 1

    def clear(self) -> None:
        """Releases every graph (and the pool); the next calls capture again. Counters stay."""
        with _LOCK:
            while self._entries:
                _, entry = self._entries.popitem(last=False)
                entry.reset()
            self._pool = None
            self._fresh.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> GraphCacheStats:
        """The cache's counters now."""
        return GraphCacheStats(self.hits, self.misses, self.evictions, len(self._entries), self.max_entries,
                               self.capture_seconds)
