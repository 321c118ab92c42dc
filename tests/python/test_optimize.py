"""mirage.optimize on tiny diffusers models (CPU, float32 unless said) and the SD-1.5 U-Net (GPU)."""

import copy
import gc
import pickle
import subprocess
import sys
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import TorchDispatchMode

import mirage
from mirage import graphs
from common import DEVICES, GraphStandIn, randn

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKL, UNet2DConditionModel, UNet2DModel  # noqa: E402
from diffusers.models.activations import GEGLU  # noqa: E402
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402
from diffusers.models.attention_processor import Attention  # noqa: E402
from diffusers.models.resnet import ResnetBlock2D  # noqa: E402
from diffusers.models.transformers.transformer_2d import Transformer2DModel  # noqa: E402
from diffusers.models.unets.unet_2d_blocks import CrossAttnUpBlock2D, UpBlock2D  # noqa: E402
from diffusers.models.upsampling import Upsample2D  # noqa: E402

# Whole models compound float32 rounding over tens of layers (the CPU reference kernels
# accumulate in float64, torch's norms in float32): a looser bound than one op's tolerance.
MODEL_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def relative_l2(got, expected):
    got, expected = got.double(), expected.double()
    return ((got - expected).norm() / expected.norm()).item()


def expected_counts(model):
    """Swaps by kind, counted from the model: what optimize should report."""
    counts, consumed = Counter(), set()
    for module in model.modules():
        if type(module) is ResnetBlock2D and type(module.nonlinearity) is nn.SiLU:
            counts["ResnetBlock2D"] += 1
            consumed |= {id(module.norm1), id(module.norm2)}
        elif type(module) is BasicTransformerBlock and module.norm_type == "layer_norm" and module.pos_embed is None \
                and getattr(module, "fuser", None) is None:
            counts["BasicTransformerBlock"] += 1
            consumed |= {id(module.norm2), id(module.norm3)}  # norm1 is swapped on its own
        elif type(module) is Attention:
            counts["Attention"] += 1
            consumed |= {id(inner) for inner in module.modules()}
        elif type(module) is GEGLU:
            counts["GEGLU"] += 1
        elif type(module) is Transformer2DModel and module.is_input_continuous:
            counts["Transformer2DModel"] += 1
        elif type(module) is Upsample2D and module.use_conv and not module.use_conv_transpose:
            counts["Upsample2D"] += 1
        elif type(module) in (UpBlock2D, CrossAttnUpBlock2D):
            counts[type(module).__name__] += 1
        elif type(module) is UNet2DConditionModel and type(module.conv_act) is nn.SiLU:
            counts["group_norm_silu"] += 1  # conv_norm_out and conv_act
            consumed.add(id(module.conv_norm_out))
    for module in model.modules():
        if id(module) not in consumed and type(module) in (nn.GroupNorm, nn.LayerNorm):
            counts[type(module).__name__] += 1
    return dict(counts)


def optimized_and_original(model, **options):
    """(optimize(model), an untouched copy of model); optimize changes the model in place."""
    model.eval()
    original = copy.deepcopy(model)
    options.setdefault("dtype", torch.float32)
    options.setdefault("verbose", False)
    return mirage.optimize(model, **options), original


