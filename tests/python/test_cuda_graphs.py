import pytest
import torch

import mirage
from common import capture_graph, randn


@pytest.mark.cuda
def test_capture_and_replay_with_new_inputs():
    c = 320
    x = randn(2, c, 32, 32, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    t = randn(2, 1024, c, device="cuda", dtype=torch.float16)
    r = randn(2, 1024, c, device="cuda", dtype=torch.float16)
    w = randn(c, device="cuda")
    f = randn(2, 1024, 2 * c, device="cuda", dtype=torch.float16)

    def step():
        return (mirage.ops.group_norm(x, 32, w, w, 1e-5, "silu"),
                mirage.ops.layer_norm(t, w, w, 1e-5, residual=r),
                mirage.ops.geglu(f))

    graph, outputs = capture_graph(step)
    for _ in range(3):
        for buf in (x, t, r, f):
            buf.copy_(randn(*buf.shape, device="cuda", dtype=buf.dtype))
        graph.replay()
        torch.cuda.synchronize()
        gn, (ln, total), gg = outputs
        torch.testing.assert_close(gn, mirage.ops.group_norm(x, 32, w, w, 1e-5, "silu"), atol=0, rtol=0)
        torch.testing.assert_close(ln, mirage.ops.layer_norm(t, w, w, 1e-5, residual=r)[0], atol=0, rtol=0)
        torch.testing.assert_close(total, t + r, atol=0, rtol=0)
        torch.testing.assert_close(gg, mirage.ops.geglu(f), atol=0, rtol=0)
