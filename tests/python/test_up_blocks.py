"""mirage.nn.cat_channels and the up-blocks that use it for the U-Net's skip connections."""

import copy

import pytest
import torch

import mirage
from common import DEVICES, DTYPES, randn
from tolerances import tolerance

CL = torch.channels_last


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [((2, 8, 5, 7), (2, 3, 5, 7)), ((1, 1, 1, 1), (1, 5, 1, 1)), ((3, 16, 4, 2), (3, 16, 4, 2))])
@pytest.mark.parametrize("layouts", [(CL, CL), (CL, torch.contiguous_format), (torch.contiguous_format,) * 2])
def test_cat_channels_is_torch_cat(device, dtype, shapes, layouts):
    a, b = (randn(*shape, dtype=dtype, device=device).contiguous(memory_format=layout)
            for shape, layout in zip(shapes, layouts))
    got, expected = mirage.nn.cat_channels(a, b), torch.cat([a, b], dim=1)
    assert torch.equal(got, expected)
    if layouts == (CL, CL):
        assert got.is_contiguous(memory_format=CL)


@pytest.mark.parametrize("shapes", [((0, 3, 2, 2), (0, 4, 2, 2)), ((2, 0, 2, 2), (2, 4, 2, 2)), ((2, 3, 0, 2), (2, 4, 0, 2))])
def test_cat_channels_of_empty_tensors(shapes):
    a, b = (torch.empty(*shape).contiguous(memory_format=CL) for shape in shapes)
    got = mirage.nn.cat_channels(a, b)
    assert got.shape == torch.cat([a, b], dim=1).shape


def test_cat_channels_strided_3d_and_mismatched_inputs():
    a = randn(2, 6, 4, 4).contiguous(memory_format=CL)[:, :, ::2]  # channels-last, not dense
    b = randn(2, 3, 2, 4)
    assert torch.equal(mirage.nn.cat_channels(a, b), torch.cat([a, b], dim=1))
    x, y = randn(2, 3, 5), randn(2, 4, 5)
    assert torch.equal(mirage.nn.cat_channels(x, y), torch.cat([x, y], dim=1))
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        mirage.nn.cat_channels(randn(2, 3, 4, 4).contiguous(memory_format=CL), randn(2, 3, 4, 5).contiguous(memory_format=CL))


def test_cat_channels_gradients():
    a = randn(2, 4, 3, 3, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_()
    b = randn(2, 2, 3, 3, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_()
    grad = randn(2, 6, 3, 3, dtype=torch.float64)
    mirage.nn.cat_channels(a, b).backward(grad)
    torch.testing.assert_close(a.grad, grad[:, :4])
    torch.testing.assert_close(b.grad, grad[:, 4:])


# ----------------------------------------------------------------------------------------------
# Up-blocks

blocks = pytest.importorskip("diffusers.models.unets.unet_2d_blocks")


def diffusers_up_block(cross_attention, add_upsample=True):
    torch.manual_seed(3)
    common = dict(in_channels=8, prev_output_channel=16, out_channels=16, temb_channels=12, num_layers=2,
                  resnet_groups=4, add_upsample=add_upsample)
    if cross_attention:
        block = blocks.CrossAttnUpBlock2D(cross_attention_dim=6, num_attention_heads=2, **common)
    else:
        block = blocks.UpBlock2D(**common)
    return block.double().eval()


def up_block_inputs(batch=2):
    # Skip connections popped from the end: the last one meets the block's input first.
    return (randn(batch, 16, 4, 4, dtype=torch.float64), (randn(batch, 8, 4, 4, dtype=torch.float64),
                                                           randn(batch, 16, 4, 4, dtype=torch.float64)),
            randn(batch, 12, dtype=torch.float64), randn(batch, 5, 6, dtype=torch.float64))


def run(block, cross_attention, inputs, layout, upsample_size=None):
    hidden, skips, temb, context = inputs
    # Copies: FreeU scales the block's input in place.
    hidden, skips = hidden.clone(memory_format=layout), tuple(s.clone(memory_format=layout) for s in skips)
    if cross_attention:
        return block(hidden, skips, temb, encoder_hidden_states=context, upsample_size=upsample_size)
    return block(hidden, skips, temb, upsample_size=upsample_size)


@pytest.mark.parametrize("cross_attention", [False, True])
@pytest.mark.parametrize("layout", [CL, torch.contiguous_format])
@pytest.mark.parametrize("upsample_size", [None, (9, 7)])
@pytest.mark.parametrize("freeu", [False, True])
def test_up_blocks_match_diffusers(cross_attention, layout, upsample_size, freeu):
    block = diffusers_up_block(cross_attention)
    cls = mirage.nn.CrossAttnUpBlock2D if cross_attention else mirage.nn.UpBlock2D
    fused = cls.from_diffusers(copy.deepcopy(block))
    assert sorted(fused.state_dict()) == sorted(block.state_dict())
    if freeu:  # what UNet2DConditionModel.enable_freeu sets on each up-block
        block.resolution_idx = fused.resolution_idx = 0
        for target in (block, fused):
            target.s1, target.s2, target.b1, target.b2 = 0.9, 0.2, 1.2, 1.4
    inputs = up_block_inputs()
    with torch.no_grad():
        torch.testing.assert_close(run(fused, cross_attention, inputs, layout, upsample_size),
                                   run(block, cross_attention, inputs, layout, upsample_size), **tolerance(torch.float64))


def test_up_block_gradient_checkpointing_and_gradients():
    # diffusers' enable_gradient_checkpointing sets these two attributes; the function here only
    # records its calls. (NCHW: on the H200 machine, torch 2.11, a float64 CPU backward through
    # the channels-last resnets under torch.utils.checkpoint segfaulted inside pytest, 2026-11-23.)
    block = diffusers_up_block(cross_attention=False, add_upsample=False).train()
    fused = mirage.nn.UpBlock2D.from_diffusers(copy.deepcopy(block))
    calls = []
    for target in (block, fused):
        target.gradient_checkpointing = True
        target._gradient_checkpointing_func = lambda fn, *args: calls.append(fn) or fn(*args)
    inputs = up_block_inputs()
    run(fused, False, inputs, torch.contiguous_format).sum().backward()
    assert calls == list(fused.resnets)
    run(block, False, inputs, torch.contiguous_format).sum().backward()
    for name, parameter in fused.named_parameters():
        torch.testing.assert_close(parameter.grad, dict(block.named_parameters())[name].grad)


def test_optimize_swaps_up_blocks_and_their_children():
    unet = pytest.importorskip("diffusers").UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, cross_attention_dim=8, attention_head_dim=2,
        sample_size=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    optimized = mirage.optimize(unet, dtype=torch.float32, verbose=False)
    up_blocks = optimized.module.up_blocks
    assert [type(b) for b in up_blocks] == [mirage.nn.UpBlock2D, mirage.nn.CrossAttnUpBlock2D]
    assert type(up_blocks[0].resnets[0]) is mirage.nn.ResnetBlock2D
    assert type(up_blocks[0].upsamplers[0]) is mirage.nn.Upsample2D
    assert type(up_blocks[1].attentions[0]) is mirage.nn.Transformer2DModel
    assert up_blocks[1].has_cross_attention and not hasattr(up_blocks[0], "has_cross_attention")


def test_cat_channels_compiles_fullgraph():
    a = randn(2, 4, 3, 5).contiguous(memory_format=CL)
    b = randn(2, 6, 3, 5).contiguous(memory_format=CL)
    compiled = torch.compile(mirage.nn.cat_channels, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a, b), torch.cat([a, b], dim=1))
