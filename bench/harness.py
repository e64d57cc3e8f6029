"""What the GPU benchmarks share: variant names, building a variant's step, timing, memory.

`bench.run` (the benchmark), `bench.check_cuda` (correctness on CUDA) and
`bench.overhead` (CPU profile of a step) import from here; nothing here
runs on import, and everything but the timing and the memory probe works
on CPU.

Variant names
-------------
One grammar for every benchmark in ``bench/`` (``bench/paper`` included)::

    <compiler>[+<capture>][+adam][/<control>]

- compiler: ``eager`` (the model as written), ``paper`` (the ERASE paper's
  eager scheme, `bench.models.PaperSchedule`), ``inductor``
  (``torch.compile(model)``), ``reduce-overhead``
  (``torch.compile(model, mode="reduce-overhead")``: cudagraph trees),
  ``erase`` (``backend="erase"``, Inductor inside);
- capture, how the step reaches the GPU:

  - none: every call launched from Python (``erase``: its CUDA graphs off);
  - ``+graphs`` (erase only): erase's own CUDA graphs, the backend's
    default on CUDA; no change to the training loop;
  - ``+graph`` (inductor only) and ``+step-graph`` (erase only, its own
    graphs off): the whole training step captured by hand in one
    ``torch.cuda.CUDAGraph`` (`whole_step_graph`): the controls;
  - ``+step`` (inductor and erase, erase's own graphs off): the whole step
    through ``erase_fx.compile_step`` (the product API for the same thing);

- ``+adam``: the optimizer update inside the step,
  ``torch.optim.Adam(foreach=True, capturable=True)``;
- control, the same program with one thing changed (erase only):
  ``/one-stream`` (``options={"overlap": False}``: every segment on the main
  stream, same segments and kernels: what the overlap alone is worth),
  ``/streams=N`` (N side streams; ``/streams=0``: no side stream, the
  forward compiled as one graph), ``/release-lag=N`` (``options=
  {"tuning": {"release_lag": N}}``, a tuning setting as the rest below:
  under capture, memory released N segments after its
  last reader instead of at the join; ``/release-lag=none``: at the join;
  ``=auto``, the default: ``compile_step`` times the candidates and keeps
  one, `erase_fx.capture_tuning`; ``=record-stream``: every value dropped
  after its last reader and marked with ``record_stream``, the allocator
  ordering the reuse, which needs
  ``PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True``),
  ``/side-cuda-streams=N``, ``=none`` and
  ``=auto`` (`Tuning.side_cuda_streams`),
  ``/stages-on-main`` and
  ``/stages-on-side`` (``stages_on_side=False`` or ``True``: each
  block's stage on the main stream, or on the block's side stream, whatever
  the default's rule decides), ``/shared-input-values``
  (``copy_input_values=False``: large values made from the
  inputs alone shared between blocks, as the partitioner left them),
  ``/no-recompute`` (``recompute_boundary_values=False``: each
  block's segment reads every value across its boundary instead of
  recomputing the cheap elementwise ones: what the recomputation saves or
  loses; ``/recompute``, ``True``, the default since 2026-12-02, names the
  rows measured before),
  ``/all-parts`` (``min_part_share=0.0``: every gradient part
  early, however small: what the cost check on parts saves or loses),
  ``/stock-fusion`` (``keep_inplace_writes=False``: side-stream
  segments fused as Inductor chooses: what keeping large in-place writes
  possible saves in memory or costs in time),
  ``/graph-end`` (``graph_end_at_return=True``: a single graph's last block
  at its forward's end too, the backward then only scaling where every
  block is early),
  ``/stock-candidate`` (``stock_candidate=True``: inside ``compile_step`` the
  stock compilation of each graph with early blocks is the tuning's last
  candidate, chosen by its rule, the least memory within 2% of the fastest:
  the row is no slower than stock's but for that tolerance; the choice is
  in the row's ``capture_chosen``; only ``+step`` variants time it),
  several of these one after another (``/streams=2/stages-on-main``: each
  sets its own options; two that set the same option are an error),
  ``/aot_eager``
  (inner compiler ``aot_eager``: eager's kernels, so it must train exactly as
  eager); for ``+step`` variants, ``/early-optimizer`` (``compile_step``'s
  ``early_optimizer=True``: the early blocks' parameters updated on update
  streams during the forward; with ``+adam``, what that is worth);
  ``/layouts-unpinned`` (no option: for the row, erase_fx's
  ``inductor_segments.pin_early_outputs_to_fx_layout`` does nothing, so early
  gradients leave their segments in whatever layout Inductor derives there, as
  before that function: what keeping eager's memory format costs or saves);
  ``/late-cse`` (no option: erase_fx's joint graph is not merged by
  ``merge_common_subexpressions`` before its blocks are cloned, and the stock
  partitioner merges it after, as before that pass: what merging first saves);
  ``/partitioner-order`` (no option: each block's side segment in the
  partitioner's order, its loss value after its early backward, as before
  ``split_segments.forward_first``: what computing the loss value first saves).

So ``erase+step+adam`` is erase inside ``compile_step`` with Adam in the step,
``erase+step/one-stream`` its no-overlap control. `Variant.parse` reads a name
and rejects what the grammar does not allow; `LEGACY_NAMES` maps the names
earlier results files used. ``bench.paper`` adds names of its own experiments
(``baseline``, ``compile``: stock ``torch.compile`` with the run's inner
backend) and the rounding control ``eager/1ulp``.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import re
import statistics
import unittest.mock
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from erase_fx.capture_tuning import in_graph_pool

COMPILERS = ("eager", "paper", "inductor", "reduce-overhead", "erase")
#: capture -> the compilers it applies to.
CAPTURES = {"graphs": ("erase",), "graph": ("inductor",), "step-graph": ("erase",),
            "step": ("inductor", "erase")}
#: The captures of a whole training step by hand (`whole_step_graph`).
HAND_CAPTURES = ("graph", "step-graph")
#: Each named control -> the backend options it sets (and streams=N, release-lag=N).
CONTROL_OPTIONS: dict[str, dict[str, Any]] = {
    "one-stream": {"overlap": False},
    "stages-on-main": {"tuning": {"stages_on_side": False}},
    "stages-on-side": {"tuning": {"stages_on_side": True}},
    "shared-input-values": {"tuning": {"copy_input_values": False}},
    "recompute": {"tuning": {"recompute_boundary_values": True}},
    "no-recompute": {"tuning": {"recompute_boundary_values": False}},
    "all-parts": {"tuning": {"min_part_share": 0.0}},
    "stock-fusion": {"tuning": {"keep_inplace_writes": False}},
    "graph-end": {"tuning": {"graph_end_at_return": True}},
    "stock-candidate": {"tuning": {"stock_candidate": True}},
    "aot_eager": {"inner": "aot_eager"},
}
#: The numbered controls that set a tuning setting (`erase_fx.config.Tuning`), not an option.
TUNING_CONTROLS = ("release-lag", "side-cuda-streams")
#: Each named control of ``+step`` variants -> the ``compile_step`` options it sets.
STEP_CONTROL_OPTIONS: dict[str, dict[str, Any]] = {
    "early-optimizer": {"early_optimizer": True},
}
#: Each control that patches erase_fx for its row (an A/B of an internal choice that has no
#: option): per patch, the module, the name, and what replaces it.
PATCH_CONTROLS: dict[str, tuple[tuple[str, str, Any], ...]] = {
    "layouts-unpinned": (("erase_fx.emit.inductor_segments", "pin_early_outputs_to_fx_layout",
                          lambda segment, indices: []),),
    "partitioner-order": (("erase_fx.passes.split_segments", "forward_first",
                           lambda nodes: nodes),),
    # NB: the order before merge_common_subexpressions: no merge before the blocks are
    # cloned (the pass finds no repeat), the stock partitioner's CSE after
    "late-cse": (("erase_fx.passes.merge_common_subexpressions", "_duplicates",
                  lambda graph: []),
                 ("erase_fx.passes.partition_joint_graph", "PARTITIONER_CSE", True)),
}
CONTROLS = (*CONTROL_OPTIONS, *STEP_CONTROL_OPTIONS, *PATCH_CONTROLS)

#: Names used by earlier results files and scripts, and the name each has now.
LEGACY_NAMES = {
    "erase-graphs": "erase+graphs",
    "erase-1stream": "erase/one-stream",
    "erase-aot_eager": "erase/aot_eager",
    "erase+graphs-1stream": "erase+graphs/one-stream",
    "erase+wholestep": "erase+step-graph",
    "erase+wholestep-1stream": "erase+step-graph/one-stream",
    "eager+1ulp": "eager/1ulp",
}

#: Names of ``bench.paper``'s own experiments, outside the grammar: the model
#: without detach trained end to end, stock ``torch.compile`` with the run's
#: inner backend, and eager started from weights one float step away.
EXPERIMENT_NAMES = ("baseline", "compile", "eager/1ulp")

#: ``compile_step`` settings of the ``+step`` variants.
STEP_WARMUP = 2
STEP_MAX_CAPTURES = 8
#: Calls after the first (compiling) one before timing: warm-up, then the
#: captures of every graph variant (reduce-overhead records on its second
#: run, ``compile_step`` captures after `STEP_WARMUP` calls).
WARMUP_STEPS = 5
ADAM_LR = 1e-4


def canonical(name: str) -> str:
    """``name`` in today's vocabulary (a legacy name mapped, any other unchanged)."""
    return LEGACY_NAMES.get(name, name)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A variant name, read: see the module docstring for the grammar."""

    compiler: str
    capture: str | None = None
    adam: bool = False
    control: str | None = None  # one or more of CONTROLS, streams=N, release-lag=N, '/'-joined

    @classmethod
    def parse(cls, name: str) -> Variant:
        text = canonical(name)
        match = re.fullmatch(r"([a-z-]+)((?:\+[a-z-]+)*)(?:/(.+))?", text)
        if match is None:
            raise ValueError(f"variant {name!r} is not compiler[+capture][+adam][/control]")
        compiler, plus, control = match.group(1), match.group(2), match.group(3)
        if compiler not in COMPILERS:
            raise ValueError(f"variant {name!r}: compiler {compiler!r} is not one of "
                             f"{', '.join(COMPILERS)}")
        parts = [p for p in plus.split("+") if p]
        adam = parts[-1:] == ["adam"]
        if adam:
            parts = parts[:-1]
        if len(parts) > 1:
            raise ValueError(f"variant {name!r}: one capture at most, then +adam")
        capture = parts[0] if parts else None
        if capture is not None and compiler not in CAPTURES.get(capture, ()):
            allowed = ", ".join(f"+{c} ({'/'.join(of)})" for c, of in CAPTURES.items())
            raise ValueError(f"variant {name!r}: capture +{capture} does not apply to "
                             f"{compiler}; captures: {allowed}")
        if adam and compiler == "paper":
            raise ValueError(f"variant {name!r}: the paper's scheme has no optimizer form")
        if control is not None:
            if compiler != "erase":
                raise ValueError(f"variant {name!r}: controls (/{'/'.join(CONTROLS)}, "
                                 f"/streams=N, /release-lag=N) apply to erase variants only")
            numbered = (r"streams=(0|[1-9]\d*)|release-lag=([1-9]\d*|auto|none|record-stream)"
                        r"|side-cuda-streams=([1-9]\d*|auto|none)")
            changed: dict[str, str] = {}
            for one in control.split("/"):
                if one not in CONTROLS and not re.fullmatch(numbered, one):
                    raise ValueError(f"variant {name!r}: control {one!r} is not one of "
                                     f"{', '.join(CONTROLS)}, streams=N, release-lag=N, "
                                     "side-cuda-streams=N")
                if one in STEP_CONTROL_OPTIONS and capture != "step":
                    raise ValueError(f"variant {name!r}: /{one} is an option of compile_step: "
                                     "it applies to +step variants only")
                for key in _option_names(_control_options(one)):
                    if key in changed:
                        raise ValueError(f"variant {name!r}: controls {changed[key]!r} and "
                                         f"{one!r} both set {key}")
                    changed[key] = one
        return cls(compiler, capture, adam, control)

    def __str__(self) -> str:
        text = self.compiler
        if self.capture:
            text += f"+{self.capture}"
        if self.adam:
            text += "+adam"
        if self.control:
            text += f"/{self.control}"
        return text

    @property
    def hand_capture(self) -> bool:
        """The whole step captured by hand in one CUDA graph (``+graph``, ``+step-graph``)."""
        return self.capture in HAND_CAPTURES

    @property
    def step_api(self) -> bool:
        """The whole step through ``erase_fx.compile_step`` (``+step``)."""
        return self.capture == "step"

    @property
    def controls(self) -> tuple[str, ...]:
        """The controls one by one (``/streams=2/stages-on-main``: two)."""
        return tuple(self.control.split("/")) if self.control else ()

    @property
    def erase_options(self) -> dict[str, Any]:
        """The backend options of an erase variant: the defaults, then each control's."""
        options: dict[str, Any] = {"inner": "inductor", "cudagraphs": self.capture == "graphs"}
        for one in self.controls:
            options = merge_options(options, _control_options(one))
        return options

    @property
    def step_options(self) -> dict[str, Any]:
        """The ``compile_step`` options of a ``+step`` variant's controls (``/early-optimizer``)."""
        options: dict[str, Any] = {}
        for one in self.controls:
            options.update(STEP_CONTROL_OPTIONS.get(one, {}))
        return options

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Inside: erase_fx with this variant's patch controls (``/layouts-unpinned``) applied."""
        with contextlib.ExitStack() as stack:
            for one in self.controls:
                for module, name, replacement in PATCH_CONTROLS.get(one, ()):
                    stack.enter_context(
                        unittest.mock.patch.object(importlib.import_module(module), name,
                                                   replacement))
            yield

    def stock(self) -> tuple[str, ...]:
        """The stock variants this erase variant is compared with (speed and memory).

        ``erase`` against ``inductor``; ``erase+graphs`` against both stock
        graph forms, ``reduce-overhead`` and ``inductor+graph``;
        ``erase+step-graph`` against ``inductor+graph``; ``erase+step``
        against ``inductor+step``; ``+adam`` forms against the ``+adam``
        form of each. A control compares like the variant it controls.
        Stock variants have none.
        """
        if self.compiler != "erase":
            return ()
        stock = {None: ("inductor",), "graphs": ("reduce-overhead", "inductor+graph"),
                 "step-graph": ("inductor+graph",), "step": ("inductor+step",)}[self.capture]
        return tuple(s + "+adam" if self.adam else s for s in stock)


