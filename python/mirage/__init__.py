"""mirage: fused CUDA kernels and drop-in modules that make existing PyTorch models fast.

Importing mirage loads its compiled library, which registers the ``torch.ops.mirage.*``
operators. ``mirage.ops`` has typed wrappers for them and ``mirage.nn`` the fused modules.
"""

import torch

from . import _build_info

__version__ = "0.1.0"


def _check_torch_version(built: str, running: str) -> None:
    """Refuse a torch other than the one mirage was compiled against.

    A C++ extension built against one torch fails with undefined symbols (or worse, runs with a
    mismatched ABI) under another; this turns that into an actionable message.
    """
    if built != running:
        raise ImportError(
            f"mirage was built against torch {built}, but torch {running} is installed. "
            "Rebuild mirage for this torch: from its checkout, `pip install --no-build-isolation --no-deps "
            "--force-reinstall .` (or `make install`); from the package index, `pip install --no-build-isolation "
            "--no-deps --force-reinstall --no-cache-dir mirage-ops` (without --no-cache-dir pip reinstalls the "
            "wheel it built before)."
        )


_check_torch_version(_build_info.TORCH_VERSION, torch.__version__)

from . import _C  # noqa: E402  (loads libmirage: registers torch.ops.mirage)
from . import nn, ops  # noqa: E402
from .info import build_info, info  # noqa: E402
from .info import cmake_prefix_path as _cmake_prefix_path  # noqa: E402
from .optimize import OptimizedModule, OptimizeReport, optimize, report  # noqa: E402  (also loads mirage.graphs)

#: The directory to add to CMake's ``CMAKE_PREFIX_PATH`` for ``find_package(mirage)`` in a LibTorch
#: program (target ``mirage::mirage``; README, "From C++").
cmake_prefix_path = _cmake_prefix_path()

__all__ = ["OptimizeReport", "OptimizedModule", "build_info", "cmake_prefix_path", "graphs", "info", "nn", "ops",
           "optimize", "report", "__version__"]
