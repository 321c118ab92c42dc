#!/usr/bin/env bash
# The one GPU-machine run: build against the device's torch for sm_90a, run every test (the
# `cuda`-marked ones included) and Catch2, then the benchmarks. Results and logs go to $OUT.
#   usage (device tool): bash scripts/device_check.sh [bench args...]
set -uo pipefail
OUT="${OUT:-/tmp/mirage-out}"
mkdir -p "$OUT"
export MIRAGE_CUDA_ARCHS=90a PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
BUILD=build/device
status=0
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }

step "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; python3 -c \
  'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; nvcc --version | tail -1; } | tee "$OUT/machine.txt"

step "build"
if ! python3 -m pip install -q --no-build-isolation --no-deps -e . -C build-dir=$BUILD \
     -C cmake.define.MIRAGE_BUILD_TESTS=ON > "$OUT/build.log" 2>&1; then
  echo "build with Catch2 tests failed (see build.log); building without them" | tee -a "$OUT/build.log"
  python3 -m pip install -q --no-build-isolation --no-deps -e . -C build-dir=$BUILD \
    -C cmake.define.MIRAGE_BUILD_TESTS=OFF >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
python3 -m mirage info | tee -a "$OUT/machine.txt"

step "pytest"
export MIRAGE_TORCHSCRIPT_MODULE="$PWD/$BUILD/scripted_group_norm.pt"
python3 -m pytest -q -p no:cacheprovider tests/python -rs > "$OUT/pytest.log" 2>&1 || status=1
tail -5 "$OUT/pytest.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20

step "ctest"
if [ -f $BUILD/CTestTestfile.cmake ]; then
  ctest --test-dir $BUILD --output-on-failure > "$OUT/ctest.log" 2>&1 || status=1
  tail -4 "$OUT/ctest.log"
else
  echo "no Catch2 build on this machine" | tee "$OUT/ctest.log"
fi

step "demo"
python3 -m mirage demo 2>&1 | tee "$OUT/demo.txt"

step "bench_norms"
python3 benchmarks/bench_norms.py --json "$OUT/norms.json" "$@" 2>&1 | tee "$OUT/bench_norms.txt"
step "done (status $status)"
exit $status
