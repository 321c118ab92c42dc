"""mirage.patterns.fuse: each rewrite applies where it should, nowhere else, and keeps the outputs."""

import copy
import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import mirage
from common import randn
from mirage.nn.conv import Conv2dAct
from mirage.patterns import fuse
from tolerances import REDUCTION_ERROR_FACTOR, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from plain_net import PlainNet, randomize_batch_norms  # noqa: E402


def prepared(module: nn.Module, dtype=torch.float64, device="cpu") -> nn.Module:
    """module in eval mode and dtype, with random batch-norm statistics and (for the small test
    modules; PlainNet keeps its initialization, whose scale its depth needs) random parameters."""
    module = module.to(device=device, dtype=dtype).eval()
    if not isinstance(module, PlainNet):
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.copy_(randn(*parameter.shape, dtype=dtype, device=device, mean=0.1, std=0.4))
    randomize_batch_norms(module)
    return module


def fused_and_checked(module: nn.Module, *inputs, dtype=torch.float64):
    """fuse(module) in dtype; asserts the result computes what module computes. Returns the
    result and the swap kinds counted.

    float64 outputs must match the float64 module's; in lower precision the fused module's error
    against the float64 module is bounded by the unfused module's own (softmax amplifies rounding
    differences in the logits beyond a fixed tolerance).
    """
    reference = prepared(module, torch.float64)
    module = copy.deepcopy(reference).to(dtype)
    with torch.no_grad():
        expected = reference(*[x.double() for x in inputs])
        result = fuse(module)
        got = result.module(*[x.to(dtype) for x in inputs])
        unfused = module(*[x.to(dtype) for x in inputs])
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float64:
        torch.testing.assert_close(got, expected, **tolerance(dtype))
    else:
        ours = (got.double() - expected).abs().max().item()
        theirs = (unfused.double() - expected).abs().max().item()
        # Plus the dtype's rtol of the output's scale: SDPA's fused CPU kernels round differently
        # from an unfused softmax (2.9e-5 on outputs of magnitude 3.7 on the GPU machine's CPU).
        slack = tolerance(dtype)["atol"] + tolerance(dtype)["rtol"] * expected.abs().max().item()
        assert ours <= REDUCTION_ERROR_FACTOR * theirs + slack, (ours, theirs)
    return result, Counter(kind for kind, _ in result.swaps)


# --- Conv2d -> BatchNorm2d -> activation ---------------------------------------------------------


class ConvBNAct(nn.Module):
    def __init__(self, act=None, **conv_kwargs):
        super().__init__()
        conv_kwargs = {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "padding": 1, **conv_kwargs}
        self.conv = nn.Conv2d(**conv_kwargs)
        self.bn = nn.BatchNorm2d(conv_kwargs["out_channels"])
        self.act = act

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.act(y) if self.act is not None else y


class FunctionalAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6), act

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("build, kind", [
    (lambda: nn.Sequential(nn.Conv2d(4, 6, 3, bias=False), nn.BatchNorm2d(6), nn.SiLU()), "conv_bn_silu"),
    (lambda: ConvBNAct(nn.SiLU(inplace=True), stride=2, groups=2, padding_mode="reflect"), "conv_bn_silu"),
    (lambda: ConvBNAct(nn.GELU(), dilation=2, bias=False), "conv_bn_gelu"),
    (lambda: ConvBNAct(nn.GELU(approximate="tanh")), "conv_bn_gelu_tanh"),
    (lambda: ConvBNAct(nn.ReLU()), "conv_bn_relu"),
    (lambda: ConvBNAct(None), "conv_bn"),
    (lambda: FunctionalAct(F.silu), "conv_bn_silu"),
    (lambda: FunctionalAct(lambda x: F.gelu(x, approximate="tanh")), "conv_bn_gelu_tanh"),
    (lambda: FunctionalAct(torch.relu), "conv_bn_relu"),
    (lambda: nn.Sequential(nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6, affine=False), nn.SiLU()), "conv_bn_silu"),
])
def test_conv_bn_act_is_folded(build, kind, dtype):
    result, kinds = fused_and_checked(build(), randn(2, 4, 9, 11), dtype=dtype)
    assert kinds == {kind: 1} and not result.skipped
    modules = list(result.module.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in modules)
    (fused,) = [m for m in modules if isinstance(m, Conv2dAct)]
    assert fused.activation == kind[len("conv_bn_"):] if kind != "conv_bn" else fused.activation == "none"


