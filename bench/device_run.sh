#!/usr/bin/env bash
# The GPU runs, in parts that each fit one device call (10 minutes at most, compile included;
# each bench.run part stops starting rows at its --budget-s and keeps what it measured).
#
# Open questions (issue 37: the drop-in's time; issue 39: the memory plan)
#   bash bench/device_run.sh dropin-a  bench.overhead (cProfile, torch.profiler tables, GPU busy
#                                      share) of reduce-overhead and erase+graphs on mlp:128,
#                                      gpt:16 and DGL ResNet-18 (~8 min)
#   bash bench/device_run.sh dropin-b  erase+graphs/graph-end and erase+step/graph-end against their
#                                      defaults and stock on mlp:128, gpt:16, DGL ResNet-18 (~9 min)
#   bash bench/device_run.sh dropin-c  bench.overhead --shapes: the CPU ops a drop-in step calls
#                                      outside its graphs, on DGL ResNet-18 and mlp:128 (~5 min)
#   bash bench/device_run.sh launch-a  bench.graph_launch (host time of one CUDA graph replay by
#                                      the graph's shape), then patterns-prof (~7 min)
#   bash bench/device_run.sh patterns-prof  CPU profile and torch.profiler tables of inductor+step
#                                      and erase+step on two user patterns where erase is slower
#                                      (~6 min)
#   bash bench/device_run.sh stock-a   erase+step/stock-candidate against erase+step and
#                                      inductor+step: local-loss VGG, mlp:128, ResNet-18 (~9 min)
#   bash bench/device_run.sh plan-a    bench.plan_peaks (predicted peaks of the release plans) on
#                                      gpt:16, ctr:16384, mlp:128, DGL ResNet-18 (~6 min, estimated)
#   bash bench/device_run.sh plan-b    release_lag="record_stream" under the allocator's reuse
#                                      setting: check_step's race stress, gpt:16 (~8 min, estimated)
#   bash bench/device_run.sh plan-c    after plan-b passes: /release-lag=record-stream against the
#                                      default and stock on gpt:16, ctr:16384 (~8 min, estimated)
#   bash bench/device_run.sh plan-d    the same on mlp:128 and DGL ResNet-18 (~8 min, estimated)
#   bash bench/device_run.sh fp16-a    float16 autocast at a GradScaler's scale (the learned seed):
#                                      gpt-fp16:16 beside gpt:16 (bf16), step API and drop-in pairs
#                                      (~9 min, estimated)
#
# Regenerate the result tables
#   bash bench/device_run.sh bench-a   bench.run on the three small configs, with one-stream rows
#                                      (~9 min)
#   bash bench/device_run.sh bench-b   bench.run on ctr:4096 (with one-stream rows) and ctr:16384
#                                      (~9 min)
#   bash bench/device_run.sh step      compile_step against the hand capture, with and without Adam,
#                                      one-stream controls, on the three small configs (~8 min)
#   bash bench/device_run.sh memory-a  step memory and time on the gpt configs (bf16 autocast),
#                                      every way of compiling (~7 min)
#   bash bench/device_run.sh memory-b  the same on ctr:16384 (~3 min)
#   bash bench/device_run.sh models-a  check_models: the dropout GPT and CTR, DGL ResNet-18 and
#                                      MobileNetV3 (~8 min)
#   bash bench/device_run.sh models-b  check_models: GoogLeNet with its aux heads, forced early
#                                      (~6 min)
#   bash bench/device_run.sh models-c  check_models: EfficientNet-B0, DGL and as shipped (~9 min)
#   bash bench/device_run.sh models-d  check_models: the ViTs, MobileNetV3 and ResNet-18 as shipped
#                                      (~9 min)
#   bash bench/device_run.sh patterns-a  issue 36's user patterns at GPU sizes: erase+step against
#                                      inductor+step, then the drop-in pair in the time left
#                                      (~9.5 min)
#   bash bench/device_run.sh patterns-b  the drop-in pair alone on the same configs (~8 min)
#     patterns-a and patterns-b take --smoke: the same part on the CPU at tiny sizes, aot_eager
#     inside, its table in /tmp/erase_fx_device_run/smoke (never bench/results); exits non-zero
#     if a row failed (~4 min on 2 cores): run it before a GPU call
#   bash bench/device_run.sh frameworks-a  bench.frameworks: a Lightning Trainer step on DGL
#                                      ResNet-18, compiled each way (needs lightning) (~8 min)
#   bash bench/device_run.sh frameworks-b  the same on ctr:1024:512:1024:6 (~6 min)
#   bash bench/device_run.sh towers    bench.run and a race stress on towers over a shared front
#                                      (~9 min)
#   bash bench/device_run.sh paper     digits (full preset), NanoChat (both attentions), the report
#                                      (~9.5 min)
#   bash bench/device_run.sh paper-ctr-a  the CTR experiment (full preset), seeds 0-2 (~7 min)
#   bash bench/device_run.sh paper-ctr-b  the same, seeds 3-4 (~5 min)
#   bash bench/device_run.sh paper-ctr-c  the same, seed 5 (~3 min)
#   bash bench/device_run.sh paper-ctr-speed  erase+graphs and reduce-overhead only, 5 seeds
#                                      (~3 min): the speed claim
#
# Checks
#   bash bench/device_run.sh checks    check_cuda: parity, training-loop shapes, 2,000-step race
#                                      stress (~9 min)
#
# Past runs that result tables or docs cite (rerun one to reproduce its figures)
#   bash bench/device_run.sh memory-c  held_to_join, then release_lag 2 and 4, one side stream and
#                                      one stream on gpt:16 and ctr:16384 (~8 min)
#   bash bench/device_run.sh memory-e  check_models on the dropout models, then stages on side vs
#                                      main (ResNet-18) and two side streams (~9 min)
#   bash bench/device_run.sh memory-f  race stress, then /shared-input-values on two gpt chains and
#                                      mlp:512, then held_to_join (~9 min)
#   bash bench/device_run.sh gpt8-a    gpt:8's controls and profiler traces, then the CPU time per
#                                      step of the drop-in pair on mlp:128 (~9.5 min)
#   bash bench/device_run.sh segments-a  bench.segment_cost on gpt:8 --no-recompute, with traces
#                                      (~6 min)
#   bash bench/device_run.sh overhead-a  the drop-in pair's CPU time per step on the three small
#                                      chains, cProfile's top functions (~4 min)
#   bash bench/device_run.sh kernels-a  bench.kernel_counts, stock against erase, on ResNet-18,
#                                      MobileNetV3 and GoogLeNet (issue 13) (~8 min)
#   bash bench/device_run.sh vision-e  issue 13's before/after on GoogLeNet (aux heads; compiled on
#                                      the stock path since min_part_share) and MobileNetV3 (~7 min)
#   bash bench/device_run.sh layout-a  /layouts-unpinned against the default on MobileNetV3 and
#                                      ResNet-18 (DGL) (~9 min)
#   bash bench/device_run.sh async-a   cudaMallocAsync against the native allocator: race stress,
#                                      then the step API on gpt:16, ctr:16384, mlp:512 (~9 min)
#   bash bench/device_run.sh early-c   check_step's early optimizer, then Adam in the step with and
#                                      without early updates: small chains, ResNet-18 (~9 min)
#   bash bench/device_run.sh early-d   the same Adam rows on ResNet-18, gpt:16, ctr:16384 (~9 min)
#   bash bench/device_run.sh memprof-a  each stream's graph pool on gpt:16 and ctr:16384
#                                      (bench.memory_profile), then the conv check (~9 min)
#   bash bench/device_run.sh memprof-b  gpt:16 streams=0 profiled, its code kept, then the conv
#                                      check with its diagnosis (~5 min)
#   bash bench/device_run.sh determinism-a  check_step's determinism-conv, then gpt:16 streams=0
#                                      against one stream (~9 min)
#   bash bench/device_run.sh onestream-a  the conv check, then one stream against streams=0 and
#                                      stock on gpt:8, ctr:16384, mlp:512, ctr:1024 (~9 min)
#   bash bench/device_run.sh inplace-a  keep_inplace_writes against /stock-fusion: the kernel pair
#                                      check, gpt:16's pools, its time and step memory (~8 min)
#   bash bench/device_run.sh pool-a    where the side pools outgrow their high-water marks, gpt:16
#                                      and the DGL ViT (~2 min)
#   bash bench/device_run.sh order-a   split_segments.forward_first against /partitioner-order on
#                                      gpt:16 and gpt:8, then gpt:16's streams profiled (~8 min)
#   bash bench/device_run.sh order-b   compile_step exactness and the gpt race stress (~4 min)
#   bash bench/device_run.sh sched-c   gpt:16's side 1 code and scheduler IR, default and
#                                      /forward-first (a variant since removed: it fails) (~2 min)
#   bash bench/device_run.sh soft-c    gpt-soft:16 against gpt:16, then gpt-soft's streams profiled
#                                      (~7 min)
#   bash bench/device_run.sh soft-d    check_inplace_fusion with both heads, then gpt-soft:16 and
#                                      gpt:16 (~5 min)
#   bash bench/device_run.sh soft-e    gpt-soft:16 with /stock-fusion beside, the refused fusions
#                                      logged (~3 min)
#   bash bench/device_run.sh auto-a    the release-lag check, then release_lag="auto" on the DGL ViT
#                                      and ResNet-18 (~9 min)
#   bash bench/device_run.sh auto-c    the release-lag check, then release_lag "auto", alone and with
#                                      side_cuda_streams, on ctr:16384, ResNet-18, mlp:512 (~10 min)
#   bash bench/device_run.sh fold-a    the gpt race stress on the "auto" defaults, then gpt-soft:16
#                                      against gpt:16 (~8 min)
#
# Each part updates the current tables in bench/results/ (bench/results/README.md: step.json
# and step.md for bench.run's rows, check_*.md, memory.md, ...; paper/). Where $OUT is set (the
# device machine: what is written under it comes back) the tables a part changed are copied to
# $OUT/results/ at its end: copy them over bench/results/ and commit. Traces and generated code
# go to $OUT (else /tmp/erase_fx_device_run), never into the tables. Join the CTR parts into
# ctr.json beside the other paper files, and rebuild the report, with
#   python -m bench.paper.ctr --merge bench/results/paper/parts/ctr-seeds-0-2.json \
#     bench/results/paper/parts/ctr-seeds-3-4.json bench/results/paper/parts/ctr-seed-5.json
#   python -m bench.paper.report
# Parts used for past experiments were removed on 2026-12-05; `git log -p bench/device_run.sh`
# has them.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  dropin-a|dropin-b|dropin-c|launch-a|patterns-prof|stock-a|plan-a|plan-b|plan-c|plan-d) ;;
  fp16-a) ;;
  bench-a|bench-b|step|memory-a|memory-b|models-a|models-b|models-c|models-d) ;;
  patterns-a|patterns-b|frameworks-a|frameworks-b|towers) ;;
  paper|paper-ctr-a|paper-ctr-b|paper-ctr-c|paper-ctr-speed|checks) ;;
  memory-c|memory-e|memory-f|gpt8-a|segments-a|overhead-a|kernels-a|vision-e|layout-a) ;;
  async-a|early-c|early-d|memprof-a|memprof-b|determinism-a|onestream-a|inplace-a) ;;
  pool-a|order-a|order-b|sched-c|soft-c|soft-d|soft-e|auto-a|auto-c|fold-a) ;;
  *) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 2 ;;  # NB: the header, however long