def _control_options(control: str) -> dict[str, Any]:
    """The backend options one control sets (a valid control: `Variant.parse` checks)."""
    if control in CONTROL_OPTIONS:
        return CONTROL_OPTIONS[control]
    if control in STEP_CONTROL_OPTIONS or control in PATCH_CONTROLS:
        return {}
    key, value = control.split("=")
    named = {"auto": "auto", "none": None, "record-stream": "record_stream"}
    option = {key.replace("-", "_"): named[value] if value in named else int(value)}
    return {"tuning": option} if key in TUNING_CONTROLS else option


def merge_options(options: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``options`` updated with ``more``, their tuning settings (``"tuning"``) merged too."""
    merged = {**options, **more}
    if "tuning" in options and "tuning" in more:
        merged["tuning"] = {**options["tuning"], **more["tuning"]}
    return merged


def _option_names(options: dict[str, Any]) -> list[str]:
    """The options and the tuning settings ``options`` sets, each by its own name."""
    return [key for key in options if key != "tuning"] + list(options.get("tuning", {}))


def judged_erase(name: str) -> bool:
    """An erase variant whose targets are judged: every erase variant but the controls."""
    try:
        variant = Variant.parse(name)
    except ValueError:
        return False
    return variant.compiler == "erase" and variant.control is None


# -- building a variant's step ------------------------------------------------------


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]


def max_rel_err(reference, candidate) -> float:
    """The largest relative norm error of any tensor pair (inf when one side is missing)."""
    worst = 0.0
    for r, c in zip(reference, candidate):
        if r is None or c is None:
            if (r is None) != (c is None):
                return float("inf")
            continue
        worst = max(worst, ((c.float() - r.float()).norm()
                            / r.float().norm().clamp_min(1e-30)).item())
    return worst


def compile_erase(model: nn.Module, **options):
    """``torch.compile(model, backend="erase")``, raising instead of falling back."""
    return torch.compile(model, backend="erase", options={"on_error": "raise", **options})


def compile_forward(variant: Variant, model: nn.Module, inner: str | None = None):
    """The compiled (or eager) model a variant's training step calls.

    ``inner="aot_eager"`` (`bench.run`'s ``--smoke``): no code generation, so that every
    variant runs on a CPU in seconds: stock variants compile with ``backend="aot_eager"``
    (``reduce-overhead``'s mode dropped), erase variants with ``inner="aot_eager"``.
    """
    if variant.compiler == "eager":
        return model
    if variant.compiler == "paper":
        from bench.models import PaperSchedule

        return PaperSchedule(model)
    if inner is not None and variant.compiler != "erase":
        return torch.compile(model, backend=inner)
    if variant.compiler == "inductor":
        return torch.compile(model)
    if variant.compiler == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    options = variant.erase_options
    if inner is not None:
        options["inner"] = inner
    return compile_erase(model, **options)


def make_optimizer(variant: Variant, model: nn.Module) -> torch.optim.Optimizer | None:
    """Adam for ``+adam`` variants (capturable where the parameters are on CUDA), else None."""
    if not variant.adam:
        return None
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.Adam(model.parameters(), lr=ADAM_LR, foreach=True, capturable=on_cuda)


def train_step(model: nn.Module, fn, optimizer: torch.optim.Optimizer | None = None):
    """One training step as a function of the batch: zero the grads, forward, backward, update.

    NB: grads are set to None first, not zeroed: under a whole-step capture
    the backward then allocates them from the graph's pool once, and every
    replay writes the same memory (what ``.grad`` keeps pointing at).
    """

    def step(*inputs):
        model.zero_grad(set_to_none=True)
        loss = fn(*inputs)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss.detach()

    return step


def whole_step_graph(model: nn.Module, fn, inputs: Sequence[torch.Tensor],
                     optimizer: torch.optim.Optimizer | None = None) -> Callable[[], None]:
    """The whole training step (forward, backward, and the update if any) in one CUDA graph.

    Warms up three steps on a side stream (which also creates the
    optimizer's state), captures the fourth, and returns a step that copies
    ``inputs`` into the captured batch and replays.
    """
    static = [t.clone() for t in inputs]
    one_step = train_step(model, fn, optimizer)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            one_step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        one_step(*static)

    def step():
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()

    return step


@dataclasses.dataclass
class BuiltStep:
    """A variant's training step on a fixed batch, built and called once (compiled)."""

    step: Callable[[], Any]
    optimizer: torch.optim.Optimizer | None = None
    program: Any = None  # the compile_step object of a +step variant

    def capture_info(self) -> dict[str, Any]:
        """``compile_step``'s captures, replays and reason for not capturing, if +step."""
        if self.program is None:
            return {}
        info = {key: getattr(self.program, key, None)
                for key in ("captures", "replays", "uncaptured_reason")}
        if getattr(self.program, "early_optimizer", False):
            info["early_updated"] = self.program.early_updated
            info["early_refused"] = dict(self.program.early_refused)
        tunings = getattr(self.program, "capture_tunings", ())
        if tunings:
            info["capture_chosen"] = tunings[-1].chosen.describe()
            info["capture_trials"] = "; ".join(m.describe() for m in tunings[-1].measured)
            info["tuning_captures"] = self.program.tuning_captures
        return info

    def warm_up(self, steps: int) -> None:
        """``steps`` calls, then more while ``compile_step`` still times the candidates of
        its ``"auto"`` options (its calls then capture and time: not yet the steady state)."""
        for _ in range(steps):
            self.step()
        while getattr(self.program, "tuning", False):
            self.step()


def build_step(variant: Variant | str, model: nn.Module, inputs: Sequence[torch.Tensor], *,
               after_first: Callable[[], None] = lambda: None,
               loss_of: Callable[[Any], torch.Tensor] | None = None,
               inner: str | None = None) -> BuiltStep:
    """Build ``variant``'s step of ``model`` on ``inputs``; run its first (compiling) step.

    ``after_first`` runs right after that first step, while ``.grad`` holds
    its gradients (`bench.run` checks them there and switches tf32 on);
    hand captures take their graph after it. ``loss_of``: the loss is
    ``loss_of(model(*inputs))``, applied outside the compiled model, as the
    users of a `bench.user_patterns` pattern write it (None: the model's
    output is the loss). ``inner``: `compile_forward`'s.
    """
    variant = Variant.parse(variant) if isinstance(variant, str) else variant
    fn = compile_forward(variant, model, inner)
    if loss_of is not None:
        fn = _with_loss(fn, loss_of)
    optimizer = make_optimizer(variant, model)
    one_step = train_step(model, fn, optimizer)
    if variant.hand_capture:
        one_step(*inputs)
        after_first()
        return BuiltStep(whole_step_graph(model, fn, inputs, optimizer), optimizer)
    if variant.step_api:
        import erase_fx

        compile_step = getattr(erase_fx, "compile_step", None)
        if compile_step is None:
            raise RuntimeError("this erase_fx has no compile_step (the +step variants need it)")
        program = compile_step(one_step, warmup=STEP_WARMUP, max_captures=STEP_MAX_CAPTURES,
                               **variant.step_options)
        program(*inputs)
        after_first()
        return BuiltStep(lambda: program(*inputs), optimizer, program)
    one_step(*inputs)
    after_first()
    return BuiltStep(lambda: one_step(*inputs), optimizer)


def _with_loss(forward: Callable[..., Any], loss_of: Callable[[Any], torch.Tensor]):
    """``forward`` followed by ``loss_of``: the loss of a model whose output is not its loss."""

    def loss(*inputs):
        return loss_of(forward(*inputs))

    return loss


# -- timing and memory (CUDA) -------------------------------------------------------


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Inside: ``torch.use_deterministic_algorithms(True)`` (the race checks: a difference
    between two runs is then a race, not an atomic add's order); the setting before, after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def time_steps(step, trials: int, steps_per_trial: int, warmup: int = 0):
    """Median, min and max over ``trials`` of the mean step time (ms, CUDA events)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps_per_trial):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps_per_trial)
    return statistics.median(times), min(times), max(times)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the model's own state: parameters, buffers, grads, optimizer state.

    Each tensor counted once (by address and size), at its own size, not
    its storage's: a grad handed out as a view of a larger graph buffer
    counts as a grad, the rest of the buffer as what the program keeps.
    """
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    seen = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()}
    return sum(size for _, size in seen)


#: CUgraphMem_attribute: the physical memory the driver holds for graph allocations now.
_GRAPH_MEM_RESERVED_CURRENT = 2


def allocator_backend() -> str:
    """The CUDA caching allocator's backend: ``"native"`` or ``"cudaMallocAsync"``.

    Set for the process before CUDA starts, by
    ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``. Under capture the
    two place memory differently: the native allocator hands a block freed
    on a stream to later allocations on that stream only, and a graph keeps
    its private pool's segments whole; with ``cudaMallocAsync`` captured
    allocations are graph memory nodes, and the driver gives an allocation
    the physical memory of any allocation freed before it in the graph's
    order, whatever the streams.
    """
    return torch.cuda.get_allocator_backend()


def held_bytes() -> int:
    """Bytes the caching allocator holds for tensors and CUDA graphs now.

    Native backend: the live blocks of the default pool, plus every segment
    of a CUDA graph pool whole: a captured graph keeps the blocks its
    temporaries used (free to the allocator's statistics, but replays write
    them), and cudagraph trees (``reduce-overhead``) hand out replay outputs
    as storages made from data pointers, which ``memory_allocated`` does not
    count at all. ``cudaMallocAsync`` backend: the memory in use in the
    driver's default pool, plus the physical memory the driver holds for
    graph allocations (`graph_memory_bytes`).
    """
    if allocator_backend() == "cudaMallocAsync":
        return torch.cuda.memory_allocated() + graph_memory_bytes()
    return sum(segment["total_size"] if in_graph_pool(segment) else segment["allocated_size"]
               for segment in torch.cuda.memory_snapshot())


def _cuda_driver_device():
    """The CUDA driver library and the current device's handle.

    NB: torch reports no graph-memory figures, so these two calls go to the
    driver itself (``cuDeviceGetGraphMemAttribute``, ``cuDeviceGraphMemTrim``:
    CUDA 11.4+), through ctypes.
    """
    driver = ctypes.CDLL("libcuda.so.1")
    device = ctypes.c_int()
    _driver_check(driver.cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()),
                  "cuDeviceGet")
    return driver, device


def _driver_check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")


def graph_memory_bytes() -> int:
    """Physical memory the driver holds for CUDA graph allocations on the current device.

    Graph allocations are made only under the ``cudaMallocAsync`` backend
    (0 under the native one); a graph keeps what its launches mapped until
    it is destroyed and `trim_graph_memory` runs.
    """
    driver, device = _cuda_driver_device()
    value = ctypes.c_uint64()
    _driver_check(driver.cuDeviceGetGraphMemAttribute(device, _GRAPH_MEM_RESERVED_CURRENT,
                                                      ctypes.byref(value)),
                  "cuDeviceGetGraphMemAttribute")
    return value.value


def trim_graph_memory() -> None:
    """Give back the graph memory no live graph holds (the ``cudaMallocAsync`` backend's)."""
    if allocator_backend() == "cudaMallocAsync":
        driver, device = _cuda_driver_device()
        _driver_check(driver.cuDeviceGraphMemTrim(device), "cuDeviceGraphMemTrim")


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-stream workspaces (torch keeps one set per stream for the process).

    NB: every new stream a variant uses (erase's side streams, a capture's
    stream) gets its workspaces at its first matmul, about 65 MiB on the
    H200, held until cleared: cleared before each row, each row pays for its
    own streams, whatever ran before it.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class StepMemory:
    """The memory of one variant's steady-state step, in three calls.

    ``start()`` before the variant is built (everything the benchmark
    itself holds is the floor); ``before_timing()`` after warm-up and
    capture, which resets the peak; ``finish(model, optimizer)`` after the
    timed steps, outputs dropped. Gives, in bytes:

    - ``peak_mem_bytes``: ``max_memory_allocated`` over the timed steps;
    - ``step_peak_bytes``: that peak minus what was allocated before them
      (near 0 for a replayed graph: its memory is held, not allocated);
    - ``kept_bytes``: what the compiled program keeps between steps (graph
      pools, static inputs, buffers, and the cuBLAS workspaces of the
      streams it uses, `workspaces`): `held_bytes` after the timed steps
      minus the floor and `state_bytes` (parameters, buffers, grads,
      optimizer state);
    - ``state_bytes``: the model's own state, as subtracted;
    - ``mem_bytes``: ``kept_bytes + step_peak_bytes``, what a step needs
      beyond the model's own state at its worst moment: the figure the
      memory targets judge.

    NB: a step that sets grads to None first frees them before its forward,
    so where grads outweigh activations the step peak is near 0 even
    without graphs: the comparison speaks where activations dominate (the
    gpt configs, ctr:16384).
    """

    def start(self) -> None:
        torch.cuda.synchronize()
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
        trim_graph_memory()
        self.floor = held_bytes()

    def before_timing(self) -> None:
        torch.cuda.synchronize()
        self.before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def finish(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        state = state_bytes(model, optimizer)
        kept = held_bytes() - self.floor - state
        step_peak = peak - self.before
        return {"peak_mem_bytes": peak, "step_peak_bytes": step_peak, "kept_bytes": kept,
                "mem_bytes": kept + step_peak, "state_bytes": state}

    def workspaces(self) -> int:
        """Bytes of cuBLAS workspaces held now (call after the variant is dropped): part of kept."""
        torch.cuda.synchronize()
        held = held_bytes()
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
        return held - held_bytes()
