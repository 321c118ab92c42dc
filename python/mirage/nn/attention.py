"""Multi-head attention with fused projections: one QKV (or KV) GEMM, then scaled_dot_product_attention.

``from_diffusers_attention`` builds a :class:`FusedAttention` that computes what a diffusers
``Attention`` module computes with its default processor (``AttnProcessor2_0``; the classic
``AttnProcessor`` too). ``fuse_linears`` is the projection fusion, shared with ``mirage.patterns``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .group_norm import GroupNorm as MirageGroupNorm
from .layer_norm import LayerNorm as MirageLayerNorm
from .linear import linear


def fuse_linears(linears: Sequence[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the concatenation of ``linears``' outputs (last dim).

    The linears must read the same input width and share dtype and device. Biases are
    concatenated; a linear without one contributes zeros (adding 0 changes no value).
    """
    first = linears[0]
    for linear in linears:
        if type(linear) is not nn.Linear:
            raise ValueError(f"only plain nn.Linear projections are fused, got {type(linear).__name__}")
        if linear.in_features != first.in_features:
            raise ValueError(f"projections read different widths ({first.in_features} vs {linear.in_features})")
        if linear.weight.dtype != first.weight.dtype or linear.weight.device != first.weight.device:
            raise ValueError("projections have weights of different dtypes or devices")
    out_features = sum(linear.out_features for linear in linears)
    has_bias = any(linear.bias is not None for linear in linears)
    # Meta first: its random initialization would be overwritten anyway.
    fused = nn.Linear(first.in_features, out_features, bias=has_bias, device="meta")
    requires_grad = first.weight.requires_grad
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=requires_grad)
        if has_bias:
            biases = [linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
                      for linear in linears]
            fused.bias = nn.Parameter(torch.cat(biases), requires_grad=requires_grad)
    fused.training = first.training
    return fused


class FusedAttentionProcessor:
    """Stands for mirage's fused attention where diffusers lists attention processors
    (``model.attn_processors``): no processor of diffusers' ``Attention`` itself."""

    def __call__(self, *args, **kwargs):
        raise TypeError("mirage.nn.FUSED_ATTENTION stands for the fused attention of mirage.optimize in "
                        "attn_processors; it is not a processor for diffusers' Attention")

    def __repr__(self) -> str:
        return "mirage.nn.FUSED_ATTENTION (mirage.optimize's fused attention; processors cannot change after optimize)"

    def __reduce__(self) -> str:
        return "FUSED_ATTENTION"  # pickles and copies are the one instance


FUSED_ATTENTION = FusedAttentionProcessor()


def _fused_projections(module: "FusedAttention") -> Tuple[str, Tuple[str, ...]]:
    """The fused projection's name and diffusers' names of its parts, in order (equal widths)."""
    return ("to_kv", ("to_k", "to_v")) if module.is_cross_attention else ("to_qkv", ("to_q", "to_k", "to_v"))


def _split_projections(module: "FusedAttention", state_dict, prefix: str, local_metadata) -> None:
    fused, parts = _fused_projections(module)
    for kind in ("weight", "bias"):
        key = f"{prefix}{fused}.{kind}"
        if key in state_dict:
            # Copies: safetensors (save_pretrained) refuses tensors that share memory.
            for name, part in zip(parts, state_dict.pop(key).chunk(len(parts))):
                state_dict[f"{prefix}{name}.{kind}"] = part.clone()


def _join_projections(module: "FusedAttention", state_dict, prefix: str, local_metadata, strict, missing_keys,
                      unexpected_keys, error_msgs) -> None:
    """The parts' entries joined into the fused projection's. With parts absent (all of them
    too), the ones given are loaded into their slices (the rest keep their values) and the absent
    ones are reported missing by their own names, as the unfused module would report them, never
    as the fused projection, a name of mirage's; a part of the wrong shape is reported by its name
    too, and keeps its values."""
    fused, parts = _fused_projections(module)
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name in parts]
        current = getattr(getattr(module, fused), kind)
        if f"{prefix}{fused}.{kind}" in state_dict or current is None:
            continue
        slices = current.detach().chunk(len(parts))
        wrong = [key for key, old in zip(keys, slices) if key in state_dict and state_dict[key].shape != old.shape]
        error_msgs.extend(f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)}, "
                          f"the shape in the current model is {tuple(old.shape)}."
                          for key, old in zip(keys, slices) if key in wrong)
        missing_keys.extend(key for key in keys if key not in state_dict)
        # A part of the wrong shape keeps its values, as the unfused module's would. Parts given
        # beside kept ones are joined in the module's dtype and device (load_state_dict's copy
        # would convert them anyway); all given, as they are (assign=True keeps theirs).
        given = [key in state_dict and key not in wrong for key in keys]
        if current.is_meta and any(given) and not all(given):
            # Parameters without values (an empty-weights model): nothing to keep beside the parts given.
            error_msgs.append(f"cannot load some of {', '.join(keys)} into {prefix}{fused}.{kind}, which is on the "
                              "meta device: give all of them")
        else:
            state_dict[f"{prefix}{fused}.{kind}"] = torch.cat(
                [state_dict[key] for key in keys] if all(given) else
                [state_dict[key].to(old) if use else old for key, old, use in zip(keys, slices, given)])
        for key in keys:
            state_dict.pop(key, None)


