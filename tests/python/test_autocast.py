"""Autocast across mirage's ops: what each op's own tests do not show alone."""

import pytest
import torch

import mirage
from common import randn

F64 = torch.float64
PAIRS = torch.tensor([[0, 1], [1, 0]])

# (op, call, the float64 operand, the float32 one). Autocast casts float32 operands to its dtype
# and leaves float64 alone: they would reach the op in two dtypes.
MIXED = [
    ("bias_act", lambda: mirage.ops.bias_act(randn(2, 4, 3, 3, dtype=F64), None, randn(2, 4, 3, 3)), "x", "residual"),
    ("linear", lambda: mirage.ops.linear(randn(3, 4, dtype=F64), randn(5, 4)), "x", "weight"),
    ("linear", lambda: mirage.ops.linear(randn(3, 4), randn(5, 4), None, randn(3, 5, dtype=F64)), "residual", "x"),
    ("add_layer_norm", lambda: mirage.ops.layer_norm(randn(3, 4, dtype=F64), residual=randn(3, 4)), "x", "residual"),
    ("message_passing", lambda: mirage.ops.message_passing(randn(2, 4), randn(2, 4, dtype=F64), PAIRS),
     "filter", "x"),
    ("pair_product", lambda: mirage.ops.pair_product(randn(2, 4, dtype=F64), randn(2, 4), PAIRS), "a", "b"),
    ("vector_message_passing",
     lambda: mirage.ops.vector_message_passing(randn(2, 12, dtype=F64), randn(2, 12, dtype=F64),
                                               randn(2, 3, 4, dtype=F64), randn(2, 3), PAIRS),
     "x", "directions"),
]


@pytest.mark.parametrize("op,call,wide,narrow", MIXED)
def test_float64_beside_a_cast_operand_is_named_as_autocast_made_it(op, call, wide, narrow):
    # The op's own dtype check said "residual must have x's dtype (Double), got BFloat16" of a
    # residual passed in float32.
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            RuntimeError, match=rf"mirage::{op}: under autocast, {wide} is float64, which autocast leaves as it is, "
                                rf"but {narrow} is Float, which it casts to BFloat16; pass them in one dtype"):
        call()
    with pytest.raises(RuntimeError, match=rf"mirage::{op}: .*Double"):
        call()  # outside autocast, the op's own check
