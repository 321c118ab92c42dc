"""Fusions for plain PyTorch nets, found in their torch.fx graphs.

``fuse(module)`` traces ``module`` with torch.fx and rewrites three patterns:

* ``Conv2d -> BatchNorm2d (eval) [-> SiLU | GELU | ReLU]``: the batch norm folded into the
  convolution's weights, the activation applied by ``mirage.nn.Conv2dAct``
  (kinds ``conv_bn``, ``conv_bn_silu``, ``conv_bn_gelu``, ...);
* ``GroupNorm -> SiLU``: ``mirage.nn.GroupNorm(activation="silu")`` sharing the parameters
  (kind ``group_norm_silu``);
* attention written by hand: three ``nn.Linear`` q/k/v projections of one input, split into heads,
  ``softmax(q @ k^T * scale) @ v`` (``matmul``, ``@``, ``bmm`` or ``einsum``; scale multiplied or
  divided, on the scores or on q) -> one fused QKV ``nn.Linear`` and
  ``F.scaled_dot_product_attention`` (kind ``attention``).

A rewrite applies only where the intermediates it removes have no other users; candidates left
alone are reported with the reason. Modules whose ``forward`` cannot be traced (data-dependent
control flow, optional arguments, ``*args``) are not rewritten themselves: their children are
traced instead, and where those children look like a pattern (a Conv2d beside a BatchNorm2d, a
GroupNorm beside a SiLU, three Linears of one input width) the module is reported as left alone
with the reason it could not be traced. Modules with forward hooks, or with a ``forward`` set on
the instance, are called as modules (what they add runs at every call) and are not fused; a module
whose forward changes its own state is not traced (its state is put back). Tracing fixes Python-level decisions (``if self.flag:``) at fuse time, as any
torch.fx capture does, and batch-norm folding fixes the running statistics: the result is for
inference.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Container, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .nn.attention import fuse_linears
from .nn.calls import forward_extras
from .nn.conv import Conv2dAct
from .nn.group_norm import GroupNorm as MirageGroupNorm


@dataclass
class PatternResult:
    """What :func:`fuse` did.

    Attributes:
        module: the rewritten module (a ``torch.fx.GraphModule``), or the module passed in
            (possibly with rewritten children) when nothing in its own graph was rewritten.
        swaps: ``(kind, qualified name)`` of every rewrite.
        skipped: ``(qualified name, reason)`` of every candidate left alone.
    """

    module: nn.Module
    swaps: List[Tuple[str, str]] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)


def fuse(module: nn.Module, prefix: str = "", sealed: Container[int] = ()) -> PatternResult:
    """Rewrite the fusable patterns of ``module`` (see the module docstring).

    Args:
        module: any ``nn.Module``. When its ``forward`` cannot be traced (or it has forward
            hooks or a forward set on the instance, which a graph of its class's forward would
            not run), its children are fused and replaced in place (``setattr`` on ``module``);
            so are those of such a submodule, which the trace keeps whole.
        prefix: ``module``'s qualified name in the enclosing model, prepended to reported names.
        sealed: ids of modules to keep whole and leave untouched inside (``mirage.optimize``'s
            left-alone ``Attention``s, whose code tests the exact types of their children).

    Returns:
        A :class:`PatternResult`. When ``module`` is traced, the result's module is a new
        ``GraphModule`` (sharing the untouched submodules), or ``module`` when no pattern of its
        own graph was rewritten.
    """
    result = PatternResult(module)
    tracer = _Tracer(sealed)
    if isinstance(module, _CONTAINERS) and id(module) not in sealed:
        _fuse_children(module, prefix, sealed, result)
        return result
    if tracer.plain_leaf(module, prefix):
        return result
    graph_module, untraced = _trace(tracer, module)
    if graph_module is None:
        hidden = _hidden_patterns(module)
        if hidden:
            result.skipped.append((prefix, f"{type(module).__name__}'s forward is not traceable by torch.fx "
                                           f"({untraced}), so {' and '.join(hidden)} among its children cannot be "
                                           "fused"))
        _fuse_children(module, prefix, sealed, result)
        return result

    # Modules kept whole for their hooks: fused inside, as an untraceable module is.
    kept_whole = set()
    for node in graph_module.graph.nodes:
        if node.op == "call_module" and node.target not in kept_whole:
            sub = graph_module.get_submodule(node.target)
            if not tracer.plain_leaf(sub, node.target):
                kept_whole.add(node.target)
                inner = fuse(sub, qualified_name(prefix, node.target), sealed)
                result.swaps += inner.swaps
                result.skipped += inner.skipped

    rewriter = _Rewriter(graph_module, prefix)
    rewriter.fuse_conv_bn()
    rewriter.fuse_group_norm_silu()
    rewriter.fuse_attention()
    result.swaps += rewriter.swaps
    result.skipped += rewriter.skipped
    if rewriter.swaps:
        graph_module.graph.lint()
        graph_module.delete_all_unused_submodules()
        graph_module.recompile()
        # Not .train(): that would also flip the submodules shared with `module`.
        graph_module.training = module.training
        result.module = graph_module
    return result


# torch.nn's containers, never called themselves, and its data-parallel wrappers: leaves to torch.fx
# (torch.nn's modules all are), but what they hold is the user's, fused in place as the children
# of a module that cannot be traced are.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.DataParallel, nn.parallel.DistributedDataParallel)


def _fuse_children(module: nn.Module, prefix: str, sealed: Container[int], result: PatternResult) -> None:
    """:func:`fuse` on each child of ``module``, put back in place (``setattr``) where rewritten."""
    for name, child in list(module.named_children()):
        child_result = fuse(child, qualified_name(prefix, name), sealed)
        result.swaps += child_result.swaps
        result.skipped += child_result.skipped
        if child_result.module is not child:
            setattr(module, name, child_result.module)


def altered_submodule(module: nn.Module) -> Optional[Tuple[str, str]]:
    """The name (relative to ``module``, "" for itself) of the first module in ``module``'s tree
    whose call runs more than its class's forward, and what (:func:`forward_extras`), or None. A
    fused replacement would not run it (and hooks such as weight_norm's compute the weights a
    fusion reads), so such modules are left alone."""
    return next(((name, extras) for name, sub in module.named_modules() if (extras := forward_extras(sub))), None)


class _Tracer(fx.Tracer):
    """torch.fx's tracer with mirage's modules and the sealed ones as leaves, next to torch.nn's,
    and every module with forward hooks: called as a module in the graph, it runs its hooks at
    every call (traced through, they would run once, at trace time)."""

    # Buffers as get_attr nodes, like parameters: torch.fx's default evaluates expressions of them
    # at trace time (`self.mean.view(1, 3, 1, 1)`) into constants, which drop the buffers' keys
    # from the state dict and ignore later changes to them.
    proxy_buffer_attributes = True

    def __init__(self, sealed: Container[int] = ()) -> None:
        super().__init__()
        self.sealed = sealed

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.plain_leaf(m, module_qualified_name) or forward_extras(m) is not None

    def plain_leaf(self, m: nn.Module, module_qualified_name: str) -> bool:
        """A leaf not fused inside, whatever its hooks: torch.nn's modules, mirage's, the sealed,
        and user subclasses of the layers mirage fuses, which stay modules so that the report can
        name them (traced through, they would vanish from the model unreported)."""
        return (id(m) in self.sealed or type(m).__module__.startswith("mirage.") or isinstance(m, _FUSED_LAYERS)
                or super().is_leaf_module(m, module_qualified_name))


# The torch.nn layers mirage's swaps and patterns replace: a subclass of one is kept as a module.
_FUSED_LAYERS = (nn.Conv2d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm, nn.Linear)


def _trace(tracer: _Tracer, module: nn.Module) -> Tuple[Optional[fx.GraphModule], str]:
    """(``module``'s GraphModule, "") or (None, why its forward cannot be captured faithfully)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None, "its signature cannot be read"
    for parameter in parameters:
        # An optional argument becomes a proxy that `is None` never matches, so tracing would
        # silently take the branch for "given"; *args/**kwargs have no faithful placeholders.
        if parameter.default is None:
            return None, f"the optional argument {parameter.name}=None"
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            return None, f"the variadic argument {parameter}"
    extras = forward_extras(module)
    if extras is not None:
        return None, f"it has {extras}, which a graph of its class's forward would not run"
    # The trace runs the real forward on proxies: what it stores on the modules (a cache, a
    # counter) would be proxies afterwards. Their state is put back, and a forward that changes
    # it is not traced (a graph would not repeat the change).
    saved = _module_state(module)
    try:
        graph = tracer.trace(module)
        # Built before the state is put back: the tracer stores the tensors the forward makes
        # outside the parameters and buffers (a constant mask) on the root as _tensor_constant<i>,
        # which the graph module copies and the root then loses.
        traced = fx.GraphModule(tracer.root, graph, type(module).__name__)
    except Exception as error:  # noqa: BLE001 - any failure means "not traceable": fall back to the children
        return None, f"tracing failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        changed = _restore_module_state(module, saved, ignored=set(getattr(tracer, "tensor_attrs", {}).values()))
    if changed:
        return None, f"its forward changes module state ({changed}), which a graph would not repeat"
    return traced, ""


# Where a forward's in-place changes are reported as the module's own (Linear.weight, not
# Linear._parameters.weight).
_STATE_DICTS = ("_parameters", "_buffers", "_modules")


def _module_state(module: nn.Module) -> List[Tuple[Any, Any, str]]:
    """Every module's attribute dict and the dicts, lists and sets reachable from it (nested in
    one another or in tuples; its parameter, buffer and child dicts among them), each with a
    shallow copy of its contents and where it is held: what a forward could change in place
    (``self.cache[key] = x``, ``self.seen.append(x)``, ``self.state["calls"] += 1``)."""
    saved: List[Tuple[Any, Any, str]] = []
    seen = set()
    for sub in module.modules():
        pending = [(vars(sub), type(sub).__name__)]
        while pending:
            value, where = pending.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, tuple):  # unchanging itself; what it holds may not be
                pending.extend((item, where) for item in value)
            elif isinstance(value, dict):
                saved.append((value, dict(value), where))
                attributes = value is vars(sub)
                for key, item in value.items():  # an attribute is named, but for the parameters' dict and the like
                    pending.append((item, f"{where}.{key}" if attributes and key not in _STATE_DICTS else where))
            elif isinstance(value, (list, set)):
                saved.append((value, list(value), where))
                pending.extend((item, where) for item in value)
    return saved


