"""What mirage was built with and what it runs on (``python -m mirage info``)."""

from __future__ import annotations

import os

import torch

from . import _C


def build_info() -> dict:
    """The compiled library's facts: version, torch and CUDA versions, GPU architectures."""
    return dict(_C.build_info())


def cmake_prefix_path() -> str:
    """The directory to add to ``CMAKE_PREFIX_PATH`` for ``find_package(mirage)``: beside the compiled
    library (which an editable install keeps apart from the Python sources)."""
    return os.path.join(os.path.dirname(_C.__file__), "share", "cmake")


def registered_ops() -> list[str]:
    """Every operator in the ``mirage`` namespace, as the dispatcher knows it."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mirage::"))


def info() -> str:
    """A readable report of the build, the running torch, the GPU and the registered ops."""
    built = build_info()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
        launches = ("overlapped (programmatic dependent launch; MIRAGE_OVERLAP_LAUNCHES=0 turns it off)"
                    if _C.overlapped_launches(f"cuda:{torch.cuda.current_device()}")
                    else "plain (overlapped ones need compute capability 9.0, and MIRAGE_OVERLAP_LAUNCHES not 0)")
    else:
        gpu, launches = "none", "plain (no GPU)"
    lines = [
        f"mirage {built['version']}",
        f"built against: torch {built['torch_version']}, CUDA {built['cuda_version'] or 'none (CPU-only build)'}",
        f"running:       torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}",
        f"compiled GPU architectures: {', '.join('sm_' + a for a in built['cuda_archs']) or 'none'}",
        f"GPU: {gpu}",
        f"kernel launches: {launches}",
        f"C++ (CMake): find_package(mirage) with CMAKE_PREFIX_PATH={cmake_prefix_path()}",
        "ops:",
    ]
    lines += [f"  {name}" for name in registered_ops()]
    return "\n".join(lines)
