"""mirage.nn.BasicTransformerBlock (residual add + LayerNorm fused) against diffusers' block (CPU)."""

import copy
import sys

import pytest
import torch
from torch import nn

import mirage
from common import OpCounter, randn
from tolerances import tolerance

diffusers = pytest.importorskip("diffusers")
from diffusers import Transformer2DModel  # noqa: E402
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402

DIM, HEADS, HEAD_DIM, CONTEXT_DIM = 16, 2, 8, 12
# The fused block normalizes with mirage's LayerNorm, diffusers' with torch's: in float64 they
# differ by a few ulps. Against diffusers' block with mirage's norms the results are identical.
FLOAT64_TOLERANCE = dict(atol=1e-12, rtol=1e-12)

# name -> (BasicTransformerBlock arguments, width of the context it is run with or None)
CONFIGS = {
    "cross": (dict(cross_attention_dim=CONTEXT_DIM), CONTEXT_DIM),
    "cross_without_context": (dict(cross_attention_dim=DIM), None),
    "self_only": (dict(), None),
    "double_self_attention": (dict(double_self_attention=True), None),
    "double_self_attention_with_context": (dict(double_self_attention=True), DIM),
    "only_cross_attention": (dict(cross_attention_dim=CONTEXT_DIM, only_cross_attention=True), CONTEXT_DIM),
    "no_affine_biases_gelu": (dict(cross_attention_dim=CONTEXT_DIM, norm_elementwise_affine=False,
                                   attention_bias=True, activation_fn="gelu", norm_eps=1e-6), CONTEXT_DIM),
    "geglu_approximate_inner_dim": (dict(cross_attention_dim=CONTEXT_DIM, activation_fn="geglu-approximate",
                                         ff_inner_dim=24, ff_bias=False, attention_out_bias=False), CONTEXT_DIM),
}


def make_block(dtype=torch.float64, **config):
    block = BasicTransformerBlock(DIM, HEADS, HEAD_DIM, **config).to(dtype).eval()
    with torch.no_grad():  # affine parameters that are not the identity, so sharing them matters
        for name in ("norm1", "norm2", "norm3"):
            norm = getattr(block, name)
            if norm is not None and norm.weight is not None:
                norm.weight.copy_(randn(DIM, mean=1.0, std=0.2))
                norm.bias.copy_(randn(DIM, mean=0.0, std=0.2))
    return block


def with_mirage_norms(block):
    """A copy of diffusers' block whose norm2 and norm3 are mirage's LayerNorm, unfused: the same
    arithmetic as the fused block, add and norm in separate kernels (norm1 stays torch's in both)."""
    reference = copy.deepcopy(block)
    for name in ("norm2", "norm3"):
        if getattr(reference, name) is not None:
            setattr(reference, name, mirage.nn.LayerNorm.from_torch(getattr(reference, name)))
    return reference