def _restore_module_state(module: nn.Module, saved, ignored: Container[str] = ()) -> str:
    """Puts back what :func:`_module_state` saved; returns where the first change was found ("" when
    none), as ``Class.attribute``, but for the root's attributes named in ``ignored`` (the
    tracer's own constants), which are removed all the same."""
    changed = ""
    root = vars(module)
    for container, contents, where in saved:
        if container is root:
            for key in ignored:
                if key not in contents:
                    root.pop(key, None)
        if isinstance(container, dict):
            keys = [key for key in set(container) | set(contents)
                    if container.get(key, _MISSING) is not contents.get(key, _MISSING)]
            if keys:
                changed = changed or f"{where}.{sorted(map(str, keys))[0]}"
                container.clear()
                container.update(contents)
        else:
            now = list(container)
            if isinstance(container, set):  # no order to compare
                now, contents = sorted(now, key=id), sorted(contents, key=id)
            if len(now) != len(contents) or any(a is not b for a, b in zip(now, contents)):
                changed = changed or where
                container.clear()
                (container.extend if isinstance(container, list) else container.update)(contents)
    return changed


_MISSING = object()


def _hidden_patterns(module: nn.Module) -> List[str]:
    """The patterns the direct children of an untraced ``module`` look like (the fusions need
    its graph to see them): what the report names."""
    children = list(module.children())
    has = lambda kind: any(type(child) is kind for child in children)  # noqa: E731 - exact types, as the rewrites
    found = []
    if has(nn.Conv2d) and has(nn.BatchNorm2d):
        found.append("a Conv2d and a BatchNorm2d")
    if has(nn.GroupNorm) and has(nn.SiLU):
        found.append("a GroupNorm and a SiLU")
    widths = [child.in_features for child in children if type(child) is nn.Linear]
    if any(widths.count(width) >= 3 for width in widths):
        found.append("three Linears of one input width (q, k, v?)")
    return found