def test_folded_conv_replaces_the_conv_and_leaves_the_original_alone():
    model = prepared(nn.Sequential(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6), nn.SiLU()))
    weight = model[0].weight.clone()
    result = fuse(model, prefix="encoder.stem")
    assert result.swaps == [("conv_bn_silu", "encoder.stem.0")]
    assert isinstance(result.module, fx.GraphModule) and type(result.module.get_submodule("0")) is Conv2dAct
    assert type(model[0]) is nn.Conv2d and type(model[1]) is nn.BatchNorm2d
    assert torch.equal(model[0].weight, weight)


def test_from_conv_bn_keeps_channels_last_weights():
    conv = nn.Conv2d(4, 6, 3).to(memory_format=torch.channels_last)
    bn = prepared(nn.BatchNorm2d(6), torch.float32)
    fused = Conv2dAct.from_conv_bn(conv, bn, "silu")
    assert fused.weight.is_contiguous(memory_format=torch.channels_last)
    x = randn(2, 4, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), F.silu(bn(conv(x))), **tolerance(torch.float32))


class ConvUsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return F.silu(self.bn(y)) + y


class BatchNormUsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return F.silu(y) + y


def test_conv_with_a_second_user_is_left_alone():
    result, kinds = fused_and_checked(ConvUsedTwice(), randn(2, 4, 6, 6))
    assert not kinds and result.skipped == [("conv", "the convolution's output is also used without the batch norm")]


def test_batch_norm_with_a_second_user_folds_without_the_activation():
    result, kinds = fused_and_checked(BatchNormUsedTwice(), randn(2, 4, 6, 6))
    assert kinds == {"conv_bn": 1}


def test_training_mode_batch_norm_is_left_alone():
    model = prepared(nn.Sequential(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6), nn.SiLU()))
    model[1].train()
    result = fuse(model)
    assert result.module is model and not result.swaps
    assert result.skipped == [("0", "BatchNorm2d is in training mode (it normalizes with batch statistics); "
                                    "call .eval() first")]
    no_stats = prepared(nn.Sequential(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6, track_running_stats=False)))
    assert fuse(no_stats).skipped == [("0", "BatchNorm2d keeps no running statistics (track_running_stats=False)")]


# --- GroupNorm -> SiLU ----------------------------------------------------------------------------


