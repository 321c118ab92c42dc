from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ._diffusers import require_diffusers
from .. import ops
from .calls import forward_extras, runs_plain
from .conv import conv_bias_act
from .layer_norm import LayerNorm
from .linear import autocast_casts, fusable, linear

logger = logging.getLogger(__name__)

# The diffusers attributes a block keeps next to its modules (read by user code and pipelines).
ATTRIBUTES = ("dim", "num_attention_heads", "attention_head_dim", "cross_attention_dim", "activation_fn",
              "only_cross_attention", "double_self_attention", "norm_type", "_chunk_size", "_chunk_dim")


class BasicTransformerBlock(nn.Module):
    """diffusers' ``BasicTransformerBlock`` (0.42.1, ``norm_type="layer_norm"``) with each residual
    add fused into the LayerNorm that reads it.

    diffusers adds an attention output to the residual stream and normalizes the sum in two
    kernels (``h = attn(...) + h``, then ``norm(h)``); here :func:`mirage.ops.layer_norm` with
    ``residual=`` returns both the normalized sum and the sum in one. ``norm2`` (before ``attn2``)
    and ``norm3`` (before the feed-forward; after ``attn1`` when there is no ``attn2``) take that
    path; ``norm1`` reads the block's input, not a sum, and stays a module of its own. The sum is
    rounded to its dtype as the separate add rounds it, so the block computes what diffusers'
    does with the same norm kernel. Where the add would broadcast or promote (operands of
    different shapes or dtypes, or a dtype that autocast would cast), the add runs separately, as
    in diffusers.

    Built with :meth:`from_diffusers`: ``norm1``, ``attn1``, ``attn2`` and ``ff`` are the
    diffusers block's modules, ``norm2`` and ``norm3`` are ``mirage.nn.LayerNorm`` sharing their
    parameters (state-dict keys are unchanged). Self- and cross-attention,
    ``only_cross_attention``, ``double_self_attention`` and chunked feed-forward
    (:meth:`set_chunk_feed_forward`) are reproduced.
    """

    # mirage.optimize swaps modules inside this block too (the attention, GEGLU and norm1 swaps):
    # its children are called as modules, so any module computing the same function serves.
    children_swappable = True

    def __init__(self) -> None:
        # Built only by from_diffusers: the block's own submodules are its state.
        super().__init__()

    @classmethod
    def from_diffusers(cls, block: nn.Module) -> "BasicTransformerBlock":
        """The fused block for a diffusers ``BasicTransformerBlock``, sharing its submodules.

        Args:
            block: an instance of ``diffusers.models.attention.BasicTransformerBlock``.

        Returns:
            A ``mirage.nn.BasicTransformerBlock`` computing what ``block`` computes.

        Raises:
            ValueError: the block's configuration is not reproduced (the message says why): a
                ``norm_type`` other than ``"layer_norm"`` (``ada_norm``, ``ada_norm_zero``,
                ``ada_norm_single``, ``ada_norm_continuous``, ``layer_norm_i2vgen``), positional
                embeddings, a GLIGEN fuser (``attention_type="gated"``), or norms that are not
                ``nn.LayerNorm`` over the last dimension.
        """
        require_diffusers(block, "BasicTransformerBlock", "mirage.nn.BasicTransformerBlock.from_diffusers")
        norm_type = getattr(block, "norm_type", None)
        if norm_type != "layer_norm":
            raise ValueError(f"norm_type={norm_type!r}: only 'layer_norm' is reproduced (the other norm types "
                             "modulate the norms or gate the residuals)")
        if getattr(block, "pos_embed", None) is not None:
            raise ValueError(f"positional_embeddings={getattr(block, 'positional_embeddings', None)!r} are not "
                             "reproduced")
        if getattr(block, "fuser", None) is not None:
            raise ValueError("the GLIGEN fuser (attention_type 'gated' or 'gated-text-image') is not reproduced")
        if getattr(block, "scale_shift_table", None) is not None:
            raise ValueError("a scale_shift_table (PixArt-style modulation) is not reproduced")
        for name in ("norm1", "attn1", "ff"):
            if getattr(block, name, None) is None:
                raise ValueError(f"the block has no {name}")
        if block.attn2 is not None and block.norm2 is None:
            raise ValueError("the block has attn2 but no norm2")

        fused = cls()
        fused.norm1 = _layer_norm("norm1", block.norm1, fuse=False)
        fused.attn1 = block.attn1
        # norm2 exists with attn2 only: with norm_type "layer_norm" diffusers creates them together.
        fused.norm2 = _layer_norm("norm2", block.norm2, fuse=True) if block.attn2 is not None else None
        fused.attn2 = block.attn2
        fused.norm3 = _layer_norm("norm3", block.norm3, fuse=True)
        fused.ff = block.ff
        for attribute in ATTRIBUTES:
            if not hasattr(block, attribute):
                raise ValueError(f"the block has no attribute {attribute!r} (mirage follows diffusers 0.42.1)")
            setattr(fused, attribute, getattr(block, attribute))
        return fused.train(block.training)

    def set_chunk_feed_forward(self, chunk_size: Optional[int], dim: int = 0) -> None:
        """Run the feed-forward in chunks of ``chunk_size`` along ``dim`` (None: in one piece), as
        diffusers' method of the same name (called by ``enable_forward_chunking``)."""
        self._chunk_size = chunk_size
        self._chunk_dim = dim

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        encoder_hidden_states: Optional[Tensor] = None,
        encoder_attention_mask: Optional[Tensor] = None,
        timestep: Optional[Tensor] = None,
        cross_attention_kwargs: Optional[Dict[str, Any]] = None,
        class_labels: Optional[Tensor] = None,
        added_cond_kwargs: Optional[Dict[str, Tensor]] = None,
    ) -> Tensor:
        """diffusers' arguments; ``timestep``, ``class_labels`` and ``added_cond_kwargs`` feed only the
        norm types :meth:`from_diffusers` refuses, and are ignored here as diffusers' layer_norm
        path ignores them."""
        if cross_attention_kwargs is not None and cross_attention_kwargs.get("scale", None) is not None:
            logger.warning("Passing `scale` to `cross_attention_kwargs` is deprecated. `scale` will be ignored.")
        attention_kwargs = dict(cross_attention_kwargs) if cross_attention_kwargs is not None else {}
        if attention_kwargs.pop("gligen", None) is not None:
            # diffusers fails here too (with an AttributeError): the block has no GLIGEN fuser.
            raise ValueError("mirage.nn.BasicTransformerBlock: cross_attention_kwargs['gligen'] needs a GLIGEN "
                             "fuser (attention_type='gated'), which this block does not have")

        attn_output = self.attn1(
            self.norm1(hidden_states),
            encoder_hidden_states=encoder_hidden_states if self.only_cross_attention else None,
            attention_mask=attention_mask,
            **attention_kwargs,
        )
        next_norm = self.norm2 if self.attn2 is not None else self.norm3
        norm_hidden_states, hidden_states = _add_layer_norm(next_norm, attn_output, hidden_states)
        # diffusers squeezes a 4-D residual stream after the first add (not after the second).
        if hidden_states.ndim == 4:
            norm_hidden_states, hidden_states = norm_hidden_states.squeeze(1), hidden_states.squeeze(1)

        if self.attn2 is not None:
            attn_output = self.attn2(
                norm_hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
                **attention_kwargs,
            )
            norm_hidden_states, hidden_states = _add_layer_norm(self.norm3, attn_output, hidden_states)

        if self._chunk_size is not None:
            hidden_states = self._chunked_feed_forward(norm_hidden_states) + hidden_states
        else:
            hidden_states = _feed_forward(self.ff, norm_hidden_states, hidden_states)
        if hidden_states.ndim == 4:
            hidden_states = hidden_states.squeeze(1)
        return hidden_states

    def _chunked_feed_forward(self, hidden_states: Tensor) -> Tensor:
        size = hidden_states.shape[self._chunk_dim]
        if size % self._chunk_size != 0:
            raise ValueError(
                f"mirage.nn.BasicTransformerBlock: dimension {self._chunk_dim} of `hidden_states` ({size}) must be "
                f"divisible by the feed-forward chunk size {self._chunk_size} (set by enable_forward_chunking)"
            )
        chunks = hidden_states.chunk(size // self._chunk_size, dim=self._chunk_dim)
        return torch.cat([self.ff(chunk) for chunk in chunks], dim=self._chunk_dim)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.num_attention_heads}, head_dim={self.attention_head_dim}, "
                f"cross_attention={self.attn2 is not None and not self.double_self_attention}")


