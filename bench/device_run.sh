#!/usr/bin/env bash
# The GPU runs, in parts that each fit one device call (10 minutes at most).
#   bash bench/device_run.sh bench-a   bench.run on the three small configs, with one-stream rows
#   bash bench/device_run.sh bench-b   bench.run on ctr:4096 (with one-stream rows) and ctr:16384
#   bash bench/device_run.sh checks    check_cuda: parity, training-loop shapes, 2,000-step race stress
#   bash bench/device_run.sh paper-ctr  the CTR experiment: 5 seeds x 600 steps, five variants (~6 min)
#   bash bench/device_run.sh paper-ctr-all  the same, all seven variants, 5 seeds x 400 steps (~8 min est.)
#   bash bench/device_run.sh paper      digits (full preset), NanoChat (both attentions), the report
# Results go to $OUT (default bench/results/device); join bench-a and bench-b with
#   python -m bench.run --merge $OUT/bench-a.json $OUT/bench-b.json
# and, with paper-ctr's ctr.json beside the other paper files, rebuild the report with
#   python -m bench.paper.report --results-dir $OUT/paper
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  bench-a|bench-b|checks|paper-ctr|paper-ctr-all|paper) ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NB: the GPU image has torch and the other dependencies; only erase_fx itself is installed.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
case "$1" in
  bench-a)
    # NB: --streams '' leaves out the side-stream-count rows (measured once, see README)
    python3 -m bench.run --budget-s 500 --out "$OUT/bench-a.json" --streams '' \
      --configs ctr:1024:512:1024:6,mlp:512:1024:2048:6,mlp:128:2000:2000:4 ;;
  bench-b)
    python3 -m bench.run --budget-s 500 --out "$OUT/bench-b.json" --streams '' \
      --configs ctr:4096:1024:2048:6,ctr:16384:1024:2048:6 --sweep-configs ctr:4096:1024:2048:6 ;;
  checks)
    timeout 540 python3 -m bench.check_cuda --stress-steps 2000 --configs mlp:128:2000:2000:4 \
      --variants inductor+graph --trials 1 | tee "$OUT/check_cuda.log" ;;
  paper-ctr)
    mkdir -p "$OUT/paper"
    timeout 570 python3 -m bench.paper.ctr --steps 600 --seeds 5 --budget-s 470 \
      --variants baseline,eager,reduce-overhead,erase-aot_eager,erase+graphs --results-dir "$OUT/paper" ;;
  paper-ctr-all)
    mkdir -p "$OUT/paper"
    timeout 580 python3 -m bench.paper.ctr --steps 400 --seeds 5 --budget-s 500 --results-dir "$OUT/paper" ;;
  paper)
    mkdir -p "$OUT/paper"
    timeout 230 python3 -m bench.paper.digits --out-dir "$OUT/paper" || true
    timeout 340 python3 -m bench.paper.nanochat --quick --attention manual,sdpa --out-dir "$OUT/paper" || true
    python3 -m bench.paper.report --results-dir "$OUT/paper" ;;
esac