esac
SMOKE=
case "${2:-}" in
  "") ;;
  --smoke)
    case "$1" in
      patterns-a|patterns-b) SMOKE=1 ;;
      *) echo "device_run.sh: --smoke applies to patterns-a and patterns-b" >&2; exit 2 ;;
    esac ;;
  *) echo "device_run.sh: unknown option ${2}" >&2; exit 2 ;;
esac
ART=${OUT:-/tmp/erase_fx_device_run}
mkdir -p "$ART"
STARTED=$(mktemp)
# NB: the tables this part wrote, to $OUT/results/ (on exit, so a part cut short keeps them)
copy_back() {
  [ -n "${OUT:-}" ] || return 0
  find bench/results -type f -newer "$STARTED" | while read -r file; do
    mkdir -p "$OUT/results/$(dirname "${file#bench/results/}")"
    cp "$file" "$OUT/results/${file#bench/results/}"
  done
}
trap copy_back EXIT
export PYTHONUNBUFFERED=1
# NB: the GPU image has torch and the other dependencies; only erase_fx itself is installed.
# A --smoke run takes this checkout's .venv (make setup) where there is one.
if [ -n "$SMOKE" ]; then
  if [ -x .venv/bin/python ]; then PATH="$PWD/.venv/bin:$PATH"; fi
else
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
SMALL=ctr:1024:512:1024:6,mlp:512:1024:2048:6,mlp:128:2000:2000:4
# NB: the variants of the first benchmark (bench-a, bench-b); the step API has its own part
CLASSIC=eager,paper,inductor,reduce-overhead,inductor+graph,erase,erase+graphs,erase+step-graph
STEP=inductor+graph,inductor+step,erase+step-graph,erase+step
ADAM=inductor+graph+adam,inductor+step+adam,erase+step+adam
MEMORY=inductor,erase,inductor+graph,erase+step-graph,inductor+step,erase+step,reduce-overhead
MEMORY+=,erase+graphs
# NB: issue 13's quick before/after (vision-e): the step API and erase's own graphs against stock
ISSUE13=inductor+step,erase+step,reduce-overhead,erase+graphs,erase+step/one-stream
# NB: issue 36's user patterns at GPU sizes (bench.user_patterns.PATTERN_CONFIGS), the ones
# compile_step captures first: the last two cannot be captured (a .item() in the forward, a
# nonzero between blocks: they run as written, the row says why), and run last, so that a
# failed capture cannot cost the others' rows
PATTERNS=pattern-ff_one_graph:1024:2048:4,pattern-hooked_activations:1024:2048:4
PATTERNS+=,pattern-logged_on_module:1024:2048:4,pattern-vgg_local_loss:256:64:4
PATTERNS+=,pattern-gpt2_probes:16:768:6,pattern-data_dependent_between:1024:2048:4
PATTERNS+=,pattern-ff_accumulator:1024:2048:4
# NB: the same patterns at tiny sizes, for --smoke
# NB: issue 39's configs (plan-a to plan-d) and the allocator setting its candidate needs
PLAN_CONFIGS=gpt:16:384:256:8,ctr:16384:1024:2048:6,mlp:128:2000:2000:4,tv-resnet18-dgl:256:32
REUSE=graph_capture_record_stream_reuse:True
PLAN_VARIANTS=inductor+step,erase+step,erase+step/release-lag=record-stream
PATTERNS_SMOKE=pattern-ff_one_graph:4:32:2,pattern-hooked_activations:4:32:2
PATTERNS_SMOKE+=,pattern-logged_on_module:4:32:2,pattern-vgg_local_loss:4:8:2
PATTERNS_SMOKE+=,pattern-gpt2_probes:2:32:2,pattern-data_dependent_between:4:32:2
PATTERNS_SMOKE+=,pattern-ff_accumulator:4:32:2
# patterns VARIANTS TIMEOUT BUDGET: bench.run on the patterns (rows into step.json); with
# --smoke, on the tiny ones on the CPU (bench.run --smoke: a failed row fails the part)
patterns() {
  local variants=$1 limit=$2 budget=$3
  if [ -n "$SMOKE" ]; then
    python3 -m bench.run --smoke --out "$ART/smoke/step.json" --streams '' --sweep-configs '' \
      --trials 2 --steps-per-trial 1 --configs "$PATTERNS_SMOKE" --variants "$variants" 2>&1 \
      | grep -v '^erase_fx: graph'
    return
  fi
  timeout "$limit" python3 -m bench.run --budget-s "$budget" --streams '' --sweep-configs '' \
    --configs "$PATTERNS" --variants "$variants" 2>&1 | grep -v '^erase_fx: graph'
}
# run NAME CONFIGS VARIANTS [more bench.run flags]: one bench.run part (rows into step.json)
run() {
  local name=$1 configs=$2 variants=$3
  shift 3
  # NB: --streams '' leaves out the side-stream-count rows (measured once, see README);
  # timeout: a last row that overruns the budget still ends inside the device call
  timeout 570 python3 -m bench.run --budget-s 450 --streams '' \
    --configs "$configs" --variants "$variants" "$@"
}
# models NAME LIST: one check_models part (rows into check_models.md)
models() {
  timeout 570 python3 -m bench.check_models --budget-s 480 --models "$2"
}
case "$1" in
  models-a) models models-a gpt-dropout,ctr-dropout,tv-resnet18-dgl,tv-mobilenet-dgl ;;
  models-b) models models-b tv-googlenet-aux ;;
  models-c) models models-c tv-efficientnet-dgl,tv-efficientnet ;;
  models-d) models models-d tv-vit-dgl,tv-vit-dropout,tv-mobilenet,tv-resnet18 ;;
  memory-c)
    python3 -m bench.held_to_join --device cuda --out bench/results/held_to_join.md \
      --configs gpt:16:384:256:8,ctr:16384:1024:2048:6
    run memory-c gpt:16:384:256:8,ctr:16384:1024:2048:6 \
      inductor+step,erase+step,erase+step/release-lag=2,erase+step/release-lag=4,erase+step/streams=1,erase+step/one-stream \
      --budget-s 380 ;;
  memory-f)
    # NB: the stress first: outputs of one segment sharing its memory are now freed under capture
    timeout 130 python3 -m bench.check_cuda --parts stress --stress-steps 1000 \
      --parity-config mlp:256:512:1024:8 --release-lags uncaptured,none \
      2>&1 || true
    timeout 300 python3 -m bench.run --budget-s 250 --streams '' \
      --configs gpt:16:384:256:8,gpt:8:768:1024:6,mlp:512:1024:2048:6 --sweep-configs '' \
      --variants inductor+step,erase+step,erase+step/shared-input-values --trials 5 || true
    # NB: 90 s was too short for the third row and the largest values (2026-12-01)
    timeout 150 python3 -m bench.held_to_join --device cuda --out bench/results/held_to_join.md \
      --configs gpt:16:384:256:8 \
      --streams 4,2 --largest 8 ;;
  gpt8-a)
    # NB: about 60 s a row on a cold cache; the overhead parts fit the rest of the call
    timeout 330 python3 -m bench.run --budget-s 270 --streams '' \
      --configs gpt:8:768:1024:6 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/one-stream,erase+step/stages-on-main,erase+step/streams=2 || true
    timeout 150 python3 -m bench.overhead --config gpt:8:768:1024:6 --steps 50 \
      --variants inductor+step,erase+step --trace-dir "$ART" 2>&1 || true
    # the default path's CPU time per step on a small chain (issue 12, item 5: before)
    timeout 90 python3 -m bench.overhead --config mlp:128:2000:2000:4 --top 25 \
      --variants reduce-overhead,erase+graphs 2>&1 ;;
  segments-a)
    timeout 560 python3 -m bench.segment_cost --configs gpt:8:768:1024:6 --no-recompute \
      --trace-dir "$ART" 2>&1 | grep -v '^erase_fx: graph' ;;
  overhead-a)
    for config in ${SMALL//,/ }; do
      timeout 80 python3 -m bench.overhead --config "$config" --top 25 \
        --variants reduce-overhead,erase+graphs 2>&1 | grep -v '^erase_fx: graph' || true
    done ;;
  async-a)
    export ASYNC=backend:cudaMallocAsync
    PYTORCH_CUDA_ALLOC_CONF=$ASYNC timeout 100 python3 -m bench.check_cuda --parts stress \
      --stress-steps 300 --parity-config mlp:256:512:1024:8 --release-lags uncaptured,none \
      2>&1 || true
    for allocator in async native; do
      # NB: async first: the native figures have earlier runs; the second process finds the
      # compiled kernels in Inductor's cache
      if [ $allocator = async ]; then export PYTORCH_CUDA_ALLOC_CONF=$ASYNC
      else unset PYTORCH_CUDA_ALLOC_CONF; fi
      timeout 250 python3 -m bench.run --budget-s 200 \
        --streams '' --sweep-configs '' --trials 5 \
        --configs gpt:16:384:256:8,ctr:16384:1024:2048:6,mlp:512:1024:2048:6 \
        --variants inductor+step,erase+step,erase+step/streams=2 || true
    done ;;
  early-c)
    timeout 100 python3 -m bench.check_step --checks early-optimizer --steps 6 2>&1 \
      | grep -v '^erase_fx: graph' || true
    # NB: erase_fx.early_update logs at INFO the strides of a gradient autograd copied
    timeout 470 python3 -c "import logging, sys, runpy
