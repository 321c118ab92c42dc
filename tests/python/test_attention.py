"""mirage.nn.attention: FusedAttention built from diffusers' Attention computes what it computes."""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402
from diffusers.models.attention_processor import (  # noqa: E402
    Attention,
    AttnProcessor,
    AttnProcessor2_0,
    SlicedAttnProcessor,
)

import mirage  # noqa: E402,F401  (registers torch.ops.mirage)
from common import OpCounter, randn  # noqa: E402
from mirage.nn.attention import FusedAttention, from_diffusers_attention, fuse_linears  # noqa: E402
from tolerances import REDUCTION_ERROR_FACTOR, tolerance  # noqa: E402


def randomized(module: nn.Module, dtype=torch.float64, device="cpu") -> nn.Module:
    """module in dtype with random parameters (fresh norms are the identity and biases zero,
    which would hide a wrong affine or bias)."""
    module = module.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(randn(*parameter.shape, dtype=dtype, device=device, mean=0.1, std=0.3))
    return module


# (Attention kwargs, input shape, encoder_hidden_states shape or None)
CONFIGS = {
    "self": (dict(query_dim=32, heads=4, dim_head=8), (2, 7, 32), None),
    "self_bias_out_dim": (dict(query_dim=32, heads=2, dim_head=16, bias=True, out_bias=False), (1, 5, 32), None),
    "cross": (dict(query_dim=32, heads=4, dim_head=8, cross_attention_dim=12, bias=True), (2, 7, 32), (2, 9, 12)),
    "image_group_norm": (
        # UNet2DModel / AutoencoderKL mid-block attention.
        dict(query_dim=16, heads=2, dim_head=8, norm_num_groups=4, residual_connection=True, bias=True,
             rescale_output_factor=2.0, eps=1e-6, upcast_softmax=True, _from_deprecated_attn_block=True),
        (2, 16, 3, 5), None),
    "norm_cross_layer_norm": (
        dict(query_dim=32, heads=2, dim_head=16, cross_attention_dim=12, cross_attention_norm="layer_norm"),
        (2, 5, 32), (2, 7, 12)),
    "norm_cross_group_norm": (
        dict(query_dim=32, heads=2, dim_head=16, cross_attention_dim=16, cross_attention_norm="group_norm",
             cross_attention_norm_num_groups=4),
        (2, 5, 32), (2, 7, 16)),
    "qk_layer_norm": (dict(query_dim=32, heads=2, dim_head=16, qk_norm="layer_norm"), (2, 5, 32), None),
    "classic_processor_no_scale": (dict(query_dim=16, heads=2, dim_head=8, scale_qk=False), (2, 6, 16), None),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_diffusers(config, dtype):
    """float64: equal to diffusers' float64 output. float32: the error against it is bounded by
    diffusers' own float32 error (attention amplifies rounding differences in the logits)."""
    kwargs, shape, context_shape = CONFIGS[config]
    reference = randomized(Attention(**kwargs))
    attn = copy.deepcopy(reference).to(dtype)
    fused = from_diffusers_attention(attn)
    x = randn(*shape, dtype=torch.float64)
    context = None if context_shape is None else randn(*context_shape, dtype=torch.float64)
    low = (lambda t: t if t is None else t.to(dtype))  # noqa: E731
    with torch.no_grad():
        expected = reference(x, context)
        got = fused(low(x), low(context))
        theirs = (attn(low(x), low(context)).double() - expected).abs().max().item()
    assert got.shape == expected.shape and got.dtype == dtype
    if dtype == torch.float64:
        torch.testing.assert_close(got, expected, **tolerance(dtype))
    else:
        ours = (got.double() - expected).abs().max().item()
        assert ours <= REDUCTION_ERROR_FACTOR * theirs + tolerance(dtype)["atol"], (ours, theirs)


@pytest.mark.parametrize(("config", "divisions"), [("self", 0), ("image_group_norm", 1)])
def test_divides_only_by_a_rescale_output_factor_other_than_1(config, divisions):
    kwargs, shape, _ = CONFIGS[config]
    fused = from_diffusers_attention(randomized(Attention(**kwargs)))
    x = randn(*shape, dtype=torch.float64)
    with torch.no_grad(), OpCounter() as counter:
        fused(x)
    assert counter.calls.count("aten.div") == divisions


def test_classic_processor_uses_attn_scale():
    attn = Attention(query_dim=16, heads=2, dim_head=8, scale_qk=False)
    assert type(attn.processor) is AttnProcessor
    assert from_diffusers_attention(attn).scale == 1.0
    assert from_diffusers_attention(Attention(query_dim=16, heads=2, dim_head=8)).scale == pytest.approx(8 ** -0.5)


@pytest.mark.parametrize("how", ["scale_qk=False", "set_processor"])
def test_classic_processor_with_qk_norms_is_refused(how):
    # diffusers' classic AttnProcessor never applies norm_q/norm_k; they were once applied here,
    # outputs 11.6 off on values of about 10.
    attn = Attention(query_dim=16, heads=2, dim_head=8, qk_norm="layer_norm", scale_qk=how != "scale_qk=False")
    if how == "set_processor":
        attn.set_processor(AttnProcessor())
    with pytest.raises(ValueError, match="the classic AttnProcessor does not apply its norm_q/norm_k"):
        from_diffusers_attention(attn)


def test_image_input_keeps_memory_format():
    kwargs, shape, _ = CONFIGS["image_group_norm"]
    attn = randomized(Attention(**kwargs))
    fused = from_diffusers_attention(attn)
    x = randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        expected = attn(x)
        nchw = fused(x)
        channels_last = fused(x.contiguous(memory_format=torch.channels_last))
    assert nchw.is_contiguous()
    assert channels_last.is_contiguous(memory_format=torch.channels_last)
    for got in (nchw, channels_last):
        torch.testing.assert_close(got, expected, **tolerance(torch.float64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("config, projections", [("self", 2), ("image_group_norm", 2), ("cross", 3)])
def test_no_layout_copies_around_attention(device, config, projections):
    """Heads split and merged as views, channels-last images read and written in place: the
    operators the module runs include no copy; self-attention projects q, k and v in one GEMM."""
    kwargs, shape, context_shape = CONFIGS[config]
    dtype = torch.float16 if device == "cuda" else torch.float32
    fused = from_diffusers_attention(randomized(Attention(**kwargs), dtype, device))
    x = randn(*shape, dtype=dtype, device=device)
    if x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    context = None if context_shape is None else randn(*context_shape, dtype=dtype, device=device)
    with torch.no_grad(), OpCounter() as counter:
        out = fused(x, context)
    copies = [op for op in counter.calls if op in ("aten.clone", "aten.copy_", "aten._to_copy", "aten.contiguous")]
    assert copies == [], counter.calls
    assert counter.calls.count("mirage.linear") == projections and "aten.linear" not in counter.calls
    if x.ndim == 4:
        assert out.is_contiguous(memory_format=torch.channels_last)


def test_spatial_norm_takes_temb():
    attn = randomized(Attention(query_dim=32, heads=2, dim_head=16, spatial_norm_dim=4,
                                residual_connection=True, bias=True))
    fused = from_diffusers_attention(attn)
    assert fused.spatial_norm is attn.spatial_norm
    x, temb = randn(2, 32, 4, 4, dtype=torch.float64), randn(2, 4, 2, 2, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, temb=temb), attn(x, temb=temb), **tolerance(torch.float64))


MASKS = {
    "additive_batch": lambda b, h, lq, s: randn(b, 1, s, dtype=torch.float64),
    "additive_batch_heads": lambda b, h, lq, s: randn(b * h, lq, s, dtype=torch.float64),
    "additive_4d": lambda b, h, lq, s: randn(b, 1, lq, s, dtype=torch.float64),
    "bool_keys": lambda b, h, lq, s: torch.cat([torch.ones(b, 1, dtype=torch.bool), torch.rand(b, s - 1) > 0.4], 1),
}


@pytest.mark.parametrize("mask", list(MASKS))
def test_attention_mask(mask):
    attn = randomized(Attention(query_dim=32, heads=4, dim_head=8, cross_attention_dim=12))
    fused = from_diffusers_attention(attn)
    x, context = randn(2, 5, 32, dtype=torch.float64), randn(2, 7, 12, dtype=torch.float64)
    attention_mask = MASKS[mask](2, 4, 5, 7)
    with torch.no_grad():
        expected = attn(x, context, attention_mask)
        got = fused(x, context, attention_mask)
    torch.testing.assert_close(got, expected, **tolerance(torch.float64))


def test_attention_mask_refused_with_reason():
    fused = from_diffusers_attention(Attention(query_dim=16, heads=2, dim_head=8))
    x = randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"attention_mask has 4 key positions, the keys have 5"):
        fused(x, attention_mask=randn(2, 1, 4))
    with pytest.raises(ValueError, match=r"must be the batch \(2\) or batch\*heads \(4\), got shape \(3, 1, 5\)"):
        fused(x, attention_mask=randn(3, 1, 5))


def test_self_attention_module_given_a_context_and_cross_module_without_one():
    # diffusers projects whatever it is given: a self-attention module's to_k/to_v read a context
    # passed to it, and a cross-attention module attends over its input when given none.
    self_attn = randomized(Attention(query_dim=16, heads=2, dim_head=8, bias=True))
    cross_attn = randomized(Attention(query_dim=16, heads=2, dim_head=8, cross_attention_dim=16))
    x, context = randn(2, 5, 16, dtype=torch.float64), randn(2, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(from_diffusers_attention(self_attn)(x, context), self_attn(x, context),
                                   **tolerance(torch.float64))
        torch.testing.assert_close(from_diffusers_attention(cross_attn)(x), cross_attn(x), **tolerance(torch.float64))


def test_structure_and_shared_modules():
    attn = randomized(Attention(query_dim=32, heads=4, dim_head=8, bias=True, norm_num_groups=4))
    fused = from_diffusers_attention(attn)
    assert isinstance(fused, FusedAttention) and not fused.is_cross_attention
    assert fused.to_q is None and fused.to_kv is None
    assert fused.to_qkv.weight.shape == (96, 32)
    torch.testing.assert_close(fused.to_qkv.weight, torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
    torch.testing.assert_close(fused.to_qkv.bias, torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]))
    assert fused.to_out is attn.to_out
    assert isinstance(fused.group_norm, mirage.nn.GroupNorm) and fused.group_norm.weight is attn.group_norm.weight
    assert (fused.heads, fused.inner_dim, fused.residual_connection) == (4, 32, False)
    assert not fused.training

    cross = from_diffusers_attention(Attention(query_dim=32, heads=4, dim_head=8, cross_attention_dim=12).train())
    assert cross.is_cross_attention and cross.to_qkv is None and cross.training
    assert cross.to_kv.weight.shape == (64, 12)


def test_state_dict_with_parts_missing_reports_them_by_their_names():
    # As the unfused module would: the parts given are loaded into their slices, the absent ones
    # are reported missing as to_k.weight (not as the fused to_qkv.weight, a name of mirage's).
    attn = randomized(Attention(query_dim=16, heads=2, dim_head=8, bias=True))
    fused = from_diffusers_attention(copy.deepcopy(attn))
    other = randomized(Attention(query_dim=16, heads=2, dim_head=8, bias=True)).state_dict()
    partial = {k: v for k, v in other.items() if k != "to_k.weight"}
    before = fused.to_qkv.weight.detach().clone()
    result = fused.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["to_k.weight"] and result.unexpected_keys == []
    q, k, v = fused.to_qkv.weight.detach().chunk(3)
    assert torch.equal(q, other["to_q.weight"]) and torch.equal(v, other["to_v.weight"])
    assert torch.equal(k, before.chunk(3)[1])
    torch.testing.assert_close(fused.to_qkv.bias, torch.cat([other["to_q.bias"], other["to_k.bias"],
                                                             other["to_v.bias"]]))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"to_k.weight\""):
        fused.load_state_dict(partial)
    # Every part of a kind absent: still their names, and the values kept.
    no_weights = {k: v for k, v in other.items() if not k.startswith(("to_q.w", "to_k.w", "to_v.w"))}
    result = fused.load_state_dict(no_weights, strict=False)
    assert sorted(result.missing_keys) == ["to_k.weight", "to_q.weight", "to_v.weight"]
    assert torch.equal(fused.to_qkv.weight.detach().chunk(3)[1], before.chunk(3)[1])
    wrong = dict(other, **{"to_v.weight": other["to_v.weight"][:, :-1]})
    with pytest.raises(RuntimeError, match=r"size mismatch for to_v.weight: copying a param with shape \(16, 15\)") as error:
        fused.load_state_dict(wrong)
    assert "Missing" not in str(error.value)  # not the fused to_qkv.weight either
    # The parts of the right shape are loaded, as the unfused module loads them; to_v keeps its values.
    q, k, v = fused.to_qkv.weight.detach().chunk(3)
    assert torch.equal(q, other["to_q.weight"]) and torch.equal(k, other["to_k.weight"])
    assert torch.equal(v, other["to_v.weight"])


