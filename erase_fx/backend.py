"""The ``erase`` torch.compile backend.

``torch.compile(model, backend="erase", options={...})`` calls
`erase_backend` once per graph Dynamo captures (the ``torch_dynamo_backends``
entry point makes the name known after ``pip install``). A `GraphCompilation`
holds erase_fx's callbacks for that graph, and they plug in where the stock
path has its own:

- ``inner="inductor"`` (the default): stock Inductor's ``compile_fx``, with
  erase_fx as its custom partitioner and its inner compiler. Inductor's own
  passes, decompositions and layout choices stay as they are, so a graph
  with nothing to schedule compiles kernel for kernel as
  ``torch.compile(model)``.
- ``"aot_eager"``, ``"eager"``: AOTAutograd, built as torch's ``aot_eager``
  backend is, with erase_fx's partition function and compilers.

Under ``on_error="fallback"`` a failure anywhere in that (erase_fx's passes,
or a stock pass that erase_fx's presence upset) compiles the graph with the
stock backend instead, with the reason logged and in the report.

A graph that computes in float16, with no ``seed`` given, gets one more
input, the seed its early blocks run at, learned from the loss gradient of
its last backward (`erase_fx.emit.loss_seed`); until that first backward it
runs as torch's ``aot_eager`` backend compiles it.

With ``Tuning.stock_candidate``, a graph with early blocks compiled inside
`erase_fx.compile_step` is compiled by the stock backend too, from an
untouched copy, and the backend returns a switch between the two that the
step's tuning times (`erase_fx.emit.stock_switch`).

Under DistributedDataParallel (`erase_fx.ddp`): Dynamo's DDP optimizer hands
this backend whole graphs, not bucket-sized pieces, so blocks keep their
local losses (a graph with no early block is split as usual), and a graph
compiled inside a DDP module's forward all-reduces its early gradients
during the forward (``early_allreduce``).

NB: torch's ``aot_autograd(...)`` object drops keyword arguments it is called
with, so ``options`` would be lost if it were registered directly; this plain
function takes them and builds the backend itself.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from erase_fx import ddp, passes
from erase_fx.compilation import GraphCompilation
from erase_fx.config import EraseConfig
from erase_fx.emit import decompositions_for
from erase_fx.emit.capture_scope import current_scope
from erase_fx.emit.inner import cuda_device_of
from erase_fx.emit.loss_seed import (
    LossSeed,
    UntilSeeded,
    add_seed_input,
    computes_in_float16,
    with_seed,
)
from erase_fx.emit.stock_switch import StockSwitch, stock_candidate_refusal
from erase_fx.errors import EraseOptionError
from erase_fx.graph_breaks import TORCH_ROOT, ends_at_graph_break
from erase_fx.names import input_names, output_names
from erase_fx.passes.graph import copy_graph_module
from erase_fx.plan import CompileRequest
from erase_fx.report import publish

_graph_ids = itertools.count()
log = logging.getLogger(__name__)


@ddp.keeps_blocks_whole
def erase_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Any:
    """Compile one Dynamo graph with early backward scheduling.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: `EraseConfig` fields, from ``torch.compile(..., options=...)``.
        mode: not supported: erase_fx has no modes; settings go in ``options``.
    """
    if mode is not None:
        raise EraseOptionError("mode", mode,
                               "no mode: erase_fx takes its settings in options={...}")
    cfg = EraseConfig.from_options(options)
    # NB: stock compilers take ownership of the graph they compile and may
    # change it; the fallback, the stock candidate and a float16 graph's first
    # program (run until its seed is learned) compile an untouched copy.
    seed = (LossSeed(cuda_device_of(example_inputs) or torch.device("cpu"))
            if cfg.seed is None and computes_in_float16(gm) else None)
    stock_candidate = cfg.tuning.stock_candidate and current_scope() is not None
    original = (copy_graph_module(gm)
                if cfg.on_error == "fallback" or stock_candidate or seed is not None else None)
    stock_inputs = example_inputs
    if seed is not None:
        # NB: Dynamo reads its graph's placeholders again once the backend returns
        gm = copy_graph_module(gm)
        example_inputs = add_seed_input(gm, example_inputs, seed)
    request = CompileRequest(cfg, next(_graph_ids), tuple(input_names(gm)),
                             tuple(output_names(gm)), more_forward_follows(gm),
                             data_parallel=ddp.active_ddp_module(),
                             require_early_blocks=ddp.whole_ddp_graph(), loss_seed=seed)
    compilation = GraphCompilation(request)
    try:
        if cfg.inner == "inductor":
            compiled = _compile_in_stock_inductor(gm, example_inputs, compilation)
        else:
            compiled = _compile_in_aot_autograd(gm, example_inputs, compilation)
    except Exception as error:  # noqa: BLE001 - the documented fallback
        if cfg.on_error != "fallback" or isinstance(error, _NOT_FAILURES):
            raise
        if request.require_early_blocks:
            # NB: a whole DDP graph: Dynamo's DDP optimizer splits it instead, as for the
            # stock backend, and this backend compiles (or falls back on) each piece.
            ddp.log.warning("erase_fx graph %d (a whole DDP graph) failed: %s: %s; Dynamo's DDP "
                            "optimizer splits it", request.graph_id, type(error).__name__,
                            error)
            raise ddp.NoEarlyBlocks(request.graph_id) from error
        compilation.fall_back_whole(error)
        compiled, seed = stock_backend(cfg.inner)(original, stock_inputs), None
    report = compilation.finish()
    publish(report)
    if seed is not None:
        compiled = with_seed(compiled, seed)
    if not compilation.has_early_blocks:
        return compiled
    erase = _guarded(compiled, compilation)
    if seed is not None:
        erase = _until_seeded(erase, original, stock_inputs, seed, compilation)
    if stock_candidate:
        return _with_stock_candidate(erase, original, stock_inputs, compilation)
    return erase


def _compile_in_stock_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], compilation: GraphCompilation
) -> Any:
    """Stock ``compile_fx``, with erase_fx as its partitioner and inner compiler.

    Everything stock Inductor does around them stays as it is: pre-grad
    passes, decompositions, joint-graph passes (random ops, pattern matching)
    in its own fake mode, layout choices, post-grad passes. So a graph with no
    early block compiles exactly as ``torch.compile(model)`` compiles it.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    # NB: AOTAutograd's cache stores stock Inductor's compiled code only; a
    # multi-stream program is not that, so erase's graphs are not cached
    # there (Inductor's per-graph FX cache still serves each segment).
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(
            gm, example_inputs, inner_compile=compilation.inner_compile,
            config_patches={"custom_partitioner_fn": ErasePartitioner(compilation)},
        )