logging.basicConfig(level=logging.WARNING, format='%(name)s: %(message)s')
logging.getLogger('erase_fx.early_update').setLevel(logging.INFO)
sys.argv[0] = 'bench.run'
runpy.run_module('bench.run', run_name='__main__')" --budget-s 410 \
      --streams '' --sweep-configs '' --trials 5 --configs "$SMALL,tv-resnet18-dgl:256:32" \
      --variants inductor+step+adam,erase+step+adam,erase+step+adam/early-optimizer 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  memprof-a)
    # where each stream's graph pool goes (issue 14), then whether this torch's Inductor has
    # user streams, then the early optimizer's conv check with the time left
    timeout 330 python3 -m bench.memory_profile --top 8 \
      --configs gpt:16:384:256:8 \
      --variants inductor+step,erase+step,erase+step/streams=2,erase+step/streams=0 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 120 python3 -m bench.memory_profile --top 8 \
      --configs ctr:16384:1024:2048:6 --variants inductor+step,erase+step,erase+step/streams=0 \
      2>&1 | grep -v '^erase_fx: graph' || true
    python3 -c "import torch, importlib.util as u, torch._inductor.scheduler as s
print('torch', torch.__version__, 'inductor stream_utils:',
      u.find_spec('torch._inductor.stream_utils') is not None,
      '_populate_stream_assignments:', hasattr(s.Scheduler, '_populate_stream_assignments'))"
    timeout 100 python3 -m bench.check_step --checks early-optimizer-conv --steps 6 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  memprof-b)
    # why streams=0 holds a logits-sized buffer per block at its high-water mark (the generated
    # code kept), then the early optimizer's conv check with its diagnosis
    timeout 150 python3 -m bench.memory_profile --top 12 \
      --keep-code "$ART/code" --configs gpt:16:384:256:8 --variants erase+step/streams=0 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 300 python3 -m bench.check_step --checks early-optimizer-conv --steps 6 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  determinism-a)
    # is erase+step deterministic on a conv net (the early-optimizer check's baseline varied),
    # then streams=0 against segments on one stream on gpt:16 (memory and time)
    timeout 330 python3 -m bench.check_step --checks determinism-conv --steps 6 2>&1 \
      | grep -v '^erase_fx: graph' || true
    python3 -c "import importlib.util as u
