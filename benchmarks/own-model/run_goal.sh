#!/usr/bin/env bash
# The own-model goals of issue 26, timed as a user would run them (1 thread). Usage:
#   benchmarks/own-model/run_goal.sh pipeline [WORK]   # data outputs + train drafter, each timed
#   benchmarks/own-model/run_goal.sh bench [WORK]      # plain / drafter / lookup+drafter on the held-out prompts
#   benchmarks/own-model/run_goal.sh head [WORK]       # the pair's acceptance head, then ada against constant gamma
# WORK (default /work/scratch/own-goal) holds target/ (make_target.py) and prompts.jsonl (make_prompts.py);
# nothing under it is committed. STEPS (default 400, the measured run) sets the drafter's optimizer steps; RUN names a bench run.
set -euo pipefail
phase=${1:?pipeline, bench or head}
W=${2:-/work/scratch/own-goal}
T=$W/target
export OMP_NUM_THREADS=1
stamp() { echo "== $1: $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"; }

case $phase in
pipeline)
    stamp "data outputs"
    s=$(date +%s)
    python -m specdec data outputs --target "$T" --prompts "$W/prompts.jsonl" --out "$W/outputs.jsonl" \
        --max-new-tokens 64 --batch-size 16
    echo "data outputs wall: $(( $(date +%s) - s )) s"
    stamp "train drafter"
    s=$(date +%s)
    python -m specdec train drafter --target "$T" --data "$W/outputs.jsonl" --out "$W/drafter" --layers 2 \
        --steps "${STEPS:-400}" --threads 1 --measure-prompts 20 --measure-tokens 64
    echo "train drafter wall: $(( $(date +%s) - s )) s"
    stamp "done"
    ;;
bench)
    # the held-out prompts (outputs.valid.jsonl, chosen by a hash of the prompt) as the bench's {"id", "prompt"}
    python - "$T" "$W/outputs.valid.jsonl" "$W/heldout-prompts.jsonl" <<'PY'
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
with open(sys.argv[2]) as src, open(sys.argv[3], "w") as dst:
    for line in src:
        r = json.loads(line)
        dst.write(json.dumps({"id": r["id"], "prompt": tok.decode(r["prompt_ids"])}) + "\n")
PY
    stamp "bench ${RUN:-1}"
    python -m specdec bench --target "$T" --drafter "$W/drafter/final" --prompts "$W/heldout-prompts.jsonl" \
        --num-prompts 20 --max-new-tokens 64 --gamma 4 --threads 1 --repeats 3 --order prompt \
        --methods plain-hf plain spec spec-lookup ngram --no-plots --no-progress --output "$W/bench-${RUN:-1}"
    stamp "bench ${RUN:-1} done"
    ;;
head)
    stamp "train head"
    s=$(date +%s)
    python -m specdec train head --target "$T" --drafter "$W/drafter/final" --outputs "$W/outputs.jsonl" \
        --valid-outputs "$W/outputs.valid.jsonl" --out "$W/head" --threads 1
    echo "train head wall: $(( $(date +%s) - s )) s"
    stamp "pareto"
    python -m specdec bench --pareto --target "$T" --drafter "$W/drafter/final" --head "$W/head/final" \
        --prompts "$W/heldout-prompts.jsonl" --num-prompts 12 --max-new-tokens 64 --temperature 0 \
        --pareto-gamma 2 3 4 5 6 8 --pareto-confidence 0.4 --pareto-ada 0.3 0.5 0.7 --threads 1 --repeats 3 \
        --no-plots --no-progress --output "$W/pareto"
    stamp "done"
    ;;
*) echo "unknown phase $phase: use pipeline, bench or head" >&2; exit 2 ;;
esac
