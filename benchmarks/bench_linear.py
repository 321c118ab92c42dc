"""mirage::linear on few rows (and on few outputs) against PyTorch's F.linear (cuBLAS), side by side: microseconds per
call inside a CUDA graph (where both run in a model: launch cost counts, host overhead does not).
The shapes are a small molecule's (benzene's 12 atoms through a PaiNN's 128-wide layers, forward
and the x gradient, whose weight is the transposed, column-major matrix), a few larger molecules'
a diffusion model's time embedding (2 rows: mirage's few-rows kernel) and a 3,000-atom system's
atom-wise products. mirage times cuBLASLt's candidates and, for float32, its own tiled kernel on
the first call of each shape and keeps the fastest; the columns "tiled" and "cuBLASLt" time each
alone (MIRAGE_LINEAR_TILED=1 / 0; blank where the tiled kernel does not apply). Results:
docs/perf/linear.md.

    python benchmarks/bench_linear.py [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.nn.functional as F

import mirage
from harness import device_facts, kernel_times, print_table, time_in_graph, write_json

# (label, rows, in_features, out_features, column-major weight)
SHAPES = [
    ("PaiNN phi 2nd", 12, 128, 384, False),
    ("PaiNN update mlp 1st", 12, 256, 128, False),
    ("PaiNN U / V", 36, 128, 128, False),  # [12, 3, 128] vectors: 36 rows
    ("PaiNN phi 2nd, x grad", 12, 384, 128, True),
    ("PaiNN update mlp 1st, x grad", 12, 128, 256, True),
    ("PaiNN 128x128, x grad", 12, 128, 128, True),
    ("24 atoms, 128x384", 24, 128, 384, False),
    ("32 atoms, 128x384", 32, 128, 384, False),
    ("32 atoms, x grad", 32, 384, 128, True),
    ("time embedding", 2, 1280, 320, False),
    # PaiNN's basis gradient (the filter's gradient through the filter Linear's weight), float32
    # rows from 131,072 on: mirage's narrow kernel (32,768 rows: cuBLASLt's).
    ("PaiNN basis grad, 3,000 atoms", 139046, 384, 21, True),
    ("PaiNN basis grad, 32,768 pairs", 32768, 384, 21, True),
    ("PaiNN basis grad, 1M pairs", 1_000_000, 384, 21, True),
    # A 3,000-atom box: SchNet's and PaiNN's atom-wise products (PaiNN's U / V on 3 x 3,000 rows).
    ("3,000 atoms, 128x128", 3000, 128, 128, False),
    ("3,000 atoms, 128x128, x grad", 3000, 128, 128, True),
    ("3,000 atoms, PaiNN phi 2nd", 3000, 128, 384, False),
    ("3,000 atoms, PaiNN phi 2nd, x grad", 3000, 384, 128, True),
    ("3,000 atoms, PaiNN U / V", 9000, 128, 128, False),
    ("3,000 atoms, PaiNN update mlp 1st", 3000, 256, 128, False),
    ("3,000 atoms, PaiNN update mlp 1st, x grad", 3000, 128, 256, True),
]


@contextlib.contextmanager
def tiled_setting(setting: str):
    """MIRAGE_LINEAR_TILED=setting inside ("" unset: the timed choice), restored after."""
    saved = os.environ.pop("MIRAGE_LINEAR_TILED", None)
    if setting:
        os.environ["MIRAGE_LINEAR_TILED"] = setting
    try:
        yield
    finally:
        os.environ.pop("MIRAGE_LINEAR_TILED", None)
        if saved is not None:
            os.environ["MIRAGE_LINEAR_TILED"] = saved


def time_with(setting: str, fn, inputs) -> float:
    """fn timed with MIRAGE_LINEAR_TILED=setting."""
    with tiled_setting(setting):
        return time_in_graph(fn, inputs)


def tiled_kernel_runs(fn, *args) -> bool:
    """Whether fn(*args) runs mirage's tiled kernel with MIRAGE_LINEAR_TILED=1 (the library's own
    rule decides: elsewhere the setting leaves cuBLASLt or the few-rows and narrow kernels)."""
    with tiled_setting("1"):
        return any("tiled_linear_kernel" in name for name, _ in kernel_times(fn, *args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(device_facts())
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for label, m, k, n, columns in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
        weight = torch.randn(k, n, device="cuda", dtype=dtype, generator=g).t() if columns else \
            torch.randn(n, k, device="cuda", dtype=dtype, generator=g)
        bias = None if columns else torch.randn(n, device="cuda", dtype=dtype, generator=g)
        def call(t):
            return mirage.ops.linear(t, weight, bias)
        ours = time_with("", call, [(x,)])
        tiled = time_with("1", call, [(x,)]) if tiled_kernel_runs(call, x) else None
        cublaslt = time_with("0", call, [(x,)])
        theirs = time_in_graph(lambda t: F.linear(t, weight, bias), [(x,)])
        error = (mirage.ops.linear(x, weight, bias).double() - F.linear(x.double(), weight.double(),
                 None if bias is None else bias.double())).abs().max().item()
        rows.append({"shape": label, "rows": m, "k": k, "n": n, "weight": "column-major" if columns else "row-major",
                     "mirage us": round(ours, 2), "tiled us": None if tiled is None else round(tiled, 2),
                     "cuBLASLt us": round(cublaslt, 2), "F.linear us": round(theirs, 2),
                     "speedup": round(theirs / ours, 2),
                     "max error": f"{error:.1e}"})
    print_table(rows, [("shape", "shape", "s"), ("rows", "rows", "d"), ("k", "in", "d"), ("n", "out", "d"),
                       ("weight", "weight", "s"), ("mirage us", "mirage us", ".2f"), ("tiled us", "tiled", ".2f"),
                       ("cuBLASLt us", "cuBLASLt", ".2f"),
                       ("F.linear us", "F.linear us", ".2f"), ("speedup", "x", ".2f"), ("max error", "max |err|", "s")])
    write_json(args.json, {"device": device_facts(), "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