def tiny_unet2d_condition(**config):
    defaults = dict(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, cross_attention_dim=8,
                    attention_head_dim=2, sample_size=8, in_channels=4, out_channels=4,
                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    return UNet2DConditionModel(**{**defaults, **config})


def unet2d_condition_inputs(batch=2, device="cpu"):
    return (randn(batch, 4, 8, 8, device=device), torch.tensor(321.0, device=device),
            randn(batch, 5, 8, device=device))


# ----------------------------------------------------------------------------------------------
# mirage.nn.ResnetBlock2D


RESNET_CONFIGS = {
    "shortcut": dict(in_channels=8, out_channels=12),
    "conv_shortcut": dict(in_channels=8, out_channels=12, conv_shortcut=True, conv_shortcut_bias=False),
    "no_temb": dict(in_channels=8, temb_channels=None),
    "scale_shift": dict(in_channels=8, time_embedding_norm="scale_shift"),
    "skip_time_act": dict(in_channels=8, skip_time_act=True, output_scale_factor=2.0),
    "groups_out": dict(in_channels=8, out_channels=12, groups_out=3, conv_2d_out_channels=6),
    "up": dict(in_channels=8, up=True),
    "down": dict(in_channels=8, down=True),
    "up_fir": dict(in_channels=8, up=True, kernel="fir"),
    "down_fir": dict(in_channels=8, down=True, kernel="fir"),
    "up_sde_vp": dict(in_channels=8, up=True, kernel="sde_vp"),
    "down_sde_vp": dict(in_channels=8, down=True, kernel="sde_vp"),
}


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("name", list(RESNET_CONFIGS))
def test_resnet_block_matches_diffusers(name, channels_last):
    config = {"temb_channels": 10, "groups": 4, "eps": 1e-5, **RESNET_CONFIGS[name]}
    block = ResnetBlock2D(**config).eval()
    fused = mirage.nn.ResnetBlock2D.from_diffusers(block).eval()
    assert fused.conv1 is block.conv1 and fused.norm1.weight is block.norm1.weight
    assert fused.state_dict().keys() == block.state_dict().keys()
    batch = 64 if name == "up" else 2  # diffusers' large-batch upsampling branch
    x = randn(batch, 8, 6, 6)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    temb = randn(batch, 10) if config["temb_channels"] else None
    with torch.no_grad():
        torch.testing.assert_close(fused(x, temb), block(x, temb), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("factor", [1.0, 2.0])
@pytest.mark.parametrize("out_channels", [8, 12])  # identity and 1x1-conv shortcut
def test_resnet_block_epilogues_run_in_bias_act(factor, out_channels):
    # PyTorch adds a convolution's bias in a pass of its own on the GPU, then the time embedding,
    # the residual and the division by output_scale_factor take a pass each. The fused block runs
    # every convolution without bias and does all of that in two bias_act passes.
    block = ResnetBlock2D(in_channels=8, out_channels=out_channels, temb_channels=10, groups=4,
                          output_scale_factor=factor).double().eval()
    fused = mirage.nn.ResnetBlock2D.from_diffusers(block).eval()
    x, temb = randn(2, 8, 6, 6, dtype=torch.float64), randn(2, 10, dtype=torch.float64)

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.conv_biases, self.ops = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.convolution:
                self.conv_biases.append(args[2] is not None)
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        with Calls() as calls:
            got = fused(x, temb)
        torch.testing.assert_close(got, block(x, temb), atol=1e-12, rtol=1e-12)
    assert not any(calls.conv_biases)
    assert calls.ops.count("mirage.bias_act") == 2
    assert calls.ops.count("aten.div") == 0
    # The time embedding's SiLU, projection and conv1's bias are one mirage.linear. Left: only the
    # add of the shortcut's bias to conv2's ([C] vectors), never a full-tensor add.
    assert calls.ops.count("mirage.linear") == 1 and calls.ops.count("aten.silu") == 0
    assert calls.ops.count("aten.add") == (1 if out_channels != 8 else 0)


@pytest.mark.parametrize("config", [dict(temb_channels=None, time_embedding_norm="group"),  # the VAE's
                                    dict(temb_channels=10, time_embedding_norm="scale_shift")])
def test_resnet_block_conv1_bias_runs_in_bias_act_in_every_mode(config):
    # Without a time embedding to add (the VAE's "group" blocks) or with one that modulates after
    # norm2 (scale_shift), conv1's bias still goes in a bias_act pass, not in PyTorch's own.
    block = ResnetBlock2D(in_channels=8, groups=4, **config).double().eval()
    fused = mirage.nn.ResnetBlock2D.from_diffusers(block).eval()
    x = randn(2, 8, 6, 6, dtype=torch.float64)
    temb = randn(2, 10, dtype=torch.float64) if config["temb_channels"] else None
    biases = []

    class ConvBiases(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.convolution:
                biases.append(args[2] is not None)
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        with ConvBiases():
            got = fused(x, temb)
        torch.testing.assert_close(got, block(x, temb), atol=1e-12, rtol=1e-12)
    assert biases == [False, False]


def test_resnet_block_broadcasts_one_time_embedding_over_the_batch():
    block = ResnetBlock2D(in_channels=8, out_channels=12, temb_channels=10, groups=4).double().eval()
    fused = mirage.nn.ResnetBlock2D.from_diffusers(block).eval()
    x, temb = randn(3, 8, 6, 6, dtype=torch.float64), randn(1, 10, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, temb), block(x, temb), atol=1e-12, rtol=1e-12)


def test_resnet_block_without_time_projection_adds_temb_as_diffusers_does():
    # No time_emb_proj: diffusers adds a given temb unprojected, broadcast from the last dimension.
    block = ResnetBlock2D(in_channels=8, temb_channels=None, groups=4).double().eval()
    fused = mirage.nn.ResnetBlock2D.from_diffusers(block).eval()
    x, temb = randn(2, 8, 5, 8, dtype=torch.float64), randn(8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, temb), block(x, temb), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(fused(x, None), block(x, None), atol=1e-12, rtol=1e-12)


def test_resnet_block_with_time_projection_needs_temb():
    block = ResnetBlock2D(in_channels=8, temb_channels=10, groups=4).eval()
    fused = mirage.nn.ResnetBlock2D.from_diffusers(block).eval()
    with pytest.raises(ValueError, match="mirage.nn.ResnetBlock2D: temb must not be None: the block has a "
                                         "time_emb_proj"):
        fused(randn(2, 8, 5, 8), None)


@pytest.mark.parametrize("nonlinearity", ["mish", "gelu"])
def test_resnet_block_refuses_other_nonlinearities(nonlinearity):
    block = ResnetBlock2D(in_channels=8, temb_channels=10, groups=4, non_linearity=nonlinearity)
    with pytest.raises(ValueError, match="non_linearity is (Mish|GELU); only SiLU fuses into the GroupNorm"):
        mirage.nn.ResnetBlock2D.from_diffusers(block)


def test_resnet_block_refuses_replaced_norms():
    block = ResnetBlock2D(in_channels=8, temb_channels=10, groups=4)
    block.norm2 = nn.Identity()
    with pytest.raises(ValueError, match="norm2 is Identity, not nn.GroupNorm"):
        mirage.nn.ResnetBlock2D.from_diffusers(block)


# ----------------------------------------------------------------------------------------------
# Whole diffusers models


def test_unet2d_condition_model():
    optimized, original = optimized_and_original(tiny_unet2d_condition())
    result = mirage.report(optimized)
    assert result.counts == expected_counts(original)
    assert result.counts["ResnetBlock2D"] == 8 and result.counts["Attention"] == 8
    blocks = sum(type(module) is BasicTransformerBlock for module in original.modules())
    assert blocks == 4 and result.counts["BasicTransformerBlock"] == blocks
    # Each block's norm1 is swapped on its own; its norm2 and norm3 belong to the fused block.
    assert result.counts["LayerNorm"] == blocks
    assert result.left_alone == []
    sample, timestep, context = unet2d_condition_inputs()
    with torch.no_grad():
        got = optimized(sample, timestep, encoder_hidden_states=context)
        expected = original(sample, timestep, encoder_hidden_states=context)
    assert type(got) is type(expected)
    torch.testing.assert_close(got.sample, expected.sample, **MODEL_TOLERANCE)
    # Same call signature: return_dict=False gives the plain tuple.
    with torch.no_grad():
        (plain,) = optimized(sample, timestep, context, return_dict=False)
    torch.testing.assert_close(plain, expected.sample, **MODEL_TOLERANCE)


def test_unet2d_condition_model_scale_shift_and_autocast():
    # dtype=None: float32 weights, forward under autocast(float16) (on the CPU here).
    optimized, original = optimized_and_original(tiny_unet2d_condition(resnet_time_scale_shift="scale_shift"),
                                                 dtype=None)
    assert next(optimized.parameters()).dtype == torch.float32
    assert mirage.report(optimized).counts == expected_counts(original)
    sample, timestep, context = unet2d_condition_inputs()
    with torch.no_grad():
        got = optimized(sample, timestep, context).sample
        expected = original(sample, timestep, context).sample
    assert got.dtype == torch.float16
    assert relative_l2(got, expected) < 1e-2
    # Converted afterwards, the weights are no longer "kept": the report says so.
    optimized.half()
    assert "the weights were converted to float16 after optimize" in str(mirage.report(optimized))


def test_unet2d_model_with_up_down_resnets_fir_kernels_and_scale_shift():
    # NCSN++-style blocks: resnets that up/down-sample with FIR kernels, output_scale_factor sqrt(2).
    model = UNet2DModel(block_out_channels=(32, 32), norm_num_groups=8, layers_per_block=1, sample_size=8,
                        in_channels=3, out_channels=3, attention_head_dim=4, resnet_time_scale_shift="scale_shift",
                        down_block_types=("SkipDownBlock2D", "AttnSkipDownBlock2D"),
                        up_block_types=("AttnSkipUpBlock2D", "SkipUpBlock2D"))
    optimized, original = optimized_and_original(model)
    counts = mirage.report(optimized).counts
    assert counts == expected_counts(original) and counts["ResnetBlock2D"] == 10
    sample = randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(optimized(sample, 3).sample, original(sample, 3).sample, **MODEL_TOLERANCE)


def test_unet2d_model_bfloat16_converts_weights_and_layout():
    model = UNet2DModel(block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1, sample_size=8,
                        in_channels=3, out_channels=3, attention_head_dim=4, downsample_type="resnet",
                        upsample_type="resnet", down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    optimized, original = optimized_and_original(model, dtype=torch.bfloat16)
    assert mirage.report(optimized).counts == expected_counts(original)
    assert all(p.dtype == torch.bfloat16 for p in optimized.parameters())
    conv = optimized.module.conv_in.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    sample = randn(2, 3, 8, 8)
    with torch.no_grad():
        got = optimized(sample.bfloat16(), torch.tensor(7)).sample
        expected = original(sample, torch.tensor(7)).sample
    assert got.dtype == torch.bfloat16 and relative_l2(got, expected) < 5e-2


@pytest.fixture
def tiny_vae():
    return AutoencoderKL(block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)


def test_autoencoder_kl(tiny_vae):
    optimized, original = optimized_and_original(tiny_vae)
    assert mirage.report(optimized).counts == expected_counts(original)
    image = randn(1, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(optimized(image).sample, original(image).sample, **MODEL_TOLERANCE)
        # Other methods fall through to the swapped model (eagerly).
        latents = randn(1, 4, 8, 8)
        torch.testing.assert_close(optimized.decode(latents).sample, original.decode(latents).sample,
                                   **MODEL_TOLERANCE)
    assert optimized.config.latent_channels == 4 and optimized.dtype == torch.float32


def test_settings_written_through_the_wrapper_reach_the_model(tiny_vae):
    optimized, original = optimized_and_original(tiny_vae)
    for model in (optimized, original):  # tiling of 12x12 latents in 8x8 tiles: the settings decide
        model.use_tiling = True
        model.tile_sample_min_size, model.tile_latent_min_size = 16, 8
    assert optimized.module.use_tiling and optimized.module.tile_latent_min_size == 8
    assert "use_tiling" not in vars(optimized)
    latents = randn(1, 4, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(optimized.decode(latents).sample, original.decode(latents).sample,
                                   **MODEL_TOLERANCE)
    optimized.note = "mine"  # the model has no such attribute: the wrapper keeps it
    assert vars(optimized)["note"] == "mine" and not hasattr(optimized.module, "note")
    optimized.verbose = True  # the wrapper's own setting, whatever the model has
    assert vars(optimized)["verbose"] is True
    # Not what the model reads from its config (diffusers warns, and the attribute would shadow
    # the config), nor private names (nn.Module's own, accelerate's hooks).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimized.sample_size = 64
    assert vars(optimized)["sample_size"] == 64 and "sample_size" not in vars(optimized.module)
    optimized._hf_hook = "hook"
    assert vars(optimized)["_hf_hook"] == "hook" and "_hf_hook" not in vars(optimized.module)


@pytest.mark.parametrize("part", ["encoder", "decoder"])
def test_autoencoder_kl_encoder_and_decoder(tiny_vae, part):
    optimized, original = optimized_and_original(getattr(tiny_vae, part))
    assert mirage.report(optimized).counts == expected_counts(original)
    x = randn(1, 3, 16, 16) if part == "encoder" else randn(1, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), original(x), **MODEL_TOLERANCE)


class PlainAttention(nn.Module):
    """Self-attention over the pixels, written by hand: separate q/k/v, softmax(q k^T) v."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, c, h, w = x.shape
        tokens = self.norm(x.flatten(2).transpose(1, 2))
        q, k, v = (proj(tokens).view(b, h * w, self.heads, c // self.heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        probs = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, h * w, c)
        return x + self.out(out).transpose(1, 2).reshape(b, c, h, w)


class PlainNet(nn.Module):
    """Conv -> BN -> SiLU blocks, GroupNorm -> SiLU, hand-written attention, a lone GroupNorm."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU())
        self.norm, self.act = nn.GroupNorm(4, 16), nn.SiLU()
        self.attention = PlainAttention(16, heads=2)
        self.norm_out = nn.GroupNorm(4, 16)
        self.head = nn.Conv2d(16, 3, 1)

    def forward(self, x):
        return self.head(self.norm_out(self.attention(self.act(self.norm(self.stem(x))))))


def test_plain_pytorch_net():
    model = PlainNet()
    with torch.no_grad():  # running statistics that are not the identity, so folding them matters
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.copy_(randn(16, mean=0.0, std=0.5))
                module.running_var.copy_(randn(16, mean=1.0, std=0.1).abs())
    optimized, original = optimized_and_original(model)
    result = mirage.report(optimized)
    assert result.counts == {"conv_bn_silu": 2, "group_norm_silu": 1, "attention": 1, "LayerNorm": 1,
                             "GroupNorm": 1}
    assert result.left_alone == []
    image = randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(optimized(image), original(image), **MODEL_TOLERANCE)


# ----------------------------------------------------------------------------------------------
# What is left alone, strict mode, unknown models


def test_unsupported_resnet_blocks_are_left_alone_with_the_reason():
    optimized, original = optimized_and_original(tiny_unet2d_condition(act_fn="mish"))
    result = mirage.report(optimized)
    resnets = [name for name, module in original.named_modules() if type(module) is ResnetBlock2D]
    assert [name for name, _ in result.left_alone] == resnets
    assert all(reason == "ResnetBlock2D: non_linearity is Mish; only SiLU fuses into the GroupNorm"
               for _, reason in result.left_alone)
    # Their norms are swapped one by one instead.
    assert "ResnetBlock2D" not in result.counts
    assert result.counts == expected_counts(original)
    assert "down_blocks.0.resnets.0: ResnetBlock2D: non_linearity is Mish" in str(result)
    sample, timestep, context = unet2d_condition_inputs()
    with torch.no_grad():
        torch.testing.assert_close(optimized(sample, timestep, context).sample,
                                   original(sample, timestep, context).sample, **MODEL_TOLERANCE)


class LowRankAdapter(nn.Module):
    """A LoRA-style wrapper as peft and hand-written injectors make them: the layer as
    ``base_layer`` (no kernel_size or out_features of its own) plus a low-rank update."""

    def __init__(self, base, features_in, features_out, conv=False):
        super().__init__()
        self.base_layer = base
        layer = nn.Conv2d if conv else nn.Linear
        self.down = layer(features_in, 2, 1, bias=False) if conv else layer(features_in, 2, bias=False)
        self.up = layer(2, features_out, 1, bias=False) if conv else layer(2, features_out, bias=False)

    def forward(self, x, *args, **kwargs):
        return self.base_layer(x) + self.up(self.down(x))


def test_wrapped_upsampler_convolutions_and_cross_attention_queries():
    # The upsampler's geometry was read from the wrapper before its type was checked, and the
    # cross-attention's width from the wrapped to_q: AttributeErrors that stopped optimize with
    # the model half swapped. The upsampler is left alone; the wrapped query runs as it is.
    model = tiny_unet2d_condition()
    upsampler = model.up_blocks[0].upsamplers[0]
    upsampler.conv = LowRankAdapter(upsampler.conv, 16, 16, conv=True)
    attention = model.down_blocks[0].attentions[0].transformer_blocks[0].attn2
    attention.to_q = LowRankAdapter(attention.to_q, 8, 8)
    optimized, original = optimized_and_original(model)
    result = mirage.report(optimized)
    reason = "Upsample2D: its convolution is a LowRankAdapter, not a plain nn.Conv2d"
    assert ("up_blocks.0.upsamplers.0", reason) in result.left_alone
    assert ("Attention", "down_blocks.0.attentions.0.transformer_blocks.0.attn2") in result.swaps
    assert isinstance(optimized.module.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_q, LowRankAdapter)
    sample, timestep, context = unet2d_condition_inputs()
    with torch.no_grad():
        torch.testing.assert_close(optimized(sample, timestep, context).sample,
                                   original(sample, timestep, context).sample, **MODEL_TOLERANCE)


def test_an_attention_left_alone_keeps_its_norms():
    # DeepFloyd-IF-like: the mid block's Attention has an added-KV processor (left alone) and a
    # norm_cross, whose exact type the processor tests; swapping it, as the norm pass once did,
    # made the forward fail where diffusers' runs.
    model = tiny_unet2d_condition(block_out_channels=(8, 8), mid_block_type="UNetMidBlock2DSimpleCrossAttn",
                                  cross_attention_norm="layer_norm")
    optimized, original = optimized_and_original(model, cuda_graph=False)
    attention = optimized.module.mid_block.attentions[0]
    assert type(attention.norm_cross) is type(original.mid_block.attentions[0].norm_cross)
    assert [where for where, _ in mirage.report(optimized).left_alone] == ["mid_block.attentions.0"]
    inputs = unet2d_condition_inputs()
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs).sample, original(*inputs).sample, atol=1e-5, rtol=1e-5)


class _SubclassedAttention(Attention):
    pass


@pytest.mark.parametrize("why", ["hooked", "subclassed"])
def test_an_attention_left_alone_for_hooks_or_its_class_keeps_what_is_inside(why):
    # Left alone for a reason other than its configuration, it was once still searched: its
    # norm_cross became mirage's LayerNorm and diffusers' processor refused it.
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            cls = _SubclassedAttention if why == "subclassed" else Attention
            self.attn = cls(query_dim=8, cross_attention_dim=6, heads=2, dim_head=4, cross_attention_norm="layer_norm")

        def forward(self, hidden, context):
            return self.attn(hidden, encoder_hidden_states=context)

    model = Wrapper()
    calls = []
    if why == "hooked":
        model.attn.register_forward_hook(lambda module, args, output: calls.append(1))
    optimized, original = optimized_and_original(model, cuda_graph=False)
    report = mirage.report(optimized)
    assert report.swaps == [] and [where for where, _ in report.left_alone] == ["attn"]
    assert type(optimized.module.attn.norm_cross) is nn.LayerNorm
    hidden, context = randn(2, 5, 8), randn(2, 3, 6)
    with torch.no_grad():
        output = optimized(hidden, context)
        assert calls == ([1] if why == "hooked" else [])  # the hook ran in the optimized model
        torch.testing.assert_close(output, original(hidden, context))


def test_an_attention_left_alone_is_not_searched_by_the_pattern_pass():
    from diffusers.models.attention_processor import SlicedAttnProcessor

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(query_dim=8, heads=2, dim_head=4, norm_num_groups=4)
            self.attn.set_processor(SlicedAttnProcessor(1))

        def forward(self, hidden):
            return self.attn(hidden)

    optimized, original = optimized_and_original(Wrapper(), cuda_graph=False)
    # Reported once, for its processor (the pattern pass once reported it again as untraceable),
    # and its GroupNorm kept.
    assert [where for where, _ in mirage.report(optimized).left_alone] == ["attn"]
    assert type(optimized.module.attn.group_norm) is nn.GroupNorm
    hidden = randn(2, 8, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(optimized(hidden), original(hidden))


def test_strict_raises_listing_every_candidate_left_alone():
    model = tiny_unet2d_condition(act_fn="mish")
    resnets = [name for name, module in model.named_modules() if type(module) is ResnetBlock2D]
    with pytest.raises(ValueError) as error:
        mirage.optimize(model, dtype=torch.float32, strict=True, verbose=False)
    message = str(error.value)
    assert message.startswith(f"mirage.optimize(strict=True): {len(resnets)} candidate(s) of UNet2DConditionModel")
    assert all(f"  {name}: ResnetBlock2D: non_linearity is Mish" in message for name in resnets)


def test_strict_passes_when_everything_is_swapped():
    optimized = mirage.optimize(tiny_unet2d_condition(), dtype=torch.float32, strict=True, verbose=False)
    assert mirage.report(optimized).left_alone == []


def test_subclasses_of_registered_types_are_left_alone():
    class CustomGroupNorm(nn.GroupNorm):
        pass

    model = nn.Sequential(nn.Conv2d(3, 8, 1), CustomGroupNorm(4, 8), nn.GroupNorm(2, 8))
    optimized, _ = optimized_and_original(model)
    result = mirage.report(optimized)
    assert result.counts == {"GroupNorm": 1}
    assert result.left_alone == [("1", "CustomGroupNorm subclasses GroupNorm and may compute differently")]


def test_unknown_model_passes_through_untouched(capsys):
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    model[2].eval()  # modes as the user left them, mixed
    optimized = mirage.optimize(model)  # defaults: float16, channels_last, graphs
    assert optimized is model
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert [m.training for m in model.modules()] == [True, True, True, False]
    result = mirage.report(model)
    assert result.untouched and result.swaps == [] and result.left_alone == []
    assert "nothing recognised" in str(result) and "returned untouched" in str(result)
    assert "nothing recognised; returned untouched" in capsys.readouterr().err


def test_a_model_built_from_mirage_modules_with_nothing_to_swap_passes_through_untouched():
    # Its mirage modules are the user's, not an earlier optimize's swaps: counted as such, the
    # model was converted to float16 in place and wrapped.
    model = nn.Sequential(nn.Linear(4, 8), mirage.nn.LayerNorm(8))
    assert mirage.optimize(model, verbose=False) is model
    assert model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert mirage.report(model).untouched


def test_modules_calling_mirage_ops_are_traced_and_fused():
    # The wrappers' tensor check refused torch.fx's proxies for a while: nothing calling a mirage
    # op could be traced, and the convolution and batch norm before it were no longer fused.
    class ConvBnBiasAct(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, x):
            return mirage.ops.bias_act(self.bn(self.conv(x)), None, None, "silu")

    optimized, original = optimized_and_original(ConvBnBiasAct(), cuda_graph=False)
    assert mirage.report(optimized).counts == {"conv_bn": 1}
    x = randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), original(x), **MODEL_TOLERANCE)


def test_mirage_imports_and_optimizes_without_diffusers():
    script = (
        "import sys; sys.modules['diffusers'] = None\n"  # any import of diffusers now fails
        "import torch, mirage\n"
        "model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.GroupNorm(2, 8))\n"
        "print(mirage.report(mirage.optimize(model, verbose=False)).counts)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "{'GroupNorm': 1}"


def test_report_refuses_models_optimize_did_not_return():
    with pytest.raises(ValueError, match="mirage.report: this Linear was not returned by mirage.optimize"):
        mirage.report(nn.Linear(2, 2))


def test_optimizing_an_optimized_model_returns_it_and_keeps_its_report(capsys):
    optimized, _ = optimized_and_original(tiny_unet2d_condition())
    before = str(mirage.report(optimized))
    assert mirage.optimize(optimized) is optimized
    assert str(mirage.report(optimized)) == before
    assert "the model is already optimized (an OptimizedModule); returned as it is" in capsys.readouterr().err


def test_attention_processors_set_after_optimize_are_refused():
    # diffusers' set_attn_processor reaches every attention module's set_processor: the fused
    # attention must refuse, not keep computing the default attention without a word.
    from diffusers.models.attention_processor import AttnProcessor

    optimized, original = optimized_and_original(tiny_unet2d_condition())
    with pytest.raises(ValueError, match="mirage's fused attention .* cannot take the processor AttnProcessor"):
        optimized.set_attn_processor(AttnProcessor())
    # What attn_processors lists (every attention module, as the original's does) is taken back:
    # diffusers' save-and-restore of processors.
    processors = optimized.attn_processors
    assert processors.keys() == original.attn_processors.keys()
    assert set(processors.values()) == {mirage.nn.FUSED_ATTENTION}
    optimized.set_attn_processor(processors)
    # diffusers rebuilds processors as type(processor)() (unloading an IP-Adapter); copies are the one instance.
    optimized.set_attn_processor(type(mirage.nn.FUSED_ATTENTION)())
    assert copy.deepcopy(mirage.nn.FUSED_ATTENTION) is mirage.nn.FUSED_ATTENTION
    assert pickle.loads(pickle.dumps(processors)) == processors
    with pytest.raises(ValueError, match="Cannot call `set_default_attn_processor` when attention processors are "
                                         r"of type mirage.nn.FUSED_ATTENTION \(mirage.optimize's fused attention"):
        optimized.set_default_attn_processor()
    with pytest.raises(TypeError, match="not a processor for diffusers' Attention"):
        mirage.nn.FUSED_ATTENTION()


def test_checkpoints_keep_diffusers_keys(tmp_path):
    # save_pretrained reaches the inner model: its fused attention projections must be written, and
    # read back, under diffusers' to_q / to_k / to_v keys.
    optimized, original = optimized_and_original(tiny_unet2d_condition())
    assert sorted(optimized.module.state_dict()) == sorted(original.state_dict())
    optimized.save_pretrained(tmp_path)
    reloaded = UNet2DConditionModel.from_pretrained(tmp_path).eval()
    other = tiny_unet2d_condition().eval()  # other weights, loaded into the optimized model
    optimized.module.load_state_dict(other.state_dict())
    args = unet2d_condition_inputs(2)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(*args).sample, original(*args).sample, rtol=0, atol=0)
        torch.testing.assert_close(optimized(*args).sample, other(*args).sample, **MODEL_TOLERANCE)


def test_report_string_and_settings(capsys):
    optimized = mirage.optimize(tiny_unet2d_condition(), dtype=torch.float16, cuda_graph=True)
    text = str(mirage.report(optimized))
    assert text.startswith("mirage.optimize(UNet2DConditionModel): 40 swapped, 0 left alone")
    assert "8  ResnetBlock2D -> mirage.nn.ResnetBlock2D (GroupNorm+SiLU fused)" in text
    assert "4  BasicTransformerBlock -> mirage.nn.BasicTransformerBlock (residual add+LayerNorm fused)" in text
    assert "1  Upsample2D -> mirage.nn.Upsample2D (2x2 sub-pixel convolutions, no upsampled image)" in text
    assert "1  group_norm_silu -> mirage.nn.GroupNorm(activation='silu')" in text  # conv_norm_out + conv_act
    assert "precision: float16 weights and buffers" in text
    assert "channels_last: 4-D weights and 4-D inputs" in text
    assert "CUDA graphs: off (skipped: the model is on cpu" in text
    err = capsys.readouterr().err
    assert "mirage: optimize UNet2DConditionModel: swapping modules" in err
    assert "mirage: optimize UNet2DConditionModel: 40 swapped, 0 left alone" in err


def test_bad_arguments():
    with pytest.raises(ValueError, match="mirage.optimize: dtype must be None or one of"):
        mirage.optimize(nn.Linear(2, 2), dtype=torch.int8)
    with pytest.raises(ValueError, match="mirage.optimize: max_graphs must be an int >= 1, got 0"):
        mirage.optimize(nn.Linear(2, 2), max_graphs=0)
    with pytest.raises(TypeError, match="mirage.optimize: model must be an nn.Module, got function"):
        mirage.optimize(lambda x: x)
    # A string is truthy: "False" would have turned the option on.
    for option in ("channels_last", "cuda_graph", "strict", "verbose"):
        with pytest.raises(ValueError, match=f"mirage.optimize: {option} must be True or False, got 'False'"):
            mirage.optimize(nn.Linear(2, 2), **{option: "False"})


class TakesAHostMask(nn.Module):
    """A model whose first input may sit on the CPU (a mask, or diffusers' timestep)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)  # something for optimize to swap
        self.proj = nn.Linear(8, 8)

    def forward(self, mask, x):
        return self.proj(self.norm(x)).masked_fill(~mask.to(x.device), 0.0)  # keeps the product's dtype


@pytest.mark.cuda
def test_autocast_follows_the_weights_device_not_the_first_input():
    optimized = mirage.optimize(TakesAHostMask().cuda(), dtype=None, cuda_graph=False, verbose=False)
    assert isinstance(optimized, mirage.OptimizedModule)
    with torch.no_grad():
        out = optimized(torch.ones(8, dtype=torch.bool), randn(2, 8, device="cuda"))
    assert out.dtype == torch.float16  # autocast on the CPU had left the CUDA product in float32


def test_an_optimized_model_goes_with_its_last_reference():
    """No reference cycle through its graph cache: the model and its GPU memory are freed when the
    last reference goes, not at the garbage collector's next pass (a pipeline swapping models)."""
    import weakref

    collecting = gc.isenabled()
    gc.disable()
    try:
        optimized = mirage.OptimizedModule(nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8)), max_graphs=2,
                                           verbose=False)
        gone = weakref.ref(optimized)
        del optimized
        assert gone() is None
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("make", [PlainNet, tiny_unet2d_condition], ids=["traced", "diffusers"])
def test_what_optimize_replaces_goes_with_the_callers_reference(make):
    """The modules and weights optimize replaces are freed when the caller lets go of the model it
    passed in, not at the garbage collector's next full pass: on an H200 the SD-1.5 U-Net's fused
    attention projections left 110 MiB of replaced q/k/v weights allocated (2026-11-30). Two
    cycles held them: the swap pass's recursive visitor and its record of visited modules, and
    torch.fx's Proxy.__iter__ (PlainNet's `b, c, h, w = x.shape`), which keeps the stack of the
    trace."""
    import weakref

    model = make().eval()
    before = [weakref.ref(t) for t in (*model.modules(), *model.parameters())]
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        model = mirage.optimize(model, dtype=torch.float32, cuda_graph=False, verbose=False)
        kept = {id(t) for t in (*model.modules(), *model.parameters())}
        lingering = [type(t).__name__ for t in (ref() for ref in before) if t is not None and id(t) not in kept]
        assert not lingering
    finally:
        if collecting:
            gc.enable()


