"""The precision options of mirage.ff's calculator and MD driver, apart from ASE (which the
calculator imports): mirage.ff.optimize holds its probe to "fp32" as well."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["PRECISIONS", "check_precision", "matmul_precision"]

#: "fp32": float32 matmuls throughout (TF32 off); "tf32": TF32 matmuls allowed (10-bit
#: mantissa inputs, float32 accumulation); "bf16-mixed": the model's forward under
#: ``torch.autocast(bfloat16)``, forces still taken with respect to float32 positions.
PRECISIONS = ("fp32", "tf32", "bf16-mixed")


def check_precision(precision: Any, who: str, dtype: torch.dtype = torch.float32) -> str:
    """``precision`` if it is one of :data:`PRECISIONS` and means something for a model of ``dtype``."""
    if precision not in PRECISIONS:
        raise ValueError(f"{who}: precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if precision != "fp32" and dtype == torch.float64:
        # TF32 and autocast change float32 arithmetic only: the model would run as in "fp32".
        raise ValueError(f"{who}: precision={precision!r} changes float32 arithmetic only, and the model is float64; "
                         "use precision='fp32', or convert the model with model.float()")
    return precision


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """TF32 on for "tf32", off otherwise, for the duration; the caller's settings come back after.

    Captures must run inside: cuBLAS' math mode is recorded into the graph. Set through the legacy
    ``allow_tf32``, which on torch >= 2.9 sets the newer ``fp32_precision`` too, so both agree
    inside whichever the caller used (``torch.set_float32_matmul_precision("high")``,
    ``allow_tf32``, ``fp32_precision``): set through the newer one alone, the legacy getter
    (which mirage's and PyTorch's code may read) raises. Both are restored after, and then the
    global ``torch.set_float32_matmul_precision`` level if it was readable and reads otherwise now
    ("medium" is not one of the backend's settings: restored through them alone, the global getter
    raised on the mix); a legacy flag the caller had left unreadable may come back readable, with the same
    meaning.
    """
    matmul = torch.backends.cuda.matmul
    saved_new = getattr(matmul, "fp32_precision", None)  # torch >= 2.9
    try:
        saved_legacy = matmul.allow_tf32
    except RuntimeError:  # the caller set only the newer API
        saved_legacy = None
    saved_global = _global_matmul_precision()  # None: the caller mixed the APIs already
    matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        if saved_legacy is not None:
            matmul.allow_tf32 = saved_legacy
        if saved_new is not None:
            matmul.fp32_precision = saved_new
        if saved_global is not None and _global_matmul_precision() != saved_global:
            torch.set_float32_matmul_precision(saved_global)


def _global_matmul_precision() -> Any:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # a mix of the legacy and the newer settings
        return None