class NormAct(nn.Module):
    def __init__(self, act, reuse=False):
        super().__init__()
        self.norm, self.act, self.reuse = nn.GroupNorm(2, 6), act, reuse

    def forward(self, x):
        y = self.norm(x)
        return self.act(y) + y if self.reuse else self.act(y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("act", [nn.SiLU(), F.silu])
def test_group_norm_silu(act, dtype):
    result, kinds = fused_and_checked(NormAct(act), randn(2, 6, 5, 3), dtype=dtype)
    assert kinds == {"group_norm_silu": 1}
    fused = result.module.norm
    assert isinstance(fused, mirage.nn.GroupNorm) and fused.activation == "silu"


def test_group_norm_sharing_parameters_and_not_fused_where_it_should_not_be():
    model = prepared(NormAct(nn.SiLU()))
    assert fuse(model).module.norm.weight is model.norm.weight
    result, kinds = fused_and_checked(NormAct(nn.SiLU(), reuse=True), randn(2, 6, 4, 4))
    assert not kinds and result.skipped == [("norm", "the group norm's output is also used without the SiLU")]
    result, kinds = fused_and_checked(NormAct(nn.ReLU()), randn(2, 6, 4, 4))
    assert not kinds and not result.skipped


# --- attention ------------------------------------------------------------------------------------


class ManualAttention(nn.Module):
    """Multi-head self-attention written out by hand, in the forms people write it."""

    def __init__(self, form="matmul", dim=24, heads=3, context_dim=None):
        super().__init__()
        self.form, self.heads, self.head_dim = form, heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(context_dim or dim, dim, bias=False)
        self.v = nn.Linear(context_dim or dim, dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.0)
        self.attn_drop = nn.Dropout(0.1)  # what eval mode turns off

    def split(self, t, B, N):
        return t.view(B, N, self.heads, -1).transpose(1, 2)

    def forward(self, x, context):
        B, N, C = x.shape
        h, form = self.heads, self.form
        source = context if form == "different_inputs" else x
        if form in ("matmul", "softmax_dim_-2", "probs_returned", "scores_returned", "dropout", "different_inputs",
                    "masked", "causal", "cast", "temperature"):
            q, k, v = self.split(self.q(x), B, N), self.split(self.k(source), B, N), self.split(self.v(source), B, N)
            scores = q @ k.transpose(-2, -1) * self.scale
            if form == "masked":
                scores = scores + context[:, None, :, :N]
            if form == "causal":
                scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
            if form == "cast":
                scores = scores.float()
            if form == "temperature":  # a learned one
                scores = scores * self.out.bias[0]
            probs = scores.softmax(dim=-2 if form == "softmax_dim_-2" else -1)
            if form == "dropout":
                probs = F.dropout(probs, p=0.1, training=True)
            out = (self.drop(probs) @ v).transpose(1, 2).reshape(B, N, C)
            if form == "probs_returned":
                return self.out(out), probs
            if form == "scores_returned":
                return self.out(out), scores
        elif form == "divide_q_scaled":
            q = self.q(x).reshape(B, N, h, C // h).permute(0, 2, 1, 3) * self.scale
            k = self.k(x).reshape(B, N, h, C // h).permute(0, 2, 3, 1)
            v = self.v(x).reshape(B, N, h, C // h).permute(0, 2, 1, 3)
            probs = F.softmax(torch.matmul(q, k) / 1.5, dim=3)
            out = torch.matmul(probs, v).permute(0, 2, 1, 3).flatten(2) * 1.5
        elif form == "bmm":
            q = self.q(x).reshape(B, N, h, -1).transpose(1, 2).reshape(B * h, N, -1)
            k = self.k(x).reshape(B, N, h, -1).transpose(1, 2).reshape(B * h, N, -1)
            v = self.v(x).reshape(B, N, h, -1).transpose(1, 2).reshape(B * h, N, -1)
            probs = nn.functional.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.head_dim), dim=-1)
            out = torch.bmm(probs, v).reshape(B, h, N, -1).transpose(1, 2).reshape(B, N, C)
        elif form == "einsum":
            q, k, v = (proj(x).view(B, N, h, -1) for proj in (self.q, self.k, self.v))
            probs = torch.einsum("bnhd,bmhd->bhnm", q, k).mul(self.scale).softmax(-1)
            out = torch.einsum("bhnm,bmhd->bnhd", probs, v).reshape(B, N, C)
        elif form == "einsum_heads_first":
            q, k, v = (self.split(proj(x), B, N) for proj in (self.q, self.k, self.v))
            probs = torch.softmax(torch.einsum("bhid,bhjd->bhij", q, k) * self.scale, -1)
            out = torch.einsum("bhij,bhjd->bhid", probs, v).transpose(1, 2).reshape(B, N, C)
        elif form == "runtime_scale":
            q, k, v = (self.split(proj(x), B, N) for proj in (self.q, self.k, self.v))
            probs = (q @ k.mT * q.shape[-1] ** -0.5).softmax(-1)
            out = (probs @ v).transpose(1, 2).flatten(2)
        elif form == "runtime_width_scale":  # the head size from x's width: not matched
            q, k, v = (self.split(proj(x), B, N) for proj in (self.q, self.k, self.v))
            probs = (q @ k.mT * (x.shape[-1] // self.heads) ** -0.5).softmax(-1)
            out = (probs @ v).transpose(1, 2).flatten(2)
        elif form == "runtime_sqrt_scale":
            q, k, v = (self.split(proj(x), B, N) for proj in (self.q, self.k, self.v))
            probs = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(-1)
            out = (probs @ v).transpose(1, 2).flatten(2)
        elif form == "dropout_module":
            q, k, v = (self.split(proj(x), B, N) for proj in (self.q, self.k, self.v))
            probs = self.attn_drop((q @ k.transpose(-2, -1) * self.scale).softmax(-1))
            out = (probs @ v).transpose(1, 2).flatten(2)
        elif form == "split_by_own_shape":  # a helper reading each projection's own shape
            def heads(t):
                batch, tokens, channels = t.shape
                return t.view(batch, tokens, h, channels // h).transpose(1, 2)

            q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
            probs = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
            out = (probs @ v).transpose(1, 2).reshape(B, N, C)
        elif form == "einsum_output_of_unknown_rank":  # the scores' rank is not in the graph: einsum's subscripts give it
            q, k, v = (proj(x).unflatten(-1, (h, -1)).transpose(1, 2) for proj in (self.q, self.k, self.v))
            probs = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
            out = torch.einsum("bhij,bhjd->bhid", probs, v).transpose(1, 2).flatten(2)
        elif form == "single_head":
            probs = torch.softmax(torch.bmm(self.q(x), self.k(x).transpose(1, 2)) * self.scale, -1)
            out = torch.bmm(probs, self.v(x))
        return self.out(out)


ATTENTION_FORMS = ["matmul", "divide_q_scaled", "bmm", "einsum", "einsum_heads_first", "runtime_scale",
                   "runtime_sqrt_scale", "dropout_module", "split_by_own_shape", "single_head",
                   "einsum_output_of_unknown_rank"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("form", ATTENTION_FORMS)
def test_attention_forms_are_fused(form, dtype):
    model = ManualAttention(form)
    x = randn(2, 7, 24)
    result, kinds = fused_and_checked(model, x, x, dtype=dtype)
    assert kinds == {"attention": 1} and not result.skipped
    graph = result.module.graph
    assert sum(n.target is F.scaled_dot_product_attention for n in graph.nodes) == 1
    assert not any(n.target in ("softmax", torch.softmax, F.softmax) for n in graph.nodes)
    linears = [m for m in result.module.modules() if isinstance(m, nn.Linear)]
    assert sorted(m.out_features for m in linears) == [24, 72]  # out and the fused qkv


_OTHER_OPERATIONS = ("the scores go through other operations than a scale, a mask or an additive term before the "
                     "softmax (a cast, a learned temperature, ...), which are not matched")


@pytest.mark.parametrize("form, reason", [
    ("softmax_dim_-2", "softmax over dim -2, not over the keys (the last of 4 dims)"),
    ("probs_returned", "the attention probabilities are also used elsewhere"),
    ("scores_returned", "the attention scores are also used outside the softmax"),
    ("dropout", "dropout (p=0.1) on the attention probabilities is not fused"),
    ("different_inputs", "q, k and v are projected from different inputs"),
    ("masked", "the scores are masked or get an additive term (a mask or bias) before the softmax, which is not matched"),
    ("causal", "the scores are masked or get an additive term (a mask or bias) before the softmax, which is not matched"),
    ("cast", _OTHER_OPERATIONS),
    ("temperature", _OTHER_OPERATIONS),
    ("runtime_width_scale", "the scale is computed at run time in a form that is not matched (matched: a constant, "
                            "or q.shape[-1] ** -0.5 or / math.sqrt(q.shape[-1]))"),
])
def test_attention_left_alone_with_reason(form, reason):
    model = prepared(ManualAttention(form))
    result = fuse(model, prefix="blocks.0")
    assert result.module is model and not result.swaps
    assert result.skipped == [("blocks.0", reason)]


def test_attention_dropout_module_in_training_mode_is_left_alone():
    model = prepared(ManualAttention("dropout_module")).train()
    result = fuse(model)
    assert not result.swaps
    assert result.skipped == [("ManualAttention", "dropout (p=0.1) on the attention probabilities is not fused")]


def test_softmax_that_is_not_attention_is_no_candidate():
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x).softmax(-1)

    result = fuse(Classifier())
    assert not result.swaps and not result.skipped

    class ProductClassifier(nn.Module):  # a softmax over a product, read by no product
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return torch.softmax(torch.relu(x @ self.weight) * 2.0, -1)

    result = fuse(ProductClassifier())
    assert not result.swaps and not result.skipped


# --- tracing: fallback to children, what is returned ---------------------------------------------


class DataDependent(nn.Module):
    """Not traceable (branches on a tensor value); its children are."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())
        self.attn = ManualAttention("matmul", dim=8, heads=2)
        self.head = nn.Linear(4, 8)

    def forward(self, x):
        y = self.block(x)
        if y.sum() > 0:
            y = -y
        tokens = self.head(y.mean((2, 3)))[:, None].expand(-1, 3, -1)
        return self.attn(tokens, tokens)


class OptionalArgument(nn.Module):
    """Traceable, but its optional argument would be frozen as given: fused by children."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())

    def forward(self, x, shift=None):
        y = self.block(x)
        return y if shift is None else y + shift


class OptionalArgumentAroundLayers(nn.Module):
    """Not traced (an optional argument), its conv, batch norm and SiLU direct children: the
    pattern between them is in its graph alone, so it is reported as left alone."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU()

    def forward(self, x, scale=None):
        y = self.act(self.bn(self.conv(x)))
        return y if scale is None else y * scale


def test_untraceable_module_hiding_a_pattern_is_reported():
    model = prepared(OptionalArgumentAroundLayers())
    result = fuse(model, prefix="stem")
    assert result.module is model and not result.swaps
    assert result.skipped == [("stem", "OptionalArgumentAroundLayers's forward is not traceable by torch.fx (the "
                                       "optional argument scale=None), so a Conv2d and a BatchNorm2d among its "
                                       "children cannot be fused")]
    if hasattr(mirage, "optimize"):
        with pytest.raises(ValueError, match=r"strict=True\): 1 candidate\(s\) of OptionalArgumentAroundLayers"):
            mirage.optimize(prepared(OptionalArgumentAroundLayers(), torch.float32), strict=True)


def test_untraceable_module_has_its_children_fused_in_place():
    model = prepared(DataDependent())
    x = randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        result = fuse(model, prefix="net")
        got = model(x)
    assert result.module is model
    assert sorted(result.swaps) == [("attention", "net.attn"), ("conv_bn_silu", "net.block.0")]
    assert isinstance(model.block, fx.GraphModule) and isinstance(model.attn, fx.GraphModule)
    torch.testing.assert_close(got, expected, **tolerance(torch.float64))

    optional = prepared(OptionalArgument())
    with torch.no_grad():
        expected = optional(x, x)
        result = fuse(optional)
        got = optional(x, x)
    assert result.module is optional and result.swaps == [("conv_bn_silu", "block.0")]
    torch.testing.assert_close(got, expected, **tolerance(torch.float64))


class CachingForward(nn.Module):
    """Stores a tensor on itself at its first call, as position tables and feature caches do."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.linspace(0.0, 1.0, x.shape[-1], dtype=x.dtype)
        return self.block(x + self.table)


def test_forward_that_changes_module_state_is_not_traced_and_keeps_its_state():
    model = prepared(CachingForward())
    reference = copy.deepcopy(model)
    x = randn(2, 4, 5, 5, dtype=torch.float64)
    result = fuse(model)
    # Traced, the cache would hold a torch.fx Proxy; the module's own graph is not rewritten.
    assert model.table is None and result.module is model
    assert result.swaps == [("conv_bn_silu", "block.0")]
    with torch.no_grad():
        got = model(x)
        expected = reference(x)
    assert isinstance(model.table, torch.Tensor)
    torch.testing.assert_close(got, expected, **tolerance(torch.float64))


class ChangesContainersInPlace(nn.Module):
    """Changes what its attributes hold without rebinding them: a call counter in a dict, a
    feature cache, a list of seen shapes (nested in a tuple)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())
        self.state = {"calls": 0}
        self.features = {}
        self.log = ([],)

    def forward(self, x):
        self.state["calls"] += 1
        h = self.block(x)
        self.features["block"] = h
        self.log[0].append(tuple(h.shape))
        return h * self.state["calls"]


def test_forward_that_changes_containers_in_place_is_not_traced_and_keeps_its_state():
    model = prepared(ChangesContainersInPlace())
    reference = copy.deepcopy(model)
    x = randn(2, 4, 5, 5, dtype=torch.float64)
    result = fuse(model)
    # Traced, the counter would be frozen into the graph at 1 and the cache would hold a Proxy.
    assert model.state == {"calls": 0} and model.features == {} and model.log == ([],)
    assert result.module is model and result.swaps == [("conv_bn_silu", "block.0")]
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), reference(x), **tolerance(torch.float64))
    assert model.state == {"calls": 3} and model.features["block"].shape == x.shape and len(model.log[0]) == 3


@pytest.mark.parametrize("change", ["dict", "list", "set", "nested"])
def test_module_state_names_what_changed_in_place(change):
    from mirage.patterns import _module_state, _restore_module_state
    module = nn.Linear(2, 2)
    module.table, module.items, module.tags, module.nested = {"a": 1}, [1, 2], {"x"}, ({"deep": [0]},)
    saved = _module_state(module)
    {"dict": lambda: module.table.update(b=2), "list": lambda: module.items.append(3),
     "set": lambda: module.tags.add("y"), "nested": lambda: module.nested[0]["deep"].append(1)}[change]()
    where = {"dict": "Linear.table.b", "list": "Linear.items", "set": "Linear.tags", "nested": "Linear.nested"}
    assert _restore_module_state(module, saved) == where[change]
    assert (module.table, module.items, module.tags, module.nested) == ({"a": 1}, [1, 2], {"x"}, ({"deep": [0]},))
    assert _restore_module_state(module, _module_state(module)) == ""


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.norm = nn.GroupNorm(2, 4)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.norm(self.bn(self.conv(self.block(x)))))


def _hooked_and_checked(hook_on, hook, *, pre=False):
    """fuse(Stem()) with ``hook`` registered on the module at ``hook_on``: asserts the result
    computes what the hooked model computes; returns the result."""
    model = prepared(Stem())
    target = model.get_submodule(hook_on)
    (target.register_forward_pre_hook if pre else target.register_forward_hook)(hook)
    x = randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        result = fuse(model)
        got = result.module(x)
    torch.testing.assert_close(got, expected, **tolerance(torch.float64))
    return result


def test_modules_with_forward_hooks_are_not_fused():
    zero = lambda module, inputs, output: output * 0  # noqa: E731
    result = _hooked_and_checked("bn", zero)
    assert ("bn", "bn has forward hooks, which the fused module would not run") not in result.skipped
    assert ("conv", "bn has forward hooks, which the fused module would not run") in result.skipped
    assert sorted(kind for kind, _ in result.swaps) == ["conv_bn_silu", "group_norm_silu"]

    result = _hooked_and_checked("act", zero)
    assert ("norm", "act has forward hooks, which the fused module would not run") in result.skipped
    result = _hooked_and_checked("conv", lambda module, inputs: (inputs[0] * 2,), pre=True)
    assert ("conv", "conv has forward hooks, which the fused module would not run") in result.skipped


class TwiceCalled(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.GroupNorm(2, 4),
                                   nn.SiLU())

    def forward(self, x):
        return self.block(self.block(x))


def test_a_module_called_twice_is_fused_once_under_its_name():
    # Each call got a fused copy of its own ("block.3_fused" beside "block.3"): the state dict
    # gained keys, the original checkpoint no longer loaded, and the report counted two swaps.
    model = prepared(TwiceCalled())
    keys = set(model.state_dict())
    x = randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        result = fuse(model)
        torch.testing.assert_close(result.module(x), expected, **tolerance(torch.float64))
    assert sorted(result.swaps) == [("conv_bn_relu", "block.0"), ("group_norm_silu", "block.3")]
    assert {key for key in result.module.state_dict() if not key.startswith("block.1.")} == \
        {key for key in keys if not key.startswith("block.1.")}  # the folded batch norm's keys go, as documented


class InContainers(nn.Module):
    """Blocks in an nn.ModuleList, called by a forward torch.fx cannot trace (an optional argument)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TwiceCalled().block, TwiceCalled().block])
        self.heads = nn.ModuleDict({"out": nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU())})

    def forward(self, x, scale=None):
        for block in self.blocks:
            x = block(x)
        x = self.heads["out"](x)
        return x if scale is None else x * scale


@pytest.mark.parametrize("wrap", [False, True])
def test_modules_in_containers_and_data_parallel_are_fused(wrap):
    # nn.ModuleList, nn.ModuleDict and nn.DataParallel are torch.nn modules, which the pass took
    # as leaves: nothing inside them was fused, and nothing was reported.
    model = prepared(InContainers())
    model = nn.DataParallel(model) if wrap else model
    x = randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        result = fuse(model)
        torch.testing.assert_close(result.module(x), expected, **tolerance(torch.float64))
    prefix = "module." if wrap else ""
    assert sorted(result.swaps) == sorted([("conv_bn_relu", f"{prefix}blocks.0.0"), ("conv_bn_relu", f"{prefix}blocks.1.0"),
                                           ("group_norm_silu", f"{prefix}blocks.0.3"),
                                           ("group_norm_silu", f"{prefix}blocks.1.3"),
                                           ("group_norm_silu", f"{prefix}heads.out.0")])


def test_modules_with_a_forward_set_on_the_instance_are_not_fused():
    model = prepared(Stem())
    inner = model.bn.forward
    model.bn.forward = lambda x: inner(x) * 0.5  # as LoRA patchers and offloading wrappers do
    x = randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        result = fuse(model)
        torch.testing.assert_close(result.module(x), expected, **tolerance(torch.float64))
    assert ("conv", "bn has a forward set on the instance, which the fused module would not run") in result.skipped


def test_hooks_on_a_container_run_at_every_call_and_its_children_are_fused_in_place():
    calls = []
    result = _hooked_and_checked("block", lambda module, inputs, output: calls.append(1))
    assert ("block", "Sequential's forward is not traceable by torch.fx (it has forward hooks, which a graph of its "
                     "class's forward would not run), so a Conv2d and a BatchNorm2d among its children cannot be fused"
            ) in result.skipped
    assert ("conv_bn", "conv") in result.swaps and ("group_norm_silu", "norm") in result.swaps
    calls.clear()
    with torch.no_grad():
        for _ in range(2):
            result.module(randn(1, 4, 3, 3, dtype=torch.float64))
    assert len(calls) == 2  # at every call (traced through, it ran once: at trace time)


def test_hooks_on_the_model_keep_it_untraced():
    result = _hooked_and_checked("", lambda module, inputs, output: output * 2)
    model = result.module
    assert isinstance(model, Stem) and model._forward_hooks
    assert result.swaps == [("conv_bn_silu", "block.0")]


def test_weight_norm_convolution_is_not_folded_with_stale_weights():
    model = prepared(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    model[0] = nn.utils.weight_norm(model[0])
    with torch.no_grad():
        model[0].weight_g.mul_(3.0)  # conv.weight is recomputed from weight_g at the next call
    x = randn(2, 3, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        result = fuse(model)
        got = result.module(x)
    assert not result.swaps and result.skipped == [("0", "0 has forward hooks, which the fused module would not run")]
    torch.testing.assert_close(got, expected, **tolerance(torch.float64))


def test_nothing_to_fuse_returns_the_same_module():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    result = fuse(model)
    assert result.module is model and not result.swaps and not result.skipped
    leaf = nn.Conv2d(3, 3, 1)
    assert fuse(leaf).module is leaf


def test_fusing_twice_changes_nothing_more():
    first = fuse(prepared(PlainNet.tiny())).module
    again = fuse(first)
    assert again.module is first and not again.swaps and not again.skipped


# --- the plain net end to end ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_plain_net(dtype):
    result, kinds = fused_and_checked(PlainNet.tiny(), randn(2, 3, 16, 16), dtype=dtype)
    # conv-BN-SiLU: stem 1, per level down 3 (ResBlock 2, downsample 1), middle 4 (2 ResBlocks),
    # per level up 3 (upsample conv 1, ResBlock 2): 17. GroupNorm-SiLU: middle 1, per level up 1.
    assert kinds == {"conv_bn_silu": 17, "group_norm_silu": 3, "attention": 3}
    assert not result.skipped
    names = {name for kind, name in result.swaps if kind == "attention"}
    assert names == {"down.1.1", "middle.2", "up.1.1"}


def test_plain_net_through_optimize():
    if not hasattr(mirage, "optimize"):
        pytest.skip("mirage.optimize is not available")
    model = prepared(PlainNet.tiny(), torch.float32)
    x = randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
        optimized = mirage.optimize(copy.deepcopy(model), dtype=torch.float32, channels_last=False,
                                    cuda_graph=False)
        got = optimized(x)
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plain_net_cuda_low_precision_error_bounded_by_torch(dtype):
    reference = prepared(PlainNet(width=32, depth=1, head_dim=16), torch.float64, "cuda")
    model = copy.deepcopy(reference).to(dtype)
    x = randn(2, 3, 32, 32, dtype=torch.float64, device="cuda")
    with torch.no_grad():
        expected = reference(x)
        theirs = (model(x.to(dtype)).double() - expected).norm() / expected.norm()
        result = fuse(model)
        ours = (result.module(x.to(dtype)).double() - expected).norm() / expected.norm()
    assert Counter(kind for kind, _ in result.swaps)["attention"] == 3
    assert ours <= REDUCTION_ERROR_FACTOR * theirs, (ours.item(), theirs.item())


class ReadsConstants(nn.Module):
    """A forward that makes a constant tensor (a causal-style mask) and reads a child's buffer:
    torch.fx keeps both on the root as _tensor_constant<i>, which is not state the forward changes."""

    def __init__(self):
        super().__init__()
        # Direct children: only a trace of this forward can pair them.
        self.conv, self.bn, self.act = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU()
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x):
        mask = torch.ones(5, 5, dtype=torch.bool).triu(1)  # for 5 x 5 images
        return self.act(self.bn(self.conv(x))).masked_fill(mask, 0.0) * self.bn2.running_var.view(1, -1, 1, 1)


def test_constants_the_tracer_keeps_are_not_module_state():
    model = ReadsConstants()
    attributes = set(vars(model))
    result, kinds = fused_and_checked(model, randn(2, 4, 5, 5))
    assert kinds == Counter({"conv_bn_silu": 1}) and result.skipped == []
    assert set(vars(model)) == attributes  # the model passed in keeps no constant of the tracer's


class NormalizesByBuffers(nn.Module):
    """An input normalization by the model's own buffers (as image front ends write it), then a
    GroupNorm -> SiLU to fuse; ``flip`` a buffer read by Python control flow."""

    def __init__(self, flip=False):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]))
        if flip:
            self.register_buffer("flip", torch.tensor(True))
        self.conv, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)

    def forward(self, x):
        x = (x - self.mean.view(1, 3, 1, 1)) / self.std.view(1, 3, 1, 1)
        if hasattr(self, "flip") and self.flip:
            x = x.flip(-1)
        return F.silu(self.norm(self.conv(x)))


