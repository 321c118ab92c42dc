from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ._diffusers import require_diffusers
from .calls import runs_plain
from .conv import conv_bias_act
from .group_norm import GroupNorm
from .linear import linear

TIME_EMBEDDING_NORMS = ("default", "scale_shift")


class ResnetBlock2D(nn.Module):
    """diffusers' ``ResnetBlock2D`` (0.42.1) with each GroupNorm → SiLU pair in one kernel.

    Built with :meth:`from_diffusers`; it shares every submodule and parameter of the block it
    replaces (state-dict keys are unchanged) and computes the same function as diffusers'
    forward: ``norm1`` → SiLU, optional up/down-sampling, ``conv1``, the time embedding (added,
    or applied as scale and shift), ``norm2`` → SiLU, ``dropout``, ``conv2``, the shortcut and
    ``/ output_scale_factor`` (skipped when it is 1, where it changes nothing).

    With ``time_embedding_norm="scale_shift"`` the modulation sits between ``norm2`` and the
    SiLU, so only ``norm1`` fuses its activation there.
    """

    def __init__(self) -> None:
        # Built only by from_diffusers: the block's own submodules are its state.
        super().__init__()

    @classmethod
    def from_diffusers(cls, block: nn.Module) -> "ResnetBlock2D":
        """The fused block for a diffusers ``ResnetBlock2D``, sharing its submodules.

        Args:
            block: an instance of ``diffusers.models.resnet.ResnetBlock2D``.

        Returns:
            A ``mirage.nn.ResnetBlock2D`` computing what ``block`` computes.

        Raises:
            ValueError: the block's configuration cannot be reproduced (the message says why):
                a nonlinearity other than SiLU, norms that are not ``nn.GroupNorm``, or an unknown
                ``time_embedding_norm`` together with a time embedding.
        """
        require_diffusers(block, "ResnetBlock2D", "mirage.nn.ResnetBlock2D.from_diffusers")
        nonlinearity = getattr(block, "nonlinearity", None)
        if type(nonlinearity) is not nn.SiLU:
            raise ValueError(
                f"non_linearity is {type(nonlinearity).__name__}; only SiLU fuses into the GroupNorm"
            )
        for name in ("norm1", "norm2"):
            norm = getattr(block, name, None)
            if type(norm) is not nn.GroupNorm:
                raise ValueError(f"{name} is {type(norm).__name__}, not nn.GroupNorm")
        mode = block.time_embedding_norm
        if block.time_emb_proj is not None and mode not in TIME_EMBEDDING_NORMS:
            raise ValueError(f"time_embedding_norm={mode!r} is not one of {TIME_EMBEDDING_NORMS}")

        fused = cls()
        fused.norm1 = GroupNorm.from_torch(block.norm1, activation="silu")
        # scale_shift modulates between norm2 and the activation: that activation stays separate.
        fused.norm2 = GroupNorm.from_torch(block.norm2, activation="none" if mode == "scale_shift" else "silu")
        fused.conv1 = block.conv1
        fused.conv2 = block.conv2
        fused.time_emb_proj = block.time_emb_proj
        fused.dropout = block.dropout
        fused.nonlinearity = block.nonlinearity
        fused.conv_shortcut = block.conv_shortcut
        # Upsample2D/Downsample2D modules, or the plain functions diffusers uses for the
        # "fir" and "sde_vp" kernels; either is called as it is.
        fused.upsample = block.upsample
        fused.downsample = block.downsample
        for attribute in ("in_channels", "out_channels", "use_conv_shortcut", "use_in_shortcut", "up",
                          "down", "output_scale_factor", "time_embedding_norm", "skip_time_act", "pre_norm"):
            setattr(fused, attribute, getattr(block, attribute))
        fused.training = block.training  # forward reads it; the shared children keep their own flags
        return fused

    def forward(self, input_tensor: Tensor, temb: Optional[Tensor], *args, **kwargs) -> Tensor:
        # diffusers accepts (and ignores) a deprecated `scale` argument here; so does this block.
        hidden_states = self.norm1(input_tensor)

        if self.upsample is not None:
            # As diffusers: upsample_nearest_nhwc fails for large batches (diffusers issue 984).
            if hidden_states.shape[0] >= 64:
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)

        # PyTorch adds a convolution's bias in a kernel of its own, a full pass over the
        # activations: conv1's bias and the [N, C] time embedding ("default" mode) go in one
        # bias_act pass instead, and in the other modes the bias alone. (Without time_emb_proj
        # diffusers adds a given temb as it is, broadcast from the right: that stays unfused.)
        projected = self.time_emb_proj is not None
        add_temb = self.time_embedding_norm == "default" and temb is not None
        fused_conv1 = runs_plain(self.conv1, nn.Conv2d) and (projected or not add_temb)
        conv1_bias_in_temb = False
        if projected:
            if temb is None:  # diffusers fails on it too, deep inside; say what is missing
                raise ValueError("mirage.nn.ResnetBlock2D: temb must not be None: the block has a time_emb_proj "
                                 "(temb_channels was set)")
            # The SiLU (from_diffusers checked the nonlinearity) is applied as the projection
            # reads temb, and conv1's bias joins the projection's epilogue as a residual broadcast
            # over the batch: one kernel for a few samples, where diffusers spends three.
            residual = None
            if fused_conv1 and add_temb and self.conv1.bias is not None and temb.dim() == 2:
                residual = self.conv1.bias.expand(temb.shape[0], -1)
                conv1_bias_in_temb = True
            temb = linear(self.time_emb_proj, temb, residual, "none" if self.skip_time_act else "silu")

        if fused_conv1:
            hidden_states = conv_bias_act(self.conv1, hidden_states, shift=temb if add_temb else None,
                                          conv_bias=not conv1_bias_in_temb)
        else:
            hidden_states = self.conv1(hidden_states)
        if fused_conv1 and add_temb:
            temb = None  # added
        elif temb is not None and projected:
            temb = temb[:, :, None, None]

        if self.time_embedding_norm == "scale_shift":
            if temb is None:
                raise ValueError("mirage.nn.ResnetBlock2D: `temb` must not be None when time_embedding_norm "
                                 "is 'scale_shift'")
            time_scale, time_shift = torch.chunk(temb, 2, dim=1)
            hidden_states = self.norm2(hidden_states)
            hidden_states = self.nonlinearity(hidden_states * (1 + time_scale) + time_shift)
        else:
            if self.time_embedding_norm == "default" and temb is not None:
                hidden_states = hidden_states + temb
            hidden_states = self.norm2(hidden_states)

        hidden_states = self.dropout(hidden_states)
        shortcut = self.conv_shortcut
        # As diffusers: contiguous only in training, where DDP wants matching gradient strides.
        if shortcut is not None and self.training:
            input_tensor = input_tensor.contiguous()
        if not runs_plain(self.conv2, nn.Conv2d) or not (shortcut is None or runs_plain(shortcut, nn.Conv2d)):
            if shortcut is not None:
                input_tensor = shortcut(input_tensor)
            output = input_tensor + self.conv2(hidden_states)
            # Dividing by 1 changes no value; skipping it saves a kernel launch and a pass.
            return output / self.output_scale_factor if self.output_scale_factor != 1.0 else output
        # conv2's bias, a 1x1 shortcut conv's bias, the residual add and 1 / output_scale_factor
        # in one bias_act pass after conv2 (PyTorch: a bias pass per conv, the add, the division).
        shortcut_bias = None
        if shortcut is not None:
            shortcut_bias = shortcut.bias
            input_tensor = shortcut._conv_forward(input_tensor, shortcut.weight, None)
        return conv_bias_act(self.conv2, hidden_states, shift=shortcut_bias, residual=input_tensor,
                             scale=1.0 / self.output_scale_factor)

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
                f"time_embedding_norm={self.time_embedding_norm!r}, up={self.up}, down={self.down}")
