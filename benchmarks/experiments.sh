#!/usr/bin/env bash
# The work waiting for a GPU (benchmarks/NOTES-kernels.md, "Session 14"), as phases that each fit one 10-minute
# device call:
#   OUT=... bash benchmarks/experiments.sh first    # GPU tests of the prefill-attention fix and the FP8 tensor-core
#                                                   # variant, its sweep, an A/B of it end to end, the first prefill
#                                                   # numbers (TTFT 4K / 32K by both INT4 many-rows paths), and a
#                                                   # profiler trace of the engine's MTP step (~9.5 min)
#   OUT=... bash benchmarks/experiments.sh tests    # the pooled-decode / fast-path / generate-CLI GPU files (~5 min)
#   OUT=... bash benchmarks/experiments.sh kernels  # INT8 LM head around its tile, INT4 GEMM against the decode
#                                                   # experts kernels in 16-token chunks (~2 min)
#   OUT=... bash benchmarks/experiments.sh ab       # alternating A/B of the GDN b/a dots in the GDN kernel (~8 min)
# Each step has its own time limit and writes under $OUT, so a failure or a timeout loses only itself. Set
# ROOFLINE_COMMIT to the commit the tree is (the device copy's git metadata may not say). fla-core is installed
# from .carry/ as synthetic.sh does.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if ls .carry/*/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla-site .carry/*/fla_core-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fla-site
fi
day=$(date -u +%F)
synthetic() {  # name, time limit, extra flags...: the 122B at context 0, 10 repeats
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m roofline.cli bench synthetic --shape qwen3.5-122b-a10b --contexts 0 --repeats 10 "$@" \
    --out "$OUT/$day-synthetic-qwen3.5-122b-a10b-$name.json" 2>&1 | tee "$OUT/synthetic-$name.log" | tail -30
}
gpu_tests() {  # time limit, pytest arguments...
  local limit=$1
  shift
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -15
}
case "${1:-}" in
  first)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    gpu_tests 80 -m gpu tests/test_chunked_prefill.py tests/test_kernels.py -k "prefill or fp8 or dense_matmul or router_top_k or residual_and_norm"
    timeout 140 python3 benchmarks/kernels.py --quick --only fp8,router 2>&1 | tail -60
    ROOFLINE_FP8_DOT=1 synthetic fp8-dot 100 --prefill 0 --engine-tokens 0 --batch-decode 0
    # prefill (32K in four chunks of 8K: time to first token and peak memory) after the decode rows of the default
    synthetic default 190 --prefill 4K,32K --engine-tokens 0 --batch-decode 0 --profile
    timeout 100 python3 benchmarks/profile_mtp_engine.py 2>&1 | tail -80
    ;;
  tests)  # the files a 150 s limit cut in session 13
    gpu_tests 240 -m gpu tests/test_pooled_decode.py tests/test_fast_path.py tests/test_generate_cli.py
    gpu_tests 150 -m gpu tests/test_bench_synthetic.py
    ;;
  kernels)
    timeout 300 python3 benchmarks/kernels.py --quick --only int8,int4_gemm 2>&1 | tail -40
    ;;
  ab)  # the experiment against the default, alternating so drift shows: B A B A
    for round in a b; do
      ROOFLINE_GDN_BA_IN_KERNEL=1 synthetic "ba-in-kernel-$round" 110 --prefill 0 --engine-tokens 0 --batch-decode 0
      synthetic "default-$round" 110 --prefill 0 --engine-tokens 0 --batch-decode 0
    done
    ;;
  *)
    echo "usage: OUT=DIR bash benchmarks/experiments.sh first|tests|kernels|ab" >&2
    exit 2
    ;;
esac
