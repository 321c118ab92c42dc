"""The wheel's requirement on torch: exactly the torch release it is compiled against.

A C++ extension runs only with the torch it was built against (mirage refuses any other at import,
saying how to rebuild). A range such as `torch>=2.6` would let pip keep or install another torch
beside a built wheel, so the wheel pins the release of the torch that is importable while it is
built: pyproject.toml's build requirement in an isolated build, the environment's own torch with
`--no-build-isolation`. The local version label (`+cu130`) is dropped: `torch==2.14.1` accepts
every build of that release, and which CUDA build runs is the user's choice, checked at import.

scikit-build-core calls `dynamic_metadata` (pyproject.toml's [[tool.dynamic-metadata]]).
"""
from importlib.metadata import PackageNotFoundError, version


def torch_requirement(torch_version):
    """`torch==<release>` for a torch version string such as `2.14.1+cu130`."""
    return "torch==" + torch_version.split("+", 1)[0]


def dynamic_metadata(settings, project):
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        raise RuntimeError("mirage-ops: building needs torch installed (pyproject.toml's build requirement "
                           "in an isolated build; your own torch with --no-build-isolation)") from None
    return {"dependencies": [torch_requirement(torch_version)]}


def dynamic_wheel(settings):
    """A wheel built from the sdist pins the torch of its own build, which may not be the sdist's:
    the sdist's PKG-INFO marks the requirement Dynamic (METADATA 2.2) instead of fixing the sdist
    builder's torch, which installers may trust for every wheel built from it."""
    return {"dependencies": True}