def _compile_in_aot_autograd(
    gm: fx.GraphModule, example_inputs: Sequence[Any], compilation: GraphCompilation
) -> Any:
    """AOTAutograd with erase_fx's callbacks, as torch's ``aot_eager`` backend is built."""
    backend = aot_autograd(
        fw_compiler=compilation.compile_forward,
        bw_compiler=compilation.compile_backward,
        inference_compiler=compilation.compile_inference,
        partition_fn=compilation.partition,
        decompositions=decompositions_for(compilation.cfg.inner),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


class ErasePartitioner(CustomPartitionerFn):
    """erase_fx's partitioner as stock Inductor takes one (``config.custom_partitioner_fn``)."""

    def __init__(self, compilation: GraphCompilation):
        self.compilation = compilation

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object],
                 **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        return self.compilation.partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> Any:
        # NB: part of Inductor's cache keys: erase_fx's own sources and settings
        return (_sources_hash(), repr(self.compilation.cfg))

    # NB: Inductor copies and pickles its config to build cache keys; this
    # object stands for its settings there, not for the compilation it holds.
    def __deepcopy__(self, memo: dict) -> ErasePartitioner:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (f"erase_fx.ErasePartitioner{self.uuid()!r}",))


def more_forward_follows(gm: fx.GraphModule) -> bool:
    """Whether more of the user's forward runs after this graph, for its last block's
    backward to overlap (`erase_fx.emit.graph_end`): Dynamo ended it at a graph break, or
    compiled it from a module's forward that another module's forward calls, uncompiled
    (Dynamo skipped that frame, as it does one that calls an ``autograd.Function``
    instance's ``apply``, or the user compiled a submodule): the rest of that forward runs
    when this graph returns. Called at compile time, from Dynamo's frame callback."""
    return ends_at_graph_break(gm) or called_from_a_forward(sys._getframe(1))


def called_from_a_forward(frame: types.FrameType | None) -> bool:
    """Whether the first frame of ``frame``'s stack outside torch and erase_fx (the caller
    of the frame Dynamo compiles: the frame itself has not started) is a module's
    ``forward``.

    NB: Dynamo runs its backend inside the eval-frame callback of the frame it compiles,
    before that frame runs, so the stack above holds its caller's frames; a caller running
    code Dynamo made (``torch._dynamo.utils.orig_code_map`` maps it to the user's) calls
    the resume function after its graph break, and returns what that returns: nothing of
    it follows (torch 2.11-2.14; tests/test_graph_end.py pins both)."""
    from torch._dynamo.utils import orig_code_map

    while frame is not None:
        if not is_internal_source(frame.f_code.co_filename):
            code = frame.f_code
            if code.co_name != "forward" or code.co_argcount == 0 or code in orig_code_map:
                return False
            return isinstance(frame.f_locals.get(code.co_varnames[0]), torch.nn.Module)
        frame = frame.f_back
    return False


#: the source folders whose frames `called_from_a_forward` looks past: torch's (the module
#: call, Dynamo), erase_fx's (`erase_fx.explain`), Python's own
_INTERNAL_SOURCES = (TORCH_ROOT, str(Path(__file__).parent) + os.sep, "<frozen")