print('control_dependencies:', u.find_spec('torch._inductor.fx_passes.control_dependencies') is not None)"
    timeout 230 python3 -m bench.run --budget-s 190 --streams '' \
      --configs gpt:16:384:256:8 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step/streams=0,erase+step/one-stream 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  onestream-a)
    # the early optimizer's conv check after a throwaway first compile; then segments on the
    # main stream (/one-stream) against streams=0 (one graph) and stock on the other configs
    timeout 150 python3 -m bench.check_step --checks early-optimizer-conv --steps 6 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 420 python3 -m bench.run --budget-s 380 --streams '' \
      --configs gpt:8:768:1024:6,ctr:16384:1024:2048:6,mlp:512:1024:2048:6,ctr:1024:512:1024:6 \
      --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step/streams=0,erase+step/one-stream 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  inplace-a)
    # keep_inplace_writes on side segments: this torch's extension points, one CUDA kernel pair,
    # then gpt:16's side-stream pools and its time and memory, with and without it
    python3 -c "import torch, torch.compiler.config as cc, inspect
from torch._inductor.virtualized import V
from torch._inductor.choices import InductorChoices as C
print('torch', torch.__version__, 'set_choices_handler', hasattr(V, 'set_choices_handler'),
      'cache_key_tag', hasattr(cc, 'cache_key_tag'), 'can_fuse', inspect.signature(C.can_fuse))"
    timeout 90 python3 -m bench.check_inplace_fusion 2>&1 || true
    timeout 200 python3 -m bench.memory_profile --top 6 \
      --configs gpt:16:384:256:8 --variants erase+step,erase+step/stock-fusion 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 300 python3 -m bench.run --budget-s 260 --streams '' \
      --configs gpt:16:384:256:8 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/stock-fusion 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  sched-c)
    # why gpt:16's side 1 computes its loss value last even when its FX graph computes it
    # first (/forward-first): side 1's code with Inductor's scheduler IR before and after
    # fusion, for the default and /forward-first. Answer: /forward-first changed nothing on
    # the GPU (the same code), since it kept the order of any block with a random op, and
    # cuDNN attention's backward is tagged as one; split_segments.forward_first replaced it
    for v in erase+step erase+step/forward-first; do
      dir=/tmp/sched-c/${v//[\/+]/-}
      timeout 200 python3 -m bench.memory_profile --top 3 --keep-code "$dir" --keep-ir \
        --keep-code-of "side 1" --configs gpt:16:384:256:8 --variants "$v" 2>&1 \
        | grep -v '^erase_fx: graph' || true
    done
    tar czf "$ART/sched-c-code.tgz" -C /tmp sched-c ;;
  order-a)
    # each block's loss value before its early backward (split_segments.forward_first), against
    # the partitioner's order: the gpt chains, whose side streams held the logits and their
    # gradient at once; then gpt:16's streams (high-water marks, what is alive there)
    timeout 400 python3 -m bench.run --budget-s 330 --streams '' \
      --configs gpt:16:384:256:8,gpt:8:768:1024:6 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step,erase+step/partitioner-order 2>&1 \
      | grep -v '^erase_fx: graph' || true
    for v in erase+step erase+step/partitioner-order; do
      timeout 150 python3 -m bench.memory_profile --top 3 --configs gpt:16:384:256:8 \
        --variants "$v" 2>&1 | grep -v '^erase_fx: graph\|debug trace' || true
    done ;;
  pool-a)
    for cfg in gpt:16:384:256:8 tv-vit-dgl:256:32; do
      timeout 140 python3 -m bench.memory_profile --top 3 --configs "$cfg" --variants erase+step \
        2>&1 | grep -v '^erase_fx: graph' || true
    done ;;
  auto-a)
    # release_lag="auto": compile_step times each candidate lag and keeps one (erase_fx.lag_tuning);
    # bitwise against the default first, then time and step memory where release_lag 2 and 4
    # (2026-12-03) found the lag worth 0.88x of stock's memory (the ViT) and where it cost 12%
    # of time (ResNet-18)
    timeout 170 python3 -m bench.check_step --checks release-lag --steps 4 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 400 python3 -m bench.run --budget-s 340 --streams '' \
      --configs tv-vit-dgl:256:32,tv-resnet18-dgl:256:32 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step,erase+step/release-lag=auto 2>&1 \
      | grep -v '^erase_fx: graph' || true ;;
  auto-c)
    # after auto-a found ~92 MiB left over by the tuning (fixed since, on CPU): the check (one
    # graph pool left; folding bitwise too), then "auto" against the default: the lag alone,
    # and with side_cuda_streams (not yet run on a GPU), to decide what becomes the default
    timeout 200 python3 -m bench.check_step --checks release-lag --steps 4 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 370 python3 -m bench.run --budget-s 320 --streams '' \
      --configs ctr:16384:1024:2048:6,tv-resnet18-dgl:256:32,mlp:512:1024:2048:6 \
      --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step,erase+step/release-lag=auto,erase+step/release-lag=auto/side-cuda-streams=auto 2>&1 \
      | grep -v '^erase_fx: graph' || true ;;
  soft-d)
    for head in target soft; do
      timeout 120 python3 -m bench.check_inplace_fusion --head $head 2>&1 || true
    done
    timeout 280 python3 -m bench.run --budget-s 220 --streams '' \
      --configs gpt-soft:16:384:256:8,gpt:16:384:256:8 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step 2>&1 | grep -v '^erase_fx: graph' || true ;;
  soft-e)
    # NB: the FX graph cache off, so that every segment compiles and logs its refusals
    TORCHINDUCTOR_FX_GRAPH_CACHE=0 timeout 320 python3 -c "
