"""mirage::linear on few rows (and on few outputs) against PyTorch's F.linear (cuBLAS), side by side: microseconds per
call inside a CUDA graph (where both run in a model: launch cost counts, host overhead does not).
The shapes are a small molecule's (benzene's 12 atoms through a PaiNN's 128-wide layers, forward
and the x gradient, whose weight is the transposed, column-major matrix), a few larger molecules'
and a diffusion model's time embedding (2 rows: mirage's few-rows kernel; every other shape here
is cuBLASLt's, its algorithm timed on the first call). Results: docs/perf/linear.md.

    python benchmarks/bench_linear.py [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import mirage
from harness import device_facts, print_table, time_in_graph, write_json

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
]


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
        ours = time_in_graph(lambda t: mirage.ops.linear(t, weight, bias), [(x,)])
        theirs = time_in_graph(lambda t: F.linear(t, weight, bias), [(x,)])
        error = (mirage.ops.linear(x, weight, bias).double() - F.linear(x.double(), weight.double(),
                 None if bias is None else bias.double())).abs().max().item()
        rows.append({"shape": label, "rows": m, "k": k, "n": n, "weight": "column-major" if columns else "row-major",
                     "mirage us": round(ours, 2), "F.linear us": round(theirs, 2), "speedup": round(theirs / ours, 2),
                     "max error": f"{error:.1e}"})
    print_table(rows, [("shape", "shape", "s"), ("rows", "rows", "d"), ("k", "in", "d"), ("n", "out", "d"),
                       ("weight", "weight", "s"), ("mirage us", "mirage us", ".2f"),
                       ("F.linear us", "F.linear us", ".2f"), ("speedup", "x", ".2f"), ("max error", "max |err|", "s")])
    write_json(args.json, {"device": device_facts(), "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