# Marks each module a swap put in (an instance attribute, so deep copies and pickles keep it):
# optimizing the model again counts its earlier swaps from the marks (OptimizeReport.swapped_before).
_SWAPPED_IN = "_mirage_swapped_in"


def swapped_in(module: nn.Module) -> nn.Module:
    """``module``, marked as put in by a swap; see :func:`swaps_made`."""
    vars(module)[_SWAPPED_IN] = True
    return module


def swaps_made(model: nn.Module) -> int:
    """The modules under ``model`` that swaps put in (mirage modules a user built a model from are not)."""
    return sum(1 for module in model.modules() if vars(module).get(_SWAPPED_IN, False))


def qualified_name(prefix: str, name: str) -> str:
    """``prefix.name``, or whichever of the two is not empty (module names in reports)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


# --- node classification ---------------------------------------------------------------------

_ACTIVATION_MODULES = {nn.SiLU: "silu", nn.ReLU: "relu", nn.GELU: "gelu"}
_ACTIVATION_FUNCTIONS = {F.silu: "silu", F.relu: "relu", torch.relu: "relu", F.gelu: "gelu"}
_MATMULS = (operator.matmul, torch.matmul, torch.bmm)
_MULS = (operator.mul, torch.mul)
_DIVS = (operator.truediv, torch.div)
_SOFTMAXES = (F.softmax, torch.softmax)
_SCALAR_ARITHMETIC = (operator.pow, operator.mul, operator.truediv, operator.floordiv, operator.add, operator.sub,
                      math.sqrt)
# Ops that only rearrange a tensor (their first argument): the head split and merge.
_LAYOUT_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "unflatten", "flatten", "unsqueeze"}
_LAYOUT_FUNCTIONS = (torch.reshape, torch.transpose, torch.permute, torch.flatten, torch.unflatten, torch.unsqueeze)


def _is_function(node: fx.Node, functions) -> bool:
    return node.op == "call_function" and node.target in functions


def _is_method(node: fx.Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def _argument(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target}"


def _is_layout_op(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _LAYOUT_METHODS) or _is_function(node, _LAYOUT_FUNCTIONS)


def _shape_arguments(node: fx.Node) -> Sequence[Any]:
    """The sizes or dims list of a view/reshape/permute call, given inline or as one sequence."""
    rest = node.args[1:] if node.args else ()
    if not rest:
        rest = (node.kwargs.get("shape", node.kwargs.get("dims", ())),)
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return tuple(rest[0])
    return tuple(rest)


class _Rewriter:
    """Applies the rewrites to one traced graph and records what it did."""

    def __init__(self, graph_module: fx.GraphModule, prefix: str) -> None:
        self.gm = graph_module
        self.graph = graph_module.graph
        self.prefix = prefix
        self.swaps: List[Tuple[str, str]] = []
        self.skipped: List[Tuple[str, str]] = []

    # --- helpers ---

    def _module(self, node: fx.Node) -> Optional[nn.Module]:
        return self.gm.get_submodule(node.target) if node.op == "call_module" else None

    def _report_subclassed_conv_bn(self, conv_node: fx.Node) -> None:
        """A convolution feeding a batch norm where either is a user subclass (timm's Conv2dSame,
        say): left alone, since a subclass may compute differently, and reported."""
        conv = self._module(conv_node)
        if not isinstance(conv, nn.Conv2d):
            return
        bn = next((m for m in map(self._module, conv_node.users) if isinstance(m, nn.BatchNorm2d)), None)
        if bn is not None:
            self.skipped.append((qualified_name(self.prefix, conv_node.target),
                                 f"{type(conv).__name__} -> {type(bn).__name__}: a subclass of Conv2d or BatchNorm2d "
                                 "may compute differently, so the batch norm is not folded"))

    def _module_of_type(self, node: fx.Node, cls: type) -> Optional[nn.Module]:
        module = self._module(node)
        return module if type(module) is cls else None

    def _install(self, path: str, module: nn.Module, nodes: Sequence[fx.Node]) -> str:
        """Put ``module`` at ``path`` when only ``nodes`` use what is there (every call of a module
        called more than once, say), else at a free name beside it; returns where it went."""
        used_elsewhere = any(
            other not in nodes
            and (other.op == "call_module" and other.target == path
                 or other.op == "get_attr" and str(other.target).startswith(path + "."))
            for other in self.graph.nodes
        )
        if used_elsewhere:
            path = self._free_path(path + "_fused")
        self.gm.add_submodule(path, swapped_in(module))
        return path

    def _replace_calls(self, path: str, module: nn.Module, calls: Sequence[Sequence[fx.Node]]) -> None:
        """Installs ``module`` for the calls of the module at ``path`` (:meth:`_install`): each call
        is its node, then the nodes ``module`` absorbs, in order; the node calls ``module`` and
        takes the last absorbed node's users, and the absorbed nodes go."""
        target = self._install(path, module, [node for node, *_ in calls])
        for node, *absorbed in calls:
            node.target = target
            absorbed[-1].replace_all_uses_with(node)
            for gone in reversed(absorbed):
                self.graph.erase_node(gone)

    def _free_path(self, path: str) -> str:
        candidate, index = path, 1
        while self._path_exists(candidate):
            candidate, index = f"{path}_{index}", index + 1
        return candidate

    def _path_exists(self, path: str) -> bool:
        owner = self.gm
        for name in path.split("."):
            if not hasattr(owner, name):
                return False
            owner = getattr(owner, name)
        return True

    def _activation(self, node: fx.Node, source: fx.Node) -> Optional[str]:
        """The activation name when ``node`` applies SiLU/ReLU/GELU to ``source`` alone, else None."""
        module = self._module(node)
        if module is not None:
            name = _ACTIVATION_MODULES.get(type(module))
            if name == "gelu" and module.approximate == "tanh":
                name = "gelu_tanh"
            return name if node.args == (source,) and not node.kwargs else None
        if node.op == "call_function" and node.target in _ACTIVATION_FUNCTIONS and node.args[:1] == (source,):
            name = _ACTIVATION_FUNCTIONS[node.target]
            extra = set(node.kwargs) - {"inplace", "approximate"}
            if len(node.args) > 1 and name != "gelu" or extra:
                return None
            if name == "gelu":
                approximate = _argument(node, 1, "approximate", "none")
                if approximate not in ("none", "tanh"):
                    return None
                name = "gelu_tanh" if approximate == "tanh" else "gelu"
            return name
        return None

    def _hooked(self, *nodes: Optional[fx.Node]) -> Optional[str]:
        """Why the modules ``nodes`` call cannot be fused (one runs more than its class's forward:
        :func:`altered_submodule`), or None."""
        for node in nodes:
            module = self._module(node) if node is not None else None
            altered = altered_submodule(module) if module is not None else None
            if altered is not None:
                where = qualified_name(qualified_name(self.prefix, node.target), altered[0])
                return f"{where} has {altered[1]}, which the fused module would not run"
        return None

    def _name(self, node: fx.Node) -> str:
        """The qualified name of the module whose forward holds ``node``."""
        stack = node.meta.get("nn_module_stack") or {}
        inner = list(stack.values())[-1][0] if stack else ""
        return qualified_name(self.prefix, inner) or type(self.gm).__name__

    # --- Conv2d -> BatchNorm2d [-> activation] ---

    def fuse_conv_bn(self) -> None:
        # The call sites of each (conv, batch norm, activation), fused into one module: a block
        # called twice keeps one module under its name, as it has one state-dict entry.
        sites: Dict[Tuple[str, str, Optional[str]], List[Tuple[fx.Node, ...]]] = {}
        for conv_node in list(self.graph.nodes):
            conv = self._module_of_type(conv_node, nn.Conv2d)
            if conv is None:
                self._report_subclassed_conv_bn(conv_node)
                continue
            name = qualified_name(self.prefix, conv_node.target)
            bn_nodes = [user for user in conv_node.users if self._module_of_type(user, nn.BatchNorm2d) is not None]
            if not bn_nodes:
                self._report_subclassed_conv_bn(conv_node)
                continue
            if len(conv_node.users) > 1:
                self.skipped.append((name, "the convolution's output is also used without the batch norm"))
                continue
            bn_node = bn_nodes[0]
            if bn_node.args != (conv_node,) or bn_node.kwargs:
                continue
            act_node = _only_user(bn_node)
            activation = self._activation(act_node, bn_node) if act_node is not None else None
            hooked = self._hooked(conv_node, bn_node, act_node if activation else None)
            if hooked:
                self.skipped.append((name, hooked))
                continue
            key = (conv_node.target, bn_node.target, activation)
            sites.setdefault(key, []).append((conv_node, bn_node, act_node) if activation else (conv_node, bn_node))
        for (conv_path, bn_path, activation), calls in sites.items():
            name = qualified_name(self.prefix, conv_path)
            try:
                fused = Conv2dAct.from_conv_bn(self.gm.get_submodule(conv_path), self.gm.get_submodule(bn_path),
                                               activation or "none")
            except ValueError as error:
                self.skipped.append((name, str(error)))
                continue
            self._replace_calls(conv_path, fused, calls)
            self.swaps.append((f"conv_bn_{activation}" if activation else "conv_bn", name))

    # --- GroupNorm -> SiLU ---

    def fuse_group_norm_silu(self) -> None:
        sites: Dict[str, List[Tuple[fx.Node, fx.Node]]] = {}  # each norm's (norm, SiLU) calls: one module
        for norm_node in list(self.graph.nodes):
            norm = self._module_of_type(norm_node, nn.GroupNorm)
            if norm is None:
                continue
            silu_nodes = [user for user in norm_node.users if self._activation(user, norm_node) == "silu"]
            if not silu_nodes:
                continue
            name = qualified_name(self.prefix, norm_node.target)
            if len(norm_node.users) > 1:
                self.skipped.append((name, "the group norm's output is also used without the SiLU"))
                continue
            hooked = self._hooked(norm_node, silu_nodes[0])
            if hooked:
                self.skipped.append((name, hooked))
                continue
            sites.setdefault(norm_node.target, []).append((norm_node, silu_nodes[0]))
        for norm_path, calls in sites.items():
            fused = MirageGroupNorm.from_torch(self.gm.get_submodule(norm_path), activation="silu")
            self._replace_calls(norm_path, fused, calls)
            self.swaps.append(("group_norm_silu", qualified_name(self.prefix, norm_path)))

    # --- attention ---

    def fuse_attention(self) -> None:
        for node in list(self.graph.nodes):
            softmax = self._softmax(node)
            if softmax is None:
                continue
            if not _looks_like_scores(softmax[0]):
                # Not over a plain (scaled, masked, biased) product, yet reading one and read by
                # one, as attention's softmax is: a candidate this pass does not take.
                if _near_product(softmax[0], upstream=True) and _near_product(node, upstream=False):
                    self.skipped.append((self._name(node), "the scores go through other operations than a "
                                         "scale, a mask or an additive term before the softmax (a cast, a "
                                         "learned temperature, ...), which are not matched"))
                continue  # a softmax, but not over products: not an attention candidate
            name = self._name(node)
            match = _AttentionMatch(self, node, softmax)
            reason = match.reason or self._hooked(*match.linears, *match.removed)
            if reason is not None:
                self.skipped.append((name, reason))
                continue
            match.rewrite()
            self.swaps.append(("attention", name))

    def _softmax(self, node: fx.Node) -> Optional[Tuple[fx.Node, Any, Any]]:
        """``(input, dim, dtype)`` when ``node`` is a softmax, else None."""
        module = self._module(node)
        if type(module) is nn.Softmax:
            return node.args[0], module.dim, None
        if _is_function(node, _SOFTMAXES) or _is_method(node, "softmax"):
            dtype_index = 3 if node.target is F.softmax else 2
            return node.args[0], _argument(node, 1, "dim"), _argument(node, dtype_index, "dtype")
        return None