def is_internal_source(filename: str) -> bool:
    """Whether ``filename`` is torch's, erase_fx's or Python's own (not torchvision's, say:
    each folder is matched with its separator)."""
    return filename.startswith(_INTERNAL_SOURCES)


def stock_backend(inner: str) -> Any:
    """The stock torch.compile backend erase_fx falls back to for an inner compiler."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("inductor" if inner == "inductor" else "aot_eager")


@functools.cache
def _sources_hash() -> str:
    """A hash of erase_fx's own sources (read once, at the first compile, not at import)."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    root = Path(__file__).resolve().parent
    files = sorted(str(p) for folder in (root, root / "emit", Path(passes.__file__).parent)
                   for p in folder.glob("*.py"))
    return get_hash_for_files(tuple(files)).hex()


#: Exceptions that are not failures of a compile but Dynamo's way of saying
#: "skip this frame" or "stop" (or erase_fx's, to the DDP optimizer: "split
#: this one as usual"): they pass through the fallback.
_NOT_FAILURES: tuple[type[BaseException], ...] = (torch._dynamo.exc.SkipFrame, ddp.NoEarlyBlocks)


def _guarded(compiled: Any, compilation: GraphCompilation) -> Any:
    """The compiled callable, raising clear errors on backward uses erase_fx cannot run."""

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        compilation.watch(outputs)
        return outputs

    # NB: like AOTAutograd's own result, Dynamo must not trace into this wrapper.
    return torch._dynamo.disable(run)


def _until_seeded(erase: Any, original: fx.GraphModule, example_inputs: Sequence[Any],
                  seed: LossSeed, compilation: GraphCompilation) -> Any:
    """A float16 graph with early blocks: a copy of ``original`` compiled by torch's
    ``aot_eager`` backend too (no code generation: it runs once), run until a backward
    has taught the graph its loss seed (`erase_fx.emit.loss_seed`), then ``erase``.
    Where the seed cannot be learned (no loss is an output the graph can watch), the copy
    is compiled by the inner compiler's stock backend, and runs always."""
    seed.losses = compilation.joint.found.loss_outputs
    if seed.losses:
        inner = "aot_eager"
        log.info("erase_fx graph %d: computes in float16: runs as aot_eager until a backward "
                 "gives its losses their gradient, then its early blocks at that gradient",
                 compilation.graph_id)
    else:
        inner = compilation.cfg.inner
        log.warning("erase_fx graph %d computes in float16 and none of its early blocks' "
                    "losses is an output it can watch for the loss gradient: it runs its stock "
                    "compilation (options={'seed': s} runs the blocks early at s)",
                    compilation.graph_id)
    stock = stock_backend(inner)(copy_graph_module(original), example_inputs)
    # NB: like AOTAutograd's own result, Dynamo must not trace into the switch.
    return torch._dynamo.disable(UntilSeeded(erase, stock, seed))


def _with_stock_candidate(erase: Any, original: fx.GraphModule, example_inputs: Sequence[Any],
                          compilation: GraphCompilation) -> Any:
    """Inside a compile_step, with ``Tuning.stock_candidate``: ``original`` compiled by the
    stock backend too, and a `StockSwitch` between it and ``erase`` (erase's compiled
    function), unless the graph cannot have one (logged at INFO: `stock_candidate_refusal`)
    or the stock compile fails (logged; raised under ``on_error="raise"``)."""
    cfg, graph_id = compilation.cfg, compilation.graph_id
    forward = compilation.forward
    planned = forward is not None and forward.updates is not None and bool(forward.updates.planned)
    why = stock_candidate_refusal(
        data_parallel=compilation.request.data_parallel is not None,
        updates_early=planned and current_scope().early_optimizer,
        example_inputs=example_inputs)
    if why is not None:
        log.info("erase_fx graph %d: no stock candidate for compile_step's tuning: %s",
                 graph_id, why)
        return erase
    try:
        stock = stock_backend(cfg.inner)(original, example_inputs)
    except Exception as error:  # noqa: BLE001 - the candidate is optional
        if cfg.on_error == "raise":
            raise
        log.warning("erase_fx graph %d: no stock candidate for compile_step's tuning: the "
                    "stock compile failed: %s: %s", graph_id, type(error).__name__, error)
        return erase
    log.info("erase_fx graph %d: compiled by the stock backend too: compile_step's tuning "
             "times it as its last candidate", graph_id)
    # NB: like AOTAutograd's own result, Dynamo must not trace into the switch.
    return torch._dynamo.disable(StockSwitch(erase, stock, graph_id))


def make_backend(**options: Any) -> Any:
    """``erase_backend`` with options bound, for ``torch.compile(backend=make_backend(...))``."""
    EraseConfig.from_options(options)  # fail early on bad options
    return functools.partial(erase_backend, options=options)