@pytest.mark.parametrize("flip", [False, True])
def test_expressions_of_buffers_stay_expressions_of_the_buffers(flip):
    # torch.fx's default tracer evaluated `self.mean.view(...)` at trace time into constants: the
    # buffers left the state dict (a reference checkpoint no longer loaded) and later changes to
    # them were ignored; a buffer read by an `if` was baked in, then dropped.
    model, reference = NormalizesByBuffers(flip), NormalizesByBuffers(flip)
    reference.load_state_dict(model.state_dict())
    result = fuse(model)
    assert Counter(kind for kind, _ in result.swaps) == Counter({} if flip else {"group_norm_silu": 1})
    fused = result.module
    assert list(fused.state_dict()) == list(reference.state_dict())
    fused.load_state_dict(reference.state_dict())
    x = randn(2, 3, 6, 6)
    with torch.no_grad():
        for changed in (fused, reference):  # the same change to both
            changed.mean.mul_(2.0)
            if flip:
                changed.flip.fill_(False)
        torch.testing.assert_close(fused(x), reference(x), **tolerance(torch.float32))


class SubclassedLayers(nn.Module):
    """User subclasses of the layers mirage fuses, beside a plain Conv-BN-SiLU that is fused."""

    class MyGroupNorm(nn.GroupNorm):
        pass

    class MyConv(nn.Conv2d):
        pass

    class MyBatchNorm(nn.BatchNorm2d):
        pass

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())
        self.norm = self.MyGroupNorm(2, 4)
        self.conv1, self.bn1 = self.MyConv(4, 4, 1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), self.MyBatchNorm(4)

    def forward(self, x):
        x = F.silu(self.norm(self.block(x)))
        return self.bn2(self.conv2(self.bn1(self.conv1(x))))