def _is_product(node: Any) -> bool:
    return isinstance(node, fx.Node) and (
        _is_function(node, _MATMULS + (torch.einsum,)) or _is_method(node, "matmul", "bmm"))


def _is_add(node: Any) -> bool:
    return isinstance(node, fx.Node) and (
        _is_function(node, (operator.add, operator.sub, torch.add)) or _is_method(node, "add", "sub"))


def _near_product(node: Any, upstream: bool, hops: int = 3) -> bool:
    """A matrix product within ``hops`` steps of ``node`` (``node`` included) through its inputs
    (``upstream``) or through its users."""
    if not isinstance(node, fx.Node):
        return False
    if _is_product(node):
        return True
    neighbours = node.all_input_nodes if upstream else list(node.users)
    return hops > 0 and any(_near_product(other, upstream, hops - 1) for other in neighbours)


def _looks_like_scores(node: Any) -> bool:
    """A (scaled) matrix product, possibly plus a mask or bias, or masked (``masked_fill``): what
    attention's softmax reads."""
    node = _strip_scales(node, single_use=False)[0]
    if _is_add(node):
        return any(_is_product(_strip_scales(arg, single_use=False)[0]) for arg in node.args)
    if _is_method(node, "masked_fill") or _is_function(node, (torch.masked_fill,)):
        return _is_product(_strip_scales(node.args[0], single_use=False)[0])
    return _is_product(node)


