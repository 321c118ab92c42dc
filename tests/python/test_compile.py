import re

import pytest
import torch
from torch import nn

import mirage
from common import DEVICES, randn


class Block(nn.Module):
    """All the ops in one graph: norm + SiLU, a pre-norm residual step, and the GEGLU gate."""

    def __init__(self, c):
        super().__init__()
        self.gn = mirage.nn.GroupNorm(4, c, activation="silu")
        self.ln = mirage.nn.LayerNorm(c)
        self.geglu = mirage.nn.GEGLU(c, c)

    def forward(self, x, residual):
        h = self.gn(x).flatten(2).transpose(1, 2)
        normed, stream = self.ln(h, residual)
        return self.geglu(normed) + stream


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    block = Block(16).to(device)
    compiled = torch.compile(block, fullgraph=True)
    for _ in range(2):  # new inputs each call: the compiled graph must not have baked them in
        x = randn(2, 16, 4, 4, device=device).contiguous(memory_format=torch.channels_last)
        r = randn(2, 16, 16, device=device)
        expected = block(x, r)
        got = compiled(x, r)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert not torch.equal(got, torch.zeros_like(got))



def test_inductor_with_dynamic_shapes_compiles_the_block_once():
    """The block of norms and GEGLU under Inductor itself (the default backend) with dynamic
    shapes: no new graph for a new batch and token count, and eager's values."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    block = Block(16)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, dynamic=True, fullgraph=True)
    traces = []
    for batch, side in ((3, 5), (6, 7)):
        x = randn(batch, 16, side, side).contiguous(memory_format=torch.channels_last)
        r = randn(batch, side * side, 16)
        torch.testing.assert_close(compiled(x, r), block(x, r), atol=1e-5, rtol=1e-5)
        traces.append(counter.frame_count)
    # Dynamo may restart its first trace (the modules' float eps), which counts twice.
    assert traces[1] == traces[0], f"traces after each call: {traces}"

# The U-Net's ops with sizes that vary between calls (batch, spatial, tokens): each maps an input
# size n to (the op's call, its inputs). Weights keep fixed sizes, as a model's do.
def _dynamic_cases(device):
    def cl(t):
        return t.contiguous(memory_format=torch.channels_last)

    w8, b8 = randn(8, device=device), randn(8, device=device)
    w16, b16 = randn(16, device=device), randn(16, device=device)
    weight, bias4 = randn(4, 16, device=device), randn(4, device=device)
    ops = torch.ops.mirage
    return {
        "group_norm": (lambda x: ops.group_norm(x, 4, w8, b8, 1e-5, "silu"),
                       lambda n: (cl(randn(n, 8, n + 2, 7, device=device)),)),
        "layer_norm": (lambda x: ops.layer_norm(x, w16, b16, 1e-5),
                       lambda n: (randn(n, n + 2, 16, device=device),)),
        "add_layer_norm": (lambda x, r: ops.add_layer_norm(x, r, w16, b16, 1e-5),
                           lambda n: (randn(n, 16, device=device), randn(n, 16, device=device))),
        "geglu": (lambda x: ops.geglu(x, "tanh"), lambda n: (randn(n, n + 2, 16, device=device),)),
        "bias_act": (lambda x, r: ops.bias_act(x, b8, r, "gelu", 0.5),
                     lambda n: (cl(randn(n, 8, n + 2, 7, device=device)),
                                cl(randn(n, 8, n + 2, 7, device=device)))),
        "linear": (lambda x, r: ops.linear(x, weight, bias4, r, "silu"),
                   lambda n: (randn(n, 16, device=device), randn(n, 4, device=device))),
        "subpixel_shuffle": (lambda x: ops.subpixel_shuffle(x, bias4),
                             lambda n: (cl(randn(n, 16, n + 2, 7, device=device)),)),
    }


DYNAMIC_OPS = sorted(_dynamic_cases("cpu"))


def _outputs(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DYNAMIC_OPS)
def test_dynamic_shapes_compile_once(name, device):
    """torch.compile(dynamic=True) traces each op once for every size (symbolic sizes in its Meta
    kernel and checks; sizes() would specialize them and recompile at each new size), and the
    compiled forward and backward equal eager's."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    call, make = _dynamic_cases(device)[name]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(call, backend=counter, dynamic=True, fullgraph=True)
    for n in (3, 4, 6):
        inputs = [t.requires_grad_() for t in make(n)]
        twins = [t.detach().clone().requires_grad_() for t in inputs]
        got, expected = _outputs(compiled(*inputs)), _outputs(call(*twins))
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.stride() == e.stride()
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        sum(o.sum() for o in got).backward()
        sum(o.sum() for o in expected).backward()
        for t, twin in zip(inputs, twins):
            torch.testing.assert_close(t.grad, twin.grad, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1, f"{name} was compiled {counter.frame_count} times for 3 sizes"


# The U-Net's ops over a batch of data-dependent size: each maps a batch tensor x to the op's
# call; inputs that share the batch (a residual) are formed from x, as they would share its size
# in a model. (Input shape, whether it is also tried channels-last, the dimensions that may be
# data-dependent: the batch, and the sizes no weight is compared with.)
def _unbacked_cases(device):
    w8, b8 = randn(8, device=device), randn(8, device=device)
    w16, b16 = randn(16, device=device), randn(16, device=device)
    weight, bias4 = randn(4, 16, device=device), randn(4, device=device)
    ops = torch.ops.mirage
    return {
        "group_norm": (lambda x: ops.group_norm(x, 4, w8, b8, 1e-5, "silu"), (7, 8, 5, 6), True, (0,)),
        "layer_norm": (lambda x: ops.layer_norm(x, w16, b16, 1e-5), (7, 9, 16), False, (0, 1)),
        "add_layer_norm": (lambda x: ops.add_layer_norm(x, x.cos(), w16, b16, 1e-5), (7, 16), False, (0,)),
        "geglu": (lambda x: ops.geglu(x, "tanh"), (7, 9, 16), False, (0, 1)),
        "bias_act": (lambda x: ops.bias_act(x, b8, x.sin(), "gelu", 0.5), (7, 8, 5, 6), True, (0, 2, 3)),
        "linear": (lambda x: ops.linear(x, weight, bias4, x[:, :4].cos(), "silu"), (7, 16), False, (0,)),
        "subpixel_shuffle": (lambda x: ops.subpixel_shuffle(x, bias4), (7, 16, 5, 6), True, (0,)),
    }


UNBACKED_CASES = [(name, layout, dim) for name, (_, _, four_d, dims) in _unbacked_cases("cpu").items()
                  for layout in (("contiguous", "channels_last") if four_d else ("contiguous",)) for dim in dims]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, layout, dim", UNBACKED_CASES)
def test_unbacked_sizes(name, layout, dim, device):
    """A batch (or a sequence length, or bias_act's spatial size) whose size is data-dependent
    (mark_unbacked: no guard may be put on it) traces with fullgraph, channels-last input
    included (its layout read without a guard), and the compiled forward and backward equal
    eager's, in eager's memory format."""
    torch._dynamo.reset()
    call, shape, _, _ = _unbacked_cases(device)[name]
    x = randn(*shape, device=device)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    twin = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    torch._dynamo.decorators.mark_unbacked(x, dim)
    got, expected = _outputs(torch.compile(call, backend="aot_eager", fullgraph=True)(x)), _outputs(call(twin))
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.stride() == e.stride()
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    sum(o.sum() for o in got).backward()
    sum(o.sum() for o in expected).backward()
    torch.testing.assert_close(x.grad, twin.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DYNAMIC_OPS)
def test_export_with_dynamic_dims(name, device):
    """torch.export with a Dim on the varying sizes keeps them symbolic (no constraint violation),
    and the exported program runs at another size."""
    call, make = _dynamic_cases(device)[name]

    class Op(nn.Module):
        def forward(self, *inputs):
            return call(*inputs)

    example = make(3)
    n = torch.export.Dim("n", min=2, max=64)
    # The varying dimensions of each input (dims 0 and 2 of the 4-D ones, 0 and 1 of the 3-D ones).
    spans = {2: {0: n}, 3: {0: n, 1: n + 2}, 4: {0: n, 2: n + 2}}
    program = torch.export.export(Op(), example, dynamic_shapes=(tuple(spans[t.dim()] for t in example),))
    inputs = make(6)
    for g, e in zip(_outputs(program.module()(*inputs)), _outputs(call(*inputs))):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_bad_input_under_symbolic_sizes_names_op_and_argument():
    """A check that fails while tracing with symbolic sizes still names the op and the argument,
    and writes each size as its symbol with the example's value."""
    torch._dynamo.reset()
    w = randn(5)
    compiled = torch.compile(lambda x: torch.ops.mirage.layer_norm(x, w, None, 1e-5), backend="aot_eager",
                             dynamic=True, fullgraph=True)
    with pytest.raises(Exception) as error:
        compiled(randn(3, 16))
    # The weight, a global of the traced function, is made symbolic too.
    assert re.search(r"mirage::layer_norm: weight must have shape \[s\d+=16\], got \[(s\d+=)?5\]", str(error.value))


def test_export_conv_bias_act_with_a_batch_dim_spanning_its_channels():
    """mirage.nn.conv_bias_act (the U-Net's convolutions with a per-sample time-embedding shift)
    exports with a batch Dim whose range includes the channel count, and runs at that batch (its
    shape check once compared the batch with the channels: the guard N != C refused the Dim)."""
    conv = nn.Conv2d(4, 8, 3, padding=1)

    class ConvShift(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x, shift):
            return mirage.nn.conv_bias_act(self.conv, x, shift=shift, activation="silu")

    batch = torch.export.Dim("batch", max=64)
    program = torch.export.export(ConvShift(), (randn(2, 4, 6, 7), randn(2, 8)),
                                  dynamic_shapes=({0: batch}, {0: batch}))
    x, shift = randn(8, 4, 6, 7), randn(8, 8)
    torch.testing.assert_close(program.module()(x, shift), ConvShift()(x, shift))
