#!/usr/bin/env bash
# The GPU runs, in parts that each fit one device call (10 minutes at most, compile included;
# each bench.run part stops starting rows at its --budget-s and keeps what it measured).
#   bash bench/device_run.sh bench-a   bench.run on the three small configs, with one-stream rows
#   bash bench/device_run.sh bench-b   bench.run on ctr:4096 (with one-stream rows) and ctr:16384
#   bash bench/device_run.sh step      the whole step: compile_step against the hand capture, with
#                                      and without Adam inside, and one-stream controls, on the
#                                      three small configs (~8 min)
#   bash bench/device_run.sh memory-a  step memory and time on the gpt configs (bf16 autocast):
#                                      inductor, erase, the hand captures, the step API,
#                                      reduce-overhead, erase+graphs (~7 min)
#   bash bench/device_run.sh memory-b  the same on ctr:16384 (~3 min)
#   bash bench/device_run.sh memory-c  step memory after the loss-tail fix: gpt:16:384:256:8 and
#                                      ctr:16384 with the step API, release_lag 2 and 4, one side
#                                      stream and one-stream controls,
#                                      and bench.held_to_join on CUDA (~8 min)
#   bash bench/device_run.sh memory-d  stages on side streams (the default) against stages on the
#                                      main stream and inductor+step: step memory and time on
#                                      gpt:16:384:256:8, ctr:16384 and the three small chains,
#                                      bench.held_to_join on CUDA, after a 1,000-step race
#                                      stress, captured and not, on an 8-stage chain (7 blocks
#                                      over 4 side streams: memory reused on a stream) (~9 min)
#   bash bench/device_run.sh memory-e  after memory-d: check_models on the dropout GPT and CTR
#                                      models (random ops in stages on side streams), then
#                                      ResNet-18 DGL with stages on side vs on main, and two side
#                                      streams on gpt:16:384:256:8 and ctr:16384 (~9 min)
#   bash bench/device_run.sh memory-f  each block's own copy of the label mask (the default, since
#                                      copy_input_values_per_block) against one shared mask
#                                      (/shared-input-values) and inductor+step: step memory and
#                                      time on two gpt chains and mlp:512 (no mask: the same
#                                      program), after a 1,000-step race stress, then
#                                      bench.held_to_join on CUDA with the largest values held
#                                      (~9 min)
#   bash bench/device_run.sh streams-a two side streams against four (the default) in the step
#                                      API: time and step memory on the three small chains,
#                                      gpt:16:384:256:8 and ctr:16384, to decide whether the
#                                      default should be two (less memory on gpt/ctr:16384,
#                                      speed unknown on the small chains) (~8 min)
#   bash bench/device_run.sh gpt8-a    why gpt:8:768:1024:6 loses 5% (the first config where the
#                                      schedule is slower than stock): the one-stream control,
#                                      stages on main, 2 side streams, then torch.profiler traces
#                                      of inductor+step and erase+step, then the CPU time per step
#                                      of reduce-overhead and erase+graphs on mlp:128 (~9.5 min)
#   bash bench/device_run.sh segments-a  bench.segment_cost on gpt:8:768:1024:6 with --no-recompute
#                                      and profiler traces: stock, segments and the forward whole
#                                      on one stream, side streams, and the two segmented rows
#                                      without recompute_boundary_values (~6 min; 6 traces + log)
#   bash bench/device_run.sh onegraph-a  the default against /no-recompute (recompute_boundary_values
#                                      off, the default before 2026-12-02) and /streams=0 (no side
#                                      stream: the forward compiled as one graph, the early
#                                      backward in order on the main stream) and stock on the gpt
#                                      chains: time and step memory (~7 min)
#   bash bench/device_run.sh onegraph-b  the same on ctr:16384 and the three small chains (~9 min)
#   bash bench/device_run.sh onegraph-c  the same on MobileNetV3 and DGL ResNet-18 (~9 min; at about
#                                      100 s of compile a MobileNetV3 variant, the budget may drop
#                                      ResNet-18's last rows)
#   bash bench/device_run.sh onegraph-d  the same on the last of issue 13's torchvision configs, the
#                                      ViT (DGL), and EfficientNet-B0 (DGL) (~9 min)
#   bash bench/device_run.sh overhead-a  the CPU time per step of reduce-overhead and erase+graphs
#                                      (erase's own graphs) on the three small chains, with
#                                      cProfile's top functions (issue 12, item 5) (~4 min)
#   bash bench/device_run.sh streams-c 4, 3 and 2 side streams with recompute on (gpt:16:384:256:8,
#                                      then ctr:16384 as the budget allows), erase's own graphs
#                                      against reduce-overhead on the three small chains, and the
#                                      DGL ViT with 2 side streams (~9 min)
#   bash bench/device_run.sh streams-d fewer side streams for few blocks, stages kept on the main
#                                      stream (with 2 streams the auto rule puts them on side, where
#                                      the ViT's third stage queued behind the first block's
#                                      backward: 1.01x of stock): the DGL ViT at 4 streams, at
#                                      2 with stages on main, at 1 (~7 min, not yet run)
#   bash bench/device_run.sh streams-e the same on DGL ResNet-18, then MobileNetV3 DGL as the
#                                      budget allows (~9 min, not yet run)
#   bash bench/device_run.sh memprof-a where each stream's CUDA graph pool goes (bench.memory_profile):
#                                      gpt:16:384:256:8 at 4, 2 and 0 side streams and stock,
#                                      ctr:16384 at 4 and 0 and stock; whether Inductor has user
#                                      streams; then the early optimizer's conv check (~9 min)
#   bash bench/device_run.sh memprof-b gpt:16 with streams=0 profiled, its generated code kept; the
#                                      early optimizer's conv check with its diagnosis (~5 min)
#   bash bench/device_run.sh determinism-a  stock, erase one-stream, erase and erase with early updates,
#                                      each trained twice on DGL ResNet-18 (deterministic mode:
#                                      equal bits expected), then gpt:16 streams=0 against
#                                      segments on one stream (~9 min)
#   bash bench/device_run.sh onestream-a  the early optimizer's conv check (a throwaway compile first),
#                                      then segments on the main stream against streams=0 and
#                                      stock on gpt:8, ctr:16384, mlp:512, ctr:1024 (~9 min)
#   bash bench/device_run.sh inplace-a side segments compiled with and without keep_inplace_writes:
#                                      the torch's extension points, one CUDA kernel pair
#                                      (bench.check_inplace_fusion), gpt:16's side-stream pools,
#                                      then its time and step memory against stock (~8 min)
#   bash bench/device_run.sh inplace-b the same A/B on gpt:8 and ctr:16384 (~9 min)
#   bash bench/device_run.sh inplace-c the same A/B on DGL ResNet-18 and the DGL ViT, with the fusions
#                                      refused listed (~8 min)
#   bash bench/device_run.sh inplace-d bench.check_step's determinism-gpt: 2,000 steps of gpt:16 with
#                                      its side streams writing in place, trained twice and on one
#                                      stream, bitwise equal (~5 min, estimated)
#   bash bench/device_run.sh cse-a     merge_common_subexpressions against the order before it
#                                      (/late-cse) on gpt:16 and gpt:8 (time, step memory), then
#                                      gpt:16's side 1 profiled with its code kept (~5 min, ran
#                                      2026-12-03)
#   bash bench/device_run.sh cse-b     the same A/B on ctr:16384, mlp:512, DGL ResNet-18, DGL ViT
#                                      (~8 min, ran 2026-12-03)
#   bash bench/device_run.sh cse-c     compile_step exactness and the gpt race stress on the new
#                                      pipeline (~3 min, ran 2026-12-03)
#   bash bench/device_run.sh sched-c   gpt:16's side 1: its code and Inductor's scheduler IR (before
#                                      and after fusion), default and /forward-first (the bench
#                                      row that preceded split_segments.forward_first; ~2 min,
#                                      ran 2026-12-03)
#   bash bench/device_run.sh lag-a     release_lag 2 and 4 against the default on ctr:16384, the DGL
#                                      ViT, DGL ResNet-18 and gpt:16 (~9 min, ran 2026-12-03)
#   bash bench/device_run.sh order-a   split_segments.forward_first against the partitioner's order
#                                      (/partitioner-order) on gpt:16 and gpt:8 (time, step
#                                      memory), then gpt:16's streams profiled (~8 min)
#   bash bench/device_run.sh soft-a    gpt-soft:16 (label-smoothed targets made in the forward) against
#                                      gpt:16: time and step memory of erase+step and
#                                      inductor+step, then gpt-soft's streams profiled (~6 min,
#                                      not yet run)
#   bash bench/device_run.sh order-b   after order-a: compile_step exact against eager, and the gpt
#                                      race stress (2,000 steps, bitwise) on the new order (~4 min,
#                                      ran 2026-12-03)
#   bash bench/device_run.sh pool-a    where the side streams' pools outgrow their high-water marks
#                                      (each growth made while the request's size was free: which
#                                      allocation) on gpt:16 and the DGL ViT (~2 min; ran 2026-12-03,
#                                      twice: the first run's pool_growths lists were wrong)
#   bash bench/device_run.sh auto-a    release_lag="auto": bitwise against the default on a small
#                                      DGL ViT, then time and step memory on the DGL ViT and
#                                      ResNet-18 against the default and stock (~9 min, ran
#                                      2026-12-03: ResNet-18's row ran apart, as auto-b)
#   bash bench/device_run.sh auto-c    after the fix of the tuning's leftover pool: the check (one
#                                      graph pool left, folding bitwise), then release_lag and
#                                      side_cuda_streams "auto" against the default on ctr:16384,
#                                      ResNet-18 and mlp:512 (~10 min, ran
#                                      2026-12-03: mlp:512 and ResNet's last row left out)
#   bash bench/device_run.sh auto-d    after auto-c (ctr:16384 folded to 2 CUDA streams: 0.97x of stock's
#                                      step memory at 0.99x time): both options "auto" against the
#                                      default on ResNet-18, gpt:8, mlp:512 and gpt:16 (~9 min)
#   bash bench/device_run.sh soft-b    with both tuning options "auto" by default: gpt-soft:16 against
#                                      gpt:16 (soft-a's rows, without its profile), and the two
#                                      small chains the defaults were not measured on (~6 min,
#                                      not yet run)
#   bash bench/device_run.sh fold-a    the gpt race stress (2,000 steps, bitwise) on the new defaults,
#                                      with a run folded onto 2 CUDA streams added, then
#                                      gpt-soft:16 against gpt:16 (~8 min, ran 2026-12-03)
#   bash bench/device_run.sh soft-c    after the gpt-soft fix (each block's loss reads its own copy of
#                                      the soft targets; CPU only so far): gpt-soft:16 against
#                                      gpt:16, then gpt-soft:16's streams profiled (~7 min)
#   bash bench/device_run.sh soft-d    after soft-c (gpt-soft:16 1.24x of stock's step memory: each side
#                                      stream holds a block's logits and their gradient) and the
#                                      in-place rule fixed (a soft-target loss value fused with the
#                                      gradient blocks its write): check_inplace_fusion with both
#                                      heads, then gpt-soft:16 and gpt:16 (~5 min)
#   bash bench/device_run.sh soft-e    after soft-d (gpt-soft:16 1.00x of stock's memory, but 0.97x of its
#                                      time against 0.87x): gpt-soft:16 with stock fusion beside,
#                                      the refused fusions logged (FX graph cache off; ~3 min)
#   bash bench/device_run.sh redo-a    the rows not measured on the "auto" defaults: MobileNetV3 and
#                                      EfficientNet-B0 (DGL), ctr:1024 and mlp:128, against
#                                      inductor+step (~9 min)
#   bash bench/device_run.sh memprof-d gpt:16's side 1 with keep_inplace_writes, its generated code kept
#                                      (why it still holds the logits and their gradient; ~2 min,
#                                      ran 2026-12-03 inside mem-b)
#   bash bench/device_run.sh mem-a     the memory-first setting (overlap=False) and two side streams on
#                                      DGL ResNet-18 and the DGL ViT, against the default and
#                                      inductor+step: time and step memory (~8 min)
#   bash bench/device_run.sh mem-b     after mem-a: stages on side streams forced (their activations
#                                      freed on the side stream under capture) on DGL ResNet-18 and
#                                      the DGL ViT (3 blocks on 4 streams: stages on main by
#                                      default), then memprof-d (~9.5 min)
#   bash bench/device_run.sh memprof-c gpt:16's default profiled with its generated code kept (why a
#                                      side stream holds a block's logits and their gradient at
#                                      once), then the layout pin's A/B on MobileNetV3 (~9 min,
#                                      not yet run)
#   bash bench/device_run.sh async-a   the cudaMallocAsync allocator backend (captured allocations are
#                                      graph memory nodes: memory a side stream frees is reused by
#                                      whatever the graph orders after it, on any stream) against
#                                      the native one: a short race stress of erase's own graphs,
#                                      then the step API's time and step memory (inductor+step,
#                                      erase+step, streams=2) on gpt:16, ctr:16384 and mlp:512,
#                                      under each allocator in its own process (~9 min)
#   bash bench/device_run.sh async-b   after async-a (where torch's CUDA graphs aborted the process
#                                      under cudaMallocAsync, stock included): erase_fx captures
#                                      nothing there; the step API, erase's own graphs and stock
#                                      run as written, with the reason (~1.5 min)
#   bash bench/device_run.sh step-b    issue 12's rows in one run on the current code: the step API
#                                      against the hand capture, with and without Adam in the
#                                      step, stock and erase, on the three small chains (~7 min)
#   bash bench/device_run.sh early-a   compile_step(early_optimizer=True): bench.check_step's exactness
#                                      and race check of the early updates, then Adam in the step
#                                      with and without them against stock, on the three small
#                                      chains and DGL ResNet-18 (~7 min)
#   bash bench/device_run.sh early-b   after early-a passes: Adam in the step with and without early
#                                      updates against stock where activations dominate (gpt:16,
#                                      ctr:16384: never slower) (~6 min)
#   bash bench/device_run.sh early-c   early-a again with the updates on one update stream per side
#                                      stream (one shared stream was slower on the H200), and a
#                                      log line for each gradient autograd copied (~9 min)
#   bash bench/device_run.sh early-d   after early-c: DGL ResNet-18 with its conv weights' early
#                                      gradients made in the parameters' layout (one more copy of
#                                      AccumulateGrad's gone; their early updates possible), then
#                                      gpt:16 and ctr:16384 (never slower), Adam in the step (~9 min)
#   bash bench/device_run.sh vision-i  MobileNetV3-small (DGL): stock against erase, after early gradients
#                                      were pinned to eager's memory format (~5 min)
#   bash bench/device_run.sh early-e   bench.check_step's early optimizer on DGL ResNet-18 (Inductor's
#                                      channels-last inside; deterministic cuDNN): bitwise equal to
#                                      the step without early updates, every planned weight early
#                                      (~3 min, estimated)
#   bash bench/device_run.sh layout-a  early gradients in eager's memory format or not (/layouts-unpinned),
#                                      one run: MobileNetV3-small (DGL) and DGL ResNet-18 (~9 min)
#   bash bench/device_run.sh vision-g  GoogLeNet with its aux heads alone (~220 s of compile per
#                                      variant on a cold cache): stock against erase, and erase
#                                      with its small aux parts forced early (/all-parts)
#                                      (~9 min)
#   bash bench/device_run.sh vision-h  MobileNetV3-small (DGL) alone: stock, erase, one stream
#                                      (~6 min)
#   bash bench/device_run.sh kernels-a the kernels Inductor writes for a step, stock against erase
#                                      (bench.kernel_counts): modules, fused Triton kernels and
#                                      extern calls on DGL ResNet-18, MobileNetV3 DGL and
#                                      GoogLeNet with aux heads (issue 13's cause, as code) (~8 min)
#   bash bench/device_run.sh vision-f  stages forced on side streams against the default (auto:
#                                      on main there) on DGL ResNet-18 and MobileNetV3, after
#                                      BatchNorm's updates stopped cutting stages (~8 min)
#   bash bench/device_run.sh vision-a  torchvision ResNet-18, DGL (detached stages) and as shipped:
#                                      the step API and the hand capture of inductor and erase,
#                                      reduce-overhead and erase's own graphs, inductor and erase
#                                      without graphs, a one-stream control (~9 min, grown from ~8:
#                                      9 rows a config where 7 took ~8 min; each model compiles for
#                                      tens of seconds per variant, so the 450 s budget may drop
#                                      the second config's last rows)
#   bash bench/device_run.sh vision-b  the same on MobileNetV3-small (DGL) and a ViT (DGL: detached
#                                      pairs of blocks with token heads) (~9 min, grown from ~8, the
#                                      budget as in vision-a)
#                                      NB: since the cost check (min_part_share), erase compiles
#                                      GoogLeNet on the stock path: kernels-a, vision-c and
#                                      vision-e measure that path there; vision-g adds /all-parts
#   bash bench/device_run.sh vision-c  the same on GoogLeNet with its aux heads (~6-7 min, was ~5)
#   bash bench/device_run.sh vision-d  the same on EfficientNet-B0 (DGL, stochastic depth) (~6-7 min,
#                                      was ~5)
#   bash bench/device_run.sh vision-e  issue 13's quick before/after in one call: GoogLeNet with its
#                                      aux heads and MobileNetV3-small (DGL), the step API and
#                                      reduce-overhead against erase, a one-stream control, 5 trials
#                                      (~7 min, estimated, not yet timed; keep it out of the merge
#                                      below: vision-b and vision-c measure the same rows)
#   bash bench/device_run.sh models-a  check_models: the dropout GPT and CTR models, DGL ResNet-18
#                                      and MobileNetV3 (~8 min)
#   bash bench/device_run.sh models-b  check_models: GoogLeNet with its aux heads, forced early
#                                      (check_models.ERASE_OPTIONS) (~6 min)
#   bash bench/device_run.sh models-c  check_models: EfficientNet-B0, DGL and as shipped (~9 min)
#   bash bench/device_run.sh models-d  check_models: the ViTs, MobileNetV3 and ResNet-18 as shipped
#                                      (~9 min)
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
#   bash bench/device_run.sh frameworks-a  bench.frameworks: a Lightning Trainer step on
#                                      tv-resnet18-dgl:256:32, compiled each way (eager, inductor,
#                                      reduce-overhead, erase+graphs, inductor+step, erase+step;
#                                      needs lightning and torchvision on the image) (~8 min)
#   bash bench/device_run.sh frameworks-b  the same on ctr:1024:512:1024:6 (~6 min)
#   bash bench/device_run.sh dropin-a  where the drop-in's time goes (issue 37, item 1): bench.overhead
#                                      (cProfile by function, torch.profiler's tables, the GPU's
#                                      busy share of a step) of reduce-overhead and erase+graphs
#                                      on mlp:128:2000:2000:4, gpt:16:384:256:8 and
#                                      tv-resnet18-dgl:256:32 (~8 min)
#   bash bench/device_run.sh dropin-b  a single graph's last block at its forward's end
#                                      (erase+graphs/graph-end: Tuning.graph_end_at_return) against
#                                      the default and reduce-overhead, then erase+step/graph-end
#                                      against erase+step and inductor+step, on mlp:128, gpt:16 and
#                                      DGL ResNet-18 (~9 min, not yet run)
#   bash bench/device_run.sh patterns-prof  why erase+step is slower than inductor+step on two user
#                                      patterns (patterns-a, 2026-12-05: vgg_local_loss 1.35x,
#                                      data_dependent_between 2.16x, uncaptured): bench.overhead's
#                                      CPU profile and torch.profiler tables of both variants
#                                      (~6 min, not yet run)
#   bash bench/device_run.sh dropin-c  the CPU ops each drop-in step calls outside its graphs, by input
#                                      shapes (bench.overhead --shapes: which tensors are
#                                      detached, copied, allocated), reduce-overhead against
#                                      erase+graphs on DGL ResNet-18 and mlp:128 (~5 min, not yet
#                                      run)
#   bash bench/device_run.sh stock-a   compile_step's stock candidate (erase+step/stock-candidate:
#                                      Tuning.stock_candidate) against erase+step and
#                                      inductor+step on the local-loss VGG (erase 1.35x slower
#                                      on 2026-12-05), mlp:128 and DGL ResNet-18 (erase faster:
#                                      stock must not be chosen) (~9 min, not yet run)
#   bash bench/device_run.sh launch-a  the host time of one CUDA graph replay by the graph's shape
#                                      (bench.graph_launch: one chain, one chain over two streams,
#                                      2 and 4 parallel branches; why erase's replays cost 85-265
#                                      µs against reduce-overhead's 20), then patterns-prof
#                                      (~7 min, not yet run)
#   bash bench/device_run.sh patterns-a  issue 36's user patterns (bench.user_patterns: Forward-
#                                      Forward nets, a local-loss VGG, forward hooks, a tensor
#                                      kept on the module, a data-dependent op between blocks, a
#                                      transformers GPT-2 with probes) as bench.run configs at
#                                      GPU sizes: erase+step against inductor+step on each, then
#                                      erase+graphs against reduce-overhead as the time left
#                                      allows (~9.5 min, not yet run; the GPT-2 is skipped, with a
#                                      line, where the image has no transformers)
#   bash bench/device_run.sh patterns-b  the drop-in pair alone (erase+graphs, reduce-overhead) on
#                                      the same configs, for those patterns-a's time left out
#                                      (~8 min, estimated)
#   bash bench/device_run.sh plan-a    issue 39's memory plan on the GPU's dtypes: bench.plan_peaks
#                                      (the predicted peak of each forward's values under today's
#                                      release plan, with release_lag="record_stream" and with one
#                                      pool for every stream, segment temporaries with and without,
#                                      and the race check) on gpt:16:384:256:8,
#                                      ctr:16384:1024:2048:6, mlp:128:2000:2000:4 and
#                                      tv-resnet18-dgl:256:32, into plan_peaks.md: the figures the
#                                      step memory of plan-c and plan-d is compared with (~6 min,
#                                      estimated; not yet run)
#   bash bench/device_run.sh plan-b    release_lag="record_stream" under
#                                      PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True:
#                                      bench.check_step's record-stream race stress (gpt:16, 2,000
#                                      steps, stages on the main stream and side streams folded
#                                      onto 2, each bitwise against release_lag None) (~8 min,
#                                      estimated; not yet run)
#   bash bench/device_run.sh plan-c    after plan-b passes: erase+step/release-lag=record-stream
#                                      against erase+step (the default) and inductor+step, step
#                                      memory and time in one run, on gpt:16:384:256:8 and
#                                      ctr:16384:1024:2048:6, with the allocator setting on for
#                                      every row (~8 min, estimated; not yet run)
#   bash bench/device_run.sh plan-d    the same on mlp:128:2000:2000:4 and tv-resnet18-dgl:256:32
#                                      (~8 min, estimated; not yet run)
#     patterns-a and patterns-b take --smoke: the same part on the CPU at tiny sizes, aot_eager
#     inside, its table in /tmp/erase_fx_device_run/smoke (never bench/results); exits non-zero
#     if a row failed (~4 min on 2 cores): run it before a GPU call
# Each part updates the current tables in bench/results/ (bench/results/README.md: step.json
# and step.md for bench.run's rows, check_*.md, memory.md, ...; paper/). Where $OUT is set (the
# device machine: what is written under it comes back) the tables a part changed are copied to
# $OUT/results/ at its end: copy them over bench/results/ and commit. Traces and generated code
# go to $OUT (else /tmp/erase_fx_device_run), never into the tables. Join the CTR parts into
# ctr.json beside the other paper files, and rebuild the report, with
#   python -m bench.paper.ctr --merge bench/results/paper/parts/ctr-seeds-0-2.json \
#     bench/results/paper/parts/ctr-seeds-3-4.json bench/results/paper/parts/ctr-seed-5.json
#   python -m bench.paper.report
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  bench-a|bench-b|step|memory-a|memory-b|memory-c|memory-d|memory-e|memory-f|streams-a) ;;
  kernels-a) ;;
  vision-a|vision-b|vision-c|vision-d|vision-e|vision-f|vision-g|vision-h|vision-i|layout-a|gpt8-a) ;;
  segments-a|onegraph-a|onegraph-b|onegraph-c|onegraph-d|overhead-a|streams-c) ;;
  memprof-a|memprof-b|memprof-c|determinism-a|onestream-a|inplace-a|inplace-b|inplace-c|inplace-d|memprof-d|mem-a|mem-b|cse-a|cse-b|cse-c|sched-c|lag-a|order-a|order-b|pool-a|soft-a|auto-a|auto-c|auto-d|soft-b|fold-a|soft-c|redo-a|soft-d|soft-e) ;;
  streams-d|streams-e|async-a|async-b|step-b|early-a|early-b|early-c|early-d|early-e) ;;
  models-a|models-b|models-c|models-d) ;;
  checks|towers|paper-ctr-a|paper-ctr-b|paper-ctr-c|paper-ctr-speed|paper) ;;
  frameworks-a|frameworks-b) ;;
  patterns-a|patterns-b|dropin-a|dropin-b|patterns-prof|launch-a|dropin-c|stock-a) ;;
  plan-a|plan-b|plan-c|plan-d) ;;
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
# NB: the judged pairs first (erase+step/inductor+step, erase+step-graph/inductor+graph,
# erase+graphs/reduce-overhead, erase/inductor): a budget that runs out drops the last variants
VISION=inductor+step,erase+step,inductor+graph,erase+step-graph,reduce-overhead,erase+graphs
VISION+=,inductor,erase,erase+step-graph/one-stream
# NB: issue 13's quick before/after (vision-e): the step API and erase's own graphs against stock
ISSUE13=inductor+step,erase+step,reduce-overhead,erase+graphs,erase+step/one-stream
# NB: the default against the default before (no recompute) and the one-graph mode (streams=0)
ONEGRAPH=inductor+step,erase+step,erase+step/no-recompute,erase+step/streams=0
# NB: 2 side streams with the stages on the main stream, against the default and one side stream
FEWER=inductor+step,erase+step,erase+step/streams=2/stages-on-main,erase+step/streams=1
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
  memory-d)
    # NB: the stress first: a race found matters more than a figure
    timeout 130 python3 -m bench.check_cuda --parts stress --stress-steps 1000 \
      --parity-config mlp:256:512:1024:8 --release-lags uncaptured,none \
      2>&1 || true
    timeout 360 python3 -m bench.run --budget-s 300 --streams '' \
      --configs "mlp:512:1024:2048:6,gpt:16:384:256:8,ctr:16384:1024:2048:6,ctr:1024:512:1024:6,mlp:128:2000:2000:4" \
      --variants inductor+step,erase+step,erase+step/stages-on-main --sweep-configs '' \
      --trials 5 || true
    timeout 60 python3 -m bench.held_to_join --device cuda --out bench/results/held_to_join.md \
      --configs gpt:16:384:256:8 ;;
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
  streams-c)
    run streams-c gpt:16:384:256:8,ctr:16384:1024:2048:6 \
      inductor+step,erase+step,erase+step/streams=2,erase+step/streams=3 \
      --sweep-configs '' --trials 5 --budget-s 220 || true
    timeout 150 python3 -m bench.run --budget-s 110 --streams '' \
      --configs "$SMALL" --variants reduce-overhead,erase+graphs --sweep-configs '' --trials 5 || true
    timeout 160 python3 -m bench.run --budget-s 100 --streams '' \
      --configs tv-vit-dgl:256:32 --variants inductor+step,erase+step/streams=2 --sweep-configs '' \
      --trials 5 ;;
  streams-d)
    run streams-d tv-vit-dgl:256:32 "$FEWER" --sweep-configs '' --trials 5 --budget-s 420 ;;
  streams-e)
    run streams-e tv-resnet18-dgl:256:32,tv-mobilenet-dgl:256:64 "$FEWER" --sweep-configs '' \
      --trials 5 --budget-s 450 ;;
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
  async-b)
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync timeout 150 python3 -m bench.run \
      --streams '' --sweep-configs '' --trials 2 --steps-per-trial 5 \
      --configs mlp:512:1024:2048:6 --variants inductor+step,erase+step,erase+graphs ;;
  early-a)
    timeout 120 python3 -m bench.check_step --checks early-optimizer --steps 6 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 290 python3 -m bench.run --budget-s 230 --streams '' \
      --sweep-configs '' --trials 5 --configs "$SMALL,tv-resnet18-dgl:256:32" \
      --variants inductor+step+adam,erase+step+adam,erase+step+adam/early-optimizer ;;
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
  inplace-b)
    # after inplace-a: the same A/B where activations dominate (gpt:8, ctr:16384)
    run inplace-b gpt:8:768:1024:6,ctr:16384:1024:2048:6 \
      inductor+step,erase+step,erase+step/stock-fusion --sweep-configs '' --trials 5 --budget-s 480 ;;
  inplace-c)
    # after inplace-b: keep_inplace_writes on the DGL conv net and ViT (which fusions it refuses
    # there, from erase_fx's debug log; then time and step memory against /stock-fusion)
    timeout 570 python3 -c "import logging, runpy, sys
