#!/usr/bin/env bash
# The one GPU-machine run: build against the device's torch for sm_90a, run every test (the
# `cuda`-marked ones included) and Catch2, then the benchmarks. Results and logs go to $OUT (one
# archive, results.tar.gz, when they are more than the 8 files the device tool brings back: that
# archive takes everything under $OUT and deletes the rest, so a calling script that keeps files of
# its own under the device tool's $OUT runs this with OUT set to a folder of this script's own).
#   usage (device tool): [STEPS="build pytest ..."] bash scripts/device_check.sh [pytest args...]
# STEPS picks a subset of: build pytest ctest demo bench_norms bench_unet bench_ff profile_ff
# validate_nve, and split_phases (the split PaiNN kernel's phases, torch-free; only when named)
# (default: all but split_phases; together they outlast one 10-minute device call: split them; the
# pytest step alone takes longer than that since opcheck runs on every sample: pass test files).
# Wheels the device lacks (diffusers, ase, scikit-build-core >= 1.0) travel in .whl/ with the device
# tool's `carry` (README: GPU checks).
set -uo pipefail
OUT="${OUT:-/tmp/mirage-out}"
mkdir -p "$OUT"
export MIRAGE_CUDA_ARCHS=90a PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
BUILD=build/device
# test_torchscript.py scripts and saves this module; Catch2's test_api loads it from C++.
export MIRAGE_TORCHSCRIPT_MODULE="$PWD/$BUILD/scripted_group_norm.pt"
STEPS="${STEPS:-build pytest ctest demo bench_norms bench_unet bench_ff profile_ff validate_nve}"
status=0
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

step "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; python3 -c \
  'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; nvcc --version | tail -1; } | tee "$OUT/machine.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site
fi

if want build; then
  step "build"
  # ninja rebuilds what is older than its sources. The tree is copied here with each call, keeping
  # the files' times, so sources that came back older than objects built from other contents
  # (after an edit made on this machine) would leave those objects in place: when the sources
  # differ from the last build's, every one is stamped now.
  sources=(CMakeLists.txt cmake csrc cuda tests/cpp)
  digest=$(find "${sources[@]}" -type f | sort | xargs cat | sha256sum)
  if [ "$(cat "$BUILD/sources.sha256" 2>/dev/null)" != "$digest" ]; then
    find "${sources[@]}" -type f -exec touch {} +
  fi
  if ! python3 -m pip install -q --no-build-isolation --no-deps -e . -C build-dir=$BUILD \
       -C cmake.define.MIRAGE_BUILD_TESTS=ON > "$OUT/build.log" 2>&1; then
    echo "build with Catch2 tests failed (see build.log); building without them" | tee -a "$OUT/build.log"
    python3 -m pip install -q --no-build-isolation --no-deps -e . -C build-dir=$BUILD \
      -C cmake.define.MIRAGE_BUILD_TESTS=OFF >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  fi
  echo "$digest" > "$BUILD/sources.sha256"
  python3 -m mirage info | tee -a "$OUT/machine.txt"
fi

if want pytest; then
  step "pytest"
  python3 -m pytest -q -p no:cacheprovider -rs "${@:-tests/python}" > "$OUT/pytest.log" 2>&1 || status=1
  tail -5 "$OUT/pytest.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
fi

if want ctest; then
  step "ctest"
  if [ -f $BUILD/CTestTestfile.cmake ]; then
    # A pytest run of other files (or none) has not written the module test_api needs.
    [ -f "$MIRAGE_TORCHSCRIPT_MODULE" ] || python3 -m pytest -q -p no:cacheprovider tests/python/test_torchscript.py \
      > "$OUT/torchscript.log" 2>&1 || status=1
    ctest --test-dir $BUILD --output-on-failure > "$OUT/ctest.log" 2>&1 || status=1
    tail -4 "$OUT/ctest.log"
  else
    echo "no Catch2 build on this machine" | tee "$OUT/ctest.log"
  fi
fi

if want demo; then
  step "demo"
  python3 -m mirage demo 2>&1 | tee "$OUT/demo.txt" || status=1
fi

if want bench_norms; then
  step "bench_norms"
  python3 benchmarks/bench_norms.py --json "$OUT/norms.json" 2>&1 | tee "$OUT/bench_norms.txt" || status=1
fi

if want bench_unet && [ -f benchmarks/bench_unet.py ]; then
  step "bench_unet"
  python3 benchmarks/bench_unet.py --json "$OUT/unet.json" 2>&1 | tee "$OUT/bench_unet.txt" || status=1
fi

if want bench_ff; then
  step "bench_ff"
  python3 benchmarks/bench_forcefield.py --json "$OUT/forcefield.json" 2>&1 | tee "$OUT/bench_forcefield.txt" || status=1
fi
if want profile_ff; then
  step "profile_ff"
  (cd benchmarks && python3 profile_forcefield.py --parts) > "$OUT/profile_ff.txt" 2>&1 || status=1
  grep -E "µs|==" "$OUT/profile_ff.txt"
fi

if want split_phases; then
  step "split_phases"
  python3 benchmarks/painn_split_phases.py --phases > "$OUT/split_phases.txt" 2>&1 || status=1
  tail -4 "$OUT/split_phases.txt"
fi

if want validate_nve; then
  step "validate_nve"
  python3 scripts/validate_nve.py --out "$OUT/nve" 2>&1 | tee "$OUT/validate_nve.txt" || status=1
fi
# The device tool brings back at most 8 files from $OUT: past that, the results travel as one
# archive (tar -xzf results.tar.gz to unpack them).
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar -czf /tmp/mirage-results.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete &&
    mv /tmp/mirage-results.tar.gz "$OUT/results.tar.gz" && echo "more than 8 result files: bundled in results.tar.gz"
fi
step "done (status $status)"
exit $status