# ----------------------------------------------------------------------------------------------
# OptimizedModule


class FlattensByView(nn.Module):
    """Conv-BN-ReLU, pooling, then ``x.view(N, -1)`` into a classifier: a view that channels-last
    memory does not allow (PyTorch raises), written as many classifiers are."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(x.view(x.size(0), -1))


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_is_turned_off_when_the_forward_views_an_activation(device, capfd):
    model = FlattensByView().eval().to(device)
    x = randn(2, 3, 8, 8, device=device)
    with torch.no_grad():
        expected = model(x)
        optimized = mirage.optimize(copy.deepcopy(model), dtype=torch.float32)
        assert mirage.report(optimized).channels_last
        outputs = [optimized(x), optimized(x)]
    for got in outputs:
        torch.testing.assert_close(got, expected, **MODEL_TOLERANCE)
    result = mirage.report(optimized)
    assert not result.channels_last and "view size is not compatible" in result.channels_last_note
    assert "channels_last: off (turned off at the first call" in str(result)
    assert all(p.is_contiguous() for p in optimized.parameters())
    err = capfd.readouterr().err
    # One line says what happened; torch.fx's printout of the handled failure is not shown.
    assert "mirage: optimize: channels_last turned off at the first call" in err and "Traceback" not in err


def test_the_channels_last_fallback_under_inference_mode_leaves_normal_weights(capfd):
    # Converted under the first call's inference mode, the weights were inference tensors, which
    # every later call with grad mode on refused ("Inference tensors cannot be saved for backward").
    model = FlattensByView().eval()
    x = randn(2, 3, 8, 8)
    optimized = mirage.optimize(copy.deepcopy(model), dtype=torch.float32, cuda_graph=False, verbose=False)
    with torch.inference_mode():
        optimized(x)
    assert not any(p.is_inference() for p in optimized.parameters())
    torch.testing.assert_close(optimized(x), model(x), **MODEL_TOLERANCE)
    assert "channels_last turned off" not in capfd.readouterr().err  # verbose=False: the report says it


class ViewsABlocksOutput(nn.Module):
    """A diffusers block, then a .view of its output (which diffusers returns NCHW-contiguous)."""

    def __init__(self, block):
        super().__init__()
        self.block, self.fc = block, nn.Linear(8 * 6 * 10, 4)

    def forward(self, x, *args):
        h = self.block(x, *args)
        h = h.sample if hasattr(h, "sample") else h  # both blocks give [2, 8, 6, 10] here
        return self.fc(h.view(h.shape[0], -1))


@pytest.mark.parametrize("which", ["transformer", "upsample"])
def test_nchw_input_gives_nchw_output_as_diffusers(which):
    from diffusers.models.transformers.transformer_2d import Transformer2DModel as DiffusersTransformer
    from diffusers.models.upsampling import Upsample2D as DiffusersUpsample

    if which == "transformer":
        block = DiffusersTransformer(num_attention_heads=2, attention_head_dim=4, in_channels=8, norm_num_groups=4,
                                     cross_attention_dim=6)
        args = (randn(2, 8, 6, 10), randn(2, 3, 6))
    else:
        block = DiffusersUpsample(8, use_conv=True)
        args = (randn(2, 8, 3, 5),)
    model = ViewsABlocksOutput(block).eval()
    with torch.no_grad():
        expected = model(*args)
        optimized = mirage.optimize(copy.deepcopy(model), dtype=torch.float32, channels_last=False, verbose=False)
        assert mirage.report(optimized).swaps
        torch.testing.assert_close(optimized(*args), expected, **MODEL_TOLERANCE)


class ViewsATransposedActivation(FlattensByView):
    """A .view that fails in any layout (of a transposed activation): not channels-last's fault."""

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(x.transpose(2, 3).view(x.size(0), -1))


