"""mirage::neighbor_list's two CUDA searches side by side on periodic water boxes (5 A cutoff):
microseconds per call inside a CUDA graph, and whether both list the same pairs. What the
"auto" switch point (cuda/neighbor_list.cu, kCellListMinAtoms) rests on.

    python benchmarks/bench_neighbor_list.py [--sides 4,6,8,10,14,20] [--json out.json]
"""

from __future__ import annotations

import argparse

import torch

import mirage
from bench_forcefield import CUTOFF, water_box
from harness import device_facts, time_in_graph, write_json

METHODS = ("direct", "cell_list")


def pair_set(out) -> set:
    """The listed pairs as (i, j, shift rounded to 1e-3 A)."""
    count = int(out.num_pairs)
    rows = torch.cat([out.pairs[:, :count].t().double(), out.shifts[:count].double().round(decimals=3)], 1)
    return set(map(tuple, rows.cpu().tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="4,6,8,10,14,20", help="water molecules per box side")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(device_facts())
    rows = []
    for side in map(int, args.sides.split(",")):
        _, pos, cell = water_box(side)
        pos, cell = pos.float().cuda(), cell.float().cuda()
        capacity = 60 * pos.shape[0]  # about 46 pairs per atom at this density and cutoff
        row = {"atoms": pos.shape[0]}
        lists = {}
        for method in METHODS:
            search = lambda p: mirage.ops.neighbor_list(p, CUTOFF, cell, None, max_pairs=capacity, method=method)  # noqa: E731
            row[f"{method} us"] = round(time_in_graph(search, [(pos,)], calls=20, repeats=5), 1)
            lists[method] = search(pos)
            if int(lists[method].num_pairs) > capacity:
                raise RuntimeError(f"{pos.shape[0]} atoms: more pairs than the capacity {capacity}")
        row["pairs"] = int(lists["direct"].num_pairs)
        row["same pairs"] = pair_set(lists["direct"]) == pair_set(lists["cell_list"])
        rows.append(row)
        print(row, flush=True)
    write_json(args.json, {"device": device_facts(), "rows": rows})


if __name__ == "__main__":
    main()