def test_a_partial_state_dict_into_meta_parameters_is_refused_by_name():
    # Parameters on the meta device have no values to keep beside the parts given.
    attn = randomized(Attention(query_dim=16, heads=2, dim_head=8, bias=True))
    fused = from_diffusers_attention(copy.deepcopy(attn)).to("meta")
    partial = {k: v for k, v in attn.state_dict().items() if k != "to_k.weight"}
    with pytest.raises(RuntimeError, match=r"cannot load some of to_q.weight, to_k.weight, to_v.weight into "
                                           r"to_qkv.weight, which is on the meta device"):
        fused.load_state_dict(partial, assign=True)
    fused.load_state_dict(attn.state_dict(), assign=True)  # every part given: loaded as given
    torch.testing.assert_close(fused.to_qkv.weight, torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))


@pytest.mark.cuda
def test_a_partial_state_dict_on_the_cpu_loads_into_a_model_on_the_gpu():
    # The parts given are joined with the slices kept, which live on the GPU.
    attn = randomized(Attention(query_dim=16, heads=2, dim_head=8, bias=True))
    fused = from_diffusers_attention(copy.deepcopy(attn)).cuda()
    other = randomized(Attention(query_dim=16, heads=2, dim_head=8, bias=True)).state_dict()
    before = fused.to_qkv.weight.detach().clone()
    result = fused.load_state_dict({k: v for k, v in other.items() if k != "to_k.weight"}, strict=False)
    assert result.missing_keys == ["to_k.weight"]
    q, k, v = fused.to_qkv.weight.detach().chunk(3)
    assert fused.to_qkv.weight.is_cuda and torch.equal(q.cpu(), other["to_q.weight"])
    assert torch.equal(k, before.chunk(3)[1]) and torch.equal(v.cpu(), other["to_v.weight"])