def _scale_factor(node: fx.Node) -> Optional[Tuple[fx.Node, Any, bool]]:
    """``(tensor, factor, divides)`` when ``node`` multiplies or divides a tensor by a number
    (a constant, or a number computed from shapes), else None."""
    is_mul = _is_function(node, _MULS) or _is_method(node, "mul")
    is_div = (_is_function(node, _DIVS) or _is_method(node, "div")) and not node.kwargs
    if not (is_mul or is_div) or len(node.args) != 2:
        return None
    tensor, factor = node.args
    if is_mul and (_is_number(tensor) or _is_scalar_node(tensor)):
        tensor, factor = factor, tensor
    if not isinstance(tensor, fx.Node) or _is_scalar_node(tensor):
        return None
    if _is_number(factor) or _is_scalar_node(factor):
        return tensor, factor, is_div
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_scalar_node(value: Any) -> bool:
    """A node computing a Python number from tensor shapes (``q.shape[-1] ** -0.5``)."""
    if not isinstance(value, fx.Node):
        return False
    if _is_method(value, "size"):
        return len(value.args) == 2
    if _is_function(value, (operator.getitem,)):
        holder = value.args[0]
        return isinstance(holder, fx.Node) and (
            _is_function(holder, (getattr,)) and holder.args[1] == "shape"
            or _is_method(holder, "size") and len(holder.args) == 1)
    if _is_function(value, _SCALAR_ARITHMETIC):
        nodes = [arg for arg in value.args if isinstance(arg, fx.Node)]
        return bool(nodes) and all(_is_scalar_node(arg) for arg in nodes) and all(
            isinstance(arg, fx.Node) or _is_number(arg) for arg in value.args)
    return False


def _strip_scales(node: Any, single_use: bool = True) -> Tuple[Any, List[Tuple[Any, bool]], List[fx.Node]]:
    """Walk back from ``node`` through multiplies/divides by numbers.

    Returns the tensor before them, their ``(factor, divides)`` list and the scale nodes. With
    ``single_use``, stops at a scaled tensor that something else also reads (it must stay).
    """
    factors, nodes = [], []
    while isinstance(node, fx.Node):
        scaled = _scale_factor(node)
        if scaled is None or (single_use and len(node.users) != 1):
            break
        nodes.append(node)
        node, factor, divides = scaled
        factors.append((factor, divides))
    return node, factors, nodes


def _rank(node: Any) -> Optional[int]:
    """The number of dimensions of ``node``'s tensor where the graph says it, else None."""
    if not isinstance(node, fx.Node):
        return None
    if _is_method(node, "view", "reshape") or _is_function(node, (torch.reshape,)):
        sizes = _shape_arguments(node)
        return len(sizes) if sizes else None
    if _is_method(node, "permute") or _is_function(node, (torch.permute,)):
        return len(_shape_arguments(node))
    if _is_method(node, "unsqueeze") or _is_function(node, (torch.unsqueeze,)):
        inner = _rank(node.args[0])
        return None if inner is None else inner + 1
    if _is_method(node, "unflatten") or _is_function(node, (torch.unflatten,)):
        inner, sizes = _rank(node.args[0]), _argument(node, 2, "sizes")
        return None if inner is None or not isinstance(sizes, (tuple, list)) else inner + len(sizes) - 1
    if _is_function(node, (torch.bmm,)) or _is_method(node, "bmm"):
        return 3
    if _is_function(node, (torch.einsum,)):
        equation = node.args[0]
        return len(equation.split("->")[1].strip()) if isinstance(equation, str) and "->" in equation else None
    if (_is_method(node, "transpose", "contiguous", "softmax", "mul", "div")
            or _is_function(node, (torch.transpose,) + _MULS + _DIVS + _SOFTMAXES)):
        for arg in node.args:
            if isinstance(arg, fx.Node) and not _is_scalar_node(arg):
                return _rank(arg)
        return None
    if _is_function(node, (operator.matmul, torch.matmul)) or _is_method(node, "matmul"):
        a, b = _rank(node.args[0]), _rank(node.args[1])
        return max(a, b) if a is not None and b is not None and min(a, b) >= 2 else None
    if node.op == "call_module" and node.graph.owning_module is not None:
        module = node.graph.owning_module.get_submodule(node.target)
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Dropout, nn.Identity)):
            return _rank(node.args[0])
    return None


