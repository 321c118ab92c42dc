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
        """The fused module for diffusers' ``GEGLU`` (or a class of that name written like it: an
        ``nn.Linear`` ``proj`` whose output's halves ``a, b`` give ``a * gelu(b)``); shares its
        projection. Its forward cannot be inspected, so the name stands for the function: diffusers'
        ``SwiGLU``, ``GELU`` and ``ApproximateGELU`` have a ``proj`` too and compute something else."""
        proj = getattr(module, "proj", None)
        if type(module).__name__ != "GEGLU" or not isinstance(proj, nn.Linear) or proj.out_features % 2 != 0:
            raise TypeError(
                "mirage.nn.GEGLU.from_torch: expected a GEGLU module (diffusers' GEGLU: a `proj` nn.Linear "
                f"with an even out_features, gated a * gelu(b)), got {type(module).__name__}"
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
