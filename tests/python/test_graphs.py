import contextlib
import enum
import gc
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirage
from mirage import graphs
from common import GraphStandIn, randn


def fake_cache(fn, max_entries, **kwargs):
    pools = []

    def new_pool():
        pools.append(object())
        return pools[-1]

    cache = graphs.GraphCache(fn, max_entries, capture=GraphStandIn, new_pool=new_pool, verbose=False, **kwargs)
    return cache, pools


def entries(cache):
    return list(cache._entries.values())


def test_signature_keys_on_shape_dtype_device_layout_and_values():
    x = randn(2, 3, 4, 5)
    key = graphs.signature((x,), {"t": 1})
    assert graphs.signature((randn(2, 3, 4, 5),), {"t": 1}) == key  # values do not matter
    assert graphs.signature((randn(2, 3, 4, 6),), {"t": 1}) != key
    assert graphs.signature((x.half(),), {"t": 1}) != key
    assert graphs.signature((x.contiguous(memory_format=torch.channels_last),), {"t": 1}) != key
    assert graphs.signature((x,), {"t": 2}) != key
    assert graphs.signature((x,), {"t": 1.0}) != key  # 1 == 1.0, but they are different arguments
    assert graphs.signature((x,), {"t": True}) != key
    assert graphs.signature((x,), {}) != key
    assert graphs.signature(([x],), {"t": 1}) != key  # the nesting counts
    a, b = randn(3), randn(4)
    assert graphs.signature((), {"a": a, "b": b}) == graphs.signature((), {"b": b, "a": a})


def test_signature_refuses_unhashable_arguments():
    class Unhashable:
        __hash__ = None

    with pytest.raises(ValueError, match=r"mirage.graphs: argument kwargs\['option'\] is a Unhashable"):
        graphs.signature((randn(2),), {"option": Unhashable()})


def test_signature_refuses_objects_that_may_hold_tensors():
    class Conditioning:  # hashable by identity, and a graph would read .emb at its captured address
        def __init__(self, emb):
            self.emb = emb

    with pytest.raises(ValueError, match=r"argument args\[1\] is a Conditioning, which is neither a tensor nor a "
                                         r"plain value .* so pass tensors as arguments"):
        graphs.signature((randn(2), Conditioning(randn(3))), {})


def test_signature_keys_floats_by_their_bits_and_takes_enums():
    x = randn(2)
    nan = float("nan")
    assert graphs.signature((x,), {"s": nan}) == graphs.signature((x,), {"s": float("nan")})
    assert graphs.signature((x,), {"s": -0.0}) != graphs.signature((x,), {"s": 0.0})  # x / s differ
    assert graphs.signature((x,), {"s": complex(1.0, -0.0)}) != graphs.signature((x,), {"s": complex(1.0, 0.0)})

    class Mode(enum.Enum):
        FAST = 1
        EXACT = 2

    assert graphs.signature((x, Mode.FAST), {}) != graphs.signature((x, Mode.EXACT), {})
    assert graphs.signature((x, torch.channels_last), {}) == graphs.signature((x, torch.channels_last), {})


def test_cache_captures_once_per_signature_and_replays():
    calls = []

    def fn(x, scale=1.0):
        calls.append(x.shape)
        return {"y": x * scale, "shape": tuple(x.shape)}

    cache, pools = fake_cache(fn, 4)
    x = randn(2, 3)
    out = cache(x, scale=2.0)
    torch.testing.assert_close(out["y"], x * 2.0)
    assert out["shape"] == (2, 3)
    for _ in range(3):
        x = randn(2, 3)
        torch.testing.assert_close(cache(x, scale=2.0)["y"], x * 2.0)
    cache(randn(5, 3), scale=2.0)
    cache(randn(5, 3), scale=3.0)
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries, stats.max_entries) == (3, 3, 0, 3, 4)
    assert [entry.replays for entry in entries(cache)] == [4, 1, 1]
    # One pool, made on the first capture and shared by every graph.
    assert len(pools) == 1 and all(entry.pool is pools[0] for entry in entries(cache))