def test_fuse_linears_fills_missing_bias_with_zeros():
    a, b = nn.Linear(4, 3, bias=True), nn.Linear(4, 2, bias=False)
    fused = fuse_linears([a, b])
    x = randn(5, 4)
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], -1))
    with pytest.raises(ValueError, match=r"read different widths \(4 vs 5\)"):
        fuse_linears([a, nn.Linear(5, 2)])


class CustomAttention(Attention):
    pass


class CustomProcessor(AttnProcessor2_0):
    pass


@pytest.mark.parametrize("build, message", [
    (lambda: Attention(query_dim=16, heads=2, dim_head=8, added_kv_proj_dim=8), "added key/value projections"),
    (lambda: Attention(query_dim=16, heads=4, dim_head=4, kv_heads=2), r"grouped-query attention"),
    (lambda: Attention(query_dim=16, heads=2, dim_head=8, pre_only=True), "without an output projection"),
    (lambda: Attention(query_dim=16, heads=2, dim_head=8, processor=SlicedAttnProcessor(1)),
     "attention processor SlicedAttnProcessor is not reproduced"),
    (lambda: Attention(query_dim=16, heads=2, dim_head=8, processor=CustomProcessor()),
     "attention processor CustomProcessor is not reproduced"),
    (lambda: CustomAttention(query_dim=16, heads=2, dim_head=8), "CustomAttention subclasses diffusers Attention"),
])
def test_unsupported_configs_raise_with_reason(build, message):
    with pytest.raises(ValueError, match=message):
        from_diffusers_attention(build())