def test_channels_last_stays_when_the_forward_fails_in_any_layout(capfd):
    optimized = mirage.optimize(ViewsATransposedActivation().eval(), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="view size is not compatible"), torch.no_grad():
        optimized(randn(2, 3, 8, 8))
    result = mirage.report(optimized)
    assert result.channels_last and result.channels_last_note == "" and optimized.channels_last
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in optimized.parameters() if p.dim() == 4)
    assert "channels_last turned off" not in capfd.readouterr().err


def test_stderr_of_a_failing_first_call_is_not_lost(capfd):
    class Noisy(FlattensByView):
        def forward(self, x):
            print("the model's own warning", file=sys.stderr)
            raise ValueError("the model's own error")

    optimized = mirage.optimize(Noisy().eval(), dtype=torch.float32, verbose=False)
    capfd.readouterr()  # optimize's trace of the forward printed the warning too
    with pytest.raises(ValueError, match="the model's own error"):
        optimized(randn(2, 3, 8, 8))
    assert "the model's own warning" in capfd.readouterr().err


def test_optimized_module_runs_forward_through_its_graph_cache():
    optimized, original = optimized_and_original(tiny_unet2d_condition(), cuda_graph=False)
    assert optimized.graphs is None
    seen = []
    optimized.module.conv_in.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    optimized.graphs = graphs.GraphCache(optimized._run, 2, capture=GraphStandIn, new_pool=object, verbose=False)
    with torch.no_grad():
        for batch in (2, 2, 1):
            sample, timestep, context = unet2d_condition_inputs(batch)
            torch.testing.assert_close(optimized(sample, timestep, context).sample,
                                       original(sample, timestep, context).sample, **MODEL_TOLERANCE)
    # 4-D inputs are made channels_last before the graph's signature is taken.
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x in seen)
    result = mirage.report(optimized)
    assert (result.graphs.hits, result.graphs.misses, result.graphs.entries) == (1, 2, 2)
    captured = list(optimized.graphs._entries.values())
    # Moving or casting the model replaces the tensors the graphs read: they are released.
    optimized.double()
    assert len(optimized.graphs) == 0 and all(graph.released for graph in captured)


