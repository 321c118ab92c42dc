"""Per-kernel GPU time of mirage's ops and their PyTorch composites (torch.profiler), to see
which kernels an op launches and where its time goes.

    python benchmarks/profile_ops.py
"""

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import mirage


def main() -> None:
    h = torch.float16
    cases = []
    for shape in [(2, 320, 64, 64), (2, 960, 64, 64)]:
        for fmt in (torch.channels_last, torch.contiguous_format):
            x = torch.randn(shape, device="cuda", dtype=h).contiguous(memory_format=fmt)
            w = torch.randn(shape[1], device="cuda", dtype=h)
            cases.append((f"group_norm {shape} {fmt}", lambda x=x, w=w: mirage.ops.group_norm(x, 32, w, w, 1e-5, "silu"),
                          lambda x=x, w=w: F.silu(F.group_norm(x, 32, w, w, 1e-5))))
    t = torch.randn(8192, 320, device="cuda", dtype=h)
    wt = torch.randn(320, device="cuda", dtype=h)
    cases.append(("layer_norm 8192x320", lambda: mirage.ops.layer_norm(t, wt, wt), lambda: F.layer_norm(t, (320,), wt, wt)))
    for name, ours, theirs in cases:
        for label, fn in (("mirage", ours), ("torch", theirs)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            print(f"== {name} [{label}]")
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
                    us = getattr(e, "self_device_time_total", 0) / max(e.count, 1)
                    print(f"   {us:8.2f} us x{e.count:3d}  {e.key[:110]}")


if __name__ == "__main__":
    main()
