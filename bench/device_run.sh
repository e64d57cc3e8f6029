#!/usr/bin/env bash
# The GPU runs, in parts that each fit one device call (10 minutes at most).
#   bash bench/device_run.sh bench-a   bench.run on the three small configs, with one-stream rows
#   bash bench/device_run.sh bench-b   bench.run on ctr:4096 (with one-stream rows) and ctr:16384
#   bash bench/device_run.sh checks    check_cuda: parity, training-loop shapes, 2,000-step race stress
#   bash bench/device_run.sh towers    bench.run and a race stress on towers over a shared front
#                                      (the early parts of gradients summed in the backward; with
#                                      a top head, one early block in pieces)
#   bash bench/device_run.sh paper-ctr-a  the CTR experiment (full preset: every variant, 1000
#                                          steps), seeds 0-2 (~7 min)
#   bash bench/device_run.sh paper-ctr-b  the same, seeds 3-4 (~5 min)
#   bash bench/device_run.sh paper-ctr-c  the same, seed 5 (~3 min; part a's budget ran out
#                                          before its last run, erase+graphs of seed 2)
#   bash bench/device_run.sh paper-ctr-speed  erase+graphs and reduce-overhead only, 5 seeds
#                                          (~3 min): the speed claim, side by side
#   bash bench/device_run.sh paper      digits (full preset), NanoChat (both attentions), the report
# Results go to $OUT (default bench/results/device); join bench-a and bench-b with
#   python -m bench.run --merge $OUT/bench-a.json $OUT/bench-b.json
# join the CTR parts into ctr.json beside the other paper files, and rebuild the report, with
#   python -m bench.paper.ctr --merge $OUT/paper/parts/ctr-seeds-0-2.json \
#     $OUT/paper/parts/ctr-seeds-3-4.json $OUT/paper/parts/ctr-seed-5.json --results-dir $OUT/paper
#   python -m bench.paper.report --results-dir $OUT/paper
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  bench-a|bench-b|checks|towers|paper-ctr-a|paper-ctr-b|paper-ctr-c|paper-ctr-speed|paper) ;;
  *) sed -n 2,21p "$0"; exit 2 ;;
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
  towers)
    timeout 220 python3 -m bench.check_cuda --parity-config mlp-towers:256:512:1024:4 \
      --stress-steps 300 --configs mlp-towers:512:1024:2048:6 --variants inductor+graph \
      --trials 1 | tee "$OUT/check_cuda-towers.log" || true
    python3 -m bench.run --budget-s 330 --out "$OUT/bench-towers.json" --streams '' \
      --configs ctr-towers:4096:1024:2048:6,ctr-towers-top:4096:1024:2048:6 \
      --sweep-configs ctr-towers:4096:1024:2048:6,ctr-towers-top:4096:1024:2048:6 ;;
  paper-ctr-a)
    timeout 580 python3 -m bench.paper.ctr --seed 0 --seeds 3 --budget-s 480 \
      --name ctr-seeds-0-2 --results-dir "$OUT/paper/parts" ;;
  paper-ctr-b)
    # NB: the no-local-loss demonstration ran in part a
    timeout 580 python3 -m bench.paper.ctr --seed 3 --seeds 2 --budget-s 480 --freeze-steps 0 \
      --name ctr-seeds-3-4 --results-dir "$OUT/paper/parts" ;;
  paper-ctr-c)
    timeout 330 python3 -m bench.paper.ctr --seed 5 --seeds 1 --budget-s 300 --freeze-steps 0 \
      --name ctr-seed-5 --results-dir "$OUT/paper/parts" ;;
  paper-ctr-speed)
    timeout 580 python3 -m bench.paper.ctr --variants reduce-overhead,erase+graphs --seeds 5 \
      --freeze-steps 0 --budget-s 400 --name ctr-speed --results-dir "$OUT/paper" ;;
  paper)
    mkdir -p "$OUT/paper"
    timeout 230 python3 -m bench.paper.digits --out-dir "$OUT/paper" || true
    timeout 340 python3 -m bench.paper.nanochat --quick --attention manual,sdpa --out-dir "$OUT/paper" || true
    python3 -m bench.paper.report --results-dir "$OUT/paper" ;;
esac