def test_model_optimized_under_inference_mode_runs_outside_it():
    model = tiny_unet2d_condition()
    with torch.inference_mode():
        optimized = mirage.optimize(model, dtype=torch.float32, verbose=False)
    assert not any(p.is_inference() for p in optimized.parameters())
    optimized(*unet2d_condition_inputs())  # with grad mode on: no inference tensor may be saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 3e-3), (None, 3e-3)])
def test_a_model_built_under_inference_mode_is_optimized_and_runs(dtype, bound, device):
    # Its parameters are inference tensors; converted in place outside inference mode (dtype,
    # channels_last) they kept no version counter and every call failed, as in plain PyTorch (on
    # the GPU: the graph's first warm-up call).
    # optimize replaces them by normal copies, a tied one by one copy.
    reference = tiny_unet2d_condition().eval().to(device)
    with torch.inference_mode():
        model = copy.deepcopy(reference)
        model.tied = nn.Linear(2, 2)
        model.tied.bias = model.conv_in.bias  # a parameter of two modules (the forward never calls this one)

    def tensors():
        return [t for _, t in [*model.named_parameters(remove_duplicate=False),
                               *model.named_buffers(remove_duplicate=False)]]

    made_there = len({id(t) for t in tensors()})
    assert made_there == sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    assert all(t.is_inference() for t in tensors())
    optimized = mirage.optimize(model, dtype=dtype, verbose=False)
    assert not any(t.is_inference() for t in tensors())
    assert model.tied.bias is model.conv_in.bias and isinstance(model.tied.bias, nn.Parameter)
    # Those the swapped model still holds (the fused projections are new, normal tensors).
    assert 0 < mirage.report(optimized).inference_tensors < made_there
    assert "made under torch.inference_mode replaced by normal copies" in str(mirage.report(optimized))
    if device == "cuda":
        bound = max(bound, 3e-3)  # cuDNN's float32 convolutions run in TF32 (PyTorch's default)
    inputs = unet2d_condition_inputs(device=device)
    with torch.no_grad():
        expected = reference(*inputs).sample
    inputs = tuple(x.to(dtype or torch.float32) for x in inputs)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            assert relative_l2(optimized(*inputs).sample.float(), expected) < bound


class TaggedParameter(nn.Parameter):
    """A Parameter subclass carrying an attribute, as sharding and quantization libraries make."""


def test_a_plain_net_built_under_inference_mode_keeps_parameter_classes_and_fuses():
    reference = PlainNet().eval()
    with torch.inference_mode():
        model = copy.deepcopy(reference)
        model.head.weight = TaggedParameter(model.head.weight)
        model.head.weight.shard = "rows"
        # A wrapper subclass keeps its data in attributes: copied over the clone's, they came back.
        model.head.register_buffer("pair", TwoTensor(torch.ones(3), torch.zeros(3)))
    old_pair = model.head.pair
    optimized = mirage.optimize(model, dtype=torch.float32, verbose=False)
    pair = optimized.module.head.pair
    assert type(pair) is TwoTensor and not pair.a.is_inference() and pair.a.data_ptr() != old_pair.a.data_ptr()
    result = mirage.report(optimized)
    assert result.counts["conv_bn_silu"] == 2 and result.inference_tensors > 0
    head = optimized.module.head.weight
    assert type(head) is TaggedParameter and head.shard == "rows" and not head.is_inference()
    assert not any(t.is_inference() for t in [*optimized.parameters(), *optimized.buffers()])
    image = randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(optimized(image), reference(image), **MODEL_TOLERANCE)