log = logging.getLogger('erase_fx'); log.setLevel(logging.DEBUG)
handler = logging.StreamHandler(); handler.setLevel(logging.DEBUG)
handler.addFilter(lambda record: 'fusion refused' in record.getMessage()); log.addHandler(handler)
sys.argv = ['bench.run', '--budget-s', '450', '--streams', '',
            '--configs', 'tv-resnet18-dgl:256:32,tv-vit-dgl:256:32', '--sweep-configs', '',
            '--trials', '5', '--variants', 'inductor+step,erase+step,erase+step/stock-fusion']
runpy.run_module('bench.run', run_name='__main__')" 2>&1 | grep -v '^erase_fx: graph' ;;
  inplace-d)
    # the race stress with in-place writes on the side streams: gpt:16, 2,000 steps, trained
    # twice and on one stream, bitwise equal
    timeout 560 python3 -m bench.check_step --checks determinism-gpt --steps 400 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  cse-a)
    # merge_common_subexpressions (each block's label mask its own, none saved for the
    # backward) against the order before it (/late-cse), on the LM-head chains; then
    # gpt:16's side 1 profiled, its code kept (does the loss value still come last?)
    timeout 400 python3 -m bench.run --budget-s 330 --streams '' \
      --configs gpt:16:384:256:8,gpt:8:768:1024:6 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step,erase+step/late-cse 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 150 python3 -m bench.memory_profile --top 3 \
      --keep-code /tmp/cse-a-code --keep-code-of "side 1" --configs gpt:16:384:256:8 \
      --variants erase+step 2>&1 | grep -v '^erase_fx: graph'
    tar czf "$ART/cse-a-code.tgz" -C /tmp cse-a-code ;;
  cse-b)
    # after cse-a: the same A/B where the label masks are small (never slower, never more
    # memory): ctr:16384, mlp:512, DGL ResNet-18, DGL ViT
    timeout 560 python3 -m bench.run --budget-s 480 --streams '' \
      --configs ctr:16384:1024:2048:6,mlp:512:1024:2048:6,tv-resnet18-dgl:256:32,tv-vit-dgl:256:32 \
      --sweep-configs '' --trials 3 --variants inductor+step,erase+step,erase+step/late-cse 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  cse-c)
    # after cse-a: compile_step's exactness against eager, and the race stress with memory
    # reuse on gpt (multi-stream bit-identical to one stream, deterministic mode)
    timeout 560 python3 -m bench.check_step --checks exactness,determinism-gpt --steps 400 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  lag-a)
    # release_lag on the current pipeline, where it has not been measured since 2026-12-01
    # (ctr:16384 then: 1.30x of stock's step memory with release_lag=2 against 1.64x, at the
    # same time): the models whose main-stream activations side streams read
    timeout 570 python3 -m bench.run --budget-s 500 --streams '' \
      --configs ctr:16384:1024:2048:6,tv-vit-dgl:256:32,tv-resnet18-dgl:256:32,gpt:16:384:256:8 \
      --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step,erase+step/release-lag=2,erase+step/release-lag=4 2>&1 \
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
    # bitwise against the default first, then time and step memory where lag-a found the lag
    # worth 0.88x of stock's memory (the ViT) and where it cost 12% of time (ResNet-18)
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
  auto-d)
    # where auto-c's budget ran out: "auto" for both options against the default, on the
    # configs whose default still uses more memory than stock, and on gpt:16 (met: 1.00x)
    timeout 560 python3 -m bench.run --budget-s 500 --streams '' \
      --configs tv-resnet18-dgl:256:32,gpt:8:768:1024:6,mlp:512:1024:2048:6,gpt:16:384:256:8 \
      --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step,erase+step/release-lag=auto/side-cuda-streams=auto 2>&1 \
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
  redo-a)
    # docs/performance.md's rows still "measured with None", on the defaults (both "auto")
    timeout 560 python3 -m bench.run --budget-s 500 --streams '' \
      --configs tv-mobilenet-dgl:256:64,tv-efficientnet-dgl:128:64,ctr:1024:512:1024:6,mlp:128:2000:2000:4 \
      --sweep-configs '' --trials 3 --variants inductor+step,erase+step 2>&1 \
      | grep -v '^erase_fx: graph' || true ;;
  soft-c)
    # fold-a measured gpt-soft:16 at 1.37x of stock's step memory (gpt:16 1.00x) before the fix
    timeout 300 python3 -m bench.run --budget-s 240 --streams '' \
      --configs gpt-soft:16:384:256:8,gpt:16:384:256:8 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step 2>&1 | grep -v '^erase_fx: graph' || true
    timeout 150 python3 -m bench.memory_profile --top 3 --configs gpt-soft:16:384:256:8 \
      --variants erase+step 2>&1 | grep -v '^erase_fx: graph' || true ;;
  fold-a)
    # the race stress where memory is reused across blocks (folded streams), then soft-a's rows
    timeout 270 python3 -m bench.check_step --checks determinism-gpt --steps 400 2>&1 \
      | grep -v '^erase_fx: graph' || true
    timeout 250 python3 -m bench.run --budget-s 200 --streams '' \
      --configs gpt-soft:16:384:256:8,gpt:16:384:256:8 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step 2>&1 | grep -v '^erase_fx: graph' || true ;;
  soft-b)
    # soft-a's rows on the new defaults (they tune), then the small chains not measured yet
    timeout 380 python3 -m bench.run --budget-s 330 --streams '' \
      --configs gpt-soft:16:384:256:8,gpt:16:384:256:8,ctr:1024:512:1024:6,mlp:128:2000:2000:4 \
      --sweep-configs '' --trials 3 --variants inductor+step,erase+step 2>&1 \
      | grep -v '^erase_fx: graph' || true ;;
  soft-a)
    # soft targets made in the forward (copy_input_values_per_block, and assign_streams' rules
    # for a loss that reads them), measured on CPU only so far
    timeout 400 python3 -m bench.run --budget-s 330 --streams '' \
      --configs gpt-soft:16:384:256:8,gpt:16:384:256:8 --sweep-configs '' --trials 3 \
      --variants inductor+step,erase+step 2>&1 | grep -v '^erase_fx: graph' || true
    timeout 150 python3 -m bench.memory_profile --top 3 --configs gpt-soft:16:384:256:8 \
      --variants erase+step 2>&1 | grep -v '^erase_fx: graph' || true ;;
  order-b)
    timeout 560 python3 -m bench.check_step --checks exactness,determinism-gpt --steps 400 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  mem-a)
    # overlap=False (the memory-first setting) and streams=2 where neither was measured
    timeout 580 python3 -m bench.run --budget-s 500 --streams '' \
      --configs tv-resnet18-dgl:256:32,tv-vit-dgl:256:32 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/one-stream,erase+step/streams=2 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  mem-b)
    timeout 420 python3 -m bench.run --budget-s 340 --streams '' \
      --configs tv-vit-dgl:256:32,tv-resnet18-dgl:256:32 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/stages-on-side 2>&1 \
      | grep -v '^erase_fx: graph' || true
    bash "$0" memprof-d ;;
  memprof-d)
    # why gpt:16's side 1 still holds a block's logits and their gradient with
    # keep_inplace_writes (the other side streams hold one of the two): its code kept
    timeout 200 python3 -m bench.memory_profile --top 3 \
      --keep-code "$ART/code" --keep-code-of "side 1" --configs gpt:16:384:256:8 \
      --variants erase+step 2>&1 | grep -v '^erase_fx: graph' ;;
  memprof-c)
    # why each side stream holds a block's logits and their gradient at once (2 of 64 MiB on
    # gpt:16): the default's generated code kept; then the layout pin's A/B on MobileNetV3
    timeout 150 python3 -m bench.memory_profile --top 12 \
      --keep-code "$ART/code" --configs gpt:16:384:256:8 --variants erase+step 2>&1 \
      | grep -v '^erase_fx: graph' || true
    python3 -c "import torch, torch._inductor.config as c