def _feed_forward(ff: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """``ff(x) + residual``; for diffusers' ``FeedForward`` (its ``net`` modules run in order, as
    its forward runs them) ending in an ``nn.Linear``, the add goes into that Linear's epilogue."""
    net = getattr(ff, "net", None)
    if (type(ff).__name__ != "FeedForward" or not type(ff).__module__.startswith("diffusers.") or forward_extras(ff)
            or not isinstance(net, nn.ModuleList) or len(net) == 0 or type(net[-1]) is not nn.Linear):
        return ff(x) + residual
    for module in net[:-1]:
        x = module(x)
    return linear(net[-1], x, residual)


def _layer_norm(name: str, norm: Optional[nn.Module], *, fuse: bool) -> nn.Module:
    """``norm`` checked to be a LayerNorm over the last dimension; as ``mirage.nn.LayerNorm`` (sharing
    its parameters) when ``fuse``, else as it is (optimize swaps it on its own)."""
    if isinstance(norm, LayerNorm):
        return norm
    if type(norm) is not nn.LayerNorm:
        raise ValueError(f"{name} is {type(norm).__name__}, not nn.LayerNorm")
    if len(norm.normalized_shape) != 1:
        raise ValueError(f"{name} normalizes {tuple(norm.normalized_shape)}, not only the last dimension")
    return LayerNorm.from_torch(norm) if fuse else norm


def _add_layer_norm(norm: LayerNorm, attn_output: Tensor, residual: Tensor) -> Tuple[Tensor, Tensor]:
    """``(norm(s), s)`` for ``s = attn_output + residual``: one kernel where the add is a plain
    same-dtype, same-shape add, else the add then the norm."""
    if attn_output.shape == residual.shape and attn_output.dtype == residual.dtype:
        if not autocast_casts(attn_output):
            return norm(attn_output, residual)
    hidden_states = attn_output + residual
    return norm(hidden_states), hidden_states


class Transformer2DModel(nn.Module):
    """diffusers' ``Transformer2DModel`` (0.42.1) for continuous (image) input, without the layout
    copy at its end.

    diffusers turns the tokens back into an image with ``.permute(0, 3, 1, 2).contiguous()``: on
    channels-last activations that is a full NCHW copy, after which ``proj_out`` (a 1x1 conv with
    channels-last weights) copies back and the residual add mixes layouts (profiled on an H200:
    these were most of the 63 copy kernels of an optimized SD-1.5 forward). Here the permuted
    view itself is used: the same values, channels-last, no copy. The output's memory layout
    therefore is channels-last where diffusers' is NCHW, for channels-last input (what
    ``mirage.optimize`` passes by default); NCHW input gets NCHW output, as from diffusers.

    Built with :meth:`from_diffusers`, sharing the model's ``norm``, ``proj_in``,
    ``transformer_blocks`` and ``proj_out`` (state-dict keys unchanged); optimize swaps inside it.
    """

    children_swappable = True

    def __init__(self) -> None:
        # Built only by from_diffusers: the model's own submodules are its state.
        super().__init__()

    @classmethod
    def from_diffusers(cls, model: nn.Module) -> "Transformer2DModel":
        """The copy-free module for a diffusers ``Transformer2DModel`` with continuous input.

        Raises:
            ValueError: vectorized (discrete) or patched input, which take other code paths.
        """
        require_diffusers(model, "Transformer2DModel", "mirage.nn.Transformer2DModel.from_diffusers")
        if not getattr(model, "is_input_continuous", False):
            kind = "patched" if getattr(model, "is_input_patches", False) else "vectorized"
            raise ValueError(f"{kind} input is not reproduced (only continuous image input)")
        fused = cls()
        fused.norm = model.norm
        fused.proj_in = model.proj_in
        fused.transformer_blocks = model.transformer_blocks
        fused.proj_out = model.proj_out
        fused.use_linear_projection = model.use_linear_projection
        fused.training = model.training  # the shared children keep their own flags
        return fused

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Optional[Tensor] = None,
                timestep: Optional[Tensor] = None, added_cond_kwargs: Optional[Dict[str, Tensor]] = None,
                class_labels: Optional[Tensor] = None, cross_attention_kwargs: Optional[Dict[str, Any]] = None,
                attention_mask: Optional[Tensor] = None, encoder_attention_mask: Optional[Tensor] = None,
                return_dict: bool = True) -> Any:
        # As diffusers: 2-D keep-masks become additive biases of shape (batch, 1, tokens).
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = ((1 - attention_mask.to(hidden_states.dtype)) * -10000.0).unsqueeze(1)
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
            encoder_attention_mask = ((1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0).unsqueeze(1)

        _, _, height, width = hidden_states.shape
        residual = hidden_states
        hidden_states = _project_in(self.proj_in, self.norm(hidden_states), self.use_linear_projection)

        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, attention_mask=attention_mask,
                                  encoder_hidden_states=encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, timestep=timestep,
                                  cross_attention_kwargs=cross_attention_kwargs, class_labels=class_labels)

        output = _project_out(self.proj_out, hidden_states, residual, self.use_linear_projection, height, width)
        if not residual.is_contiguous(memory_format=torch.channels_last):
            # NCHW input gets NCHW output, as from diffusers (user code may .view it); only
            # channels-last input, mirage.optimize's, skips the copy.
            output = output.contiguous()
        if not return_dict:
            return (output,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=output)