class FusedAttention(nn.Module):
    """diffusers-style attention: optional norms, fused projections, SDPA, output projection.

    Self-attention (``to_qkv``) projects q, k and v with one GEMM; cross-attention (``to_q`` and
    ``to_kv``) projects k and v with one. Heads are views of the projection output (an unflatten
    and a transpose, no copy), which ``F.scaled_dot_product_attention`` reads strided.

    ``forward`` takes the arguments diffusers passes to its ``Attention`` modules. A 4-D
    ``(B, C, H, W)`` input is attended over its ``H*W`` positions and returned as ``(B, C, H, W)``
    in the input's memory format; channels-last input is read and written with no layout copy.

    Attributes that diffusers blocks or user code read from attention modules are kept:
    ``heads``, ``scale``, ``inner_dim``, ``is_cross_attention``, ``residual_connection``,
    ``rescale_output_factor``, ``to_out``, ``group_norm``, ``spatial_norm``, ``norm_cross``,
    ``norm_q``, ``norm_k``.

    State dicts use diffusers' keys (``to_q.weight``, ...): the fused projection is split on saving
    and joined on loading, a load missing some parts reporting those by name. The split entries are
    copies, also under ``state_dict(keep_vars=True)``: the module holds one parameter for them.
    """

    def __init__(
        self,
        heads: int,
        scale: float,
        to_out: nn.ModuleList,
        to_qkv: Optional[nn.Linear] = None,
        to_q: Optional[nn.Linear] = None,
        to_kv: Optional[nn.Linear] = None,
        group_norm: Optional[nn.Module] = None,
        spatial_norm: Optional[nn.Module] = None,
        norm_cross: Optional[nn.Module] = None,
        norm_q: Optional[nn.Module] = None,
        norm_k: Optional[nn.Module] = None,
        residual_connection: bool = False,
        rescale_output_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self_attention = to_qkv is not None and to_q is None and to_kv is None
        cross_attention = to_qkv is None and to_q is not None and to_kv is not None
        if not (self_attention or cross_attention):
            raise ValueError("mirage.nn.FusedAttention: give either to_qkv (self-attention) or to_q and to_kv")
        self.heads = heads
        self.scale = scale
        self.is_cross_attention = to_qkv is None
        # From the fused projections (plain nn.Linear): to_q may be any module (a LoRA adapter), run as it is.
        self.inner_dim = (to_qkv.out_features // 3) if to_qkv is not None else to_kv.out_features // 2
        self.to_qkv, self.to_q, self.to_kv = to_qkv, to_q, to_kv
        self.to_out = to_out
        self.group_norm = group_norm
        self.spatial_norm = spatial_norm
        self.norm_cross = norm_cross
        self.norm_q = norm_q
        self.norm_k = norm_k
        self.residual_connection = residual_connection
        self.rescale_output_factor = rescale_output_factor
        # State dicts in diffusers' keys (to_q, to_k, to_v), as save_pretrained writes them and
        # from_pretrained or load_state_dict reads them: the fused projections are split on saving
        # and joined on loading.
        self.register_state_dict_post_hook(_split_projections)
        self.register_load_state_dict_pre_hook(_join_projections)

    def get_processor(self, return_deprecated_lora: bool = False) -> "FusedAttentionProcessor":
        """What diffusers' ``attn_processors`` lists for this module: :data:`FUSED_ATTENTION`, which
        :meth:`set_processor` takes back (diffusers' save-and-restore of processors)."""
        return FUSED_ATTENTION

    def set_processor(self, processor: object) -> None:
        """Refuses an attention processor but :data:`FUSED_ATTENTION` (or another instance of its
        class: diffusers rebuilds processors as ``type(processor)()`` when it unloads an
        IP-Adapter): diffusers' ``set_attn_processor`` (and ``set_default_attn_processor``) call
        this on every attention module, and keeping the fused computation in place of the
        processor asked for would change the results without a word."""
        if isinstance(processor, FusedAttentionProcessor):
            return
        raise ValueError(
            f"mirage's fused attention (from mirage.optimize) cannot take the processor {type(processor).__name__}: "
            "it computes diffusers' default attention; set processors on the model before mirage.optimize "
            "(an Attention with another processor is left alone, and the report says so)")

    def forward(
        self,
        hidden_states: Tensor,
        encoder_hidden_states: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        temb: Optional[Tensor] = None,
        **cross_attention_kwargs,
    ) -> Tensor:
        """Attention of ``hidden_states`` (``(B, L, C)`` or ``(B, C, H, W)``) over itself or over
        ``encoder_hidden_states`` (``(B, S, C_enc)``).

        ``attention_mask``: ``(B, S)``, ``(B, L|1, S)``, ``(B, 1, L|1, S)`` or ``(B*heads, L|1, S)``,
        additive (query dtype) or bool, as diffusers takes it; ``temb`` feeds ``spatial_norm``.
        Other keyword arguments are ignored, as diffusers' processor ignores them (its ``scale``
        is deprecated and unused).
        """
        residual = hidden_states
        if self.spatial_norm is not None:
            hidden_states = self.spatial_norm(hidden_states, temb)

        image_size = None
        if hidden_states.ndim == 4:
            image_size = hidden_states.shape[2:]
            channels_last = hidden_states.is_contiguous(memory_format=torch.channels_last)
            if self.group_norm is not None:
                # Same statistics as diffusers' norm of the (B, C, H*W) tokens, without the transposes.
                hidden_states = self.group_norm(hidden_states)
            # (B, C, H, W) -> (B, H*W, C): a view, contiguous when the input is channels-last.
            hidden_states = hidden_states.flatten(2).transpose(1, 2)
        elif self.group_norm is not None:
            hidden_states = self.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        if encoder_hidden_states is not None and self.norm_cross is not None:
            encoder_hidden_states = self._norm_encoder_hidden_states(encoder_hidden_states)
        query, key, value = self._project(hidden_states, encoder_hidden_states)
        if self.norm_q is not None:
            query = self.norm_q(query)
        if self.norm_k is not None:
            key = self.norm_k(key)

        mask = None
        if attention_mask is not None:
            mask = self._sdpa_mask(attention_mask, key.shape[0], key.shape[2])
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scale)
        out = out.transpose(1, 2).flatten(2)
        out = self.to_out[1](linear(self.to_out[0], out))

        if image_size is not None:
            # (B, H*W, C) -> (B, C, H, W): a view in channels-last memory, which a channels-last
            # input keeps; NCHW input gets NCHW output, as from diffusers.
            out = out.transpose(1, 2).unflatten(2, image_size)
            if not channels_last:
                out = out.contiguous()
        if self.residual_connection:
            out = out + residual
        if self.rescale_output_factor != 1.0:
            out = out / self.rescale_output_factor
        return out

    def _heads(self, projection: Tensor, parts: int) -> Tuple[Tensor, ...]:
        """``parts`` tensors of ``(B, heads, L, head_dim)``, views of ``projection`` ``(B, L, parts*inner)``."""
        split = projection.unflatten(-1, (parts, self.heads, -1))
        return tuple(split.select(-3, i).transpose(1, 2) for i in range(parts))

    def _project(self, hidden_states: Tensor, encoder_hidden_states: Optional[Tensor]) -> Tuple[Tensor, ...]:
        if not self.is_cross_attention:
            if encoder_hidden_states is None:
                return self._heads(linear(self.to_qkv, hidden_states), 3)
            # A self-attention module given a context: q and kv from the fused weight's row blocks
            # (views), as diffusers' to_q and to_k/to_v would compute them.
            weight, bias, inner = self.to_qkv.weight, self.to_qkv.bias, self.inner_dim
            query = F.linear(hidden_states, weight[:inner], None if bias is None else bias[:inner])
            kv = F.linear(encoder_hidden_states, weight[inner:], None if bias is None else bias[inner:])
        else:
            query = linear(self.to_q, hidden_states)
            context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            kv = linear(self.to_kv, context)
        return self._heads(query, 1) + self._heads(kv, 2)

    def _norm_encoder_hidden_states(self, encoder_hidden_states: Tensor) -> Tensor:
        if isinstance(self.norm_cross, (nn.GroupNorm, MirageGroupNorm)):
            # Group norm normalizes dim 1: put the hidden dimension there and back.
            return self.norm_cross(encoder_hidden_states.transpose(1, 2)).transpose(1, 2)
        return self.norm_cross(encoder_hidden_states)

    def _sdpa_mask(self, mask: Tensor, batch: int, key_length: int) -> Tensor:
        """diffusers' mask shapes as SDPA's ``(B, heads|1, L|1, S)``, without repeating over heads."""
        if mask.shape[-1] != key_length:
            raise ValueError(
                f"mirage.nn.FusedAttention: attention_mask has {mask.shape[-1]} key positions, the keys have "
                f"{key_length}; diffusers zero-pads such masks, which mirage does not reproduce"
            )
        if mask.shape[0] == batch * self.heads:
            return mask.reshape(batch, self.heads, -1, key_length)
        if mask.shape[0] == batch:
            return mask.reshape(batch, 1, -1, key_length)
        raise ValueError(
            f"mirage.nn.FusedAttention: attention_mask's first dimension must be the batch ({batch}) or "
            f"batch*heads ({batch * self.heads}), got shape {tuple(mask.shape)}"
        )

    def extra_repr(self) -> str:
        kind = "cross" if self.is_cross_attention else "self"
        return f"{kind}-attention, heads={self.heads}, inner_dim={self.inner_dim}, scale={self.scale:.6g}"


def from_diffusers_attention(attn: nn.Module) -> FusedAttention:
    """A :class:`FusedAttention` computing what diffusers ``Attention`` ``attn`` computes.

    The output projection, dropout and norms are shared with ``attn``; the fused QKV (or KV)
    projection is new (the concatenated weights). ``attn``'s ``group_norm`` becomes a mirage
    ``GroupNorm`` sharing its parameters.

    Follows ``AttnProcessor2_0``: SDPA with scale ``head_dim**-0.5``, ``dropout_p=0``, not causal,
    whatever ``attn.is_causal`` says. For the classic ``AttnProcessor`` (set when
    ``scale_qk=False``) the scale is ``attn.scale``; its ``upcast_attention``/``upcast_softmax``
    need nothing here, as the SDPA kernels keep scores and softmax in float32 anyway.

    Raises:
        TypeError: ``attn`` is not a diffusers ``Attention``.
        ValueError: a configuration this module does not reproduce; the message says which.
    """
    from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

    if not isinstance(attn, Attention):
        raise TypeError(f"from_diffusers_attention: expected a diffusers Attention, got {type(attn).__name__}")
    if type(attn) is not Attention:
        raise ValueError(f"{type(attn).__name__} subclasses diffusers Attention and may change what it computes")
    processor = attn.get_processor()
    if type(processor) not in (AttnProcessor2_0, AttnProcessor):
        raise ValueError(
            f"attention processor {type(processor).__name__} is not reproduced "
            "(mirage follows AttnProcessor2_0 and AttnProcessor)"
        )
    if attn.added_kv_proj_dim is not None or attn.only_cross_attention:
        raise ValueError("added key/value projections (added_kv_proj_dim) are not supported")
    if attn.to_out is None:
        raise ValueError("attention without an output projection (pre_only) is not supported")
    if attn.inner_kv_dim != attn.inner_dim:
        raise ValueError("grouped-query attention (kv_heads != heads) is not supported")
    if attn.inner_dim % attn.heads != 0:
        raise ValueError(f"inner dimension {attn.inner_dim} is not divisible by heads {attn.heads}")

    if isinstance(processor, AttnProcessor2_0):
        # AttnProcessor2_0 leaves SDPA's default scale: 1/sqrt of the width of one key head.
        scale = (attn.inner_dim // attn.heads) ** -0.5
    else:
        if attn.norm_q is not None or attn.norm_k is not None:
            raise ValueError("the classic AttnProcessor does not apply its norm_q/norm_k (qk_norm), which mirage's "
                             "attention would")
        scale = attn.scale

    group_norm = attn.group_norm
    if type(group_norm) is nn.GroupNorm:
        group_norm = MirageGroupNorm.from_torch(group_norm)
    elif group_norm is not None and not isinstance(group_norm, MirageGroupNorm):
        raise ValueError(f"group_norm of type {type(group_norm).__name__} is not supported")
    if attn.norm_cross is not None and not isinstance(
        attn.norm_cross, (nn.LayerNorm, nn.GroupNorm, MirageLayerNorm, MirageGroupNorm)
    ):
        raise ValueError(f"norm_cross of type {type(attn.norm_cross).__name__} is not supported")

    projections = {}
    if attn.is_cross_attention:
        projections.update(to_q=attn.to_q, to_kv=fuse_linears([attn.to_k, attn.to_v]))
    else:
        projections.update(to_qkv=fuse_linears([attn.to_q, attn.to_k, attn.to_v]))
    fused = FusedAttention(
        heads=attn.heads,
        scale=scale,
        to_out=attn.to_out,
        group_norm=group_norm,
        spatial_norm=attn.spatial_norm,
        norm_cross=attn.norm_cross,
        norm_q=attn.norm_q,
        norm_k=attn.norm_k,
        residual_connection=attn.residual_connection,
        rescale_output_factor=attn.rescale_output_factor,
        **projections,
    )
    return fused.train(attn.training)
