"""GroupNorm+SiLU, LayerNorm (plain and with the residual add), GEGLU, a convolution's epilogue
(bias_act: bias + residual), linear (a Linear with the residual add in its epilogue) and the
time-embedding projection (linear with an input SiLU, two rows), and the U-Net's up-sampling
(nearest 2x, then a 3x3 convolution; mirage: 2x2 sub-pixel convolutions and subpixel_shuffle,
also timed alone against its PyTorch composite) at the SD-1.5 U-Net's shapes, fp16: mirage
against PyTorch eager and torch.compile of the same composite, in one run.

Every variant is timed as 100 back-to-back calls inside one CUDA graph (no launch overhead),
cycling through enough input sets that no call finds its input in L2 (every set once, so more
calls where there are more sets), each call writing its output to memory of its own. mirage's
kernels launched overlapped (docs/ops.md) start beside the call before them, here another call of
the same op: set MIRAGE_OVERLAP_LAUNCHES=0 for the plain launches a kernel of another library
ahead of it gets in a model. "rel err" is mirage's against the composite in float32 (TF32 off)
on the same float16 inputs; "eager's" is PyTorch's float16 composite's against it. GB/s counts the fewest
bytes an op must move (inputs read once, outputs written once); "% copy" is that over the
measured device-to-device copy bandwidth (of 1 GiB). "copy us" is PyTorch copying the same bytes
(half read, half written; the faster of its copy kernel and the copy engine), timed the same
way: a reference for what a pass over that many bytes costs with start-up and tail, not a bound.

    python benchmarks/bench_norms.py [--json results.json] [--quick] [--ops layer_norm,add_layer_norm]
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F

import mirage
from harness import (copy_bandwidth_gbs, copy_us, device_facts, full_float32, print_table, rotation_count,
                     time_in_graph, write_json)

GROUP_NORM_SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8),
                     (2, 2560, 8, 8), (2, 960, 64, 64)]
TOKEN_SHAPES = [(2 * 4096, 320), (2 * 1024, 640), (2 * 256, 1280)]  # (tokens, dim)


def first(out):
    """An op's first output (add_layer_norm returns the normalized rows and the sum)."""
    return out[0] if isinstance(out, tuple) else out


def group_norm_silu(x, w, b):
    return F.silu(F.group_norm(x, 32, w, b, 1e-5))


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def add_layer_norm(x, r, w, b):
    s = x + r
    return F.layer_norm(s, (s.shape[-1],), w, b, 1e-5), s


def geglu(x):
    a, g = x.chunk(2, dim=-1)
    return a * F.gelu(g)


def bias_residual(x, b, r):
    """What follows a convolution with a bias in a residual block: PyTorch's bias pass, then the add."""
    return (x + b[:, None, None]) + r


def linear_residual(x, w, b, r):
    """A transformer block's last Linear and its residual add, as diffusers writes them."""
    return F.linear(x, w, b) + r


# (tokens, in, out, with residual): proj_in and the attention outputs (no residual), proj_out and
# the feed-forward's output Linear (residual), at 64x64, 32x32 and 16x16 latents.
LINEAR_SHAPES = [(8192, 320, 320, False), (8192, 320, 320, True), (8192, 1280, 320, True),
                 (2048, 2560, 640, True), (512, 5120, 1280, True)]


def time_embedding(t, w, b, conv_bias):
    """A ResnetBlock2D's time-embedding projection, then conv1's bias added to it (diffusers adds
    both to the convolution's output; mirage folds them into one [N, C] shift)."""
    return F.linear(F.silu(t), w, b) + conv_bias


# (in, out) of the SD-1.5 U-Net's time-embedding projections (batch 2).
TIME_EMBEDDING_SHAPES = [(1280, 320), (1280, 640), (1280, 1280)]


def upsample_conv(x, w, b, folded):
    """diffusers' Upsample2D: nearest 2x, then the 3x3 convolution (``folded`` is mirage's)."""
    return F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w, b, padding=1)


def subpixel_upsample_conv(x, w, b, folded):
    return mirage.ops.subpixel_shuffle(F.conv2d(x, folded, None, padding=1), b)


