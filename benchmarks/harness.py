"""Shared benchmark machinery: CUDA-graph timing, input rotation, the copy-bandwidth ceiling,
and the table/JSON report. Every subject runs its peers side by side through these."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import time

import torch


def device_facts() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": code_commit(),
    }


def code_commit() -> str:
    """The commit of the code measured. The GPU machine gets a copy of the working tree whose git
    metadata can be older than the code (the device tool's copy): the caller names the commit
    there with MIRAGE_COMMIT. Without it, a tree that differs from HEAD says so ("+changes"), so
    that a stale HEAD is never taken for the code's commit."""
    named = os.environ.get("MIRAGE_COMMIT", "")
    if named:
        return named

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    try:
        changed = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+changes" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@contextlib.contextmanager
def full_float32():
    """float32 references without TF32: cuDNN's convolutions and cuBLAS' matmuls take TF32 by
    default on Ampere and later (cudnn.allow_tf32 is True), whose 10-bit mantissa is float16's."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def rotation_count(bytes_per_set: int) -> int:
    """Input sets to cycle through so that consecutive calls never find their input in L2."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, math.ceil(3 * l2 / max(bytes_per_set, 1)))


def capture_graph(record, warmup):
    """(graph, record()'s result captured in it): warmup() runs first on a side stream, so lazy
    initialisation (cuBLAS handles, autotuning) stays out of the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warmup()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = record()
    return graph, result


def time_in_graph(fn, input_sets, calls: int = 100, repeats: int = 15) -> float:
    """Median microseconds per call of fn(*inputs), measured as back-to-back calls captured in one
    CUDA graph (at least `calls`, and every one of input_sets once: fewer would leave the inputs
    used in L2 across replays), timed with CUDA events. The calls' outputs are kept for the
    capture, so each writes to memory of its own, as the copy reference (copy_us) writes to
    rotated destinations: freed at once, every output would reuse one block, kept in L2."""
    calls = max(calls, len(input_sets))

    def warmup():
        for inputs in input_sets[:3]:
            fn(*inputs)

    def record():
        return [fn(*input_sets[i % len(input_sets)]) for i in range(calls)]

    graph, _ = capture_graph(record, warmup)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def copy_us(nbytes: int, input_sets: int = 1, calls: int = 100, repeats: int = 15) -> float:
    """µs of a device-to-device copy moving nbytes (half read, half written): the faster of a copy
    kernel (an elementwise add of zero) and the copy engine (copy_), each timed by time_in_graph
    (calls, repeats) over input_sets source/destination pairs (rotation_count's, to keep each call
    out of L2)."""
    pairs = [(torch.empty(nbytes // 4, dtype=torch.float16, device="cuda").normal_(),
              torch.empty(nbytes // 4, dtype=torch.float16, device="cuda")) for _ in range(input_sets)]
    kernel_us = time_in_graph(lambda src, dst: torch.add(src, 0.0, out=dst), pairs, calls=calls, repeats=repeats)
    engine_us = time_in_graph(lambda src, dst: dst.copy_(src), pairs, calls=calls, repeats=repeats)
    del pairs
    return min(kernel_us, engine_us)


def copy_bandwidth_gbs(size_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth of 1 GiB, counting bytes read plus bytes written."""
    return 2 * size_bytes / (copy_us(2 * size_bytes, calls=10, repeats=10) * 1e-6) / 1e9


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    headers = [h for _, h, _ in columns]
    cells = [[("" if r.get(k) is None else format(r[k], f)) for k, _, f in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("-|-".join("-" * w for w in widths))
    for c in cells:
        print(" | ".join(v.rjust(w) for v, w in zip(c, widths)))


def kernel_times(fn, *args, warmup: int = 3, **kwargs) -> list[tuple[str, float]]:
    """(name, µs) of every CUDA kernel one call of fn runs, from torch.profiler, after warm-up.
    Run it outside CUDA graphs: the profiler then sees the kernels one by one."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args, **kwargs)
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]


def categorizer(categories: list[tuple[str, tuple[str, ...]]], default: str):
    """name -> the first category whose substrings occur in the kernel name (case-insensitive)."""
    def category(name: str) -> str:
        lowered = name.lower()
        for label, keys in categories:
            if any(k in lowered for k in keys):
                return label
        return default
    return category


def print_kernel_report(label: str, kernels: list[tuple[str, float]], category, top: int) -> None:
    """Kernel count, GPU time by category (category(name) -> label) and the top kernels by time."""
    from collections import defaultdict

    total = sum(t for _, t in kernels)
    print(f"\n== {label}: {len(kernels)} kernels, {total / 1e3:.3f} ms of GPU time")
    for title, key in (("by category", category), (f"top {top} kernels", lambda name: name[:110])):
        groups = defaultdict(lambda: [0.0, 0])
        for name, t in kernels:
            groups[key(name)][0] += t
            groups[key(name)][1] += 1
        print(f"   {title}:")
        ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
        for name, (t, n) in ranked[: top if key is not category else None]:
            print(f"   {t / 1e3:7.3f} ms  {100 * t / max(total, 1e-9):5.1f}%  x{n:4d}  {name}")


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