def test_cache_bound_is_honoured_with_lru_eviction():
    cache, _ = fake_cache(lambda x: x + 1, 2)
    a, b, c = randn(1), randn(2), randn(3)
    cache(a)
    cache(b)
    graph_a, graph_b = entries(cache)
    cache(a)  # a is now the most recently used: b goes first
    cache(c)
    assert len(cache) == 2
    assert graph_b.released and not graph_a.released
    assert entries(cache)[0] is graph_a
    cache(b)  # b again: a new capture, evicting a
    assert graph_a.released
    assert [entry.signature for entry in entries(cache)] == [graphs.signature((c,), {}), graphs.signature((b,), {})]
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (1, 4, 2, 2)


def test_evicted_graphs_are_released_and_not_kept():
    GraphStandIn.live.clear()
    cache, _ = fake_cache(lambda x: x * 2, 3)
    for n in range(1, 40):
        cache(randn(n))
        # No gc.collect(): released entries must go with their last reference, not with a cycle.
        assert len(GraphStandIn.live) <= 3
    assert cache.stats().evictions == 36
    cache.clear()
    assert len(cache) == 0 and len(GraphStandIn.live) == 0


def test_cache_forwards_its_settings_and_prints_progress(capsys):
    cache = graphs.GraphCache(lambda x: x, 1, copy_outputs=False, warmup=5, capture=GraphStandIn,
                              new_pool=object)
    cache(randn(2, 3, dtype=torch.float16))
    entry = entries(cache)[0]
    assert entry.copy_outputs is False and entry.warmup == 5
    assert "mirage: captured CUDA graph 1/1 for (args[0]: float16[2, 3])" in capsys.readouterr().err


def test_signature_hash_is_the_tuples():
    key = graphs.signature((randn(2, 3),), {"t": 1})
    plain = tuple(key)
    assert key == plain and hash(key) == hash(plain) and {plain: 1}[key] == 1


def test_signature_names_an_unhashable_argument():
    with pytest.raises(ValueError, match=r"argument kwargs\['z'\]\[1\] is a set, which is neither a tensor nor a plain"):
        graphs.signature((randn(2),), {"z": (1, {2})})


def test_prepare_and_replay_count_like_calls_and_follow_evictions():
    cache, _ = fake_cache(lambda x: x * 2, 1)
    x = randn(3)
    key, entry = cache.prepare(x)
    assert key == graphs.signature((x,), {}) and cache.holds(key, entry)
    assert cache.prepare(randn(3)) == (key, entry)  # same signature: no second capture
    torch.testing.assert_close(cache.replay(key, entry), x * 2)
    entry.static_inputs[0].fill_(5.0)  # what a hot-path caller does: write the buffers, then replay
    torch.testing.assert_close(cache.replay(key, entry), torch.full((3,), 10.0))
    # As for a call: the capture is a miss, the first replay after it part of that call.
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (1, 1)
    y = randn(3)
    torch.testing.assert_close(cache(y), y * 2)
    assert cache.stats().hits == 2 and entry.replays == 3
    cache(randn(4))  # a new signature evicts the only graph
    assert not cache.holds(key, entry) and entry.released
    with pytest.raises(RuntimeError, match="GraphCache.replay: this graph was evicted or cleared"):
        cache.replay(key, entry)
    key4, entry4 = cache.prepare(randn(4))
    cache.clear()
    assert not cache.holds(key4, entry4)


def test_each_prepared_graph_counts_its_first_replay_as_its_capture():
    # Each capture by prepare() is owed one uncounted replay, whatever is captured in between.
    cache, _ = fake_cache(lambda x: x * 2, 4)
    first, second = cache.prepare(randn(3)), cache.prepare(randn(4))
    cache(randn(5))  # a third signature, captured by a call
    cache.replay(*first)
    cache(randn(4))  # second's first replay, through a call
    assert (cache.stats().misses, cache.stats().hits) == (3, 0)
    cache.replay(*first)
    cache.replay(*second)
    assert cache.stats().hits == 2
    # An evicted graph owes nothing: captured again, its first replay is its capture call's.
    small, _ = fake_cache(lambda x: x * 2, 1)
    small.prepare(randn(3))
    small(randn(4))
    key, entry = small.prepare(randn(3))
    small.replay(key, entry)
    assert (small.stats().misses, small.stats().hits, small.stats().evictions) == (3, 0, 2)


def test_replay_of_a_freshly_prepared_graph_makes_it_the_most_recent():
    cache, _ = fake_cache(lambda x: x * 2, 2)
    b = randn(2)
    cache(b)
    key, entry = cache.prepare(randn(3))  # captured, not yet replayed
    cache(b)
    cache.replay(key, entry)  # now the most recently used: b goes first
    cache(randn(4))
    assert cache.holds(key, entry) and graphs.signature((b,), {}) not in cache._entries