print('torch', torch.__version__, {k: getattr(c.triton, k, 'absent')
      for k in ('mix_order_reduction', 'nested_reduction', 'multi_kernel')})"
    timeout 420 python3 -m bench.run --budget-s 380 --streams '' \
      --configs tv-mobilenet-dgl:256:64 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/layouts-unpinned 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  early-e)
    timeout 400 python3 -m bench.check_step --checks early-optimizer-conv --steps 6 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  early-d)
    timeout 560 python3 -m bench.run --budget-s 470 --streams '' \
      --sweep-configs '' --trials 5 \
      --configs tv-resnet18-dgl:256:32,gpt:16:384:256:8,ctr:16384:1024:2048:6 \
      --variants inductor+step+adam,erase+step+adam/early-optimizer,erase+step+adam 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  early-b)
    run early-b gpt:16:384:256:8,ctr:16384:1024:2048:6 \
      inductor+step+adam,erase+step+adam,erase+step+adam/early-optimizer \
      --sweep-configs '' --trials 5 --budget-s 300 ;;
  step-b)
    run step-b "$SMALL" "$STEP,$ADAM" --sweep-configs '' --trials 5 --budget-s 400 ;;
  onegraph-a)
    run onegraph-a gpt:8:768:1024:6,gpt:16:384:256:8 "$ONEGRAPH" --sweep-configs '' --trials 5 \
      --budget-s 480 ;;
  onegraph-b)
    run onegraph-b "ctr:16384:1024:2048:6,$SMALL" "$ONEGRAPH" --sweep-configs '' --trials 5 \
      --budget-s 480 ;;
  onegraph-c)
    run onegraph-c tv-mobilenet-dgl:256:64,tv-resnet18-dgl:256:32 "$ONEGRAPH" \
      --sweep-configs '' --trials 5 --budget-s 480 ;;
  onegraph-d)
    run onegraph-d tv-vit-dgl:256:32,tv-efficientnet-dgl:128:64 "$ONEGRAPH" \
      --sweep-configs '' --trials 5 --budget-s 480 ;;
  vision-g)
    timeout 570 python3 -m bench.run --budget-s 330 --streams '' \
      --configs tv-googlenet-aux:128:64 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/all-parts ;;
  layout-a)
    timeout 570 python3 -m bench.run --budget-s 500 --streams '' \
      --configs tv-mobilenet-dgl:256:64,tv-resnet18-dgl:256:32 --sweep-configs '' --trials 5 \
      --variants inductor+step,erase+step,erase+step/layouts-unpinned 2>&1 \
      | grep -v '^erase_fx: graph' ;;
  vision-i)
    timeout 340 python3 -m bench.run --budget-s 270 --streams '' \
      --configs tv-mobilenet-dgl:256:64 --variants inductor+step,erase+step --sweep-configs '' \
      --trials 5 2>&1 | grep -v '^erase_fx: graph' ;;
  vision-h)
    run vision-h tv-mobilenet-dgl:256:64 inductor+step,erase+step,erase+step/one-stream \
      --sweep-configs '' --trials 5 --budget-s 330 ;;
  kernels-a)
    timeout 540 python3 -m bench.kernel_counts --differences \
      --configs tv-resnet18-dgl:256:32,tv-mobilenet-dgl:256:64,tv-googlenet-aux:128:64 ;;
  streams-a)
    timeout 480 python3 -m bench.run --budget-s 430 --streams '' \
      --configs "$SMALL,gpt:16:384:256:8,ctr:16384:1024:2048:6" --sweep-configs '' \
      --variants inductor+step,erase+step,erase+step/streams=2 --trials 5 || true ;;
  vision-f)
    run vision-f tv-resnet18-dgl:256:32,tv-mobilenet-dgl:256:64 \
      inductor+step,erase+step,erase+step/stages-on-side --sweep-configs '' --trials 5 ;;
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
  vision-a)
    run vision-a tv-resnet18-dgl:256:32,tv-resnet18:256:32 "$VISION" --sweep-configs '' ;;
  vision-b)
    run vision-b tv-mobilenet-dgl:256:64,tv-vit-dgl:256:32 "$VISION" --sweep-configs '' ;;
  vision-c)
    run vision-c tv-googlenet-aux:128:64 "$VISION" --sweep-configs '' ;;
  vision-d)
    run vision-d tv-efficientnet-dgl:128:64 "$VISION" --sweep-configs '' ;;
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
