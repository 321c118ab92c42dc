"""``mirage.optimize``: swap fused modules into a model, set its precision and layout, graph it.

Modules are swapped by instance from an explicit registry (exact type → builder); classes,
torch and diffusers are never edited. Every candidate the registry had to leave alone is
reported with the reason (:func:`report`).
"""

from __future__ import annotations

import contextlib
import gc
import io
import re
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ._arguments import count, flag
from .graphs import GraphCache, GraphCacheStats, _flatten, progress
from .nn import (GEGLU, BasicTransformerBlock, CrossAttnUpBlock2D, GroupNorm, LayerNorm, ResnetBlock2D,
                 Transformer2DModel, UpBlock2D, Upsample2D)
from .nn.attention import from_diffusers_attention
from .patterns import altered_submodule, fuse, qualified_name, swapped_in, swaps_made

__all__ = ["OptimizeReport", "OptimizedModule", "Swap", "optimize", "report"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# mirage's CUDA layer_norm normalizes rows of up to this many elements.
LAYER_NORM_MAX_WIDTH = 16384


# ----------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class Swap:
    """One registry entry: every instance of exactly ``module.name`` becomes ``build(instance)``.

    The class is looked up in ``sys.modules`` and never imported: a model can only hold
    diffusers' classes if diffusers is already imported, so diffusers stays optional and models
    without it do not pay for importing it.

    Attributes:
        module, name: where the class is defined (``"torch.nn"``, ``"GroupNorm"``).
        kind: the report's name for this swap.
        replacement: what it becomes, for the report.
        build: returns the replacement (sharing the instance's parameters) or raises
            ``ValueError(reason)`` for a configuration it cannot reproduce.
        opaque: when an instance is left alone, leave everything inside it alone too (its code
            may depend on the exact types of its children).
        candidate: instances it returns False for are no candidates: neither swapped nor
            reported (an ``Upsample2D`` without a convolution has nothing to fold into).
    """

    module: str
    name: str
    kind: str
    replacement: str
    build: Callable[[nn.Module], nn.Module]
    opaque: bool = False
    candidate: Optional[Callable[[nn.Module], bool]] = None

    def resolve(self) -> Optional[type]:
        defining = sys.modules.get(self.module)
        return getattr(defining, self.name, None) if defining is not None else None


def _build_transformer_block(block: nn.Module) -> nn.Module:
    fused = BasicTransformerBlock.from_diffusers(block)
    for name in ("norm2", "norm3"):
        norm = getattr(fused, name)
        if norm is not None and norm.normalized_shape > LAYER_NORM_MAX_WIDTH:
            raise ValueError(f"{name} is {norm.normalized_shape} wide, beyond the {LAYER_NORM_MAX_WIDTH} "
                             "mirage's CUDA kernel handles")
    return fused


def _build_geglu(module: nn.Module) -> nn.Module:
    try:
        # diffusers' GEGLU gates with the exact (erf) GELU.
        return GEGLU.from_torch(module, approximate="none")
    except TypeError as error:
        raise ValueError(str(error)) from None


def _build_layer_norm(norm: nn.Module) -> nn.Module:
    fused = LayerNorm.from_torch(norm)
    if fused.normalized_shape > LAYER_NORM_MAX_WIDTH:
        raise ValueError(f"normalized width {fused.normalized_shape} exceeds the {LAYER_NORM_MAX_WIDTH} "
                         "mirage's CUDA kernel handles")
    return fused


# Stage 1: whole diffusers blocks. Their forward is known, so norm → activation pairs and
# residual add → norm pairs inside them fuse; this runs before the pattern pass, which cannot trace
# diffusers' Python control flow.
BLOCK_SWAPS: Tuple[Swap, ...] = (
    # Their resnets, transformers and up-samplers are swapped inside them (children_swappable).
    Swap("diffusers.models.unets.unet_2d_blocks", "UpBlock2D", "UpBlock2D",
         "mirage.nn.UpBlock2D (skip connections concatenated as rows)", UpBlock2D.from_diffusers),
    Swap("diffusers.models.unets.unet_2d_blocks", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
         "mirage.nn.CrossAttnUpBlock2D (skip connections concatenated as rows)",
         CrossAttnUpBlock2D.from_diffusers),
    Swap("diffusers.models.resnet", "ResnetBlock2D", "ResnetBlock2D",
         "mirage.nn.ResnetBlock2D (GroupNorm+SiLU fused)", ResnetBlock2D.from_diffusers),
    # Its attentions, GEGLU and norm1 are swapped inside it by this and the later stages
    # (mirage.nn.BasicTransformerBlock.children_swappable).
    Swap("diffusers.models.attention", "BasicTransformerBlock", "BasicTransformerBlock",
         "mirage.nn.BasicTransformerBlock (residual add+LayerNorm fused)", _build_transformer_block),
    # Its norm, blocks and projections are swapped inside it (children_swappable).
    Swap("diffusers.models.transformers.transformer_2d", "Transformer2DModel", "Transformer2DModel",
         "mirage.nn.Transformer2DModel (no NCHW copy at its end)", Transformer2DModel.from_diffusers),
    # Attention's processors test `isinstance(norm_cross, nn.LayerNorm)`: swapping its norms alone
    # would break it, hence opaque.
    Swap("diffusers.models.attention_processor", "Attention", "Attention",
         "mirage fused attention (one QKV GEMM, SDPA)", from_diffusers_attention, opaque=True),
    Swap("diffusers.models.activations", "GEGLU", "GEGLU", "mirage.nn.GEGLU", _build_geglu),
    Swap("diffusers.models.upsampling", "Upsample2D", "Upsample2D",
         "mirage.nn.Upsample2D (2x2 sub-pixel convolutions, no upsampled image)", Upsample2D.from_diffusers,
         candidate=lambda block: block.use_conv and not block.use_conv_transpose),
)

# Stage 3: single torch norms wherever they remain, after the pattern pass has fused the
# GroupNorm → SiLU pairs it can see.
NORM_SWAPS: Tuple[Swap, ...] = (
    Swap("torch.nn", "GroupNorm", "GroupNorm", "mirage.nn.GroupNorm", GroupNorm.from_torch),
    Swap("torch.nn", "LayerNorm", "LayerNorm", "mirage.nn.LayerNorm", _build_layer_norm),
)


def _is_mirage_module(module: nn.Module) -> bool:
    return type(module).__module__.startswith("mirage.")


def _searched(module: nn.Module) -> bool:
    """Whether swaps look inside ``module``: any module but mirage's own (they may rely on the
    exact types of their children), except those declaring ``children_swappable`` (their children
    are the replaced block's modules, only ever called); and not PyTorch's encoder layer, already
    one fused op in inference (``torch._transformer_encoder_layer_fwd``), which reads its norms'
    weights, not their forward: swapped norms would not run."""
    if isinstance(module, nn.TransformerEncoderLayer):
        return False
    return not _is_mirage_module(module) or getattr(type(module), "children_swappable", False)


def _apply_swaps(root: nn.Module, swaps: Sequence[Swap], result: "OptimizeReport",
                 sealed: Dict[int, nn.Module]) -> nn.Module:
    """Replaces, in place, every instance of a registered type under ``root``; returns the new
    root (``root`` itself unless it is an instance). Replacements are not searched further, but
    for those that declare ``children_swappable``. An opaque swap's instance left alone is added
    to ``sealed``, and sealed modules are not searched, in this pass or the later ones."""
    by_type = {cls: swap for swap in swaps if (cls := swap.resolve()) is not None}
    if not by_type:
        return root
    # A module reachable under two names is swapped once, and both names get the replacement.
    # Each entry keeps its module alive: a module swapped out could otherwise be freed and its id
    # reused by a module built later in the pass (a replacement's new children are visited).
    visited: Dict[int, Tuple[nn.Module, nn.Module]] = {}

    def visit(module: nn.Module, name: str) -> nn.Module:
        if id(module) in visited:
            return visited[id(module)][1]
        if id(module) in sealed:
            return module
        replacement = module
        swap = by_type.get(type(module))
        left_alone_by: Optional[Swap] = None  # the swap that had to leave the module alone
        if swap is not None and swap.candidate is not None and not swap.candidate(module):
            pass  # not a candidate: nothing to swap, nothing to report
        elif swap is not None and (altered := altered_submodule(module)) is not None:
            where = qualified_name(name, altered[0]) or "(model)"
            what = f"{where} has {altered[1]}"
            # Once: the pattern pass may have said so already.
            if not any(at == name and what in reason for at, reason in result.left_alone):
                result.left_alone.append((name, f"{swap.kind}: {what}, which the replacement would not run"))
            left_alone_by = swap
        elif swap is not None:
            try:
                replacement = swapped_in(swap.build(module))
                result.swaps.append((swap.kind, name))
            except ValueError as reason:
                result.left_alone.append((name, f"{swap.kind}: {reason}"))
                left_alone_by = swap
        else:
            base = next((cls for cls in by_type if isinstance(module, cls)), None)
            if base is not None:
                result.left_alone.append(
                    (name, f"{type(module).__name__} subclasses {base.__name__} and may compute differently"))
                left_alone_by = by_type[base]
        if left_alone_by is not None and left_alone_by.opaque:
            sealed[id(module)] = module
            return module
        if _searched(replacement):
            for child_name, child in list(replacement.named_children()):
                new_child = visit(child, qualified_name(name, child_name))
                if new_child is not child:
                    setattr(replacement, child_name, new_child)
        visited[id(module)] = (module, replacement)
        return replacement

    try:
        return visit(root, "")
    finally:
        # visit's closure holds visit itself, a cycle only the garbage collector frees: without
        # this the modules swapped out, weights and all (110 MiB of the SD-1.5 U-Net's attention
        # projections), would stay allocated until its next run.
        visited.clear()


def _fuse_output_norm(model: nn.Module, result: "OptimizeReport") -> None:
    """diffusers' UNet2DConditionModel ends in ``conv_norm_out`` then ``conv_act``, called one
    right after the other on nothing else, in a forward the pattern pass cannot trace (its optional
    arguments). With a SiLU the pair becomes one ``mirage.nn.GroupNorm(activation="silu")`` (sharing
    the norm's parameters) and an ``nn.Identity``, in place."""
    unet = getattr(sys.modules.get("diffusers.models.unets.unet_2d_condition"), "UNet2DConditionModel", None)
    for name, module in model.named_modules():
        if (unet is not None and type(module) is unet and type(module.conv_norm_out) is nn.GroupNorm
                and type(module.conv_act) is nn.SiLU and altered_submodule(module.conv_norm_out) is None
                and altered_submodule(module.conv_act) is None):
            module.conv_norm_out = swapped_in(GroupNorm.from_torch(module.conv_norm_out, activation="silu"))
            module.conv_act = nn.Identity()
            result.swaps.append(("group_norm_silu", qualified_name(name, "conv_norm_out")))


def _fuse_patterns(model: nn.Module, result: "OptimizeReport", sealed: Dict[int, nn.Module]) -> nn.Module:
    """Stage 2: plain-PyTorch patterns (conv+BN(+act), GroupNorm→SiLU, q/k/v attention) via FX."""
    fused = fuse(model, sealed=sealed)
    # torch.fx's Proxy.__iter__ (`B, C, H, W = x.shape` in a traced forward) keeps its own frame in
    # a local, a reference cycle that holds the whole stack of the trace, the model passed in
    # included, until the garbage collector's next full pass: the modules this pass replaced,
    # weights and all, would stay allocated after the caller lets go of them. One pass here
    # (0.1-0.3 s) frees them now.
    gc.collect()
    result.swaps.extend(fused.swaps)
    result.left_alone.extend(fused.skipped)
    return fused.module


# ----------------------------------------------------------------------------------------------
# The report


@dataclass
class OptimizeReport:
    """What :func:`optimize` did to a model (``str()`` gives a readable summary).

    Attributes:
        model: the class name of the model passed in.
        swaps: ``(kind, qualified name)`` of every swap.
        left_alone: ``(qualified name, reason)`` of every candidate that was not swapped.
        dtype: the weights' dtype set by optimize (or converted to since: ``precision_note``), or
            None when they were kept.
        precision_note: the conversion of the weights after optimize (``.float()``, ``.to(dtype)``),
            or "".
        autocast_dtype: the dtype the forward autocasts to, or None.
        channels_last: 4-D weights and inputs converted to channels_last.
        channels_last_note: why channels_last was turned off after optimize (the forward failed
            with channels-last tensors), or "".
        cuda_graph: forwards run through CUDA graphs.
        cuda_graph_note: why graphs are off, when they are.
        max_graphs: graphs held at most.
        graphs: graph-cache counters at the time :func:`report` was called (None without graphs).
        seconds: time optimize took.
        inference_tensors: the parameters and buffers made under ``torch.inference_mode`` (a
            model built or loaded there) that optimize replaced by normal copies of them.
        swapped_before: the modules an earlier ``optimize`` swapped in that the model passed in
            holds (in place, or a model it returned, or a copy of either): this one then converts
            and wraps the model, with or without new swaps.
    """

    model: str
    swaps: List[Tuple[str, str]] = field(default_factory=list)
    left_alone: List[Tuple[str, str]] = field(default_factory=list)
    dtype: Optional[torch.dtype] = None
    precision_note: str = ""
    autocast_dtype: Optional[torch.dtype] = None
    channels_last: bool = False
    channels_last_note: str = ""
    cuda_graph: bool = False
    cuda_graph_note: str = ""
    max_graphs: int = 0
    graphs: Optional[GraphCacheStats] = None
    seconds: float = 0.0
    inference_tensors: int = 0
    swapped_before: int = 0

    @property
    def counts(self) -> Dict[str, int]:
        """Swaps by kind."""
        return dict(Counter(kind for kind, _ in self.swaps))

    @property
    def untouched(self) -> bool:
        """Nothing recognisable: no swap, no candidate, nothing swapped before; the model was
        returned as it was."""
        return not self.swaps and not self.left_alone and not self.swapped_before

    def __str__(self) -> str:
        head = f"mirage.optimize({self.model})"
        if self.untouched:
            return (f"{head}: nothing recognised (no module or pattern mirage can swap); the model was returned "
                    "untouched: no mode, precision, layout or CUDA-graph change")
        lines = [f"{head}: {len(self.swaps)} swapped, {len(self.left_alone)} left alone, {self.seconds:.1f} s"]
        if self.swapped_before:
            lines.append(f"  swapped before: {self.swapped_before}, in place by an earlier mirage.optimize (they "
                         "stay; the settings below are this call's)")
        if self.swaps:
            lines.append("  swapped:")
            lines += [f"    {count:5d}  {kind} -> {_replacement(kind)}"
                      for kind, count in self.counts.items()]
        if self.left_alone:
            lines.append("  left alone:")
            lines += [f"    {name or '(model)'}: {reason}" for name, reason in self.left_alone]
        if self.dtype is not None:
            precision = f"{_dtype_name(self.dtype)} weights and buffers"
        else:
            precision = f"weights kept, forward under torch.autocast({_dtype_name(self.autocast_dtype)})"
        lines.append(f"  precision: {precision} (mirage norms keep float32 statistics)"
                     + (f"; {self.precision_note}" if self.precision_note else ""))
        if self.inference_tensors:
            lines.append(f"  {self.inference_tensors} parameters and buffers made under torch.inference_mode replaced "
                         "by normal copies (converted in place outside it, they would fail every call)")
        layout = "4-D weights and 4-D inputs" if self.channels_last else "off"
        lines.append(f"  channels_last: {layout}" + (f" ({self.channels_last_note})" if self.channels_last_note else ""))
        if self.cuda_graph:
            lines.append(f"  CUDA graphs: on, at most {self.max_graphs}"
                         + (f"; {self.graphs}" if self.graphs is not None else ""))
        else:
            lines.append(f"  CUDA graphs: off ({self.cuda_graph_note})")
        return "\n".join(lines)


_REPLACEMENTS = {
    **{swap.kind: swap.replacement for swap in BLOCK_SWAPS + NORM_SWAPS},
    # The kinds mirage.patterns reports.
    "group_norm_silu": "mirage.nn.GroupNorm(activation='silu')",
    "attention": "one QKV nn.Linear + scaled_dot_product_attention",
}


def _replacement(kind: str) -> str:
    if kind.startswith("conv_bn"):  # conv_bn, conv_bn_silu, conv_bn_gelu, ...
        return "mirage.nn.Conv2dAct (BatchNorm folded into the conv)"
    return _REPLACEMENTS.get(kind, "fused")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# What optimize returned → its report. Weak, so a report never keeps a model alive.
_REPORTS: "weakref.WeakKeyDictionary[nn.Module, OptimizeReport]" = weakref.WeakKeyDictionary()


def report(model: nn.Module) -> OptimizeReport:
    """The report of :func:`optimize` for ``model``.

    Args:
        model: a model returned by :func:`optimize`.

    Returns:
        An :class:`OptimizeReport`, with the graph cache's counters as of now.

    Raises:
        ValueError: ``model`` did not come from :func:`optimize`.
    """
    found = _REPORTS.get(model) if isinstance(model, nn.Module) else None
    if found is None:
        raise ValueError(f"mirage.report: this {type(model).__name__} was not returned by mirage.optimize")
    if not isinstance(model, OptimizedModule):
        return found
    now = _weights_dtype(model.module)
    if found.dtype is not None and now is not None and now != found.dtype:
        found = replace(found, dtype=now, precision_note=f"converted from {_dtype_name(found.dtype)} after optimize")
    elif found.dtype is None and now in (torch.float16, torch.bfloat16):
        found = replace(found, precision_note=f"the weights were converted to {_dtype_name(now)} after optimize")
    if model.graphs is None:
        return found
    if model._graphs_paused:
        found = replace(found, cuda_graph=False, cuda_graph_note="paused: the model is not on one CUDA device "
                                                                 "(.cpu()); captured again once it is")
    return replace(found, graphs=model.graphs.stats())


# ----------------------------------------------------------------------------------------------
# The wrapper


# The message of a .view that the tensor's strides do not allow (torch's, since at least 1.x).
_VIEW_ERROR = "view size is not compatible with input tensor's size and stride"


def _channels_last_4d(tensor: Tensor) -> Tensor:
    return tensor.contiguous(memory_format=torch.channels_last) if tensor.dim() == 4 else tensor


class OptimizedModule(nn.Module):
    """What :func:`optimize` returns: the swapped model, run with its input layout, autocast and
    CUDA-graph settings. Same call signature and outputs as the model.

    Attributes it does not have itself are read from the inner model, so code that reads
    ``unet.config``, ``unet.dtype`` or calls ``vae.decode`` keeps working (such methods run the
    swapped modules eagerly: only ``forward`` goes through the graphs), and written there where
    the inner model has them (``vae.use_tiling = True`` reaches the model). Its state dict has the
    inner model's keys under ``module.``.

    Attributes:
        module: the swapped model.
        graphs: the :class:`mirage.graphs.GraphCache` running ``forward``, or None.
    """

    def __init__(self, module: nn.Module, *, autocast_dtype: Optional[torch.dtype] = None,
                 channels_last: bool = False, max_graphs: int = 0, verbose: bool = True) -> None:
        super().__init__()
        self.module = module
        self.autocast_dtype = autocast_dtype
        self.channels_last = channels_last
        self.verbose = verbose
        self._layout_proven = False  # whether a call has gone through with channels-last tensors
        self.graphs: Optional[GraphCache] = _graph_cache(self, max_graphs, verbose) if max_graphs else None
        self._graphs_paused = False  # while the model is moved off one CUDA device (cpu()): eager calls
        # Modules holding weights derived from others (mirage.nn.Upsample2D's folded kernels):
        # a graph replay skips their forward, so they check for changed weights here.
        self._derived = [m for m in module.modules() if hasattr(m, "refresh_derived_weights")]
        # Modules whose forward branches on Python settings a user may change after a graph was
        # captured (mirage.nn.UpBlock2D's FreeU factors, set by diffusers' enable_freeu): their
        # graph_key() joins each call's graph signature, so a change captures a new graph.
        self._keyed = _keyed_modules(module)
        self.register_load_state_dict_post_hook(_release_graphs_of_replaced_weights)
        self._weights_at = _addresses(module)  # where the graphs read the weights (see _apply)

    def refresh_derived_weights(self, force: bool = False) -> None:
        """Recomputes the weights swapped modules derive from the model's (``mirage.nn.Upsample2D``'s
        folded kernels) where those changed, or all of them with ``force``: after changes PyTorch's
        version counter does not see (writes through ``.data``). In place, so graphs stay valid.
        ``forward`` runs the unforced check before every call."""
        for derived in self._derived:
            derived.refresh_derived_weights(force)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._forward(args, kwargs)
        except RuntimeError as error:
            hint = self._input_dtype_hint(args, kwargs, error)
            if hint is not None and error.args and isinstance(error.args[0], str):
                # The hint joins the message of the error itself, which keeps its type (CaptureError).
                error.args = (f"{error.args[0]}\n{hint}", *error.args[1:])
            raise

    def _input_dtype_hint(self, args: Sequence[Any], kwargs: Dict[str, Any], error: RuntimeError) -> Optional[str]:
        """For a dtype mismatch that inputs in another floating dtype than the weights explain
        (float32 inputs to a model optimize made float16, the likeliest first mistake), what to do;
        None otherwise. PyTorch's own message names neither mirage nor the input."""
        if self.autocast_dtype is not None or not re.search(r"dtype|scalar type|type \(", str(error)):
            return None  # under autocast the inputs' dtype does not matter
        weights = _weights_dtype(self.module)
        leaves, names, _ = _flatten(args, kwargs)
        other = [(name, leaf) for leaf, name in zip(leaves, names)
                 if isinstance(leaf, Tensor) and leaf.is_floating_point() and leaf.dtype != weights]
        # Scalars and vectors (a diffusers timestep) are mostly cast by the model itself: named
        # only when no larger input is in another dtype.
        other = [(name, leaf) for name, leaf in other if leaf.dim() >= 2] or other
        if not other:
            return None
        listed = ", ".join(f"{name} is {_dtype_name(leaf.dtype)}" for name, leaf in other)
        result = _REPORTS.get(self)
        whose = " (optimize's dtype)" if result is not None and result.dtype == weights else ""
        instead = (", or optimize with dtype=None to keep float32 weights under autocast"
                   if weights in (torch.float16, torch.bfloat16) else "")
        return (f"mirage.optimize: the model's weights are {_dtype_name(weights)}{whose} and input {listed}; mirage "
                f"does not cast inputs: pass them in {_dtype_name(weights)} ({other[0][0]}.to({weights})){instead}")

    def _forward(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        if not (torch.compiler.is_compiling() or torch.jit.is_tracing()):  # else the modules fold in the graph
            self.refresh_derived_weights()
        if not self.channels_last:
            return self._call(args, kwargs)
        converted = pytree.tree_map_only(Tensor, _channels_last_4d, (args, kwargs))
        # is_compiling() first: read under torch.compile, the flag would become a guard, and the
        # first eager call after compiling (which sets it) would force a recompile.
        if torch.compiler.is_compiling() or self._layout_proven:
            return self._call(*converted)
        # The first call: what the forward writes to stderr is held back until it has gone
        # through, since a model traced by mirage.patterns is a torch.fx GraphModule, which prints
        # the traceback of a failing call before it raises, and the failure below is handled.
        held = io.StringIO()
        try:
            with contextlib.redirect_stderr(held):
                out = self._call(*converted)
        except BaseException as error:
            # A .view of an activation (x.view(N, -1) before a classifier, say) needs contiguous
            # memory, which channels-last tensors do not have; the model runs as it was written.
            if not (isinstance(error, RuntimeError) and _VIEW_ERROR in str(error)):
                sys.stderr.write(held.getvalue())
                raise
            return self._without_channels_last(args, kwargs, error)
        sys.stderr.write(held.getvalue())
        self._layout_proven = True
        return out

    def _call(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        # Under torch.jit.trace a replay would be recorded as its static outputs, constants of the
        # trace (a traced module returning the example's result for any input): the model's own
        # ops, mirage's among them, are what a trace can record.
        if self.graphs is not None and not self._graphs_paused and not torch.jit.is_tracing():
            if self._keyed:
                kwargs = {**kwargs, _SETTINGS_KEY: tuple(m.graph_key() for m in self._keyed)}
            try:
                return self.graphs(*args, **kwargs)
            except (ValueError, RuntimeError) as error:
                # mirage.graphs' own refusals (a CPU input, an argument it cannot key) name
                # mirage.graphs, which the caller of an optimized model never called.
                if error.args and isinstance(error.args[0], str) and error.args[0].startswith("mirage.graphs"):
                    error.args = (f"{error.args[0]}\n(mirage.optimize runs the model's forward in CUDA graphs; "
                                  "optimize(model, cuda_graph=False) runs it without them)", *error.args[1:])
                raise
        return self._run(*args, **kwargs)

    def _without_channels_last(self, args: Sequence[Any], kwargs: Dict[str, Any], error: RuntimeError) -> Any:
        """The call again as the model was written (4-D weights in contiguous memory, inputs as
        they come, graphs captured again). If it goes through, channels_last stays off and the
        report and a progress line say why; if not, the layout was not the fault: channels_last
        comes back and the call's error is raised."""
        self._set_channels_last(False)
        try:
            out = self._call(args, kwargs)
        except BaseException:
            self._set_channels_last(True)
            raise
        note = ("turned off at the first call: the model's forward failed with channels-last tensors "
                f"({str(error).splitlines()[0]}); pass channels_last=False to skip the attempt, or use "
                ".reshape or .flatten for that view")
        result = _REPORTS.get(self)
        if result is not None:
            result.channels_last, result.channels_last_note = False, note
        if self.verbose:
            progress(f"optimize: channels_last {note}")
        return out

    # Not under the caller's torch.inference_mode: the weights converted there would be inference
    # tensors, which every later call with grad mode on refuses to save for backward.
    @torch.inference_mode(False)
    def _set_channels_last(self, on: bool) -> None:
        _conv_weights_to(self.module, torch.channels_last if on else torch.contiguous_format)
        self.refresh_derived_weights(force=True)
        self.channels_last = on
        self._weights_at = _addresses(self.module)
        if self.graphs is not None:
            self.graphs.clear()

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop(_SETTINGS_KEY, None)  # a part of the graphs' signature only (_call)
        if self.autocast_dtype is None:
            return self.module(*args, **kwargs)
        device_type = self._device_type(args, kwargs)
        # The autocast cast cache would hold copies made during a capture; graphs forbid it.
        with torch.autocast(device_type, dtype=self.autocast_dtype, cache_enabled=False):
            return self.module(*args, **kwargs)

    def _device_type(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
        # The weights' device first: an input may sit on the CPU (a diffusers timestep, which the
        # model moves itself), and autocast on the CPU would leave the CUDA ops in float32.
        first = next(self.module.parameters(), None)
        if first is None:
            first = next((leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)), None)
        return first.device.type if first is not None else "cpu"

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "OptimizedModule":
        # A graph reads the parameters at their captured addresses. to(), half(), cuda() that
        # replace those tensors release the graphs, captured again at the next call; a to() that
        # changes nothing keeps them (accelerate's CPU offload calls one before every forward).
        # Off one CUDA device (cpu()), the model runs eagerly until it is moved back.
        super()._apply(fn, *args, **kwargs)
        self._release_graphs_if_weights_moved()
        return self

    def _release_graphs_if_weights_moved(self) -> None:
        """Releases the graphs if the parameters or buffers are no longer where they were captured
        reading them (a conversion, or load_state_dict(assign=True)); pauses them off one CUDA device."""
        now = _addresses(self.module)
        if now == self._weights_at:
            return
        self._weights_at = now
        if self.graphs is not None:
            self.graphs.clear()
            self._graphs_paused = not _on_one_cuda_device(self.module)

    # Pickling and copy.deepcopy: the swapped model, the settings and the report travel; the graphs
    # do not (a CUDA graph cannot be copied): the copy captures its own at its first calls.
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        graphs = state.pop("graphs")
        state["_graph_settings"] = (graphs.max_entries, graphs.verbose) if graphs is not None else None
        state["_report"] = _REPORTS.get(self)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        settings, result = state.pop("_graph_settings"), state.pop("_report")
        # A model pickled before it kept verbose: its graphs' setting, or the default.
        state.setdefault("verbose", settings[1] if settings else True)
        super().__setstate__(state)
        self._keyed = _keyed_modules(self.module)  # derived: also for models pickled before it existed
        self._weights_at = _addresses(self.module)
        self.graphs = _graph_cache(self, *settings) if settings else None
        # torch.load's map_location may have moved the tensors.
        self._graphs_paused = not _on_one_cuda_device(self.module)
        if result is not None:
            _REPORTS[self] = result

    def train(self, mode: bool = True) -> "OptimizedModule":
        """``eval()`` only: the swapped model is for inference (batch norms folded with their running
        statistics, attention dropout dropped, graphs under ``torch.no_grad``)."""
        if mode:
            raise RuntimeError("mirage.optimize: the optimized model is for inference only (batch norms are folded "
                               "and attention dropout is dropped); train the original model and optimize it again")
        return super().train(False)

    # Set in __init__ (and __setstate__): the wrapper's own, even where the inner model has an
    # attribute of that name.
    _OWN_ATTRIBUTES = frozenset({"module", "autocast_dtype", "channels_last", "verbose", "_layout_proven", "graphs",
                                 "_graphs_paused", "_derived", "_keyed", "_weights_at"})

    def __setattr__(self, name: str, value: Any) -> None:
        # A setting of the inner model (vae.use_tiling, vae.tile_sample_min_size) is written where
        # its methods read it, as reading it through the wrapper (__getattr__) reads it there.
        # Only public attributes the model holds itself, or properties it can set: not
        # nn.Module's internals (a pickle's hook dicts) nor what diffusers reads from its config.
        inner = self.__dict__.get("_modules", {}).get("module")
        if (inner is not None and not name.startswith("_") and name not in self._OWN_ATTRIBUTES
                and name not in self.__dict__ and not hasattr(type(self), name) and _settable(inner, name)):
            setattr(inner, name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            # Not Python's protocols (__deepcopy__, __getstate__, ...): the inner model's would act
            # on it alone, so that copy.deepcopy would return the bare inner model.
            if inner is None or name.startswith("__") and name.endswith("__"):
                raise
            return getattr(inner, name)


def _settable(model: nn.Module, name: str) -> bool:
    """Whether ``model`` holds ``name`` itself (an attribute, parameter, buffer or child) or its
    class has a property of that name with a setter."""
    held = vars(model)
    if name in held or any(name in held[key] for key in ("_parameters", "_buffers", "_modules")):
        return True
    attribute = getattr(type(model), name, None)
    return isinstance(attribute, property) and attribute.fset is not None


# ----------------------------------------------------------------------------------------------
# optimize


def _weights_dtype(model: nn.Module) -> Optional[torch.dtype]:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _tensors(model: nn.Module) -> List[Tensor]:
    return list(model.parameters()) + list(model.buffers())


def _devices(model: nn.Module) -> set:
    return {t.device for t in _tensors(model)}


def _on_one_cuda_device(model: nn.Module) -> bool:
    devices = _devices(model)
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


def _keyed_modules(model: nn.Module) -> List[nn.Module]:
    """The modules whose graph_key() joins each call's graph signature (OptimizedModule._call)."""
    return [m for m in model.modules() if hasattr(m, "graph_key")]


# The keyword under which OptimizedModule._call passes its modules' graph_key() values to the graphs.
_SETTINGS_KEY = "_mirage_module_settings"


def _graph_cache(optimized: "OptimizedModule", max_graphs: int, verbose: bool) -> GraphCache:
    """The graphs of ``optimized``'s forward. Its ``_run`` reached through a weak reference: the
    bound method would make a cycle (module, cache, method, module) that keeps the model and its
    GPU memory after the last reference to it goes, until the garbage collector runs."""
    owner = weakref.ref(optimized)

    def forward(*args: Any, **kwargs: Any) -> Any:
        model = owner()
        if model is None:
            raise RuntimeError("mirage.optimize: this graph cache's model is gone (the cache was kept, the "
                               "optimized model it belongs to was not); call the model, not its graphs")
        return model._run(*args, **kwargs)

    forward.__qualname__ = f"{type(optimized).__name__}.forward"  # as capture errors name it
    return GraphCache(forward, max_graphs, verbose=verbose)


def _release_graphs_of_replaced_weights(optimized: "OptimizedModule", incompatible_keys: Any) -> None:
    """load_state_dict's post hook: with assign=True the parameters are replaced, not written in
    place, and graphs captured earlier would read the old ones. A module-level function, so that
    pickling the model pickles it by name."""
    optimized._release_graphs_if_weights_moved()


def _addresses(model: nn.Module) -> List[Tuple[torch.device, torch.dtype, int]]:
    # The dtype too: tensor subclasses that wrap others (torchao's) have no data pointer of their own.
    return [(t.device, t.dtype, t.data_ptr()) for t in _tensors(model)]


def _conv_weights_to(model: nn.Module, memory_format: torch.memory_format) -> None:
    # 4-D parameters and buffers are convolution kernels; channels_last lets cuDNN run NHWC end
    # to end (nn.Module.to(memory_format=) would also reach 5-D tensors and fail on them).
    for tensor in _tensors(model):
        if tensor.dim() == 4:
            tensor.data = tensor.data.contiguous(memory_format=memory_format)


def _replace_inference_tensors(models: Sequence[nn.Module]) -> int:
    """Replaces every parameter and buffer of ``models`` made under torch.inference_mode (a model
    built or loaded there) by a normal copy of the same class and attributes, a tensor shared
    between modules by one copy. Converted in place outside inference mode (``.half()``,
    channels_last), such a tensor keeps its missing version counter and fails every later call,
    as in plain PyTorch. Returns how many were replaced. An original no longer registered is freed
    as the walk goes (so the lookup below only ever meets live inference tensors' ids)."""
    copies: Dict[int, Tensor] = {}
    for module in (m for model in models for m in model.modules()):
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is None or not tensor.is_inference():
                    continue
                if id(tensor) not in copies:
                    normal = tensor.detach().clone()
                    if issubclass(type(tensor), nn.Parameter):  # its subclass too (sharding, quantization)
                        normal = torch.Tensor._make_subclass(type(tensor), normal, tensor.requires_grad)
                    elif isinstance(tensor, nn.Parameter):  # a tensor subclass made a Parameter
                        normal = nn.Parameter(normal, requires_grad=tensor.requires_grad)
                    # Attributes set on the tensor, but not over the clone's own (a wrapper
                    # subclass keeps its data there: the originals would come back).
                    for name, value in vars(tensor).items():
                        vars(normal).setdefault(name, value)
                    copies[id(tensor)] = normal
                store[key] = copies[id(tensor)]
    return len(copies)


# Called under torch.inference_mode, the converted and fused weights would be inference tensors,
# which fail later in any call made outside it; optimize's own work is never inference-mode.
@torch.inference_mode(False)
def optimize(
    model: nn.Module,
    *,
    dtype: Optional[torch.dtype] = torch.float16,
    channels_last: bool = True,
    cuda_graph: bool = True,
    strict: bool = False,
    max_graphs: int = 8,
    verbose: bool = True,
) -> nn.Module:
    """Makes ``model`` faster for inference without editing its code.

    The model is put in ``eval()`` mode and changed in place: module instances are swapped for
    fused mirage modules that share their parameters (diffusers ``ResnetBlock2D``,
    ``BasicTransformerBlock``, ``Attention`` and ``GEGLU``; plain-PyTorch
    conv+BatchNorm(+activation), GroupNorm→SiLU and q/k/v attention patterns; remaining
    ``nn.GroupNorm`` and ``nn.LayerNorm``). Each swap computes what it replaces; anything that
    cannot be reproduced is left alone and reported.

    Args:
        model: the model, already on its device.
        dtype: ``torch.float16`` or ``torch.bfloat16`` converts parameters and buffers (mirage
            norms keep float32 statistics); ``torch.float32`` converts to float32; None keeps
            the weights and runs the forward under ``torch.autocast(dtype=torch.float16)``.
            Inputs must then be in the model's dtype, as after ``model.half()``.
        channels_last: store 4-D weights channels_last and make 4-D inputs channels_last.
        cuda_graph: run the forward through CUDA graphs, one per input signature
            (:class:`mirage.graphs.GraphCache`); only for a model on a CUDA device.
        strict: raise if any candidate had to be left alone.
        max_graphs: graphs held at most (least recently used evicted beyond).
        verbose: print progress lines on stderr (start, end, each graph capture, channels_last
            turned off at the first call).

    Returns:
        An :class:`OptimizedModule` wrapping the swapped model, or ``model`` itself, untouched
        (training mode included), when nothing in it is recognised. :func:`report` tells what was done.
        An :class:`OptimizedModule` passed in comes back as it is, whatever the options (its swaps
        are made; to change dtype, layout or graphs, optimize the model it wraps again, ``.module``:
        it keeps its swaps and gets the new settings).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: bad arguments, or ``strict=True`` and candidates were left alone (the swaps
            already made stay: each computes what it replaced).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"mirage.optimize: model must be an nn.Module, got {type(model).__name__}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"mirage.optimize: dtype must be None or one of {DTYPES}, got {dtype}")
    max_graphs = count(max_graphs, "mirage.optimize: max_graphs")
    for option, value in (("channels_last", channels_last), ("cuda_graph", cuda_graph), ("strict", strict),
                          ("verbose", verbose)):
        flag(value, f"mirage.optimize: {option}")
    if any(isinstance(t, nn.parameter.UninitializedTensorMixin) for t in _tensors(model)):
        raise ValueError("mirage.optimize: the model has uninitialized parameters or buffers (lazy modules such as "
                         "nn.LazyLinear): run one forward first, which gives them their shapes")
    if isinstance(model, OptimizedModule):
        # Its swaps are made: searching again finds nothing, and would replace its report.
        if verbose:
            progress("optimize: the model is already optimized (an OptimizedModule); returned as it is")
        return model
    start = time.perf_counter()
    name = type(model).__name__
    if verbose:
        progress(f"optimize {name}: swapping modules")

    # An earlier optimize swapped modules of this model in place (diffusers' models, whose forward
    # is not traced whole), or this is a model it returned (.module), or a copy of one: nothing is
    # left to swap, yet it is no unknown model; new precision, layout and graphs are set around them.
    result = OptimizeReport(model=name, swapped_before=swaps_made(model))
    original = model
    # The swaps read eval-mode state (BatchNorm folds its running statistics), so the search runs
    # in eval mode; a model with nothing to swap gets its own modes back.
    training = {module: module.training for module in model.modules()}
    model.eval()
    # Modules left alone whole (an Attention's processor tests the exact types of its norms):
    # no later stage swaps or fuses inside them either. Held here, so their ids stay theirs.
    sealed: Dict[int, nn.Module] = {}
    model = _apply_swaps(model, BLOCK_SWAPS, result, sealed)
    _fuse_output_norm(model, result)
    model = _fuse_patterns(model, result, sealed)
    model = _apply_swaps(model, NORM_SWAPS, result, sealed)
    model.eval()  # modules built by the swaps start in training mode

    if strict and result.left_alone:
        listing = "\n".join(f"  {where or '(model)'}: {reason}" for where, reason in result.left_alone)
        raise ValueError(
            f"mirage.optimize(strict=True): {len(result.left_alone)} candidate(s) of {name} had to be left "
            f"alone:\n{listing}\nThe model passed in is in eval mode, and swaps made in place stay (each "
            "computes what it replaced)."
        )
    if result.untouched:
        for module, mode in training.items():
            module.training = mode
        result.cuda_graph_note = "nothing recognised"
        result.seconds = time.perf_counter() - start
        _REPORTS[model] = result
        if verbose:
            progress(f"optimize {name}: nothing recognised; returned untouched")
        return model

    # The model passed in is converted too where the pattern pass made a new root (a traced
    # forward): its own modules, which the new root no longer calls, would otherwise keep the old
    # dtype beside the converted ones they share with it.
    converted = (model,) if model is original else (model, original)
    result.inference_tensors = _replace_inference_tensors(converted)
    if dtype is not None:
        # half()/bfloat16()/float() convert floating parameters and buffers like to(dtype), without
        # diffusers' to() override warning about float32 modules that UNets and VAEs do not have.
        for target in converted:
            {torch.float16: target.half, torch.bfloat16: target.bfloat16, torch.float32: target.float}[dtype]()
        result.dtype = dtype
    else:
        result.autocast_dtype = torch.float16
    if channels_last:
        for target in converted:
            _conv_weights_to(target, torch.channels_last)
        result.channels_last = True

    devices = _devices(model)
    if not cuda_graph:
        result.cuda_graph_note = "cuda_graph=False"
    elif not devices:
        result.cuda_graph_note = ("skipped: the model has no parameters or buffers, so nothing places it on a "
                                  "CUDA device; capture its calls with mirage.graphs.capture")
    elif len(devices) != 1:
        result.cuda_graph_note = (f"skipped: the model's tensors are on {sorted(map(str, devices))}; "
                                  "graphs need the whole model on one CUDA device")
    elif next(iter(devices)).type != "cuda":
        result.cuda_graph_note = (f"skipped: the model is on {next(iter(devices))}; CUDA graphs need a CUDA "
                                  "model (move it with .cuda() before mirage.optimize)")
    else:
        result.cuda_graph = True
        result.max_graphs = max_graphs

    wrapper = OptimizedModule(model, autocast_dtype=result.autocast_dtype, channels_last=channels_last,
                              max_graphs=max_graphs if result.cuda_graph else 0, verbose=verbose).eval()
    result.seconds = time.perf_counter() - start
    _REPORTS[wrapper] = result
    if verbose:
        progress(f"optimize {name}: {len(result.swaps)} swapped, {len(result.left_alone)} left alone "
                 f"in {result.seconds:.1f} s")
    return wrapper
