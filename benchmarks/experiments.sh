#!/usr/bin/env bash
# The GPU experiments (benchmarks/NOTES-kernels.md), as phases that each fit one 10-minute device call (session 26 on
# an H100: `first` + one GPU test file 240 s, `tests-cli` 264 s, `ncu` 92 s, an `ab_step.py` call of two variants
# ~45-60 s, of nine ~150 s; each with a ~50 s start).
#   OUT=... bash benchmarks/experiments.sh trees    # the GDN GPU tests, and the step against an earlier tree
#                                                   # (ROOFLINE_BEFORE: that commit's roofline package in
#                                                   # .carry/before), in alternating processes (~6 min); `trees-ab`
#                                                   # the A/B alone, with TREE_VARIANTS (ab_step variants) in each,
#                                                   # at TREE_CONTEXT tokens (default 0), on TREE_SHAPE (default
#                                                   # the 122B)
#   OUT=... bash benchmarks/experiments.sh next     # the kernels' GPU test file whole (~3-6 min)
#   OUT=... bash benchmarks/experiments.sh first    # the 122B table with prefill, the engine loop and the kernel
#                                                   # profile (~5 min); `table`: without its greedy GPU tests
#   OUT=... bash benchmarks/experiments.sh mtp      # what capture_graphs costs at start (128K / 256K context), then
#                                                   # where an MTP-2 step through Engine.step spends its time
#                                                   # (profile_mtp_engine.py, then unprofiled without PDL; H100,
#                                                   # session 19: 6.81 ms a step, its GPU work) (~4 min)
#   OUT=... bash benchmarks/experiments.sh shapes   # the 35B-A3B and 27B rows (~3 min)
#   OUT=... bash benchmarks/experiments.sh tests    # the pooled-decode and fast-path GPU test files (~9 min);
#                                                   # `tests-cli`: the generate-CLI and bench files
#   OUT=... bash benchmarks/experiments.sh kernels  # INT8 LM head around its tile, INT4 GEMM against the decode
#                                                   # experts kernels in 16-token chunks (~2 min)
#   OUT=... bash benchmarks/experiments.sh attn     # decode attention's tile sweep at 8K / 32K (~2 min)
#   OUT=... bash benchmarks/experiments.sh pool     # the 8K step in a 256K-row cache pool against a 16K one: decode
#                                                   # attention alone, then ab_step in alternating processes (~5 min)
#   OUT=... bash benchmarks/experiments.sh splits   # the attention splits by length against by span at 32K (27B,
#                                                   # 122B; session 37) with the attention GPU tests (~4 min)
#   OUT=... bash benchmarks/experiments.sh floor    # what a kernel costs in a captured PDL chain before any math:
#                                                   # empty, one arrival round or atomic adds, pure streaming 2-32 MB,
#                                                   # and (session 20) the whole share loaded before the wait (~2 min)
#   OUT=... bash benchmarks/experiments.sh persistent # a hand-written CUDA persistent kernel streaming 48 dependent
#                                                   # GEMVs (2-32 MB) against one launch a GEMV, with and without
#                                                   # PDL, and kernel_floor's Triton rows (~4 min)
#   OUT=... bash benchmarks/experiments.sh ab       # in one process on one 122B build (benchmarks/ab_step.py), 3
#                                                   # alternating rounds of the M = 1 and M = 3 (verify) graphs: the
#                                                   # default against session 17's router and INT4 configs (session
#                                                   # 18's defaults replaced them) and the router's separate top-k
#                                                   # past two rows (measured slower in session 17) (~2 min)
#   OUT=... bash benchmarks/experiments.sh ab-order # INT4 qweights in GPTQ order (ROOFLINE_INT4_QBLK=0) against
#                                                   # block-repacked (the default), on distinct-id verify rows (~2-8
#                                                   # min; chosen at install time, so two bench runs each round)
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
cuda_bindings() {  # persistent_chain.py's NVRTC and driver calls: the image's cuda-bindings, else a carried cp312 wheel
  local nvrtc  # torch's own NVRTC, on the loader's path in case cuda-bindings does not look where pip put it
  nvrtc=$(python3 -c "import glob, os, torch; print(next(iter(glob.glob(os.path.dirname(torch.__file__) + '/../nvidia/**/libnvrtc.so.*', recursive=True)), ''))")
  [ -n "$nvrtc" ] && export LD_LIBRARY_PATH=$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  python3 -c "from cuda.bindings import nvrtc; assert nvrtc.nvrtcVersion()[0] == 0" 2>/dev/null && return
  echo "the image's cuda-bindings does not load NVRTC: installing the carried wheel"
  python3 -m pip install -q --no-index --no-deps --target /tmp/cuda-site .carry/*/cuda_bindings-*.whl \
    .carry/*/cuda_pathfinder-*.whl && export PYTHONPATH=/tmp/cuda-site:$PYTHONPATH
}
day=$(date -u +%F)
synthetic() {  # name, time limit, extra flags...: the 122B at context 0, 10 repeats
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m roofline.cli bench synthetic --shape qwen3.5-122b-a10b --contexts 0 --repeats 10 "$@" \
    --out "$OUT/$day-synthetic-qwen3.5-122b-a10b-$name.json" 2>&1 | tee "$OUT/synthetic-$name.log" | tail -30
}
capacity() {  # one 256K context on a card with the memory for it (the H200: 74.5 GiB peak); 128K on an 80 GB H100
  python3 -c "import torch; print('256K' if torch.cuda.get_device_properties(0).total_memory > 100e9 else '128K')"
}
gpu_tests() {  # time limit, pytest arguments...
  local limit=$1
  shift
  # SIGINT first: pytest then prints its summary (which test was running, the durations) instead of nothing
  # one process (the device has no pytest-xdist, which the project's addopts ask for)
  timeout -s INT -k 15 "$limit" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --durations=20" "$@" 2>&1 \
    | tail -15
}
table_122b() {  # the full 122B table: decode, distinct-id verify rows, prefill, the engine loop, the kernel profile
  timeout 280 python3 -m roofline.cli bench synthetic --shape qwen3.5-122b-a10b --repeats 10 --prefill 4K,32K \
    --capacity "$(capacity)" --engine-tokens 256 --batch-decode 0 --profile --out "$OUT/$day-synthetic-qwen3.5-122b-a10b.json" 2>&1 \
    | tee "$OUT/synthetic-122b.log" | grep -v "^| _\|^| void" | tail -70
}
case "${1:-}" in
  next)  # the kernels' GPU test file whole (session 26 ran 119 of its 126 before a 215 s limit; sessions 28-29 ran
    # the experts, INT4 and GDN parts at today's defaults), ~6 min
    gpu_tests 420 tests/test_kernels.py -m gpu
    ;;
  first)  # the 122B table (table_122b); first
    # the graph's greedy tokens against the reference path's (the pooled step's GPU tests; on a fresh machine their
    # kernels compile for ~2 minutes: session 28's 120 s limit cut them after 2 of 4)
    gpu_tests 200 tests/test_pooled_decode.py -m gpu -k greedy
    table_122b
    ;;
  table)  # `first` without its greedy GPU tests (where they ran at the same default kernels), ~4.5 min
    table_122b
    ;;
  mtp)  # the profile, then without PDL: graph launch host costs (unprofiled) against the default's
    len=$([ "$(capacity)" = 256K ] && echo 262144 || echo 131072)  # capture_graphs' start time and memory at that context
    timeout 260 python3 benchmarks/profile_mtp_engine.py --shape qwen3.5-122b-a10b --steps 20 --max-model-len "$len" 2>&1 \
      | grep -v '"start"\|"end"\|"kernels"\|"first"\|^  [{}]' | tail -80
    ROOFLINE_PDL=0 timeout 150 python3 benchmarks/profile_mtp_engine.py --shape qwen3.5-122b-a10b --steps 20 --no-profile \
      2>&1 | tail -40
    ;;
  shapes)  # the 35B-A3B and 27B rows (decode at 0 / 8K / 32K, M rows), ~3 min
    for shape in qwen3.5-35b-a3b qwen3.5-27b; do
      timeout 100 python3 -m roofline.cli bench synthetic --shape $shape --repeats 10 --prefill 0 --engine-tokens 0 \
        --batch-decode 0 --out "$OUT/$day-synthetic-$shape.json" 2>&1 | grep "context\|M=1\|^| [0-9]" | tail -12
    done
    ;;
  tests|tests-cli)  # the GPU test files, two a call: at 140 s each, session 24 saw three of four cut while running
    files="test_pooled_decode test_fast_path"
    [ "$1" = tests-cli ] && files="test_generate_cli test_bench_synthetic"
    for f in $files; do
      echo "== $f"; gpu_tests 280 -m gpu "tests/$f.py" -x
    done
    ;;
  kernels)
    timeout 300 python3 benchmarks/kernels.py --quick --only int8,int4_gemm 2>&1 | tail -40
    ;;
  ncu)  # Nsight Compute on the one-row decode kernels at 122B shapes, one launch each, no PDL overlap (session 26)
    ncu="/usr/local/cuda/bin/ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats"
    for spec in "_gate_up_tc_kernel experts" "_down_tc_kernel experts" "_gdn_decode_kernel gdn"; do
      set -- $spec
      timeout 150 $ncu -k "regex:$1" --launch-skip 2 --launch-count 1 python3 benchmarks/kernels.py --quick --no-sweep \
        --only "$2" > "$OUT/ncu$1.txt" 2>&1
    done
    timeout 150 $ncu -k "regex:_gemv_tc_kernel|_fp8_gemv_kernel" --launch-skip 3 --launch-count 3 \
      python3 benchmarks/ncu_gemvs.py > "$OUT/ncu_gemvs.txt" 2>&1
    grep -hE "_kernel \(|Duration|DRAM Throughput|Elapsed Cycles|SM Active Cycles|Registers Per|Achieved Occupancy" \
      "$OUT"/ncu*.txt
    ;;
  floor)  # benchmarks/kernel_floor.py: decides whether ~7 kernels a layer can reach 0.70 (NOTES-kernels, session 16)
    timeout 300 python3 benchmarks/kernel_floor.py 2>&1 | tail -40
    ;;
  persistent)  # benchmarks/persistent_chain.py (session 47): the hand-written CUDA persistent chain's GPU tests, then
    # its rows (one launch a stage, with and without PDL, against one launch of 48 stages; bf16 and INT4), then
    # kernel_floor.py's Triton PDL rows on the same card (~5 min; the limits add up to 550 s)
    cuda_bindings
    gpu_tests 180 tests/test_persistent_chain.py -m gpu
    timeout 220 python3 benchmarks/persistent_chain.py 2>&1 | tail -35
    timeout 150 python3 benchmarks/kernel_floor.py 2>&1 | grep -E "no split|3 programs/SM" | tail -24
    ;;
  attn)  # decode attention's tiles at 8K / 32K, M = 1 and 4 (the 32K row is ~0.45 of copy in the step), ~2 min
    timeout 300 python3 benchmarks/kernels.py --only attn 2>&1 | tail -40
    ;;
  pool)  # the 8K step in bench synthetic's 256K-row pool against ab_step's 16K one (session 41: 3.795 against 3.60 ms
    # on one H100): decode attention alone at 8K keys in both pools, then ab_step's default at 8K in alternating
    # processes, ABBA (~5 min)
    timeout 120 python3 benchmarks/kernels.py --only attn --quick --no-sweep 2>&1 | grep "pool rows"
    for capacity in 16384 262144 262144 16384; do
      echo "== capacity $capacity"
      timeout 110 python3 benchmarks/ab_step.py --variants "" --rounds 3 --context 8192 --capacity $capacity \
        --out "$OUT/ab-pool-$capacity-$(date +%H%M%S).json" 2>&1 | tail -2
    done
    ;;
  splits)  # session 37's attention splits shared by the sequence's length (SPLIT_BY_LENGTH) against the span's, at 32K
    # where the 64K bucket left half of them empty: the attention GPU tests, then one ab_step process a shape (~4 min)
    gpu_tests 120 tests/test_kernels.py -m gpu -k decode_attention
    for shape in qwen3.5-27b qwen3.5-122b-a10b; do
      timeout 170 python3 benchmarks/ab_step.py --shape $shape --variants attention-splits-by-span --rounds 3 \
        --context 32768 --out "$OUT/ab-splits-$shape-32k.json" 2>&1 | tail -3
    done
    ;;
  ab)  # predictions in NOTES-kernels "Session 17"; the JSON has every round
    timeout 300 python3 benchmarks/ab_step.py --variants router-split,int4-split-verify,router-two-rows --rounds 3 2>&1 \
      | tail -30
    ;;
  trees|trees-ab)  # two trees' steps (sessions 32-34: the GDN conv ring): this tree's GDN GPU tests, then ab_step's
    # default (and $TREE_VARIANTS) in alternating processes, an earlier tree (.carry/before/roofline, commit
    # ROOFLINE_BEFORE) against this one, ABBA; a call cut short loses the second pair first. `trees-ab`: the pairs
    # alone. Without the earlier tree its runs would import this tree's package (ab_step searches PYTHONPATH in
    # order, and $PWD is on it) and measure this tree against itself
    if [ ! -f .carry/before/roofline/__init__.py ] || [ -z "${ROOFLINE_BEFORE:-}" ]; then
      echo "$1: needs the earlier tree in .carry/before/roofline and its commit in ROOFLINE_BEFORE" >&2
      exit 2
    fi
    trees_ab() {  # before|this, pair number
      local tree=$1 pair=$2 path=$PWD commit=$ROOFLINE_COMMIT
      [ "$tree" = before ] && path=$PWD/.carry/before commit=$ROOFLINE_BEFORE
      echo "== $tree $pair"  # a script's imports search its folder, then PYTHONPATH: $path's roofline
      PYTHONPATH=$path:$PYTHONPATH ROOFLINE_COMMIT=$commit timeout 150 python3 benchmarks/ab_step.py \
        --shape "${TREE_SHAPE:-qwen3.5-122b-a10b}" --variants "${TREE_VARIANTS:-}" --rounds 3 --context "${TREE_CONTEXT:-0}" \
        --out "$OUT/ab-$tree-$pair.json" 2>&1 \
        | tail -5
    }
    [ "$1" = trees ] && gpu_tests 150 tests/test_kernels.py -m gpu -k gdn
    trees_ab before 1
    trees_ab this 1
    [ "$1" = trees ] && gpu_tests 200 tests/test_pooled_decode.py -m gpu -k greedy
    trees_ab this 2
    trees_ab before 2
    ;;
  ab-order)  # run 11 kept GPTQ order for MTP engines (verify rows faster there then); session 40 measured the blocked
    # order faster at M = 1-3 on an H100, and MTP engines block-repack too
    for round in a b; do
      ROOFLINE_INT4_QBLK=0 synthetic "gptq-order-$round" 110 --prefill 0 --engine-tokens 0 --batch-decode 0
      ROOFLINE_INT4_QBLK=1 synthetic "blocked-order-$round" 110 --prefill 0 --engine-tokens 0 --batch-decode 0
    done
    ;;
  *)
    echo "usage: OUT=DIR bash benchmarks/experiments.sh next|first|table|mtp|shapes|tests|tests-cli|kernels|ncu|attn|floor|persistent|pool|splits|ab|trees|trees-ab|ab-order" >&2
    exit 2
    ;;
esac