def _conv(conv: nn.Module, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
    """``conv(x) (+ residual)``: for a plain ``nn.Conv2d``, its bias and the residual add in one
    ``bias_act`` pass after the convolution (PyTorch spends a pass on each)."""
    if runs_plain(conv, nn.Conv2d):
        return conv_bias_act(conv, x, residual=residual)
    return conv(x) if residual is None else conv(x) + residual


def _tokens(image: Tensor) -> Tensor:
    """``(B, C, H, W)`` -> ``(B, H*W, C)``: a view when the image is channels-last."""
    batch, channels, height, width = image.shape
    return image.permute(0, 2, 3, 1).reshape(batch, height * width, channels)


def _image(tokens: Tensor, height: int, width: int) -> Tensor:
    """``(B, H*W, C)`` -> ``(B, C, H, W)``, a view: channels-last memory when the tokens are contiguous."""
    return tokens.reshape(tokens.shape[0], height, width, -1).permute(0, 3, 1, 2)


def _pointwise(conv: nn.Module) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """``(weight as (C_out, C_in), bias)`` of a plain 1x1 ``nn.Conv2d`` (a matmul over the
    channels), else None."""
    if (runs_plain(conv, nn.Conv2d) and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
            and conv.dilation == (1, 1) and conv.groups == 1 and conv.padding in ((0, 0), "valid")):
        return conv.weight.flatten(1), conv.bias
    return None


def _project_in(proj: nn.Module, image: Tensor, linear_projection: bool) -> Tensor:
    """``proj_in`` of the normalized image, as tokens ``(B, H*W, C)``. A 1x1 convolution of a
    channels-last image is one matmul over the channels of its tokens, with the bias in the
    matmul's epilogue (cuDNN's convolution would leave the bias to a pass of its own)."""
    if linear_projection:
        return linear(proj, _tokens(image))
    pointwise = _pointwise(proj)
    if pointwise is not None and image.is_contiguous(memory_format=torch.channels_last):
        tokens = _tokens(image)
        if fusable(*pointwise, tokens, None):
            return ops.linear(tokens, *pointwise)
    return _tokens(_conv(proj, image))


def _project_out(proj: nn.Module, tokens: Tensor, residual: Tensor, linear_projection: bool, height: int,
                 width: int) -> Tensor:
    """``proj_out`` of the tokens plus the model's input ``residual``, as an image ``(B, C, H, W)``.
    A channels-last ``residual`` is its tokens in memory, so the add goes into the matmul's
    epilogue and the output is channels-last."""
    if residual.is_contiguous(memory_format=torch.channels_last):
        residual_tokens = _tokens(residual)
        if linear_projection:
            return _image(linear(proj, tokens, residual_tokens), height, width)
        pointwise = _pointwise(proj)
        if pointwise is not None and fusable(*pointwise, tokens, residual_tokens):
            return _image(ops.linear(tokens, *pointwise, residual_tokens), height, width)
    if linear_projection:
        return _image(proj(tokens), height, width) + residual
    return _conv(proj, _image(tokens, height, width), residual)