def _is_last_dim(dim: Any, rank: Optional[int]) -> bool:
    return dim == -1 or (rank is not None and dim == rank - 1)


def _swaps_last_two(a: Any, b: Any, rank: Optional[int]) -> bool:
    """Whether ``transpose(a, b)`` exchanges the last two dimensions."""
    if not (isinstance(a, int) and isinstance(b, int)):
        return False
    if rank is not None:
        a, b = a % rank, b % rank
        return {a, b} == {rank - 2, rank - 1}
    return {a, b} == {-2, -1}


class _AttentionMatch:
    """``softmax(q @ k^T * scale) @ v`` around one softmax node, checked; ``reason`` says why not.

    After matching: ``q``, ``k`` and ``v`` are the head views the products read (``k`` before its
    transpose), ``*_perm`` the permutations an einsum layout needs around SDPA, ``scale`` SDPA's
    scale, ``linears`` the three projection nodes, ``output`` the node SDPA replaces and
    ``removed`` the nodes the rewrite erases.
    """

    def __init__(self, rewriter: _Rewriter, softmax_node: fx.Node, softmax: Tuple[fx.Node, Any, Any]) -> None:
        self.rewriter = rewriter
        self.graph = rewriter.graph
        self.softmax_node = softmax_node
        self.removed: List[fx.Node] = [softmax_node]
        self.factors: List[Tuple[Any, bool]] = []
        self.q_perm = self.k_perm = self.v_perm = self.out_perm = None
        # Set when k^T is one permute of a head view: the dims that give k itself.
        self.k_permute_dims: Optional[Tuple[int, ...]] = None
        self.reason = self._match(*softmax)

    # Each step returns None, or the reason the graph is not (fusable) attention.

    def _match(self, scores: fx.Node, dim: Any, dtype: Any) -> Optional[str]:
        if dtype is not None:
            return "softmax with a dtype argument is not matched"
        product, self.factors, scale_nodes = _strip_scales(scores, single_use=False)
        if not _is_product(product):
            return ("the scores are masked or get an additive term (a mask or bias) before the softmax, which is "
                    "not matched")
        if any(len(node.users) != 1 for node in scale_nodes + [product]):
            return "the attention scores are also used outside the softmax"
        self.removed += scale_nodes + [product]
        reason = self._match_scores(product)
        if reason:
            return reason
        if not _is_last_dim(dim, self.scores_rank):
            return f"softmax over dim {dim}, not over the keys (the last of {self.scores_rank or 'unknown'} dims)"
        return self._match_output() or self._match_projections() or self._match_scale()

    def _match_scores(self, product: fx.Node) -> Optional[str]:
        """``product`` is q @ k^T: sets ``q``, ``k`` (with permutations) and ``scores_rank``."""
        if _is_function(product, (torch.einsum,)):
            operands, parsed = _einsum_operands(product), _parse_einsum(product.args[0])
            perms = None
            if parsed is not None and len(operands) == 2:
                perms = _score_permutations(*parsed[0], parsed[1])
            if perms is None:
                return f"einsum {product.args[0]!r} does not compute q @ k^T"
            self.q_perm, self.k_perm = perms
            self.scores_rank = len(parsed[1])
            self.q, self.k = (self._strip_operand_scales(operand) for operand in operands)
            return None

        self.q = self._strip_operand_scales(product.args[0])
        self.scores_rank = _rank(product)
        transposed = self._strip_operand_scales(product.args[1])
        if not isinstance(transposed, fx.Node) or len(transposed.users) != 1:
            return "the transposed keys are also used elsewhere"
        if _is_method(transposed, "transpose") or _is_function(transposed, (torch.transpose,)):
            a, b = _argument(transposed, 1, "dim0"), _argument(transposed, 2, "dim1")
            if not _swaps_last_two(a, b, _rank(transposed) or self.scores_rank):
                return f"the keys are transposed over dims ({a}, {b}), not the last two"
            self.k = self._strip_operand_scales(transposed.args[0])
        elif _is_function(transposed, (getattr,)) and transposed.args[1] == "mT":
            self.k = self._strip_operand_scales(transposed.args[0])
        elif _is_method(transposed, "permute") or _is_function(transposed, (torch.permute,)):
            dims = tuple(_shape_arguments(transposed))
            if len(dims) < 2 or not all(isinstance(d, int) for d in dims):
                return "the keys are permuted by dims not known at trace time"
            self.k = transposed.args[0]
            self.k_permute_dims = dims[:-2] + (dims[-1], dims[-2])
        else:
            return f"the right operand of the score product is {_describe(transposed)}, not transposed keys"
        self.removed.append(transposed)
        return None

    def _strip_operand_scales(self, node: Any) -> Any:
        base, factors, nodes = _strip_scales(node)
        self.factors = self.factors + factors
        self.removed += nodes
        return base

    def _match_output(self) -> Optional[str]:
        """softmax -> [dropout(p=0)] -> P @ v: sets ``v``, ``output`` (and einsum permutations)."""
        probs, user = self.softmax_node, _only_user(self.softmax_node)
        dropout = self._dropout_probability(user, probs) if user is not None else None
        if dropout is not None:
            if dropout != 0:
                return f"dropout (p={dropout}) on the attention probabilities is not fused"
            self.removed.append(user)
            probs, user = user, _only_user(user)
        if user is None:
            return "the attention probabilities are also used elsewhere"
        if _is_function(user, (torch.einsum,)):
            operands, parsed = _einsum_operands(user), _parse_einsum(user.args[0])
            perms = None
            if parsed is not None and len(operands) == 2 and operands.count(probs) == 1:
                p_index = operands.index(probs)
                if self.scores_rank is None:  # the graph did not say it; the probabilities' subscripts do
                    self.scores_rank = len(parsed[0][p_index])
                perms = _output_permutations(parsed[0][p_index], parsed[0][1 - p_index], parsed[1], self.scores_rank)
            if perms is None:
                return f"einsum {user.args[0]!r} does not compute P @ v"
            self.v_perm, self.out_perm = perms
            self.v = operands[1 - p_index]
        elif _is_function(user, _MATMULS) or _is_method(user, "matmul", "bmm"):
            if user.args[0] is not probs or user.args[1] is probs or user.kwargs:
                return "the attention probabilities are not the left operand of the output product"
            self.v = user.args[1]
        else:
            return f"the attention probabilities feed {_describe(user)}, not a product with v"
        self.output = user
        self.removed.append(user)
        return None

    def _dropout_probability(self, node: fx.Node, source: fx.Node) -> Optional[float]:
        module = self.rewriter._module(node)
        if type(module) is nn.Dropout:
            # In eval mode (optimize's) it passes its input through; the result is for inference,
            # as F.dropout's traced `training=False` and the batch-norm folding make it.
            return module.p if module.training else 0.0
        if _is_function(node, (F.dropout,)) and node.args[:1] == (source,):
            return 0.0 if _argument(node, 2, "training", True) is False else _argument(node, 1, "p", 0.5)
        return None

    def _match_projections(self) -> Optional[str]:
        """q, k and v are the same head view of three nn.Linear projections of one input."""
        linears, chains = [], []
        for role, end in (("q", self.q), ("k", self.k), ("v", self.v)):
            chain, node = [], end
            while isinstance(node, fx.Node) and _is_layout_op(node):
                chain.append(node)
                node = node.args[0]
            if not isinstance(node, fx.Node) or self.rewriter._module_of_type(node, nn.Linear) is None:
                found = _describe(node) if isinstance(node, fx.Node) else repr(node)
                return f"{role} is not a head view of an nn.Linear projection (it comes from {found})"
            linears.append(node)
            chains.append(chain[::-1])
        if len(set(linears)) != 3:
            return "q, k and v are not three separate projections"
        if any(node.kwargs for node in linears) or not linears[0].args == linears[1].args == linears[2].args:
            return "q, k and v are projected from different inputs"
        q_chain, k_chain, v_chain = chains
        # Projections of one input to one width have one shape: sizes read from each are equal.
        widths = {self.rewriter._module(node).out_features for node in linears}
        alike = frozenset(linears) if len(widths) == 1 else frozenset()
        q_as_k = q_chain
        if self.k_permute_dims is not None:
            # k^T was one permute of a head view: q's last op must be the permute giving k itself.
            rank = len(self.k_permute_dims)
            wanted = tuple(d % rank for d in self.k_permute_dims)
            if not q_chain or _as_permutation(q_chain[-1], rank) != wanted:
                return "q and k are split into heads differently"
            q_as_k = q_chain[:-1]
        if not (_same_chain(q_as_k, k_chain, alike) and _same_chain(q_chain, v_chain, alike)):
            return "q, k and v are split into heads differently"
        self.linears = linears
        return None

    def _match_scale(self) -> Optional[str]:
        """Fold the factors into SDPA's ``scale`` (None: SDPA's default ``1/sqrt(head_dim)``)."""
        scale, default_scale = 1.0, False
        for factor, divides in self.factors:
            if isinstance(factor, fx.Node):
                if default_scale or not self._is_inverse_sqrt_head_dim(factor, divides):
                    return ("the scale is computed at run time in a form that is not matched (matched: a "
                            "constant, or q.shape[-1] ** -0.5 or / math.sqrt(q.shape[-1]))")
                default_scale = True
            else:
                scale = scale / factor if divides else scale * factor
        if default_scale and scale != 1.0:
            return "the scale combines a run-time head-dim factor with a constant"
        self.scale = None if default_scale else float(scale)
        return None

    def _is_inverse_sqrt_head_dim(self, factor: fx.Node, divides: bool) -> bool:
        """``factor`` is ``d ** -0.5`` (multiplied) or ``d ** 0.5`` or ``math.sqrt(d)`` (divided
        by), with d the last size of q or k as SDPA reads them."""
        power = _is_function(factor, (operator.pow,)) and factor.args[1] == (0.5 if divides else -0.5)
        if not (power or divides and _is_function(factor, (math.sqrt,))):
            return False
        size = factor.args[0]
        if _is_method(size, "size") and len(size.args) == 2:
            tensor, index = size.args
        elif _is_function(size, (operator.getitem,)) and _is_scalar_node(size):
            holder, index = size.args
            tensor = holder.args[0]
        else:
            return False
        head_views = []
        if self.q_perm is None:
            head_views.append(self.q)
        if self.k_perm is None and self.k_permute_dims is None:
            head_views.append(self.k)
        return any(tensor is view for view in head_views) and _is_last_dim(index, _rank(tensor))

    def rewrite(self) -> None:
        """One fused QKV projection (sliced back into q, k, v) and SDPA in place of the products."""
        rewriter, graph = self.rewriter, self.graph
        fused = fuse_linears([rewriter._module(node) for node in self.linears])
        path = rewriter._free_path(qualified_name(str(self.linears[0].target).rpartition(".")[0], "qkv"))
        rewriter.gm.add_submodule(path, swapped_in(fused))
        first = min(self.linears, key=_position)
        offset = 0
        with graph.inserting_before(first):
            qkv = graph.call_module(path, self.linears[0].args)
            slices = []
            for node in self.linears:
                width = rewriter._module(node).out_features
                slices.append(graph.call_function(torch.narrow, (qkv, -1, offset, width)))
                offset += width
        for node, part in zip(self.linears, slices):
            node.replace_all_uses_with(part)
            graph.erase_node(node)
            _views_to_reshapes(part)
        # Single-head attention reads the projections themselves: read the slices instead.
        sliced = dict(zip(self.linears, slices))
        self.q, self.k, self.v = (sliced.get(node, node) for node in (self.q, self.k, self.v))

        with graph.inserting_before(self.output):
            k = self.k
            if self.k_permute_dims is not None:
                k = graph.call_method("permute", (k, *self.k_permute_dims))
            q, k, v = (graph.call_method("permute", (node, *perm)) if perm else node
                       for node, perm in ((self.q, self.q_perm), (k, self.k_perm), (self.v, self.v_perm)))
            kwargs = {} if self.scale is None else {"scale": self.scale}
            out = graph.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
            if self.out_perm:
                out = graph.call_method("permute", (out, *self.out_perm))
        self.output.replace_all_uses_with(out)
        for node in sorted(set(self.removed), key=_position, reverse=True):
            graph.erase_node(node)
        for factor, _ in self.factors:
            if isinstance(factor, fx.Node):
                _erase_unused(graph, factor)