def test_a_signature_mismatch_names_the_argument_and_both_sides():
    # What CapturedGraph's error says (a CUDA graph is not needed to word it).
    x = randn(4, 6)
    captured = graphs.signature((x,), {"mode": 1})
    cases = [((x.t().contiguous().t(),), {"mode": 1},
              r"argument args\[0\] is a float32\[4, 6\] tensor on cpu with strides \(1, 4\), captured as a "
              r"float32\[4, 6\] tensor on cpu with strides \(6, 1\)"),
             ((x,), {"mode": 2}, r"argument kwargs\['mode'\] is int 2, captured as int 1"),
             ((x,), {"mode": 1.0}, r"argument kwargs\['mode'\] is float 1.0, captured as int 1"),
             ((x,), {"mode": np.float32(0.25)}, r"argument kwargs\['mode'\] is float32 0.25, captured as int 1"),
             ((x,), {"other": 1}, r"called with \(args\[0\]: float32\[4, 6\]\), whose structure \(containers, "
                                  r"keyword names\) is not the captured one's")]
    for args, kwargs, message in cases:
        assert re.fullmatch(message, graphs._difference(captured, graphs.signature(args, kwargs), args, kwargs))


class _PathlessPair:
    """A pytree node registered without key functions, as diffusers' output classes are."""

    def __init__(self, first, second):
        self.first, self.second = first, second


torch.utils._pytree.register_pytree_node(_PathlessPair, lambda pair: ([pair.first, pair.second], None),
                                         lambda values, _: _PathlessPair(*values))


def test_arguments_without_paths_are_numbered_within_their_own_argument():
    x = randn(2)
    captured = graphs.signature((x, _PathlessPair(x, 1)), {"k": 3})
    given = (x, _PathlessPair(x, 2)), {"k": 3}
    assert graphs._difference(captured, graphs.signature(*given), *given) == \
        "argument args[1] (leaf 1) is int 2, captured as int 1"
    assert graphs._describe(*given) == "args[0]: float32[2], args[1] (leaf 0): float32[2]"


def test_cache_refuses_bad_max_entries():
    with pytest.raises(ValueError, match="mirage.graphs.GraphCache: max_entries must be an int >= 1, got 0"):
        graphs.GraphCache(lambda x: x, 0)


def test_bad_options_and_functions_are_refused_by_name():
    for option in ("copy_outputs", "verbose"):
        with pytest.raises(ValueError, match=f"mirage.graphs.GraphCache: {option} must be True or False, got 1"):
            graphs.GraphCache(lambda x: x, **{option: 1})
    with pytest.raises(TypeError, match="mirage.graphs.GraphCache: fn must be callable, got int"):
        graphs.GraphCache(3)
    with pytest.raises(TypeError, match="mirage.graphs.capture: fn must be callable, got str"):
        graphs.capture("forward", randn(2))
    with pytest.raises(ValueError, match="mirage.graphs.capture: copy_outputs must be True or False, got 'no'"):
        graphs.capture(lambda x: x, randn(2), copy_outputs="no")


def test_capture_refuses_cpu_inputs_and_grad():
    x = randn(2, 3)
    # Without a GPU the first thing said is that there is none ("move it to the GPU" could not be done).
    refused = (ValueError, r"input args\[0\] is on cpu") if torch.cuda.is_available() else \
        (RuntimeError, "CUDA is not available; CUDA graphs need a CUDA GPU")
    with pytest.raises(refused[0], match=r"mirage.graphs.capture: " + refused[1]):
        graphs.capture(lambda x: x * 2, x)
    w = randn(3).requires_grad_()
    with pytest.raises(ValueError, match=r"input kwargs\['weight'\] requires grad while grad mode is on"):
        graphs.capture(lambda x, weight: x * weight, x, weight=w)


