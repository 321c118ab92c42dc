"""diffusers' U-Net up-blocks with a faster skip-connection concatenation."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ._diffusers import require_diffusers


def cat_channels(a: Tensor, b: Tensor) -> Tensor:
    """``torch.cat([a, b], dim=1)``, the same values, faster for channels-last 4-D tensors.

    Channels-last, a channel concatenation interleaves the two inputs pixel by pixel. PyTorch's
    4-D ``cat`` does that element by element at 0.55-1.6 TB/s on an H200; the same ``cat`` of the
    tensors' ``[N*H*W, C]`` row views (free for channels-last tensors) takes its vectorized path
    and runs at 0.8-3.7 TB/s, about twice as fast at the SD-1.5 U-Net's shapes
    (docs/perf/unet.md). The result is channels-last as before.
    """
    last = torch.channels_last
    if a.dim() != 4 or b.dim() != 4 or not (a.is_contiguous(memory_format=last) and b.is_contiguous(memory_format=last)):
        return torch.cat([a, b], dim=1)
    n, ca, h, w = a.shape
    cb = b.shape[1]
    if b.shape[0] != n or b.shape[2:] != a.shape[2:]:
        return torch.cat([a, b], dim=1)  # let PyTorch raise its own error
    rows = torch.cat([a.permute(0, 2, 3, 1).reshape(n * h * w, ca), b.permute(0, 2, 3, 1).reshape(n * h * w, cb)], dim=1)
    return rows.view(n, h, w, ca + cb).permute(0, 3, 1, 2)


class UpBlock2D(nn.Module):
    """diffusers' ``UpBlock2D`` (0.42.1) with the skip connections concatenated by
    :func:`cat_channels`; otherwise the same forward (FreeU and gradient checkpointing
    included). Built with :meth:`from_diffusers`, sharing the block's submodules (state-dict
    keys are unchanged); its resnets and up-samplers are swapped in turn by ``mirage.optimize``.
    """

    # The block's own modules, only ever called: optimize may swap them.
    children_swappable = True

    def __init__(self) -> None:
        # Built only by from_diffusers: the block's own submodules are its state.
        super().__init__()

    @classmethod
    def from_diffusers(cls, block: nn.Module) -> "UpBlock2D":
        require_diffusers(block, cls.__name__, f"mirage.nn.{cls.__name__}.from_diffusers")
        fused = cls()
        fused.resnets = block.resnets
        if hasattr(block, "attentions"):
            fused.attentions = block.attentions
        fused.upsamplers = block.upsamplers
        for attribute in ("resolution_idx", "gradient_checkpointing", "has_cross_attention", "num_attention_heads",
                          "_gradient_checkpointing_func"):
            if hasattr(block, attribute):
                setattr(fused, attribute, getattr(block, attribute))
        # FreeU's settings, when enable_freeu ran before the swap.
        for attribute in ("s1", "s2", "b1", "b2"):
            if getattr(block, attribute, None) is not None:
                setattr(fused, attribute, getattr(block, attribute))
        return fused.train(block.training)

    def graph_key(self) -> Tuple[Any, ...]:
        """FreeU's factors, which the forward reads in Python: diffusers' enable_freeu and
        disable_freeu set them on a model already optimized, and a CUDA graph captured before
        would keep the old ones (mirage.optimize adds this to each call's graph signature)."""
        return tuple(getattr(self, name, None) for name in ("s1", "s2", "b1", "b2"))

    def forward(self, hidden_states: Tensor, res_hidden_states_tuple: Sequence[Tensor], temb: Optional[Tensor] = None,
                upsample_size: Optional[Sequence[int]] = None, *args, **kwargs) -> Tensor:
        # diffusers accepts (and ignores) a deprecated `scale` argument here; so does this block.
        return self._run(hidden_states, res_hidden_states_tuple, temb, upsample_size, None)

    def _run(self, hidden_states: Tensor, res_hidden_states_tuple: Sequence[Tensor], temb: Optional[Tensor],
             upsample_size: Optional[Sequence[int]], attend: Optional[Callable[[nn.Module, Tensor], Tensor]]) -> Tensor:
        freeu = all(getattr(self, name, None) for name in ("s1", "s2", "b1", "b2"))
        attentions = self.attentions if attend is not None else [None] * len(self.resnets)
        for resnet, attention in zip(self.resnets, attentions):
            res_hidden_states = res_hidden_states_tuple[-1]
            res_hidden_states_tuple = res_hidden_states_tuple[:-1]
            if freeu:
                from diffusers.utils.torch_utils import apply_freeu

                hidden_states, res_hidden_states = apply_freeu(self.resolution_idx, hidden_states, res_hidden_states,
                                                               s1=self.s1, s2=self.s2, b1=self.b1, b2=self.b2)
            hidden_states = cat_channels(hidden_states, res_hidden_states)
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden_states = self._gradient_checkpointing_func(resnet, hidden_states, temb)
            else:
                hidden_states = resnet(hidden_states, temb)
            if attention is not None:
                hidden_states = attend(attention, hidden_states)
        if self.upsamplers is not None:
            for upsampler in self.upsamplers:
                hidden_states = upsampler(hidden_states, upsample_size)
        return hidden_states


class CrossAttnUpBlock2D(UpBlock2D):
    """diffusers' ``CrossAttnUpBlock2D`` (0.42.1): :class:`UpBlock2D` with a transformer after each
    resnet, called as diffusers calls it."""

    def forward(self, hidden_states: Tensor, res_hidden_states_tuple: Sequence[Tensor], temb: Optional[Tensor] = None,
                encoder_hidden_states: Optional[Tensor] = None, cross_attention_kwargs: Optional[Dict[str, Any]] = None,
                upsample_size: Optional[Sequence[int]] = None, attention_mask: Optional[Tensor] = None,
                encoder_attention_mask: Optional[Tensor] = None) -> Tensor:
        def attend(attention: nn.Module, states: Tensor) -> Tensor:
            return attention(states, encoder_hidden_states=encoder_hidden_states,
                             cross_attention_kwargs=cross_attention_kwargs, attention_mask=attention_mask,
                             encoder_attention_mask=encoder_attention_mask, return_dict=False)[0]

        return self._run(hidden_states, res_hidden_states_tuple, temb, upsample_size, attend)