def test_not_an_attention_is_a_type_error():
    with pytest.raises(TypeError, match="expected a diffusers Attention, got Linear"):
        from_diffusers_attention(nn.Linear(2, 2))


def test_inside_a_transformer_block():
    # BasicTransformerBlock calls attn1 (self-attention) and attn2 (cross-attention, with the
    # encoder mask).
    block = randomized(BasicTransformerBlock(32, 4, 8, cross_attention_dim=12, attention_bias=True))
    x, context = randn(2, 6, 32, dtype=torch.float64), randn(2, 5, 12, dtype=torch.float64)
    mask = randn(2, 1, 5, dtype=torch.float64)
    with torch.no_grad():
        expected = block(x, encoder_hidden_states=context, encoder_attention_mask=mask)
        block.attn1 = from_diffusers_attention(block.attn1)
        block.attn2 = from_diffusers_attention(block.attn2)
        got = block(x, encoder_hidden_states=context, encoder_attention_mask=mask)
    torch.testing.assert_close(got, expected, **tolerance(torch.float64))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", ["self", "cross", "image_group_norm"])
def test_cuda_low_precision_error_bounded_by_torch(config, dtype):
    kwargs, shape, context_shape = CONFIGS[config]
    # Realistic sequence lengths: 16x16 pixels, 77 tokens.
    shape = (2, shape[1], 16, 16) if len(shape) == 4 else (2, 77, shape[2])
    reference = randomized(Attention(**kwargs), torch.float64, "cuda")
    attn = copy.deepcopy(reference).to(dtype)
    fused = from_diffusers_attention(attn)
    x = randn(*shape, dtype=torch.float64, device="cuda")
    context = None if context_shape is None else randn(2, 77, context_shape[2], dtype=torch.float64, device="cuda")
    low = (lambda t: t if t is None else t.to(dtype))  # noqa: E731
    with torch.no_grad():
        expected = reference(x, context)
        ours = (fused(low(x), low(context)).double() - expected).abs().max().item()
        theirs = (attn(low(x), low(context)).double() - expected).abs().max().item()
    assert ours <= REDUCTION_ERROR_FACTOR * theirs + tolerance(dtype)["atol"], (ours, theirs)
