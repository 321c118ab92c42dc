"""diffusers' ``Upsample2D`` (nearest 2x upsampling, then a 3x3 convolution) in sub-pixel form."""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._diffusers import require_diffusers
from .. import ops
from .calls import runs_plain


def _conv_attribute(name: str) -> str:
    """Where diffusers' Upsample2D keeps its convolution (its ``name`` argument picks it)."""
    return "conv" if name == "conv" else "Conv2d_0"


def _version(tensor: Tensor) -> Optional[int]:
    """The tensor's version counter, or None for one made under torch.inference_mode (or whose
    storage was, as after ``param.data = ...`` there), which has none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _fold_key(weight: Tensor) -> Tuple[Any, ...]:
    """What the folded kernels depend on, besides the weight's identity."""
    return weight.data_ptr(), _version(weight), weight.dtype, weight.device, weight.stride()


class Upsample2D(nn.Module):
    """diffusers' ``Upsample2D`` (0.42.1) without the upsampled image.

    diffusers upsamples ``x`` to twice its size by repeating each pixel (``F.interpolate``,
    nearest) and convolves that with a 3x3 kernel. Every output pixel of one parity (even or odd
    row, even or odd column) then reads the same 2x2 pixels of ``x`` through sums of the 3x3
    taps, so this module convolves ``x`` itself with those 2x2 kernels, one set per parity
    (:func:`mirage.ops.subpixel_weight`), and interleaves the four results, adding the bias on
    the way (:func:`mirage.ops.subpixel_shuffle`). Same function; 4 instead of 9 multiply-adds
    per output pixel, and neither the upsampled image nor PyTorch's bias pass. The sums of taps
    are rounded once to the weights' dtype, so results differ from diffusers' by rounding.

    Built with :meth:`from_diffusers`; it keeps the block's convolution (state-dict keys are
    unchanged) and holds the 2x2 kernels as a derived tensor of its own (16/9 of the
    convolution's weight in memory), refolded whenever the convolution's weight changes:
    replaced (``.to()``, ``.half()``, ``load_state_dict(assign=True)``), or changed in place
    (``load_state_dict``, ``copy_``), which :class:`mirage.OptimizedModule` checks before each
    call, graphs included. Changes PyTorch's version counter does not see go unnoticed: writes
    through ``.data`` (PEFT's default LoRA merge) and in-place changes to weights created under
    ``torch.inference_mode``; call :meth:`refresh_derived_weights` with ``force=True`` after
    those. With gradients enabled on the weight, the kernels are folded on every call,
    differentiably.

    An ``output_size`` other than twice the input's (a U-Net's odd-sized skip connection) is
    upsampled by interpolation as diffusers does, then convolved with the 3x3 kernel; so is
    every input once the convolution has been replaced by another module (a LoRA wrapper).
    """

    def __init__(self) -> None:
        # Built only by from_diffusers: the block's own submodules are its state.
        super().__init__()
        self._folded: Optional[Tensor] = None
        self._folded_key: Optional[Tuple[Any, ...]] = None
        self._folded_from: Optional[weakref.ref] = None  # the Parameter folded

    @classmethod
    def from_diffusers(cls, block: nn.Module) -> "Upsample2D":
        """The sub-pixel module for a diffusers ``Upsample2D``, sharing its submodules.

        Raises:
            ValueError: the block's configuration is not nearest 2x upsampling followed by a
                plain 3x3, stride-1, padding-1 ``nn.Conv2d`` (the message says what differs).
        """
        require_diffusers(block, "Upsample2D", "mirage.nn.Upsample2D.from_diffusers")
        if block.use_conv_transpose:
            raise ValueError("a transposed convolution upsamples by itself: there is no upsampled image to avoid")
        if not block.use_conv:
            raise ValueError("no convolution follows the upsampling: nothing to fold it into")
        if not block.interpolate:
            raise ValueError("interpolate=False: the block does not upsample")
        conv = getattr(block, _conv_attribute(block.name))
        if type(conv) is not nn.Conv2d:  # a wrapper (a LoRA adapter) may have no geometry to read
            raise ValueError(f"its convolution is a {type(conv).__name__}, not a plain nn.Conv2d")
        geometry = (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode)
        if geometry != ((3, 3), (1, 1), (1, 1), (1, 1), 1, "zeros"):
            raise ValueError("its convolution is not a plain 3x3 nn.Conv2d with stride 1, padding 1, dilation 1, "
                             f"one group and zero padding (got {geometry})")
        fused = cls()
        for attribute in ("channels", "out_channels", "use_conv", "use_conv_transpose", "name", "interpolate"):
            setattr(fused, attribute, getattr(block, attribute))
        fused.norm = block.norm
        # Under the block's attribute name, so that state-dict keys stay the same.
        setattr(fused, _conv_attribute(block.name), conv)
        return fused.train(block.training)

    @property
    def _conv(self) -> nn.Conv2d:
        return getattr(self, _conv_attribute(self.name))

    def refresh_derived_weights(self, force: bool = False) -> None:
        """Refolds the 2x2 kernels if the convolution's weight changed since they were folded (or
        always, with ``force``).

        A weight changed in place is refolded into the same tensor, so a CUDA graph captured
        earlier reads the new kernels; a replaced one (another dtype, device or layout) gets a new
        tensor (graphs must then be captured again, as for the weight itself).
        """
        weight = self._conv.weight
        if self._folded_is_current(weight) and not force:
            return
        version = _version(weight)
        # Without autograd (the fold is a constant of the weight), and outside inference mode, so
        # that the kernels stay usable and refoldable outside it; but for an inference weight,
        # which only inference mode can read into a new tensor (it cannot change unseen anyway).
        with torch.inference_mode(version is None), torch.no_grad():
            folded = ops.subpixel_weight(weight.detach())
            old = self._folded
            if (version is not None and old is not None and not old.is_inference()
                    and (old.dtype, old.device, old.stride()) == (folded.dtype, folded.device, folded.stride())):
                old.copy_(folded)
            else:
                self._folded = folded
        self._folded_key, self._folded_from = _fold_key(weight), weakref.ref(weight)

    def _folded_is_current(self, weight: Tensor) -> bool:
        """Whether the kernels were folded from this weight as it is now. The Parameter itself
        too: a new tensor may be given a freed one's address and version."""
        return (self._folded_from is not None and self._folded_from() is weight
                and self._folded_key == _fold_key(weight))

    def __getstate__(self):
        # The folded kernels are derived, and their weakref cannot be pickled (torch.save of the
        # model): they are folded again at the next call.
        state = super().__getstate__()
        state["_folded"] = state["_folded_key"] = state["_folded_from"] = None
        return state

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cpu(), .half() that convert the weight: the folded kernels would stay where they
        # were until the next call; they are folded again from the converted weight instead. A
        # conversion that leaves the weight as it was (accelerate's offload calls .to(device) before
        # every forward) keeps them: CUDA graphs kept across it read them at their address.
        super()._apply(fn, *args, **kwargs)
        if not self._folded_is_current(self._conv.weight):
            self._folded, self._folded_key, self._folded_from = None, None, None
        return self

    def _subpixel_weight(self) -> Tensor:
        weight = self._conv.weight
        # Compiled or traced, the fold is recorded from the weight: a cached fold would be baked
        # into the graph (ignoring later weight changes and .to() of the loaded trace), and
        # jit.trace's check, which reruns the forward under no_grad, saw another graph.
        if (torch.compiler.is_compiling() or torch.jit.is_tracing()
                or (torch.is_grad_enabled() and weight.requires_grad)):
            return ops.subpixel_weight(weight)
        self.refresh_derived_weights()
        return self._folded

    def forward(self, hidden_states: Tensor, output_size: Optional[Sequence[int]] = None, *args, **kwargs) -> Tensor:
        # diffusers accepts (and ignores) a deprecated `scale` argument here; so does this module.
        if hidden_states.dim() != 4 or hidden_states.shape[1] != self.channels:
            raise ValueError(f"mirage.nn.Upsample2D: hidden_states must be (N, {self.channels}, H, W), "
                             f"got {tuple(hidden_states.shape)}")
        if self.norm is not None:
            hidden_states = self.norm(hidden_states.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        conv = self._conv
        height, width = hidden_states.shape[-2:]
        # A LoRA wrapper, say (its weight is not what it computes), or hooks: the module is called.
        replaced = not runs_plain(conv, nn.Conv2d)
        if replaced or (output_size is not None and tuple(output_size) != (2 * height, 2 * width)):
            # diffusers' interpolation (and its workarounds for PyTorch's NHWC kernel).
            output_size = (2 * height, 2 * width) if output_size is None else output_size
            scale = max(f / s for f, s in zip(output_size, (height, width)))
            if hidden_states.shape[0] >= 64 or hidden_states.numel() * scale > 2**31:
                hidden_states = hidden_states.contiguous()
            return conv(F.interpolate(hidden_states, size=output_size, mode="nearest"))
        parities = F.conv2d(hidden_states, self._subpixel_weight(), None, padding=1)
        bias = conv.bias
        if bias is not None and bias.dtype not in (parities.dtype, torch.float32):
            bias = bias.float()  # e.g. a float16 bias under a bfloat16 autocast
        out = ops.subpixel_shuffle(parities, bias)  # channels-last
        # NCHW input gets NCHW output, as from diffusers (user code may .view it); an input both
        # layouts describe (H = W = 1, or C = 1) is NCHW there too.
        nchw = hidden_states.is_contiguous() or not hidden_states.is_contiguous(memory_format=torch.channels_last)
        return out.contiguous() if nchw else out

    def extra_repr(self) -> str:
        return f"channels={self.channels}, out_channels={self.out_channels}"