def _as_permutation(node: fx.Node, rank: int) -> Optional[Tuple[int, ...]]:
    """The dims of ``node`` as one permute of a rank-``rank`` tensor (a transpose is one too)."""
    if _is_method(node, "permute") or _is_function(node, (torch.permute,)):
        dims = tuple(_shape_arguments(node))
        return tuple(d % rank for d in dims) if all(isinstance(d, int) for d in dims) else None
    if _is_method(node, "transpose") or _is_function(node, (torch.transpose,)):
        a, b = _argument(node, 1, "dim0"), _argument(node, 2, "dim1")
        if not (isinstance(a, int) and isinstance(b, int)):
            return None
        dims = list(range(rank))
        dims[a % rank], dims[b % rank] = dims[b % rank], dims[a % rank]
        return tuple(dims)
    return None


def _position(node: fx.Node) -> int:
    for index, other in enumerate(node.graph.nodes):
        if other is node:
            return index
    raise ValueError(f"{node} is not in its graph")


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then its inputs when nothing uses them (the run-time scale's shape math)."""
    if node.users or node.op != "call_function":
        return
    inputs = [arg for arg in node.args if isinstance(arg, fx.Node)]
    graph.erase_node(node)
    for arg in inputs:
        if _is_scalar_node(arg) or _is_function(arg, (getattr,)) or _is_method(arg, "size"):
            _erase_unused(graph, arg)


def _views_to_reshapes(node: fx.Node) -> None:
    """Turn ``view`` into ``reshape`` on the layout ops downstream of a projection slice.

    A slice of the fused projection is not contiguous, so a ``view`` that merged its last
    dimension would fail where the unfused projection's did not; ``reshape`` gives the same
    values, and is the same view wherever one exists.
    """
    for user in list(node.users):
        if _is_layout_op(user) and user.args[0] is node:
            reinterprets = any(isinstance(arg, torch.dtype) for arg in user.args[1:])  # view(dtype)
            if _is_method(user, "view") and not reinterprets:
                user.target = "reshape"
            _views_to_reshapes(user)


def _same_chain(a: Sequence[fx.Node], b: Sequence[fx.Node], alike: frozenset = frozenset()) -> bool:
    """Two head-view chains apply the same ops with the same arguments (besides their input);
    sizes read from nodes in ``alike`` (tensors of one shape) count as equal."""
    return len(a) == len(b) and all(
        x.op == y.op and x.target == y.target and _same_value(x.args[1:], y.args[1:], alike)
        and _same_value(x.kwargs, y.kwargs, alike)
        for x, y in zip(a, b))


def _reads_shape(node: Any) -> bool:
    return _is_scalar_node(node) or _is_method(node, "size") or (
        _is_function(node, (getattr,)) and node.args[1] == "shape")


def _same_value(a: Any, b: Any, alike: frozenset = frozenset()) -> bool:
    """Equal arguments: equal constants, the same node (or two of ``alike``), or the same
    arithmetic on shapes (``C // heads`` written out once per projection, or a helper reading
    each projection's own shape)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        if a is b or a in alike and b in alike:
            return True
        return (_reads_shape(a) and _reads_shape(b) and a.op == b.op and a.target == b.target
                and _same_value(a.args, b.args, alike) and _same_value(a.kwargs, b.kwargs, alike))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y, alike) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[key], b[key], alike) for key in a)
    return type(a) is type(b) and a == b


def _einsum_operands(node: fx.Node) -> List[Any]:
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return operands


def _parse_einsum(equation: Any) -> Optional[Tuple[Tuple[str, str], str]]:
    """``((a, b), out)`` subscripts of a two-operand einsum with an explicit output, or None."""
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    operands = inputs.split(",")
    if len(operands) != 2 or any(len(set(s)) != len(s) for s in operands + [out]):
        return None
    return (operands[0], operands[1]), out


def _score_permutations(q: str, k: str, scores: str) -> Optional[Tuple[Optional[list], Optional[list]]]:
    """For ``einsum(q, k -> scores)`` = ``q' @ k'^T``: the permutations giving q' = (.., L, E)
    and k' = (.., S, E), None where identity; None when the einsum is not that product."""
    if len(scores) < 2:
        return None
    batch, i, j = scores[:-2], scores[-2], scores[-1]
    contracted = (set(q) & set(k)) - set(scores)
    if len(contracted) != 1:
        return None
    c = contracted.pop()
    if sorted(q) != sorted(batch + i + c) or sorted(k) != sorted(batch + j + c):
        return None
    return _permutation(q, batch + i + c), _permutation(k, batch + j + c)


def _output_permutations(p: str, v: str, out: str, scores_rank: Optional[int]):
    """For ``einsum(p, v -> out)`` = ``p @ v'`` with p laid out as the scores: the permutations
    giving v' = (.., S, Ev) and mapping SDPA's (.., L, Ev) output to ``out``; None if not that."""
    if len(p) != scores_rank or len(p) < 2:
        return None
    batch, i, j = p[:-2], p[-2], p[-1]
    extra = (set(v) & set(out)) - set(p)
    if len(extra) != 1 or j in out or i in v:
        return None
    e = extra.pop()
    if sorted(v) != sorted(batch + j + e) or sorted(out) != sorted(batch + i + e):
        return None
    return _permutation(v, batch + j + e), _permutation(batch + i + e, out)


def _permutation(source: str, target: str) -> Optional[list]:
    """Dims that permute a tensor labelled ``source`` into ``target`` order; None if identity."""
    perm = [source.index(label) for label in target]
    return None if perm == list(range(len(perm))) else perm
