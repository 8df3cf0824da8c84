#!/usr/bin/env bash
# One device session for issues 4 and 8: the GPU tests of the pooled/graph decode path,
# `roofline bench synthetic` on the published shapes, and the bundled model's MTP speculation.
# Each step has its own time limit and writes under $OUT (default benchmarks/results), so a
# failure or timeout loses only itself. Without the tests (TEST_LIMIT=0; experiments.sh tests runs them) the limits
# add up to 555 s, one 10-minute call:
#   OUT=... REPEATS=20 TEST_LIMIT=0 bash benchmarks/synthetic.sh
# fla-core (GDN prefill) is used when importable; on a machine without a registry carry its wheel in
# .carry/ (git-ignored) and it is installed from there.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-benchmarks/results}
REPEATS=${REPEATS:-20}
TEST_LIMIT=${TEST_LIMIT:-120}
mkdir -p "$OUT"
if ls .carry/*/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla-site .carry/*/fla_core-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fla-site
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
day=$(date -u +%F)
synthetic() {  # shape, time limit
  timeout "$2" python3 -m roofline.cli bench synthetic --shape "$1" --repeats "$REPEATS" --out "$OUT/$day-synthetic-$1.json" \
    2>&1 | tee "$OUT/synthetic-$1.log" | tail -42
}
if [ "$TEST_LIMIT" != 0 ]; then
  timeout "$TEST_LIMIT" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" \
    tests/test_pooled_decode.py tests/test_fast_path.py tests/test_bench_synthetic.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
fi
# Since session 11 each shape also times prefill (a 4K prompt; the MoE shapes by both expert paths since session 12)
# and the engine's own loop, and since session 12 8-sequence decode steps by both INT4 many-rows paths (~+40-80 s,
# estimated, not yet measured)
synthetic qwen3.5-122b-a10b 320
timeout 50 python3 benchmarks/speculative.py --prompts 1 --out "$OUT/$day-speculative-cuda-b1.json" 2>&1 | tail -7
synthetic qwen3.5-35b-a3b 110
synthetic qwen3.5-27b 75