@contextlib.contextmanager
def cuda_autocast_flag(dtype):
    """CUDA autocast switched on as torch.autocast("cuda") does, which without a GPU turns itself
    off: the signature only reads the flag and the dtype."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


def test_signature_keys_on_cuda_autocast_and_names_it():
    x = randn(2, 3)
    plain = graphs.signature((x,), {})
    with cuda_autocast_flag(torch.float16):
        half = graphs.signature((x,), {})
    with cuda_autocast_flag(torch.bfloat16):
        bf16 = graphs.signature((x,), {})
    assert len({plain, half, bf16}) == 3
    assert graphs._difference(half, plain, (x,), {}) == ("called without CUDA autocast, captured under CUDA "
                                                         "autocast to float16")
    assert graphs._difference(plain, bf16, (x,), {}) == ("called under CUDA autocast to bfloat16, captured "
                                                         "without CUDA autocast")


def test_signature_takes_numpy_scalars_by_type_and_value():
    x = randn(2)
    key = graphs.signature((x, np.int64(3)), {"s": np.float32(0.5), "flag": np.bool_(True)})
    assert key == graphs.signature((x, np.int64(3)), {"s": np.float32(0.5), "flag": np.bool_(True)})
    assert key != graphs.signature((x, np.int64(4)), {"s": np.float32(0.5), "flag": np.bool_(True)})
    assert key != graphs.signature((x, 3), {"s": np.float32(0.5), "flag": np.bool_(True)})  # as 1 and 1.0
    assert graphs.signature((x, np.float32("nan")), {}) == graphs.signature((x, np.float32("nan")), {})
    with pytest.raises(ValueError, match=r"argument args\[1\] is a ndarray, which is neither"):
        graphs.signature((x, np.zeros(())), {})  # a 0-d array is mutable: not a plain value


def test_signature_names_a_nested_tensor():
    nested = torch.nested.nested_tensor([randn(2, 3), randn(4, 3)])
    with pytest.raises(ValueError, match=r"argument args\[0\] is a nested tensor; a graph copies its inputs into "
                                         r"dense \(strided\) static buffers"):
        graphs.signature((nested,), {})


def test_a_failed_capture_costs_the_cache_no_graph():
    def fn(x):
        if x.shape[0] == 3:
            raise RuntimeError("no graph for three")
        return x + 1

    cache, _ = fake_cache(fn, 1)
    cache(randn(2))
    (graph_2,) = entries(cache)
    with pytest.raises(RuntimeError, match="no graph for three"):
        cache(randn(3))
    assert entries(cache) == [graph_2] and not graph_2.released
    stats = cache.stats()
    assert (stats.misses, stats.evictions, stats.hits) == (1, 0, 0)
    cache(randn(2))
    assert cache.stats().hits == 1


def test_warmup_follows_the_count_rule():
    for bad in (0, True, 2.5, "3"):
        with pytest.raises(ValueError, match=r"mirage.graphs.GraphCache: warmup must be an int >= 1, got"):
            graphs.GraphCache(lambda x: x, warmup=bad)
    with pytest.raises(ValueError, match=r"mirage.graphs.capture: warmup must be an int >= 1, got True"):
        graphs.capture(lambda x: x, randn(2), warmup=True)
    assert graphs.GraphCache(lambda x: x, warmup=np.int64(2)).warmup == 2


def test_cache_refuses_inputs_that_require_grad():
    cache, _ = fake_cache(lambda x: x * 2, 2)
    w = randn(3).requires_grad_()
    with pytest.raises(ValueError, match=r"mirage.graphs.GraphCache: input args\[0\] requires grad while grad mode"):
        cache(w)
    assert len(cache) == 0
    with torch.no_grad():
        torch.testing.assert_close(cache(w), w.detach() * 2)


# ----------------------------------------------------------------------------------------------
# On a GPU


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.norm = mirage.nn.GroupNorm(4, 16, activation="silu")
        self.proj = nn.Linear(16, 16)

    def forward(self, x, bias):
        h = self.norm(self.conv(x))
        return {"map": h, "pooled": self.proj(h.mean((2, 3))) + bias}


def small_net_inputs(batch=2, size=16):
    return randn(batch, 8, size, size, device="cuda"), randn(16, device="cuda")


@pytest.mark.cuda
def test_a_graph_captured_inside_autocast_records_its_own_casts():
    # Inside torch.autocast a warm-up fills autocast's cache with float16 copies of the weights,
    # which a capture would then read without a cast of its own; the block's end frees them. The
    # graph must replay correctly after that, with the freed memory reused meanwhile.
    lin = nn.Linear(256, 256).cuda()
    x = randn(8, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        graph = graphs.capture(lin, x)
        with torch.no_grad():
            expected = lin(x)
    scribble = [torch.full((256, 256), 1e4, dtype=torch.float16, device="cuda") for _ in range(64)]
    y = randn(8, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16), torch.no_grad():
        out, reference = graph(x), lin(y)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(graph(y), reference)
    assert out.dtype == torch.float16 and len(scribble) == 64
    with pytest.raises(ValueError, match="called without CUDA autocast, captured under CUDA autocast to float16"):
        graph(x)


@pytest.mark.cuda
def test_captured_graph_replays_new_inputs_like_eager():
    net = SmallNet().cuda().eval()
    graph = graphs.capture(net, *small_net_inputs())
    kept = []
    with torch.no_grad():
        for _ in range(4):
            x, bias = small_net_inputs()
            out = graph(x, bias)
            expected = net(x, bias)
            torch.testing.assert_close(out["map"], expected["map"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out["pooled"], expected["pooled"], atol=1e-5, rtol=1e-5)
            kept.append((out, expected))
    # Outputs are copies: earlier ones survive later replays.
    for out, expected in kept:
        torch.testing.assert_close(out["map"], expected["map"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="differs from the captured signature"):
        graph(*small_net_inputs(batch=3))


@pytest.mark.cuda
def test_replay_reads_what_was_written_into_the_static_inputs():
    net = SmallNet().cuda().eval()
    graph = graphs.capture(net, *small_net_inputs(), copy_outputs=False)
    static_x, static_bias = graph.static_inputs
    with torch.no_grad():
        for _ in range(3):
            x, bias = small_net_inputs()
            static_x.copy_(x.cpu().pin_memory(), non_blocking=True)
            static_bias.copy_(bias)
            out = graph.replay()
            expected = net(x, bias)
            torch.testing.assert_close(out["map"], expected["map"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out["pooled"], expected["pooled"], atol=1e-5, rtol=1e-5)
    graph.reset()
    with pytest.raises(RuntimeError, match="was reset"):
        graph.replay()


@pytest.mark.cuda
def test_static_arguments_name_the_buffers_of_an_in_place_state():
    # A state dict updated in place (as mirage.ff.md's): the graph's own copy of it, found by name.
    def advance(state, steps):
        for _ in range(steps):
            state["x"].add_(state["v"])
        return state

    state = {"x": torch.zeros(4, device="cuda"), "v": torch.arange(4.0, device="cuda")}
    graph = graphs.capture(advance, state, 3, copy_outputs=False)
    (buffers, steps), kwargs = graph.static_arguments
    assert steps == 3 and kwargs == {} and set(buffers) == {"x", "v"}
    assert all(any(buffers[name] is t for t in graph.static_inputs) for name in buffers)
    assert buffers["x"] is not state["x"]
    buffers["x"].zero_()
    out = graph.replay()
    assert out["x"] is buffers["x"]
    torch.testing.assert_close(buffers["x"], 3 * state["v"])
    graph.reset()
    assert graph.static_arguments == ((), {})


@pytest.mark.cuda
def test_graph_captured_under_inference_mode_replays_outside_it():
    net = SmallNet().cuda().eval()
    with torch.inference_mode():
        graph = graphs.capture(net, *small_net_inputs())
    with torch.no_grad():
        x, bias = small_net_inputs()
        torch.testing.assert_close(graph(x, bias)["map"], net(x, bias)["map"], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_copy_outputs_false_returns_the_static_buffers():
    net = SmallNet().cuda().eval()
    graph = graphs.capture(net, *small_net_inputs(), copy_outputs=False)
    first = graph(*small_net_inputs())["map"]
    x, bias = small_net_inputs()
    second = graph(x, bias)["map"]
    assert first.data_ptr() == second.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(first, net(x, bias)["map"], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_cache_captures_a_new_graph_for_a_new_shape():
    net = SmallNet().cuda().eval()
    cache = graphs.GraphCache(net, max_entries=2)
    with torch.no_grad():
        for batch in (2, 2, 1, 2, 1):
            x, bias = small_net_inputs(batch)
            torch.testing.assert_close(cache(x, bias)["map"], net(x, bias)["map"], atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    assert (stats.misses, stats.hits, stats.entries) == (2, 3, 2)


@pytest.mark.cuda
def test_memory_is_flat_across_replays_and_evictions():
    net = SmallNet().cuda().eval()
    cache = graphs.GraphCache(net, max_entries=2, verbose=False)
    inputs = small_net_inputs()
    cache(*inputs)
    # Garbage of earlier tests freed during the loop would read as memory given back (it did,
    # by 0.9 MB, in one full GPU run): collect it first.
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        cache(*inputs)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    # Many shapes through a 2-entry cache: evicted graphs give their memory back.
    for size in range(8, 40):
        cache(*small_net_inputs(size=size))
    cache(*small_net_inputs(size=16))
    two_graphs_held = torch.cuda.memory_allocated()
    for size in range(8, 40):
        cache(*small_net_inputs(size=size))
    cache(*small_net_inputs(size=16))
    assert torch.cuda.memory_allocated() <= two_graphs_held
    assert cache.stats().evictions >= 60


@pytest.mark.cuda
def test_a_graph_that_dies_in_a_cycle_during_a_capture_does_not_break_it():
    # A captured graph in a reference cycle becomes garbage during another capture, and the
    # collector would run at the next allocation (threshold 1): collected then, its CUDA graph's
    # destruction would invalidate the capture in progress.
    x = torch.ones(8, device="cuda")
    dead = graphs.capture(lambda t: t * 2, x)
    cycle = [dead]
    cycle.append(cycle)
    holder = [cycle]
    del dead, cycle
    calls = []

    def drop_then_allocate(t):
        calls.append(t)
        if len(calls) == 4:  # the captured call, after the three warm-up calls
            holder.clear()
            assert len([[i] for i in range(100)]) == 100
        return t * 3

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph = graphs.capture(drop_then_allocate, x)
    finally:
        gc.set_threshold(*thresholds)
    assert len(calls) == 4 and gc.isenabled()
    torch.testing.assert_close(graph(x), x * 3)


@pytest.mark.cuda
def test_capture_refuses_inputs_on_cpu_next_to_cuda():
    with pytest.raises(ValueError, match=r"input args\[1\] is on cpu"):
        graphs.capture(lambda x, y: x + y.cuda(), randn(2, device="cuda"), randn(2))


@pytest.mark.cuda
def test_captured_functional_ops_match_eager():
    def step(x, w):
        return F.silu(mirage.ops.group_norm(x, 4, w, w, 1e-5, "none"))

    x, w = randn(2, 8, 5, 5, device="cuda"), randn(8, device="cuda")
    graph = graphs.capture(step, x, w)
    for _ in range(3):
        x = randn(2, 8, 5, 5, device="cuda")
        torch.testing.assert_close(graph(x, w), step(x, w), atol=0, rtol=0)


@pytest.mark.cuda
def test_capture_reports_uncapturable_code():
    # In its own process: after a failed capture PyTorch's CUDA generator state is unusable
    # ("Offset increment outside graph capture"), which broke every later test that drew random
    # numbers on the GPU (seen on an H200, torch 2.11).
    code = textwrap.dedent("""
        import torch
        from mirage import graphs
        x = torch.randn(4, device="cuda")
        try:
            graphs.capture(lambda x: x * x.sum().item(), x)
        except RuntimeError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert re.search("mirage.graphs.capture: capturing .* failed", result.stdout), result.stdout + result.stderr


