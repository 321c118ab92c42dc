"""Where the split PaiNN kernel's time goes, and A/Bs of its versions, without torch.

Builds painn_split_harness.cu with nvcc (sm_90a) against cuda/painn_split.cu, or against each
SOURCE given (versions of that file: the repository's headers are used for all), runs the builds
in turn for --rounds rounds, and prints each one's time a call in CUDA graphs of 20 calls and how
far its gradient is from the first one's. With --phases, each build's kernel is a copy that
stamps %globaltimer in block 0 after every cluster barrier and before a few marked statements of
the prologue and the message phases; the harness then prints the mean time up to each stamp and
the stamp's line in the source. Needs an sm_90 GPU and nvcc (the device machine:
docs/perf/forcefield.md, "The split kernel's weights by bulk copies", measured this way).

    python3 benchmarks/painn_split_phases.py [--phases] [--rounds 3] [SOURCE ...]
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).resolve().parent / "painn_split_harness.cu"

# Statements of the kernel a stamp goes before, where a version has them: the prologue's steps,
# then in each interaction the end of phi's product, the basis' slopes and the messages' backward.
MARKS = [
    r"  // Every block checks every index",
    r"  // The block's share of grad_positions",
    r"  // The pairs within the cutoff",
    r"  const int np = kept;",
    r"  bessel_rows\(basis, nullptr\);",
    r"  copies\.wait\(\);",
    r"    // The messages, per",
    r"    const bool lanes_of_a_pair",
    r"    for \(int e = tid; e < 3 \* N \* f; e \+= threads\) gv\[e\] \+= gvs\[e\];",
]

PRELUDE = """
// Stamps of block 0's thread 0 (painn_split_phases.py).
constexpr int kMaxStamps = 256;
__device__ unsigned long long g_stamp_times[kMaxStamps];
__device__ int g_stamp_sites[kMaxStamps];
__device__ int g_stamp_count;
static const char* const kStampSites[] = {%s};
__device__ __forceinline__ void stamp(int rank, int& at, int site) {
  if (rank == 0 && threadIdx.x == 0 && at < kMaxStamps) {
    unsigned long long now;
    asm volatile("mov.u64 %%0, %%globaltimer;" : "=l"(now));
    g_stamp_times[at] = now;
    g_stamp_sites[at] = site;
    g_stamp_count = at + 1;
  }
  ++at;
}
"""


def stamped_copy(source: Path, out: Path) -> list:
    """`source` with stamps in its kernel (see MARKS), written to `out`; returns the MARKS that
    match no statement of it."""
    lines = source.read_text().splitlines()
    begin = next(n for n, line in enumerate(lines) if "painn_split_kernel(" in line and "__global__" in line)
    end = next(n for n in range(begin + 1, len(lines)) if lines[n] == "}")
    sites, body, marked = [], [], set()

    def site(n):
        sites.append(f"line {n + 1}: {lines[n].strip()}")
        return len(sites) - 1

    for n in range(begin, end):
        line = lines[n]
        if "start_after_prior_grid();" in line:
            body.append(f"  int stamp_at = 0;\n  stamp(rank, stamp_at, {site(n)});")
        for k, pattern in enumerate(MARKS):
            if re.match(pattern, line):
                indent = line[:len(line) - len(line.lstrip())]
                body.append(f"{indent}stamp(rank, stamp_at, {site(n)});")
                marked.add(k)
        if "cluster_sync();" in line:
            line = line.replace("cluster_sync();", f"cluster_sync(); stamp(rank, stamp_at, {site(n)});")
        body.append(line)
    table = ", ".join('"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"' for text in sites)
    include = next(n for n, line in enumerate(lines) if line.startswith('#include "atom_products.cuh"'))
    text = lines[:include + 1] + [PRELUDE % table] + lines[include + 1:begin] + body + lines[end:]
    out.write_text("\n".join(text) + "\n")
    return [pattern for k, pattern in enumerate(MARKS) if k not in marked]


def build_command(kernel: Path, binary: Path, phases: bool, nvcc: str = "nvcc") -> list:
    """nvcc's command that builds the harness into `binary` against `kernel` (a stamped copy where
    `phases`)."""
    return [nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
            f"-I{ROOT / 'cuda'}", f'-DKERNEL_SOURCE="{kernel}"', *(["-DMIRAGE_PHASES"] if phases else []), "-o",
            str(binary), str(HARNESS)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", type=Path, default=[ROOT / "cuda" / "painn_split.cu"],
                        help="versions of cuda/painn_split.cu (default: the repository's)")
    parser.add_argument("--phases", action="store_true", help="stamp the kernels and print their phases")
    parser.add_argument("--rounds", type=int, default=3, help="times each build runs, in turn (default 3)")
    parser.add_argument("--nvcc", default="nvcc")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="painn_split_phases_"))
    builds = []
    for index, source in enumerate(args.sources):
        source = source.resolve()
        kernel = source
        if args.phases:
            kernel = work / f"stamped_{index}.cu"
            for pattern in stamped_copy(source, kernel):
                print(f"{source}: no statement matches {pattern!r}; no stamp there", file=sys.stderr)
        binary = work / f"harness_{index}"
        builds.append((source, binary, subprocess.Popen(build_command(kernel, binary, args.phases, args.nvcc))))
    print(f"building {len(builds)} harness(es) in {work} ...", flush=True)
    if any(process.wait() != 0 for _, _, process in builds):
        print("a build failed (above)", file=sys.stderr)
        return 1

    reference = None
    for round_ in range(args.rounds):
        for index, (source, binary, _) in enumerate(builds):
            grad_file = work / f"grad_{index}.bin"
            result = subprocess.run([str(binary), str(grad_file)], capture_output=True, text=True)
            if result.returncode != 0:
                print(f"{source}: failed\n{result.stdout}{result.stderr}", file=sys.stderr)
                return 1
            output = result.stdout.strip().splitlines()
            if args.phases and round_ == 0:
                print(f"== {source}")
                print("\n".join(output[:-1]))
            grad = np.fromfile(grad_file, dtype=np.float32)
            reference = grad if reference is None else reference
            difference = float(np.abs(grad - reference).max() / max(np.abs(reference).max(), 1e-30))
            print(f"round {round_ + 1}, {source.name}: {output[-1]}; gradient off the first build's by {difference:.1e}"
                  " of its largest", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