def subpixel_shuffle(x, b):
    """mirage.ops.subpixel_shuffle in PyTorch ops: one strided copy per parity, then the bias."""
    n, c4, h1, w1 = x.shape
    c, h, w = c4 // 4, h1 - 1, w1 - 1
    out = torch.empty((n, c, 2 * h, 2 * w), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    for p in (0, 1):
        for q in (0, 1):
            g = 2 * p + q
            out[:, :, p::2, q::2] = x[:, g * c:(g + 1) * c, p:p + h, q:q + w]
    return out.add_(b.view(-1, 1, 1))


# (batch, channels, height, width) entering the SD-1.5 U-Net's three Upsample2D blocks.
UPSAMPLE_SHAPES = [(2, 1280, 8, 8), (2, 1280, 16, 16), (2, 640, 32, 32)]


def cases(quick: bool):
    """(op, shape label, layout, make_inputs, eager fn, mirage fn, bytes moved)."""
    half = torch.float16
    for shape in GROUP_NORM_SHAPES[:2] if quick else GROUP_NORM_SHAPES:
        for layout in ("channels_last", "nchw"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format

            def make(shape=shape, fmt=fmt):
                x = torch.randn(shape, device="cuda", dtype=half).contiguous(memory_format=fmt)
                return (x, torch.randn(shape[1], device="cuda", dtype=half),
                        torch.randn(shape[1], device="cuda", dtype=half))

            nbytes = 2 * 2 * torch.Size(shape).numel()
            yield ("group_norm+silu", "x".join(map(str, shape)), layout, make, group_norm_silu,
                   lambda x, w, b: mirage.ops.group_norm(x, 32, w, b, 1e-5, "silu"), nbytes)
    for shape in GROUP_NORM_SHAPES[:1] if quick else GROUP_NORM_SHAPES:
        def make_epilogue(shape=shape):
            x, r = (torch.randn(shape, device="cuda", dtype=half).contiguous(memory_format=torch.channels_last)
                    for _ in range(2))
            return x, torch.randn(shape[1], device="cuda", dtype=half), r

        yield ("bias_act", "x".join(map(str, shape)), "channels_last", make_epilogue, bias_residual,
               lambda x, b, r: mirage.ops.bias_act(x, b, r), 3 * 2 * torch.Size(shape).numel())
    for tokens, dim in TOKEN_SHAPES[:1] if quick else TOKEN_SHAPES:
        label = f"{tokens}x{dim}"

        def make_ln(tokens=tokens, dim=dim):
            return (torch.randn(tokens, dim, device="cuda", dtype=half),
                    torch.randn(dim, device="cuda", dtype=half), torch.randn(dim, device="cuda", dtype=half))

        yield ("layer_norm", label, "", make_ln, layer_norm,
               lambda x, w, b: mirage.ops.layer_norm(x, w, b, 1e-5), 2 * 2 * tokens * dim)

        def make_add(tokens=tokens, dim=dim):
            return (torch.randn(tokens, dim, device="cuda", dtype=half), torch.randn(tokens, dim, device="cuda", dtype=half),
                    torch.randn(dim, device="cuda", dtype=half), torch.randn(dim, device="cuda", dtype=half))

        yield ("add_layer_norm", label, "", make_add, add_layer_norm,
               lambda x, r, w, b: mirage.ops.layer_norm(x, w, b, 1e-5, residual=r), 4 * 2 * tokens * dim)

        inner = 4 * dim  # diffusers FeedForward: GEGLU projects to 2 x (4 x dim)

        def make_geglu(tokens=tokens, inner=inner):
            return (torch.randn(tokens, 2 * inner, device="cuda", dtype=half),)

        yield ("geglu", f"{tokens}x{2 * inner}", "", make_geglu, geglu, lambda x: mirage.ops.geglu(x),
               3 * 2 * tokens * inner)
    for tokens, k, n, with_residual in LINEAR_SHAPES[:2] if quick else LINEAR_SHAPES:
        def make_linear(tokens=tokens, k=k, n=n, with_residual=with_residual):
            x = torch.randn(tokens, k, device="cuda", dtype=half)
            w = torch.randn(n, k, device="cuda", dtype=half) / k ** 0.5
            b = torch.randn(n, device="cuda", dtype=half)
            return (x, w, b) + ((torch.randn(tokens, n, device="cuda", dtype=half),) if with_residual else ())

        nbytes = 2 * (tokens * k + n * k + n + tokens * n * (2 if with_residual else 1))
        yield ("linear+residual" if with_residual else "linear", f"{tokens}x{k}->{n}", "", make_linear,
               linear_residual if with_residual else F.linear, mirage.ops.linear, nbytes)
    for k, n in TIME_EMBEDDING_SHAPES[:1] if quick else TIME_EMBEDDING_SHAPES:
        def make_time_embedding(k=k, n=n):
            return (torch.randn(2, k, device="cuda", dtype=half), torch.randn(n, k, device="cuda", dtype=half) / k ** 0.5,
                    torch.randn(n, device="cuda", dtype=half), torch.randn(n, device="cuda", dtype=half))

        yield ("time embedding", f"2x{k}->{n}", "", make_time_embedding, time_embedding,
               lambda t, w, b, c: mirage.ops.linear(t, w, b, c.expand(2, -1), "silu"), 2 * (2 * k + n * k + 4 * n))
    for n, c, h, w in UPSAMPLE_SHAPES[1:2] if quick else UPSAMPLE_SHAPES:
        label = f"{n}x{c}x{h}x{w}"

        def make_upsample(n=n, c=c, h=h, w=w):
            x = torch.randn(n, c, h, w, device="cuda", dtype=half).contiguous(memory_format=torch.channels_last)
            weight = (torch.randn(c, c, 3, 3, device="cuda") / (3 * c ** 0.5)).contiguous(memory_format=torch.channels_last)
            # Folded from the float16 weight, as mirage.nn.Upsample2D does in a float16 model.
            return x, weight.half(), torch.randn(c, device="cuda", dtype=half), mirage.ops.subpixel_weight(weight.half())

        # Inputs read once, the 3x3 weights and the output written once (the upsampled image is
        # not counted: avoiding it is the point).
        yield ("upsample+conv3x3", label, "channels_last", make_upsample, upsample_conv, subpixel_upsample_conv,
               2 * (n * c * h * w + 9 * c * c + 4 * n * c * h * w))

        def make_shuffle(n=n, c=c, h=h, w=w):
            x = torch.randn(n, 4 * c, h + 1, w + 1, device="cuda", dtype=half)
            return x.contiguous(memory_format=torch.channels_last), torch.randn(c, device="cuda", dtype=half)

        yield ("subpixel_shuffle", f"{n}x{4 * c}x{h + 1}x{w + 1}", "channels_last", make_shuffle, subpixel_shuffle,
               mirage.ops.subpixel_shuffle, 2 * 2 * 4 * n * c * h * w)  # the values it reads, and writes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="two shapes per op")
    parser.add_argument("--ops", help="comma-separated op names of the table to run (default: all)")
    args = parser.parse_args(argv)
    all_cases = list(cases(args.quick))
    wanted = set(args.ops.split(",")) if args.ops else {case[0] for case in all_cases}
    unknown = wanted - {case[0] for case in all_cases}
    if unknown:
        print(f"bench_norms: unknown --ops {sorted(unknown)}; the ops are "
              f"{sorted({case[0] for case in all_cases})}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_norms needs a CUDA GPU", file=sys.stderr)
        return 2

    torch.backends.cudnn.benchmark = True  # as bench_unet: cuDNN times its algorithms per shape
    facts = device_facts()
    copy_gbs = copy_bandwidth_gbs()
    print(f"{facts['gpu']}, torch {facts['torch']}, CUDA {facts['cuda']}, {facts['date']}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)

    @functools.cache  # ops of one size share it
    def same_size_copy_us(nbytes: int) -> float:
        return copy_us(nbytes, rotation_count(nbytes))

    rows = []
    for op, label, layout, make, eager_fn, mirage_fn, nbytes in all_cases:
        if op not in wanted:
            continue
        sets = [make() for _ in range(rotation_count(nbytes))]
        # A fresh dynamo cache per case: past its recompile limit (8 shapes of one function)
        # torch.compile silently runs the function eagerly, which would time eager as "compile".
        torch._dynamo.reset()
        compiled_fn = torch.compile(eager_fn, dynamic=False)
        # Errors against the composite in float32 (TF32 off) on the same float16 inputs: mirage's,
        # and PyTorch's float16 eager composite's beside it for scale.
        with full_float32():
            exact = first(eager_fn(*[t.float() for t in sets[0]])).float()
        err, eager_err = (((first(fn(*sets[0])).float() - exact).norm() / exact.norm()).item()
                          for fn in (mirage_fn, eager_fn))
        eager_us = time_in_graph(eager_fn, sets)
        compile_us = time_in_graph(compiled_fn, sets)
        mirage_us = time_in_graph(mirage_fn, sets)
        gbs = nbytes / (mirage_us * 1e-6) / 1e9
        row = dict(op=op, shape=label, layout=layout, mb=nbytes / 1e6, eager_us=eager_us,
                   compile_us=compile_us, mirage_us=mirage_us, copy_us=same_size_copy_us(nbytes),
                   gbs=gbs, copy_pct=100 * gbs / copy_gbs,
                   vs_eager=eager_us / mirage_us, vs_compile=compile_us / mirage_us, rel_err=err,
                   eager_rel_err=eager_err)
        rows.append(row)
        print(f"  {op} {label} {layout}: mirage {mirage_us:.1f} us, eager {eager_us:.1f}, compile {compile_us:.1f}",
              flush=True)
        del sets
        torch.cuda.empty_cache()

    print()
    print_table(rows, [("op", "op", ""), ("shape", "shape", ""), ("layout", "layout", ""), ("mb", "MB moved", ".1f"),
                       ("eager_us", "eager us", ".1f"), ("compile_us", "compile us", ".1f"),
                       ("mirage_us", "mirage us", ".1f"), ("copy_us", "copy us", ".1f"),
                       ("gbs", "mirage GB/s", ".0f"),
                       ("copy_pct", "% copy", ".0f"), ("vs_eager", "x eager", ".2f"),
                       ("vs_compile", "x compile", ".2f"), ("rel_err", "rel err", ".1e"),
                       ("eager_rel_err", "eager's", ".1e")])
    write_json(args.json, {"facts": facts, "copy_gbs": copy_gbs, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