def test_subclassed_layers_stay_modules_and_are_reported():
    # Traced through, a subclass vanished into the graph module whenever something else in it was
    # fused, and the report (and strict=True) never named it.
    model = prepared(SubclassedLayers())
    x = randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        expected = copy.deepcopy(model)(x)
    result = fuse(model)
    assert Counter(kind for kind, _ in result.swaps) == Counter({"conv_bn_silu": 1})
    reasons = dict(result.skipped)
    assert reasons["conv1"] == ("MyConv -> BatchNorm2d: a subclass of Conv2d or BatchNorm2d may compute "
                                "differently, so the batch norm is not folded")
    assert reasons["conv2"].startswith("Conv2d -> MyBatchNorm: a subclass")
    assert isinstance(result.module.get_submodule("norm"), SubclassedLayers.MyGroupNorm)
    with torch.no_grad():
        got = result.module(x)
    torch.testing.assert_close(got, expected, **tolerance(torch.float64))
    # Through optimize the subclassed GroupNorm is named too, and strict=True raises on it.
    report = str(mirage.report(mirage.optimize(prepared(SubclassedLayers()), dtype=None, cuda_graph=False,
                                               verbose=False)))
    assert "MyGroupNorm subclasses GroupNorm and may compute differently" in report and "MyConv -> BatchNorm2d" in report
    with pytest.raises(ValueError, match="MyGroupNorm subclasses GroupNorm"):
        mirage.optimize(prepared(SubclassedLayers()), dtype=None, cuda_graph=False, verbose=False, strict=True)
