#!/usr/bin/env bash
# The same tree's `specdec bench` under two Pythons (e.g. two transformers releases: the system one and a venv made
# with `python -m venv --system-site-packages V && V/bin/pip install transformers==X`), in turn, ROUNDS rounds, so
# both see the same machine load. Usage: benchmarks/releases_pair.sh PYTHON_A PYTHON_B [ROUNDS] [OUT]
# Figures: docs/journal/2026-12-07-supported-releases.md, "Supported releases (2026-12-07)".
set -euo pipefail
cd "$(dirname "$0")/.."
a=$1 b=$2 rounds=${3:-3} out=${4:-bench-out/releases}
for r in $(seq "$rounds"); do
  for py in "$a" "$b"; do
    version=$("$py" -c 'import transformers; print(transformers.__version__)')
    echo "== round $r transformers $version load $(cut -d' ' -f1 /proc/loadavg)"
    OMP_NUM_THREADS=1 "$py" -m specdec bench --methods plain-hf plain spec --num-prompts 10 --max-new-tokens 64 \
      --repeats 3 --no-progress --no-plots --output "$out/$version-$r"
  done
done