def test_lazy_modules_are_refused_until_their_first_forward():
    model = nn.Sequential(nn.LazyConv2d(4, 3), nn.GroupNorm(2, 4), nn.SiLU())
    with pytest.raises(ValueError, match=r"mirage.optimize: the model has uninitialized parameters or buffers "
                                         r"\(lazy modules such as nn.LazyLinear\): run one forward first"):
        mirage.optimize(model, verbose=False)
    model(randn(1, 3, 6, 6))
    assert mirage.report(mirage.optimize(model, dtype=torch.float32, verbose=False)).counts == {"group_norm_silu": 1}


def test_a_model_built_under_inference_mode_left_untouched_keeps_its_tensors():
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    weights = [p for p in model.parameters()]
    assert mirage.optimize(model, verbose=False) is model
    assert all(a is b for a, b in zip(model.parameters(), weights)) and mirage.report(model).untouched


def test_optimized_module_reads_missing_attributes_from_the_model():
    optimized, original = optimized_and_original(tiny_unet2d_condition())
    assert optimized.config.cross_attention_dim == 8
    assert optimized.dtype == torch.float32 and optimized.device == torch.device("cpu")
    assert optimized.conv_in is optimized.module.conv_in
    assert optimized.num_parameters() == optimized.module.num_parameters() > 0  # a ModelMixin method
    assert not hasattr(optimized, "_hf_hook")
    with pytest.raises(AttributeError, match="no_such_thing"):
        optimized.no_such_thing


def test_modules_with_forward_hooks_are_left_alone_and_their_hooks_run():
    model = PlainNet()
    calls = []
    model.norm_out.register_forward_hook(lambda module, inputs, output: calls.append(1) or output * 2)
    optimized, original = optimized_and_original(model)
    result = mirage.report(optimized)
    assert ("norm_out", "GroupNorm: norm_out has forward hooks, which the replacement would not run") in result.left_alone
    assert "GroupNorm" not in result.counts and result.counts["conv_bn_silu"] == 2
    image = randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(optimized(image), original(image), **MODEL_TOLERANCE)
    assert len(calls) == 2  # the hook runs in the optimized model too


def test_optimizing_the_model_passed_in_again_sets_new_settings_around_its_swaps():
    # A diffusers model is swapped in place: optimized again (as the docs advise, for another
    # dtype), it came back bare, unconverted and reported as "nothing recognised".
    unet = tiny_unet2d_condition().eval()
    original = copy.deepcopy(unet)
    first = mirage.optimize(unet, dtype=torch.float32, cuda_graph=False, verbose=False)
    swaps = len(mirage.report(first).swaps)
    second = mirage.optimize(unet, dtype=torch.bfloat16, cuda_graph=False, verbose=False)
    assert isinstance(second, mirage.OptimizedModule) and next(second.parameters()).dtype == torch.bfloat16
    report = mirage.report(second)
    assert report.swaps == [] and report.swapped_before == swaps and not report.untouched
    assert f"swapped before: {swaps}, in place by an earlier mirage.optimize" in str(report)
    fresh = mirage.optimize(original, dtype=torch.bfloat16, cuda_graph=False, verbose=False)
    inputs = [t.bfloat16() for t in unet2d_condition_inputs()]
    with torch.no_grad():  # as optimizing an untouched copy in bfloat16 at once
        torch.testing.assert_close(second(*inputs).sample, fresh(*inputs).sample, rtol=0, atol=0)


@pytest.mark.parametrize("copy_by", ["deepcopy", "pickle"])
def test_a_copy_of_a_model_swapped_in_place_is_optimized_again(copy_by, tmp_path):
    # The earlier swaps were recorded by the model's identity: a copy came back as "nothing recognised".
    unet = tiny_unet2d_condition().eval()
    swaps = len(mirage.report(mirage.optimize(unet, dtype=torch.float32, cuda_graph=False, verbose=False)).swaps)
    if copy_by == "deepcopy":
        copied = copy.deepcopy(unet)
    else:
        torch.save(unet, tmp_path / "unet.pt")
        copied = torch.load(tmp_path / "unet.pt", weights_only=False)
    again = mirage.optimize(copied, dtype=torch.bfloat16, cuda_graph=False, verbose=False)
    assert isinstance(again, mirage.OptimizedModule) and next(again.parameters()).dtype == torch.bfloat16
    assert mirage.report(again).swapped_before == swaps
    # The model a first optimize returned, optimized again through .module, counts the same.
    assert mirage.report(mirage.optimize(again.module, verbose=False)).swapped_before == swaps


def test_a_model_whose_forward_was_traced_whole_claims_no_earlier_swaps():
    # Traced whole, the model passed in keeps its own modules (the returned one runs a new graph
    # module): optimized again it was said to hold the first call's swaps.
    model = PlainNet().eval()
    first = mirage.optimize(model, dtype=torch.float32, verbose=False)
    assert first.module is not model and mirage.report(first).swaps
    again = mirage.report(mirage.optimize(model, dtype=torch.float32, verbose=False))
    assert again.swapped_before == 0 and again.counts == mirage.report(first).counts


class ScaledForward(nn.Module):
    """Sets ``module.forward`` on the instance, as kohya-ss's LoRA ``apply_to`` and offloading
    wrappers do: the module keeps its type and has no hooks."""

    def __init__(self, module, factor):
        super().__init__()
        self.factor, self.inner_forward = factor, module.forward
        module.forward = self.forward

    def forward(self, *args, **kwargs):
        return self.inner_forward(*args, **kwargs) * self.factor


def test_modules_with_a_forward_set_on_the_instance_are_left_alone_and_it_runs():
    # They were swapped like any module of their type, and the replacement dropped the forward: a
    # LoRA patched in that way vanished from the output (30% off), with nothing in the report.
    unet = tiny_unet2d_condition()
    patched = ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", "down_blocks.1.resnets.0.conv1",
               "up_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj", "conv_norm_out"]
    for name in patched:
        ScaledForward(unet.get_submodule(name), 1.5)
    optimized, original = optimized_and_original(unet)
    reasons = [why for _, why in mirage.report(optimized).left_alone]
    for name in patched:
        assert any(why.endswith(f"{name} has a forward set on the instance, which the replacement would not run")
                   for why in reasons), (name, reasons)
    inputs = unet2d_condition_inputs()
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs).sample, original(*inputs).sample, **MODEL_TOLERANCE)


# The children of swapped blocks whose weights a fused path reads in place of calling them.
_READ_IN_PLACE = ["down_blocks.0.resnets.0.conv1", "down_blocks.1.resnets.0.conv2",
                  "down_blocks.1.resnets.0.conv_shortcut", "down_blocks.0.resnets.0.time_emb_proj",
                  "down_blocks.0.attentions.0.proj_in", "up_blocks.1.attentions.0.proj_out",
                  "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0",
                  "down_blocks.0.attentions.0.transformer_blocks.0.ff",
                  "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj",
                  "up_blocks.1.attentions.0.transformer_blocks.0.ff.net.2", "up_blocks.0.upsamplers.0.conv"]


@pytest.mark.parametrize("how", ["hook", "pre-hook", "forward"])
def test_hooks_and_forwards_set_after_optimize_run(how):
    # The swapped blocks read these children's weights in place of calling them: hooks and
    # patched forwards added after optimize were skipped without a word (up to 0.5 off).
    optimized, original = optimized_and_original(tiny_unet2d_condition())
    inputs = unet2d_condition_inputs()
    for name in _READ_IN_PLACE:
        handles = []
        for model in (optimized.module, original):
            child = model.get_submodule(name)
            if how == "hook":
                handles.append(child.register_forward_hook(lambda module, args, output: output * 0.5))
            elif how == "pre-hook":
                handles.append(child.register_forward_pre_hook(lambda module, args: (args[0] * 0.5, *args[1:])))
            else:
                ScaledForward(child, 0.5)
        with torch.no_grad():
            torch.testing.assert_close(optimized(*inputs).sample, original(*inputs).sample, **MODEL_TOLERANCE,
                                       msg=lambda text: f"{how} on {name}: {text}")
        for handle in handles:
            handle.remove()
        for model in (optimized.module, original):
            vars(model.get_submodule(name)).pop("forward", None)


