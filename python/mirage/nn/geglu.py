from __future__ import annotations

from torch import Tensor, nn

from .. import ops
from .linear import linear

APPROXIMATIONS = ("none", "tanh")


class GEGLU(nn.Module):
    """diffusers' GEGLU: ``proj`` (Linear to ``2 * dim_out``), then ``a * gelu(b)`` fused."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True, approximate: str = "none",
                 device=None, dtype=None) -> None:
        super().__init__()
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"mirage.nn.GEGLU: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias, device=device, dtype=dtype)
        self.approximate = approximate

    @classmethod
    def from_torch(cls, module: nn.Module, approximate: str = "none") -> "GEGLU":
        """The fused module for a GEGLU-shaped ``module``: one with an ``nn.Linear`` ``proj``
        whose output is split in halves (diffusers' ``GEGLU``); shares its projection."""
        proj = getattr(module, "proj", None)
        if not isinstance(proj, nn.Linear) or proj.out_features % 2 != 0:
            raise TypeError(
                "mirage.nn.GEGLU.from_torch: expected a module whose `proj` is an nn.Linear with an "
                f"even out_features, got {type(module).__name__}"
            )
        fused = cls(proj.in_features, proj.out_features // 2, bias=proj.bias is not None,
                    approximate=approximate, device="meta")
        fused.proj = proj
        return fused

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        # diffusers passes a deprecated `scale` argument positionally; it has no effect there either.
        return ops.geglu(linear(self.proj, hidden_states), self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