def inputs(context_dim, dtype=torch.float64, batch=2, tokens=6, context_tokens=5):
    context = randn(batch, context_tokens, context_dim, dtype=dtype) if context_dim else None
    return randn(batch, tokens, DIM, dtype=dtype), context


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_matches_diffusers_in_float64(name):
    config, context_dim = CONFIGS[name]
    block = make_block(**config)
    reference = with_mirage_norms(block)
    fused = mirage.nn.BasicTransformerBlock.from_diffusers(block)
    assert fused.attn1 is block.attn1 and fused.attn2 is block.attn2 and fused.ff is block.ff
    assert fused.norm1 is block.norm1 and fused.norm3.weight is block.norm3.weight
    assert fused.state_dict().keys() == block.state_dict().keys()
    x, context = inputs(context_dim)
    with torch.no_grad():
        got = fused(x, encoder_hidden_states=context)
        assert torch.equal(got, reference(x, encoder_hidden_states=context))
        torch.testing.assert_close(got, block(x, encoder_hidden_states=context), **FLOAT64_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_equals_the_unfused_arithmetic_in_lower_precision(dtype):
    # The fused sums before the norms are rounded to the dtype as the separate adds round them.
    block = make_block(torch.float32, cross_attention_dim=CONTEXT_DIM).to(dtype)
    reference = with_mirage_norms(block)
    fused = mirage.nn.BasicTransformerBlock.from_diffusers(block)
    x, context = inputs(CONTEXT_DIM, dtype=dtype)
    ff_outputs = []
    reference.ff.register_forward_hook(lambda module, args, output: ff_outputs.append(output))
    with torch.no_grad():
        got = fused(x, encoder_hidden_states=context)
        expected = reference(x, encoder_hidden_states=context)
    assert got.dtype == dtype
    if dtype == torch.float32:  # mirage.linear on the CPU is F.linear, then the add, in float32
        assert torch.equal(got, expected)
    else:
        # The feed-forward's residual add happens in its last matmul's float32 epilogue: one
        # rounding where the unfused block rounds the feed-forward's output, then the sum.
        eps = torch.finfo(dtype).eps
        bound = eps * (ff_outputs[0].double().abs() + expected.double().abs())
        assert ((got.double() - expected.double()).abs() <= bound).all()


@pytest.mark.parametrize(("config", "fused_adds"), [(dict(cross_attention_dim=CONTEXT_DIM), 2), (dict(), 1)])
def test_each_add_before_a_norm_is_one_fused_op(config, fused_adds):
    block = make_block(**config)
    fused = mirage.nn.BasicTransformerBlock.from_diffusers(block)
    x, context = inputs(config.get("cross_attention_dim"))
    with torch.no_grad(), OpCounter() as counter:
        fused(x, encoder_hidden_states=context)
    assert counter.calls.count("mirage.add_layer_norm") == fused_adds
    assert counter.calls.count("aten.native_layer_norm") == 1  # norm1, which reads the block's input
    # The feed-forward's residual, which no norm follows, is added in its last Linear's epilogue.
    assert counter.calls.count("aten.add") == 0
    assert counter.calls.count("mirage.linear") == 1


def test_masks_are_passed_to_the_attentions():
    block = make_block(cross_attention_dim=CONTEXT_DIM)
    reference = with_mirage_norms(block)
    fused = mirage.nn.BasicTransformerBlock.from_diffusers(block)
    x, context = inputs(CONTEXT_DIM)
    # Additive biases, as Transformer2DModel makes them from boolean masks.
    attention_mask = torch.zeros(2, 1, 6, dtype=torch.float64)
    attention_mask[0, :, -2:] = -10000.0
    encoder_attention_mask = torch.zeros(2, 1, 5, dtype=torch.float64)
    encoder_attention_mask[1, :, :3] = -10000.0
    with torch.no_grad():
        got = fused(x, attention_mask=attention_mask, encoder_hidden_states=context,
                    encoder_attention_mask=encoder_attention_mask)
        expected = reference(x, attention_mask=attention_mask, encoder_hidden_states=context,
                             encoder_attention_mask=encoder_attention_mask)
        unmasked = reference(x, encoder_hidden_states=context)
    assert torch.equal(got, expected) and not torch.equal(got, unmasked)


@pytest.mark.parametrize(("chunk_size", "dim"), [(2, 1), (1, 0)])
def test_chunked_feed_forward(chunk_size, dim):
    block = make_block(cross_attention_dim=CONTEXT_DIM)
    block.set_chunk_feed_forward(chunk_size, dim)
    reference = with_mirage_norms(block)
    fused = mirage.nn.BasicTransformerBlock.from_diffusers(block)
    assert (fused._chunk_size, fused._chunk_dim) == (chunk_size, dim)
    x, context = inputs(CONTEXT_DIM)
    with torch.no_grad():
        assert torch.equal(fused(x, encoder_hidden_states=context), reference(x, encoder_hidden_states=context))
    # Set afterwards (diffusers' enable_forward_chunking calls set_chunk_feed_forward), and unset.
    fused.set_chunk_feed_forward(3, 1)
    reference.set_chunk_feed_forward(3, 1)
    with torch.no_grad():
        assert torch.equal(fused(x, encoder_hidden_states=context), reference(x, encoder_hidden_states=context))
        fused.set_chunk_feed_forward(None)
        reference.set_chunk_feed_forward(None)
        assert torch.equal(fused(x, encoder_hidden_states=context), reference(x, encoder_hidden_states=context))
    fused.set_chunk_feed_forward(4, 1)
    with pytest.raises(ValueError, match=r"dimension 1 of `hidden_states` \(6\) must be divisible by the "
                                         r"feed-forward chunk size 4"):
        fused(x, encoder_hidden_states=context)


def test_autocast_with_a_float32_residual_stream_adds_separately():
    # Under autocast the attention output is bfloat16 and the float32 residual stream promotes the
    # add to float32: the fused op (both operands in the autocast dtype) would round differently.
    block = make_block(torch.float32, cross_attention_dim=CONTEXT_DIM)
    reference = with_mirage_norms(block)
    fused = mirage.nn.BasicTransformerBlock.from_diffusers(block)
    x, context = inputs(CONTEXT_DIM, dtype=torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with OpCounter() as counter:
            got = fused(x, encoder_hidden_states=context)
        expected = reference(x, encoder_hidden_states=context)
    assert "mirage.add_layer_norm" not in counter.calls
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_cross_attention_kwargs_gligen_is_refused():
    fused = mirage.nn.BasicTransformerBlock.from_diffusers(make_block())
    x, _ = inputs(None)
    with pytest.raises(ValueError, match=r"cross_attention_kwargs\['gligen'\] needs a GLIGEN fuser"):
        fused(x, cross_attention_kwargs={"gligen": {"objs": x}})


REFUSED = {
    "ada_norm": (dict(norm_type="ada_norm", num_embeds_ada_norm=10), "norm_type='ada_norm': only 'layer_norm'"),
    "ada_norm_zero": (dict(norm_type="ada_norm_zero", num_embeds_ada_norm=10), "norm_type='ada_norm_zero'"),
    "ada_norm_single": (dict(norm_type="ada_norm_single"), "norm_type='ada_norm_single'"),
    "ada_norm_continuous": (dict(norm_type="ada_norm_continuous", ada_norm_continous_conditioning_embedding_dim=8,
                                 ada_norm_bias=True), "norm_type='ada_norm_continuous'"),
    "layer_norm_i2vgen": (dict(norm_type="layer_norm_i2vgen"), "norm_type='layer_norm_i2vgen'"),
    "positional_embeddings": (dict(positional_embeddings="sinusoidal", num_positional_embeddings=8),
                              "positional_embeddings='sinusoidal' are not reproduced"),
    "gligen": (dict(cross_attention_dim=CONTEXT_DIM, attention_type="gated"),
               r"the GLIGEN fuser \(attention_type 'gated' or 'gated-text-image'\) is not reproduced"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_configurations_are_refused_with_the_reason(name):
    config, reason = REFUSED[name]
    block = BasicTransformerBlock(DIM, HEADS, HEAD_DIM, **config)
    with pytest.raises(ValueError, match=reason):
        mirage.nn.BasicTransformerBlock.from_diffusers(block)


def test_replaced_norms_are_refused():
    block = make_block(cross_attention_dim=CONTEXT_DIM)
    block.norm2 = nn.Identity()
    with pytest.raises(ValueError, match="norm2 is Identity, not nn.LayerNorm"):
        mirage.nn.BasicTransformerBlock.from_diffusers(block)


# ----------------------------------------------------------------------------------------------
# Through mirage.optimize


class Blocks(nn.Module):
    def __init__(self, *blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, context):
        for block in self.blocks:
            x = block(x, encoder_hidden_states=context)
        return x


def test_optimize_swaps_the_block_and_the_modules_inside_it():
    model = Blocks(make_block(torch.float32, cross_attention_dim=CONTEXT_DIM), make_block(torch.float32))
    original = copy.deepcopy(model).eval()
    optimized = mirage.optimize(model, dtype=torch.float32, verbose=False)
    result = mirage.report(optimized)
    assert result.counts == {"BasicTransformerBlock": 2, "Attention": 3, "GEGLU": 2, "LayerNorm": 2}
    assert [name for kind, name in result.swaps if kind == "LayerNorm"] == ["blocks.0.norm1", "blocks.1.norm1"]
    assert result.left_alone == []
    block = optimized.module.blocks[0]
    assert type(block) is mirage.nn.BasicTransformerBlock
    assert type(block.attn1) is mirage.nn.FusedAttention and type(block.attn2) is mirage.nn.FusedAttention
    assert type(block.ff.net[0]) is mirage.nn.GEGLU
    assert all(type(getattr(block, name)) is mirage.nn.LayerNorm for name in ("norm1", "norm2", "norm3"))
    x, context = inputs(CONTEXT_DIM, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x, context), original(x, context), atol=1e-5, rtol=1e-5)


def test_optimize_leaves_a_refused_block_alone_but_swaps_inside_it():
    model = Blocks(make_block(torch.float32, cross_attention_dim=CONTEXT_DIM, attention_type="gated"))
    original = copy.deepcopy(model).eval()
    optimized = mirage.optimize(model, dtype=torch.float32, verbose=False)
    result = mirage.report(optimized)
    assert result.left_alone == [("blocks.0", "BasicTransformerBlock: the GLIGEN fuser (attention_type 'gated' or "
                                              "'gated-text-image') is not reproduced")]
    assert result.counts["Attention"] == 3  # attn1, attn2 and the fuser's
    assert type(optimized.module.blocks[0]) is BasicTransformerBlock
    x, context = inputs(CONTEXT_DIM, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x, context), original(x, context), atol=1e-5, rtol=1e-5)


def test_optimize_refuses_norms_wider_than_the_cuda_kernel(monkeypatch):
    monkeypatch.setattr(sys.modules["mirage.optimize"], "LAYER_NORM_MAX_WIDTH", 8)
    model = Blocks(make_block(torch.float32))
    optimized = mirage.optimize(model, dtype=torch.float32, verbose=False)
    result = mirage.report(optimized)
    assert ("blocks.0", "BasicTransformerBlock: norm3 is 16 wide, beyond the 8 mirage's CUDA kernel handles") \
        in result.left_alone


@pytest.mark.parametrize("config", [
    dict(),
    dict(use_linear_projection=True),
    dict(only_cross_attention=True),
    dict(double_self_attention=True, cross_attention_dim=None),
])
def test_transformer_2d_model(config):
    config = {**dict(num_attention_heads=2, attention_head_dim=4, in_channels=8, norm_num_groups=4, num_layers=2,
                     cross_attention_dim=6), **config}
    model = Transformer2DModel(**config).eval()
    original = copy.deepcopy(model)
    blocks = sum(type(module) is BasicTransformerBlock for module in model.modules())
    optimized = mirage.optimize(model, dtype=torch.float32, verbose=False)
    result = mirage.report(optimized)
    assert blocks == 2 and result.counts["BasicTransformerBlock"] == blocks
    assert result.counts["LayerNorm"] == blocks and result.left_alone == []
    assert result.counts["Transformer2DModel"] == 1
    x = randn(2, 8, 4, 4)
    context = randn(2, 5, 6) if config["cross_attention_dim"] else None
    with torch.no_grad():
        torch.testing.assert_close(optimized(x, encoder_hidden_states=context).sample,
                                   original(x, encoder_hidden_states=context).sample, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_linear_projection", [False, True])
def test_transformer_2d_model_keeps_channels_last_and_values(use_linear_projection):
    # The swapped model ends in the permuted view, not diffusers' NCHW copy: the same values (up to
    # the 1x1 conv's summation order in the other layout), channels-last layout.
    model = Transformer2DModel(num_attention_heads=2, attention_head_dim=4, in_channels=8, norm_num_groups=4,
                               cross_attention_dim=6, use_linear_projection=use_linear_projection).double().eval()
    fused = mirage.nn.Transformer2DModel.from_diffusers(model)
    x = randn(2, 8, 5, 3, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    context = randn(2, 5, 6, dtype=torch.float64)
    with torch.no_grad():
        ours = fused(x, encoder_hidden_states=context, return_dict=False)[0]
        theirs = model(x, encoder_hidden_states=context).sample
    torch.testing.assert_close(ours, theirs, **tolerance(torch.float64))
    assert ours.is_contiguous(memory_format=torch.channels_last)


def test_transformer_2d_model_refuses_patched_input():
    model = Transformer2DModel(num_attention_heads=2, attention_head_dim=4, in_channels=4, patch_size=2,
                               sample_size=8, norm_type="ada_norm_zero", num_embeds_ada_norm=10)
    with pytest.raises(ValueError, match="patched input is not reproduced"):
        mirage.nn.Transformer2DModel.from_diffusers(model)


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    block = make_block(torch.float32, cross_attention_dim=CONTEXT_DIM)
    fused = mirage.optimize(Blocks(block), dtype=torch.float32, verbose=False).module.blocks[0]
    assert type(fused.attn1) is mirage.nn.FusedAttention
    compiled = torch.compile(fused, fullgraph=True)
    with torch.no_grad():
        for _ in range(2):  # new inputs each call: the compiled graph must not have baked them in
            x, context = inputs(CONTEXT_DIM, dtype=torch.float32)
            torch.testing.assert_close(compiled(x, encoder_hidden_states=context),
                                       fused(x, encoder_hidden_states=context), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_block_matches_the_unfused_arithmetic(dtype):
    block = make_block(torch.float32, cross_attention_dim=CONTEXT_DIM).to("cuda", dtype)
    reference = with_mirage_norms(block)
    fused = mirage.nn.BasicTransformerBlock.from_diffusers(block)
    x, context = (t.to("cuda") for t in inputs(CONTEXT_DIM, dtype=dtype))
    with torch.no_grad():
        with OpCounter() as counter:
            got = fused(x, encoder_hidden_states=context)
        expected = reference(x, encoder_hidden_states=context)
    assert counter.calls.count("mirage.add_layer_norm") == 2
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def test_from_diffusers_takes_the_blocks_it_names_and_their_mode():
    # A module of another kind failed later with an AttributeError or a reason that misled; a block
    # built from an eval-mode one reported training=True (ResnetBlock2D's forward reads it).
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.upsampling import Upsample2D
    from diffusers.models.unets.unet_2d_blocks import UpBlock2D

    for cls, name in ((mirage.nn.ResnetBlock2D, "ResnetBlock2D"), (mirage.nn.Upsample2D, "Upsample2D"),
                      (mirage.nn.UpBlock2D, "UpBlock2D"), (mirage.nn.BasicTransformerBlock, "BasicTransformerBlock"),
                      (mirage.nn.Transformer2DModel, "Transformer2DModel")):
        with pytest.raises(TypeError, match=rf"^mirage.nn.{name}.from_diffusers: expected a diffusers {name}, got Conv2d$"):
            cls.from_diffusers(nn.Conv2d(4, 4, 3))
    resnet = ResnetBlock2D(in_channels=8, out_channels=4, temb_channels=6, groups=2).eval()
    transformer = Transformer2DModel(num_attention_heads=2, attention_head_dim=4, in_channels=8,
                                     norm_num_groups=2).eval()
    assert not mirage.nn.ResnetBlock2D.from_diffusers(resnet).training
    assert not mirage.nn.Transformer2DModel.from_diffusers(transformer).training
    assert mirage.nn.ResnetBlock2D.from_diffusers(resnet.train()).training
    up = UpBlock2D(in_channels=4, prev_output_channel=4, out_channels=4, temb_channels=None, num_layers=1,
                   resnet_groups=2)
    assert isinstance(mirage.nn.UpBlock2D.from_diffusers(up), mirage.nn.UpBlock2D)
    # NCHW input gets NCHW output, also where both layouts describe it (1 x 1 images).
    upsample = mirage.nn.Upsample2D.from_diffusers(Upsample2D(4, use_conv=True).eval())
    with torch.no_grad():
        assert upsample(randn(2, 4, 1, 1)).is_contiguous()