def test_threads_calling_one_cache_get_their_own_results():
    # A call copies its inputs into the graph's static buffers, then replays: another thread's
    # copy in between (here while fn sleeps, as a replay leaves the GIL) gave it that thread's
    # result before the calls took the module's lock.
    def slow_double(x):
        time.sleep(0.002)
        return x * 2

    cache, _ = fake_cache(slow_double, 2)
    cache(torch.zeros(3))  # captured: the threads replay
    wrong = []

    def caller(value):
        for _ in range(10):
            x = torch.full((3,), float(value))
            if not torch.equal(cache(x), 2 * x):
                wrong.append(value)

    threads = [threading.Thread(target=caller, args=(v,)) for v in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and cache.stats().hits == 40


class Colour(enum.Enum):
    RED = 1


@pytest.mark.cuda
def test_outputs_may_be_any_plain_value_an_input_may_be():
    def fn(x):
        return x + 1, Colour.RED, np.float32(0.5), torch.channels_last, torch.strided, None

    x = randn(4, device="cuda")
    out = graphs.capture(fn, x)(x)
    torch.testing.assert_close(out[0], x + 1)
    assert out[1:] == (Colour.RED, np.float32(0.5), torch.channels_last, torch.strided, None)
    with pytest.raises(ValueError, match=r"returned a Stream at output\[1\]; it may hold tensors"):
        graphs.capture(lambda x: (x, torch.cuda.Stream()), x)
