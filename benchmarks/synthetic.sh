#!/usr/bin/env bash
# One device session for issue 4/8: the GPU tests of the pooled/graph decode path, then
# `roofline bench synthetic` on the three published shapes. Each step has its own time limit
# and writes under $OUT (default benchmarks/results), so a failure or timeout loses only itself.
#   OUT=... SHAPES="qwen3.5-122b-a10b qwen3.5-35b-a3b qwen3.5-27b" REPEATS=20 bash benchmarks/synthetic.sh
# fla-core (GDN prefill) is used when importable; on a machine without a registry carry its wheel in
# .carry/ (git-ignored) and it is installed from there.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-benchmarks/results}
SHAPES=${SHAPES:-qwen3.5-122b-a10b qwen3.5-35b-a3b qwen3.5-27b}
REPEATS=${REPEATS:-20}
TEST_LIMIT=${TEST_LIMIT:-200}
mkdir -p "$OUT"
if ls .carry/*/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla-site .carry/*/fla_core-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fla-site
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
if [ "$TEST_LIMIT" != 0 ]; then
  timeout "$TEST_LIMIT" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pooled_decode.py tests/test_fast_path.py tests/test_bench_synthetic.py \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -25
fi
date_tag=$(date -u +%F)
for b in 1 8; do  # the bundled model's MTP speculation, k = 0..4, with its real acceptance
  timeout 100 python3 benchmarks/speculative.py --prompts $b --out "$OUT/$date_tag-speculative-cuda-b$b.json" 2>&1 | tail -7
done
for shape in $SHAPES; do
  limit=$([ "$shape" = qwen3.5-122b-a10b ] && echo 260 || echo 110)
  timeout "$limit" python3 -m roofline.cli bench synthetic --shape "$shape" --repeats "$REPEATS" \
    --out "$OUT/$date_tag-synthetic-$shape.json" 2>&1 | tee "$OUT/synthetic-$shape.log" | tail -40
done