def test_pytorch_encoder_layers_keep_their_norms():
    # Their fused inference op reads the norms' weights: swapped norms were counted but never ran.
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                          nn.LayerNorm(16))
    optimized, original = optimized_and_original(model, cuda_graph=False, strict=True)
    report = mirage.report(optimized)
    assert report.swaps == [("LayerNorm", "2")] and report.left_alone == []  # strict passes: nothing refused
    encoder = optimized.module[1]
    assert all(type(norm) is nn.LayerNorm for layer in encoder.layers for norm in (layer.norm1, layer.norm2))
    tokens = randn(2, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(optimized(tokens), original(tokens))


def test_a_hooked_module_two_passes_could_swap_is_reported_once():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4), nn.SiLU())
    model[1].register_forward_hook(lambda module, inputs, output: output)
    optimized, _ = optimized_and_original(model)
    # The pattern pass (GroupNorm -> SiLU) says so; the norm pass, which would swap it alone, not again.
    assert mirage.report(optimized).left_alone == [("1", "1 has forward hooks, which the fused module would not run")]


def test_the_model_passed_in_is_converted_whole_when_its_forward_is_traced():
    model = PlainNet()
    optimized = mirage.optimize(model, dtype=torch.float16, channels_last=True, cuda_graph=False, verbose=False)
    # The traced forward is a new root; the model passed in keeps its own convolutions and norms,
    # converted with the rest (not float32 ones beside float16 ones it shares with the new root).
    assert isinstance(optimized.module, torch.fx.GraphModule) and optimized.module is not model
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in model.parameters() if p.dim() == 4)


def test_a_model_pickled_before_graph_keys_finds_its_keyed_modules():
    optimized, _ = optimized_and_original(tiny_unet2d_condition())
    state = optimized.__getstate__()
    del state["_keyed"]  # as pickled before the FreeU factors joined the graphs' signature
    restored = mirage.OptimizedModule.__new__(mirage.OptimizedModule)
    restored.__setstate__(state)
    assert [type(m) for m in restored._keyed] == [type(m) for m in optimized._keyed] and restored._keyed


def test_optimized_module_is_for_inference_and_copies_whole():
    optimized, original = optimized_and_original(PlainNet())
    assert not optimized.training
    optimized.eval()
    with pytest.raises(RuntimeError, match="mirage.optimize: the optimized model is for inference only"):
        optimized.train()
    copied = copy.deepcopy(optimized)
    assert type(copied) is mirage.OptimizedModule and copied.module is not optimized.module
    assert mirage.report(copied).counts == mirage.report(optimized).counts and not copied.training
    pickled = pickle.loads(pickle.dumps(optimized))
    assert type(pickled) is mirage.OptimizedModule and str(mirage.report(pickled)) == str(mirage.report(optimized))
    image = randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(copied(image), optimized(image))
        torch.testing.assert_close(pickled(image), optimized(image))


def test_compiled_optimized_module_does_not_recompile_after_an_eager_call():
    optimized, _ = optimized_and_original(PlainNet())
    compiles = []

    def backend(graph_module, example_inputs):
        compiles.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(optimized, backend=backend)
    image = randn(2, 3, 8, 8)
    with torch.no_grad():
        compiled(image)
        optimized(image)  # the first eager call proves the channels-last layout
        compiled(image)
    assert len(compiles) == 1


