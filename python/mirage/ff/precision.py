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


def check_precision(precision: Any, who: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{who}: precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    return precision


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """TF32 on for "tf32", off otherwise, for the duration; the caller's settings come back after.

    Captures must run inside: cuBLAS' math mode is recorded into the graph. torch >= 2.9 refuses
    to mix the legacy ``allow_tf32`` flag with the newer ``fp32_precision`` one, so the newer one
    is used where it exists.
    """
    matmul = torch.backends.cuda.matmul
    allow = precision == "tf32"
    if hasattr(matmul, "fp32_precision"):
        saved = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if allow else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = saved
    else:
        saved = matmul.allow_tf32
        matmul.allow_tf32 = allow
        try:
            yield
        finally:
            matmul.allow_tf32 = saved
