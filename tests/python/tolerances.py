"""One tolerance table per dtype, used by every numerical test.

Outputs are compared with a float64 reference rounded to the dtype; (atol, rtol) allow the
one rounding of the output plus float32 arithmetic inside the kernels.
"""

import torch

TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}

# Norms reduce: their error must also stay within this factor of PyTorch's own same-dtype error
# against the float64 reference (plus the dtype's atol, for outputs PyTorch happens to get exact).
REDUCTION_ERROR_FACTOR = 2.0


def tolerance(dtype):
    return TOLERANCES[dtype]