def test_compiled_optimized_unet_with_dynamic_shapes_compiles_once():
    """An optimized U-Net under torch.compile(dynamic=True) is traced once for several batches and
    resolutions (its mirage ops keep the sizes symbolic) and gives the optimized model's outputs."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    optimized, _ = optimized_and_original(tiny_unet2d_condition(), cuda_graph=False)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(optimized, backend=counter, dynamic=True)
    # Sizes unlike the model's own (cross_attention_dim 8): equal sizes would be traced as one symbol.
    traces = []
    for batch, side in ((2, 12), (3, 16), (4, 20)):
        inputs = (randn(batch, 4, side, side), torch.tensor(321.0), randn(batch, 5, 8))
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs).sample, optimized(*inputs).sample)
        traces.append(counter.frame_count)
    assert traces[0] == traces[1] == traces[2], f"traces after each call: {traces}"


# ----------------------------------------------------------------------------------------------
# On a GPU


def sd15_unet():
    return UNet2DConditionModel(block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768,
                                attention_head_dim=8, layers_per_block=2, sample_size=64)


def sd15_inputs(batch):
    return (randn(batch, 4, 64, 64, device="cuda", mean=0.0, std=1.0), torch.tensor(500.0, device="cuda"),
            randn(batch, 77, 768, device="cuda", mean=0.0, std=1.0))


@pytest.mark.cuda
def test_sd15_unet_float16_graphs_match_float32_eager():
    torch.manual_seed(0)
    unet = sd15_unet().cuda().eval()
    reference = copy.deepcopy(unet)
    optimized = mirage.optimize(unet)  # float16, channels_last, CUDA graphs
    result = mirage.report(optimized)
    assert result.left_alone == [] and result.cuda_graph
    assert result.counts == expected_counts(reference)

    def half(inputs):
        return tuple(x.half() if x.is_floating_point() and x.dim() else x for x in inputs)

    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for _ in range(2):  # new inputs each replay
            inputs = sd15_inputs(2)
            got = optimized(*half(inputs)).sample
            expected = reference(*inputs).sample
            assert got.dtype == torch.float16
            assert relative_l2(got, expected) <= 3e-3
            # The replay equals the same optimized model run eagerly.
            sample, timestep, context = half(inputs)
            eager = optimized.module(sample.contiguous(memory_format=torch.channels_last), timestep, context).sample
            torch.testing.assert_close(got, eager, atol=2e-3, rtol=2e-3)
        got = optimized(*half(sd15_inputs(1))).sample  # a new shape: a new graph
        assert got.shape == (1, 4, 64, 64)
        # 1,000 replays with changing inputs: the graphs' memory is their pool, nothing grows.
        inputs = half(sd15_inputs(2))
        optimized(*inputs)
        # Collected first and last: CUDA tensors held by cyclic garbage (of earlier tests in this
        # process, say) would otherwise be freed whenever the collector happens to run.
        gc.collect()
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        for _ in range(1000):
            inputs[0].normal_()
            optimized(*inputs)
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == allocated and torch.cuda.memory_reserved() == reserved
    stats = mirage.report(optimized).graphs
    assert (stats.misses, stats.hits, stats.entries) == (2, 1002, 2)


@pytest.mark.cuda
def test_tiny_unet_autocast_graphs_on_gpu():
    optimized, original = optimized_and_original(tiny_unet2d_condition().cuda(), dtype=None, cuda_graph=True)
    with torch.no_grad():
        for _ in range(3):
            sample, timestep, context = unet2d_condition_inputs(device="cuda")
            got = optimized(sample, timestep, context).sample
            expected = original(sample, timestep, context).sample
            assert relative_l2(got, expected) < 5e-3
    assert mirage.report(optimized).graphs.misses == 1


@pytest.mark.cuda
def test_a_copy_of_a_graphed_model_captures_its_own_graphs():
    optimized, original = optimized_and_original(PlainNet().cuda(), dtype=torch.float16, cuda_graph=True)
    image = randn(2, 3, 8, 8, device="cuda")
    with torch.no_grad():
        first = optimized(image.half())
        copied = copy.deepcopy(optimized)
        again = copied(image.half())
    assert copied.graphs is not optimized.graphs and len(copied.graphs) == 1 and len(optimized.graphs) == 1
    assert next(copied.parameters()).data_ptr() != next(optimized.parameters()).data_ptr()
    torch.testing.assert_close(again, first)


def test_a_to_that_changes_nothing_keeps_the_graphs_and_a_move_off_cuda_pauses_them():
    # accelerate's CPU offload (diffusers' enable_model_cpu_offload) calls .to(device) before
    # every forward: the graphs were once released each time, a capture per step.
    optimized, original = optimized_and_original(PlainNet(), cuda_graph=False)
    optimized.graphs = graphs.GraphCache(optimized._run, 2, capture=GraphStandIn, new_pool=object, verbose=False)
    image = randn(2, 3, 8, 8)
    with torch.no_grad():
        for _ in range(3):
            optimized.to("cpu")
            optimized(image)
        assert (optimized.graphs.stats().misses, optimized.graphs.stats().hits) == (1, 2)
        # A conversion replaces the tensors: the graphs go. The model is on the CPU, off CUDA: the
        # next calls run eagerly (on a GPU, until the model is back on one device: the cuda test).
        optimized.double()
        assert len(optimized.graphs) == 0
        assert "CUDA graphs: off (paused: the model is not on one CUDA device" in str(mirage.report(optimized))
        torch.testing.assert_close(optimized(image.double()), original.double()(image.double()), **MODEL_TOLERANCE)
        assert optimized.graphs.stats().misses == 1


def test_a_traced_optimized_model_records_its_ops_not_a_graph_replay(tmp_path):
    # A trace through the graphs recorded a replay's static outputs as constants: the traced module
    # returned the example's result for any input. LibTorch programs load such traced modules.
    optimized, original = optimized_and_original(PlainNet(), cuda_graph=False)
    optimized.graphs = graphs.GraphCache(optimized._run, 2, capture=GraphStandIn, new_pool=object, verbose=False)
    with torch.no_grad():
        # (Its check_trace would call the module once more, untraced, through the graphs.)
        traced = torch.jit.trace(optimized, (randn(2, 3, 8, 8),), check_trace=False)
    assert len(optimized.graphs) == 0 and optimized.graphs.stats().misses == 0
    assert "mirage::" in str(traced.inlined_graph)  # mirage's ops are in the trace
    traced.save(str(tmp_path / "optimized.pt"))
    loaded = torch.jit.load(str(tmp_path / "optimized.pt"))
    image = randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(image), original(image), **MODEL_TOLERANCE)


@pytest.mark.parametrize("called_first", [False, True])
@pytest.mark.parametrize("traced", ["wrapper", "module"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_traced_optimized_unet_folds_its_upsamplers_from_their_weights(grad, traced, called_first, tmp_path):
    # The swapped Upsample2D folded its 2x2 kernels at the first call and then read the cache: a
    # trace recorded the fold, jit.trace's check (rerun under no_grad) the cached kernels, and the
    # two graphs differed; traced after a call, the kernels were a constant of the trace, which
    # ignored later weight changes (and .to() of the loaded module).
    optimized, original = optimized_and_original(tiny_unet2d_condition(), cuda_graph=False)
    inputs = unet2d_condition_inputs()
    if called_first:
        with torch.no_grad():
            optimized(*inputs)  # folds and caches the kernels
    with torch.set_grad_enabled(grad):
        # Checked against a rerun (check_trace).
        traced = torch.jit.trace(optimized if traced == "wrapper" else optimized.module, inputs, strict=False)
    traced.save(str(tmp_path / "unet.pt"))
    loaded = torch.jit.load(str(tmp_path / "unet.pt"))
    with torch.no_grad():
        for model in (loaded, original):  # the same change to the upsamplers' weights of both
            for key, value in model.state_dict().items():
                if "upsamplers" in key:
                    value.mul_(0.5)
        torch.testing.assert_close(loaded(*inputs)["sample"], original(*inputs).sample, **MODEL_TOLERANCE)


def test_freeu_switched_after_optimize_captures_a_graph_of_its_own():
    # diffusers' enable_freeu / disable_freeu on an optimized model set the up-blocks' factors,
    # which their forward reads in Python: a graph captured before once kept its setting.
    optimized, original = optimized_and_original(tiny_unet2d_condition())
    optimized.graphs = graphs.GraphCache(optimized._run, 4, capture=GraphStandIn, new_pool=object, verbose=False)
    sample, timestep, context = unet2d_condition_inputs()
    factors = dict(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    with torch.no_grad():
        plain = optimized(sample, timestep, context).sample
        optimized.enable_freeu(**factors)
        original.enable_freeu(**factors)
        freeu = optimized(sample, timestep, context).sample
        torch.testing.assert_close(freeu, original(sample, timestep, context).sample, **MODEL_TOLERANCE)
        assert optimized.graphs.stats().misses == 2
        optimized.disable_freeu()
        torch.testing.assert_close(optimized(sample, timestep, context).sample, plain)
    assert (optimized.graphs.stats().misses, optimized.graphs.stats().hits) == (2, 1)
    assert (freeu - plain).abs().max() > 1e-3


@pytest.mark.cuda
def test_graph_refusals_of_an_optimized_model_say_how_to_run_without_graphs():
    optimized, _ = optimized_and_original(PlainNet().cuda(), cuda_graph=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"input args\[0\] is on cpu(.|\n)*cuda_graph=False"):
        optimized(randn(2, 3, 8, 8))


@pytest.mark.cuda
def test_a_graph_cache_kept_without_its_model_says_so():
    optimized, _ = optimized_and_original(PlainNet().cuda(), cuda_graph=True)
    cache = optimized.graphs
    del optimized
    gc.collect()
    with torch.no_grad(), pytest.raises(RuntimeError, match="this graph cache's model is gone"):
        cache(randn(2, 3, 8, 8, device="cuda"))


@pytest.mark.cuda
def test_a_model_moved_to_the_cpu_runs_eagerly_and_captures_again_back_on_the_gpu():
    optimized, original = optimized_and_original(PlainNet().cuda(), cuda_graph=True)
    image = randn(2, 3, 8, 8, device="cuda")
    with torch.no_grad():
        expected = original(image)
        torch.testing.assert_close(optimized(image), expected, **MODEL_TOLERANCE)
        optimized.cpu()
        torch.testing.assert_close(optimized(image.cpu()), expected.cpu(), **MODEL_TOLERANCE)
        assert len(optimized.graphs) == 0
        optimized.cuda()
        torch.testing.assert_close(optimized(image), expected, **MODEL_TOLERANCE)
    assert (len(optimized.graphs), optimized.graphs.stats().misses) == (1, 2)


def test_a_model_without_tensors_says_why_it_gets_no_graphs():
    optimized = mirage.optimize(nn.Sequential(nn.GroupNorm(2, 4, affine=False), nn.SiLU()), verbose=False)
    assert mirage.report(optimized).cuda_graph_note == (
        "skipped: the model has no parameters or buffers, so nothing places it on a CUDA device; capture its "
        "calls with mirage.graphs.capture")


def test_a_hooked_norm_the_pattern_pass_reported_for_another_reason_gets_its_hook_reason_too():
    class Branching(nn.Module):  # the norm's output also used without the SiLU: not a pattern
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)

        def forward(self, x):
            y = self.norm(x)
            return F.silu(y) + y

    model = Branching()
    model.norm.register_forward_hook(lambda module, inputs, output: output)
    optimized, _ = optimized_and_original(model)
    reasons = [why for where, why in mirage.report(optimized).left_alone if where == "norm"]
    assert any("has forward hooks" in why for why in reasons), reasons


def test_a_conversion_after_optimize_shows_in_the_report_and_the_hint():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.SiLU())
    optimized = mirage.optimize(model, cuda_graph=False, verbose=False).float()
    result = mirage.report(optimized)
    assert result.dtype == torch.float32 and result.precision_note == "converted from float16 after optimize"
    assert ("precision: float32 weights and buffers (mirage norms keep float32 statistics); converted from float16 "
            "after optimize") in str(result)
    with pytest.raises(RuntimeError) as error:
        optimized(torch.randn(1, 3, 8, 8, dtype=torch.float16))
    # float32 is not optimize's dtype, and dtype=None (float32 weights under autocast) is no way out.
    assert str(error.value).endswith("mirage.optimize: the model's weights are float32 and input args[0] is float16; "
                                     "mirage does not cast inputs: pass them in float32 (args[0].to(torch.float32))")


def test_the_dtype_hint_names_the_inputs_in_another_dtype_and_keeps_the_error_type():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj = nn.GroupNorm(2, 4), nn.Linear(8, 4)

        def forward(self, x, scale, context):
            return self.norm(x) * scale + self.proj(context["text"]).mean()

    optimized = mirage.optimize(TwoInputs(), cuda_graph=False, channels_last=False, verbose=False)
    x = torch.randn(1, 4, 2, 2, dtype=torch.float16)
    # A float32 scalar (a timestep, which the model may well cast itself) is not blamed beside a
    # nested float32 matrix.
    with pytest.raises(RuntimeError, match=r"input args\[2\]\['text'\] is float32; mirage does not cast") as error:
        optimized(x, torch.tensor(0.5), {"text": torch.randn(1, 8)})
    assert "args[1]" not in str(error.value)

    class Refusal(RuntimeError):
        pass

    def refuse(*args, **kwargs):
        raise Refusal("expected scalar type Half")

    optimized._run = refuse
    with pytest.raises(Refusal, match=r"(?s)expected scalar type Half\n.*input args\[0\] is float32"):
        optimized(torch.randn(1, 4, 2, 2))


def test_inputs_in_another_dtype_than_the_weights_get_a_hint():
    # The likeliest first mistake: float32 inputs to a model optimize made float16 (it casts no
    # inputs); PyTorch's error names neither mirage nor the input.
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.SiLU())
    optimized = mirage.optimize(model, cuda_graph=False, verbose=False)
    with pytest.raises(RuntimeError, match=r"(?s)should be the same.*mirage.optimize: the model's weights are float16 "
                                           r"\(optimize's dtype\) and input args\[0\] is float32; mirage does not "
                                           r"cast inputs"):
        optimized(torch.randn(1, 3, 8, 8))
    assert optimized(torch.randn(1, 3, 8, 8, dtype=torch.float16)).dtype == torch.float16
    with pytest.raises(RuntimeError) as error:  # another error gets no hint
        optimized(torch.randn(1, 5, 8, 8, dtype=torch.float16))
    assert "mirage.optimize:" not in str(error.value)
