"""Whole-model benchmark of issue 3: diffusers' SD-1.5-shaped UNet2DConditionModel and VAE decoder
(random weights) and a plain Conv-BN-SiLU + attention net, fp16, side by side in one process:

  eager        fp16, channels_last, plain PyTorch
  eager+graph  the same, captured by hand in one CUDA graph (static inputs, copy in, clone out)
  compile      torch.compile(model) (default mode)
  compile-ro   torch.compile(model, mode="reduce-overhead")
  mirage       mirage.optimize(model) (fp16, channels_last, CUDA graphs)

Every variant starts from the same fp16 channels_last model (mirage from a copy of it: the copy
is its own weights). Per variant: ms per forward (median of CUDA-event timings of whole calls,
Python included), frames/s, speedup of mirage over the best peer, the extra GPU memory: the peak
allocated while the variant is prepared and called, beyond what was allocated before (its fp16
weights included there, so what is extra is graphs' pools, workspaces, caches and any weights
a variant adds, such as fused projections), the time to the first result (compile / optimize +
capture), and the relative L2 error against an fp32 eager forward.

    python benchmarks/bench_unet.py [--models unet,vae,plain] [--batches 2,1] [--peers ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time

import torch

import mirage
from harness import capture_graph, device_facts, full_float32, print_table, write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

PEERS = ("eager", "eager+graph", "compile", "compile-ro")
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8,
)


def log(message: str) -> None:
    print(f"[bench_unet {time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_unet():
    from diffusers import UNet2DConditionModel

    with torch.device("cuda"):
        model = UNet2DConditionModel(**SD15_UNET)
    return model.eval()


def unet_inputs(batch: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    sample = torch.randn(batch, 4, 64, 64, device="cuda", generator=g).to(dtype)
    context = torch.randn(batch, 77, 768, device="cuda", generator=g).to(dtype)
    timestep = torch.tensor([500] * batch, device="cuda")
    return (sample, timestep), {"encoder_hidden_states": context}


# SD-1.5's AutoencoderKL; the benchmark runs its decoder (a 64x64 latent to a 512x512 image).
SD15_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)


def build_vae_decoder():
    from diffusers import AutoencoderKL

    with torch.device("cuda"):
        model = AutoencoderKL(**SD15_VAE)
    return model.decoder.eval()


def vae_inputs(batch: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(batch, 4, 64, 64, device="cuda", generator=g).to(dtype),), {}


def build_plain():
    from plain_net import PlainNet

    with torch.device("cuda"):
        model = PlainNet.large()
    return model.eval()


def plain_inputs(batch: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(batch, 3, 64, 64, device="cuda", generator=g).to(dtype),), {}


MODELS = {"unet": (build_unet, unet_inputs), "vae": (build_vae_decoder, vae_inputs),
          "plain": (build_plain, plain_inputs)}


def first_tensor(out):
    """The main output: a tensor, a diffusers output's `sample`, or the first of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample
    return out[0]


def to_channels_last(args):
    return tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4
                 else a for a in args)


def manual_graph(model, args, kwargs):
    """The hand-made peer: warm up on a side stream, capture one call, then per call copy the
    inputs in, replay and clone the output out (what mirage's default outputs policy does)."""
    static_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    static_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    def warmup():
        for _ in range(3):
            model(*static_args, **static_kwargs)

    graph, static_out = capture_graph(lambda: first_tensor(model(*static_args, **static_kwargs)), warmup)

    def run(*a, **k):
        for dst, src in zip(static_args, a):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        for name, src in k.items():
            if isinstance(static_kwargs[name], torch.Tensor):
                static_kwargs[name].copy_(src)
        graph.replay()
        return static_out.clone()

    return run


def time_calls(fn, args, kwargs, iters: int) -> float:
    """Median ms of whole calls (host and device), each timed with CUDA events."""
    for _ in range(3):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kwargs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_l2(out, ref) -> float:
    out, ref = first_tensor(out).float(), first_tensor(ref).float()
    return ((out - ref).norm() / ref.norm()).item()


def run_model(name: str, batch: int, peers, iters: int):
    build, make_inputs = MODELS[name]
    log(f"{name} batch {batch}: building the model (random weights)")
    reference = build()
    params = sum(p.numel() for p in reference.parameters())
    args32, kwargs32 = make_inputs(batch, torch.float32)
    with torch.inference_mode(), full_float32():
        ref_out = first_tensor(reference(*args32, **kwargs32)).float()
    fp16 = copy.deepcopy(reference).half().to(memory_format=torch.channels_last)
    args, kwargs = make_inputs(batch, torch.float16)
    args = to_channels_last(args)
    rows = []

    def measure(label, make_fn):
        torch.cuda.synchronize()
        gc.collect()  # the previous variant's garbage out of the baseline, not freed inside the measurement
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        log(f"{name} batch {batch}: {label}: preparing")
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn = make_fn()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            ms = time_calls(fn, args, kwargs, iters)
            err = rel_l2(fn(*args, **kwargs), ref_out)
        extra_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        log(f"{name} batch {batch}: {label}: {ms:.2f} ms, first result after {first_s:.1f} s, rel err {err:.1e}")
        rows.append(dict(model=name, batch=batch, variant=label, ms=ms, fps=1000.0 * batch / ms,
                         first_s=first_s, extra_mb=extra_mb, rel_err=err, params_m=params / 1e6))
        del fn, out

    if "eager" in peers:
        measure("eager", lambda: fp16)
    if "eager+graph" in peers:
        measure("eager+graph", lambda: manual_graph(fp16, args, kwargs))
    if "compile" in peers:
        torch._dynamo.reset()
        measure("compile", lambda: torch.compile(fp16))
    if "compile-ro" in peers:
        torch._dynamo.reset()
        measure("compile-ro", lambda: torch.compile(fp16, mode="reduce-overhead"))
    torch._dynamo.reset()
    # The peers' starting point: an fp32 copy converted by optimize would free half its bytes
    # inside the measurement and hide that much of mirage's own memory.
    mirage_model = copy.deepcopy(fp16)
    del fp16, reference
    holder = {}

    def optimized():
        holder["model"] = mirage.optimize(mirage_model, dtype=torch.float16, channels_last=True, cuda_graph=True)
        return holder["model"]

    measure("mirage", optimized)
    print(mirage.report(holder["model"]))
    best_peer = min((r for r in rows if r["variant"] != "mirage"), key=lambda r: r["ms"], default=None)
    for r in rows:
        r["vs_best_peer"] = best_peer["ms"] / r["ms"] if best_peer else None
    del holder, mirage_model
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="unet", help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--batches", default="2", help="comma list of batch sizes")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list of: " + ", ".join(PEERS))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args(argv)
    peers = [p for p in opts.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers: {sorted(unknown)}")
    torch.backends.cudnn.benchmark = True
    facts = device_facts()
    print(f"{facts['gpu']}, torch {facts['torch']}, CUDA {facts['cuda']}, {facts['date']}")
    rows = []
    for name in opts.models.split(","):
        for batch in (int(b) for b in opts.batches.split(",")):
            rows += run_model(name, batch, peers, opts.iters)
    print()
    print_table(rows, [("model", "model", "s"), ("batch", "batch", "d"), ("variant", "variant", "s"),
                       ("ms", "ms", ".2f"), ("fps", "frames/s", ".1f"), ("vs_best_peer", "x best peer", ".2f"),
                       ("extra_mb", "extra MiB", ".0f"), ("first_s", "first result s", ".1f"),
                       ("rel_err", "rel L2 err", ".1e")])
    write_json(opts.json, {"device": facts, "argv": sys.argv, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
