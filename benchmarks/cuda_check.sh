#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA device (run from the repository root; each stage has its own time limit,
# so a slow stage cannot eat the rest): the GPU tests (`pytest -m gpu`), then the code pair's bench eager and
# compiled (each step a CUDA graph: the eager step captured, then inductor's), float32, with LOOP_S set the loop's cost
# around the step, and, with BF16_S set, the
# graphs in bf16. Logs under $OUT (default: cuda-check/). A stage's limit of 0 skips it, e.g.
#   TESTS_S=0 INDUCTOR_S=0 BF16_S=100 benchmarks/cuda_check.sh
# On an H100 (2026-11-28) a fresh machine's first stage paid CUDA's start: 90 s for a bench stage was too little.
# Wheels in .whl/ (e.g. the transformers this checkout pins, where the machine has another) are installed first.
# The checkout's tracked files (86.8 MiB, most of it models/) exceed what a lent machine takes (64 MiB, 2026-11-28): the
# GPU tests build tiny models and the bench reads only code-target and code-drafter, so send those alone (e.g. drop
# models/ from the index for the call, ignore it, and carry the two folders; restore the index after).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-cuda-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import os, torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__,
'|', torch.cuda.get_device_name(), '| cpus', os.cpu_count())"
uptime
BENCH=(--device cuda --dtype "${DTYPE:-float32}" --methods plain-hf plain spec spec-lookup --num-prompts 12 --repeats 3
       --no-progress --no-plots)
stage() {  # name, limit in seconds, command...
  local name=$1 limit=$2; shift 2
  [ "$limit" = 0 ] && return  # a limit of 0 skips the stage
  echo "== $name (limit ${limit} s)"; local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; echo "== $name: exit $? in $((SECONDS - t0)) s"
  grep -E "^│|compile|warn|Error|passed|failed|load" "$OUT/$name.log" | tail -30
}
bench() {  # name, limit, --compile mode, SPECDEC_CUDA_STEP: the bench's log and summary.json under $OUT
  stage "bench-$1" "$2" env SPECDEC_CUDA_STEP="$4" python3 -m specdec bench "${BENCH[@]}" --compile "$3" \
    --output "/tmp/bench-$1"
  cp "/tmp/bench-$1/summary.json" "$OUT/summary-$1.json" 2>/dev/null
}
stage tests "${TESTS_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_compiled_cuda.py \
  tests/test_core_greedy.py
# the loop around the step (benchmarks/batch1_loop.py): ms per token, cProfile's top and the host's waits per round;
# LOOP_TREES="before=DIR after=." compares two trees (DIR holding a specdec/ package), in turn
stage loop "${LOOP_S:-0}" python3 benchmarks/batch1_loop.py --trees ${LOOP_TREES:-now=.} --device cuda --compile on \
  --methods plain lookup --repeats "${LOOP_REPEATS:-2}" --prompts 12 ${LOOP_PROBE:+--probe}
bench eager "${EAGER_S:-100}" off eager
bench graphs "${GRAPHS_S:-100}" on eager
bench inductor "${INDUCTOR_S:-150}" on inductor
BENCH[3]=bf16
bench graphs-bf16 "${BF16_S:-0}" on eager
uptime