import logging, sys
logging.basicConfig(format='%(name)s %(levelname)s %(message)s')
logging.getLogger('erase_fx').setLevel(logging.DEBUG)
from bench.run import main
sys.exit(main(sys.argv[1:]))" --budget-s 250 --streams '' \
      --configs gpt-soft:16:384:256:8 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step,erase+step/stock-fusion 2>&1 \
      | grep -v "^erase_fx: graph\|INFO" | grep -i "refused\|erase+step\|inductor+step" \
      | cut -c1-400 ;;
  soft-c)
    # fold-a measured gpt-soft:16 at 1.37x of stock's step memory (gpt:16 1.00x) before the fix
    timeout 300 python3 -m bench.run --budget-s 240 --streams '' \
      --configs gpt-soft:16:384:256:8,gpt:16:384:256:8 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step 2>&1 | grep -v '^erase_fx: graph' || true
    timeout 150 python3 -m bench.memory_profile --top 3 --configs gpt-soft:16:384:256:8 \
      --variants erase+step 2>&1 | grep -v '^erase_fx: graph' || true ;;
  fold-a)
    # the race stress where memory is reused across blocks (folded streams), then gpt-soft:16
    # against gpt:16
    timeout 270 python3 -m bench.check_step --checks determinism-gpt --steps 400 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 250 python3 -m bench.run --budget-s 200 --streams '' \
      --configs gpt-soft:16:384:256:8,gpt:16:384:256:8 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step 2>&1 | grep -v '^erase_fx: graph' || true ;;
  order-b)
    timeout 560 python3 -m bench.check_step --checks exactness,determinism-gpt --steps 400 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  early-d)
    timeout 560 python3 -m bench.run --budget-s 470 --streams '' \
      --sweep-configs '' --trials 5 \
      --configs tv-resnet18-dgl:256:32,gpt:16:384:256:8,ctr:16384:1024:2048:6 \
      --variants inductor+step+adam,erase+step+adam/early-optimizer,erase+step+adam 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  layout-a)
    timeout 570 python3 -m bench.run --budget-s 500 --streams '' \
      --configs tv-mobilenet-dgl:256:64,tv-resnet18-dgl:256:32 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/layouts-unpinned 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  kernels-a)
    timeout 540 python3 -m bench.kernel_counts --differences \
      --configs tv-resnet18-dgl:256:32,tv-mobilenet-dgl:256:64,tv-googlenet-aux:128:64 ;;
  memory-e)
    timeout 220 python3 -m bench.check_models --budget-s 190 --models gpt-dropout,ctr-dropout \
      2>&1 || true
    timeout 200 python3 -m bench.run --budget-s 150 \
      --streams '' --configs tv-resnet18-dgl:256:32 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/stages-on-main || true
    timeout 150 python3 -m bench.run --budget-s 110 \
      --streams '' --configs gpt:16:384:256:8,ctr:16384:1024:2048:6 --sweep-configs '' \
      --trials 5 --variants inductor+step,erase+step/streams=2 ;;
  bench-a)
    run bench-a "$SMALL" "$CLASSIC" --budget-s 500 ;;
  bench-b)
    run bench-b ctr:4096:1024:2048:6,ctr:16384:1024:2048:6 "$CLASSIC" --budget-s 500 \
      --sweep-configs ctr:4096:1024:2048:6 ;;
  step)
    # the sweep adds erase+step-graph/one-stream and erase+step/one-stream on each config
    run step "$SMALL" "$STEP,$ADAM" --sweep-configs "$SMALL" ;;
  memory-a)
    run memory-a gpt:8:768:1024:6,gpt:16:384:256:8 "$MEMORY" --sweep-configs '' ;;
  memory-b)
    run memory-b ctr:16384:1024:2048:6 "$MEMORY" --sweep-configs '' ;;
  vision-e)
    run vision-e tv-googlenet-aux:128:64,tv-mobilenet-dgl:256:64 "$ISSUE13" --sweep-configs '' \
      --trials 5 --steps-per-trial 20 ;;
  checks)
    timeout 540 python3 -m bench.check_cuda --stress-steps 2000 --configs mlp:128:2000:2000:4 \
      --variants inductor+graph --trials 1 ;;
  towers)
    timeout 220 python3 -m bench.check_cuda --parity-config mlp-towers:256:512:1024:4 \
      --stress-steps 300 --configs mlp-towers:512:1024:2048:6 --variants inductor+graph \
      --trials 1 || true
    python3 -m bench.run --budget-s 330 --streams '' \
      --configs ctr-towers:4096:1024:2048:6,ctr-towers-top:4096:1024:2048:6 --variants "$CLASSIC" \
      --sweep-configs ctr-towers:4096:1024:2048:6,ctr-towers-top:4096:1024:2048:6 ;;
  paper-ctr-a)
    timeout 580 python3 -m bench.paper.ctr --seed 0 --seeds 3 --budget-s 480 \
      --name ctr-seeds-0-2 --results-dir bench/results/paper/parts ;;
  paper-ctr-b)
    # NB: the no-local-loss demonstration ran in part a
    timeout 580 python3 -m bench.paper.ctr --seed 3 --seeds 2 --budget-s 480 --freeze-steps 0 \
      --name ctr-seeds-3-4 --results-dir bench/results/paper/parts ;;
  paper-ctr-c)
    timeout 330 python3 -m bench.paper.ctr --seed 5 --seeds 1 --budget-s 300 --freeze-steps 0 \
      --name ctr-seed-5 --results-dir bench/results/paper/parts ;;
  paper-ctr-speed)
    timeout 580 python3 -m bench.paper.ctr --variants reduce-overhead,erase+graphs --seeds 5 \
      --freeze-steps 0 --budget-s 400 --name ctr-speed ;;
  frameworks-a)
    timeout 570 python3 -m bench.frameworks --budget-s 450 --configs tv-resnet18-dgl:256:32 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  frameworks-b)
    timeout 570 python3 -m bench.frameworks --budget-s 450 --configs ctr:1024:512:1024:6 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  dropin-b)
    run dropin-b mlp:128:2000:2000:4,gpt:16:384:256:8,tv-resnet18-dgl:256:32 \
      reduce-overhead,erase+graphs,erase+graphs/graph-end,inductor+step,erase+step,erase+step/graph-end \
      --sweep-configs '' --trials 5 || true ;;
  stock-a)
    run stock-a pattern-vgg_local_loss:256:64:4,mlp:128:2000:2000:4,tv-resnet18-dgl:256:32 \
      inductor+step,erase+step,erase+step/stock-candidate --sweep-configs '' --trials 5 \
      2>&1 | grep -v '^erase_fx: graph' || true ;;
  fp16-a)
    run fp16-a gpt-fp16:16:384:256:8,gpt:16:384:256:8 \
      inductor+step,erase+step,reduce-overhead,erase+graphs --sweep-configs '' --trials 3 \
      2>&1 | grep -v '^erase_fx: graph' || true ;;
  dropin-c)
    for config in tv-resnet18-dgl:256:32 mlp:128:2000:2000:4; do
      timeout 150 python3 -m bench.overhead --config "$config" --top 40 --steps 50 --shapes \
        --variants reduce-overhead,erase+graphs 2>&1 | grep -v '^erase_fx: graph' || true
    done ;;
  launch-a)
    timeout 120 python3 -m bench.graph_launch --replays 200 || true
    bash "$0" patterns-prof ;;
  patterns-prof)
    for config in pattern-vgg_local_loss:256:64:4 pattern-data_dependent_between:1024:2048:4; do
      timeout 170 python3 -m bench.overhead --config "$config" --top 25 --steps 50 \
        --variants inductor+step,erase+step --trace-dir /tmp 2>&1 \
        | grep -v '^erase_fx: graph' || true
    done ;;
  dropin-a)
    for config in mlp:128:2000:2000:4 gpt:16:384:256:8 tv-resnet18-dgl:256:32; do
      timeout 165 python3 -m bench.overhead --config "$config" --top 25 --steps 100 \
        --variants reduce-overhead,erase+graphs --trace-dir /tmp 2>&1 \
        | grep -v '^erase_fx: graph' || true
    done ;;
  patterns-a)
    # the judged pair on every pattern first; then the drop-in pair in the time left (SECONDS:
    # since this script started), which patterns-b runs alone
    if [ -n "$SMOKE" ]; then patterns inductor+step,erase+step 0 0
    else patterns inductor+step,erase+step 520 430 || true; fi
    left=$((570 - SECONDS))
    if [ -n "$SMOKE" ]; then patterns reduce-overhead,erase+graphs 0 0
    elif [ "$left" -ge 100 ]; then patterns reduce-overhead,erase+graphs "$left" $((left - 90))
    else echo "patterns-a: ${left} s left, too little for erase+graphs against reduce-overhead:" \
      "bash bench/device_run.sh patterns-b runs them"; fi ;;
  patterns-b)
    if [ -n "$SMOKE" ]; then patterns reduce-overhead,erase+graphs 0 0
    else patterns reduce-overhead,erase+graphs 560 460; fi ;;
  plan-a)
    timeout 570 python3 -m bench.plan_peaks --device cuda --configs "$PLAN_CONFIGS" \
      --out bench/results/plan_peaks.md 2>&1 | grep -v '^erase_fx: graph' ;;
  plan-b)
    PYTORCH_ALLOC_CONF=$REUSE timeout 570 python3 -m bench.check_step --checks record-stream \
      --steps 400 2>&1 | grep -v '^erase_fx: graph' ;;
  plan-c)
    # NB: the setting for every row: it changes nothing where nothing is marked under capture
    PYTORCH_ALLOC_CONF=$REUSE run plan-c gpt:16:384:256:8,ctr:16384:1024:2048:6 \
      "$PLAN_VARIANTS" --sweep-configs '' --trials 3 2>&1 | grep -v '^erase_fx: graph' ;;
  plan-d)
    PYTORCH_ALLOC_CONF=$REUSE run plan-d mlp:128:2000:2000:4,tv-resnet18-dgl:256:32 \
      "$PLAN_VARIANTS" --sweep-configs '' --trials 3 2>&1 | grep -v '^erase_fx: graph' ;;
  paper)
    timeout 230 python3 -m bench.paper.digits || true
    timeout 340 python3 -m bench.paper.nanochat --quick --attention manual,sdpa || true
    python3 -m bench.paper.report ;;
esac
