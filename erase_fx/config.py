"""The settings of one erase_fx compilation.

`EraseConfig` is built from ``torch.compile(model, backend="erase", options={...})``.
It has the user's choices (the README's options table) and, under
``tuning``, the heuristics of the schedule and of memory under capture
(`Tuning`: ``options={"tuning": {...}}``, documented with what each trades
in ``docs/performance.md``, "Tuning settings"). An unknown option or a value
of the wrong kind raises `EraseOptionError` listing what is allowed and the
defaults; an old option name that is a tuning setting now says where it
went. Environment variables are read only for debugging dumps
(``ERASE_FX_DUMP``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from erase_fx.errors import EraseOptionError

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
PARTITIONERS = ("min_cut", "default")
ON_ERROR = ("fallback", "raise")
#: The value of ``release_lag`` and ``side_cuda_streams`` that lets `erase_fx.compile_step` choose.
AUTO = "auto"
#: The value of ``release_lag`` that leaves the reuse of memory under capture to the allocator:
#: every value dropped after its last reader and marked as used by each stream that read it
#: (`erase_fx.emit.streams`), with no plan of erase's own.
RECORD_STREAM = "record_stream"


#: How a tuning setting is named in messages (``tuning.release_lag``).
_TUNING = "tuning."


class _Shown(str):
    """A default shown as its text in the list of allowed options."""

    def __repr__(self) -> str:
        return str(self)


def _defaults(cls: type) -> dict[str, Any]:
    """Each field of the dataclass ``cls`` and its default."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _check_type(name: str, value: Any, kind: type, prefix: str = "",
                expected: str | None = None) -> None:
    # NB: bool is an int subclass; streams=True is a mistake, not 1.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise EraseOptionError(prefix + name, value, expected or f"a {kind.__name__}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...], prefix: str = "") -> None:
    if value not in choices:
        raise EraseOptionError(prefix + name, value,
                               "one of " + ", ".join(repr(c) for c in choices))


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The heuristics of erase_fx's schedule and of its memory under capture.

    Settings, not choices: each trades time against memory, or work in one
    place against work in another, and its default is what the measurements
    of ``docs/performance.md`` ("Tuning settings": every field, its default,
    what it trades, with figures) support. Set them with
    ``torch.compile(..., options={"tuning": {"release_lag": 2}})`` or
    ``erase_fx.make_backend(tuning=Tuning(release_lag=2))``.

    Attributes:
        partitioner: the stock AOTAutograd partitioner for everything that is
            not an early block: ``"min_cut"`` (recomputes cheap forward ops
            in the backward to save memory, as ``inductor`` and ``aot_eager``
            do) or ``"default"`` (saves what the backward reads).
        release_lag: under CUDA graph capture, when a tensor the main stream
            made and a block's early backward read (the block's activations)
            is freed. Memory freed on a stream under capture goes back to that
            stream only, so such a tensor is held to the join at the end of
            the forward (``None``), unless the main stream waits for the
            block's side stream N main segments after its last read and frees
            it then (an integer N >= 1): memory sooner, at the price of a wait
            that stalls the main stream while the side stream is busy.
            ``"auto"`` (default): `erase_fx.compile_step` captures the step
            with None, 2 and 1, times replays of each and keeps the least
            memory within 2% of the fastest (`erase_fx.capture_tuning`);
            outside its captures ``"auto"`` runs as None (nothing there times
            the candidates: `erase_fx.emit.capture_scope`).
            ``"record_stream"`` (experimental: not yet timed on a GPU,
            docs/performance.md#memory): under capture every value is dropped after its last reader and
            marked as used by each stream that read it, as outside capture,
            and the caching allocator reuses its memory on the stream that
            made it once the graph orders those reads before (no wait of
            erase's own); it needs
            ``PYTORCH_ALLOC_CONF=graph_capture_record_stream_reuse:True``,
            without which such memory is kept to the end of the capture.
            Uncaptured, the caching allocator frees every tensor after its
            last reader whatever this says (`erase_fx.emit.release`).
        side_cuda_streams: how many CUDA streams run the ``streams`` side
            streams: side stream ``s`` runs on CUDA stream
            ``1 + (s - 1) % side_cuda_streams``, in the same launch order and
            with the same events (nothing is recompiled; folding only adds
            order). Under capture each CUDA stream keeps its own memory pool
            and cuBLAS workspace, and the pools add up: blocks that share a
            CUDA stream share them, and run one after the other instead of
            overlapping. ``None``: one CUDA stream per side stream;
            ``"auto"`` (default): `erase_fx.compile_step` times 2 against all
            as for ``release_lag`` (with it, every pair worth trying), and
            outside its captures it runs as None.
        stages_on_side: run each early block's own stage (the forward whose
            activations its early backward reads) on the block's side stream
            too, before its head, so that those activations are made, read
            and freed on one stream: under capture they are freed once the
            block's backward is done, with no wait on the main stream, and
            the stream's next block reuses the memory; the next stage starts
            once this stage's output exists (an event). ``None`` (default):
            when there are more early blocks than side streams (a stream then
            runs several blocks); ``True``: always; ``False``: stages on the
            main stream. Needs ``streams >= 2`` (with one side stream a
            block's stage would queue behind the block before it); a block in
            pieces keeps its stage on the main stream.
        copy_input_values: each early block makes its own copy of a large
            value made from the graph's inputs alone that other blocks (or
            the forward) read too (``True``, default), instead of sharing one
            (`passes/copy_input_values_per_block.py`): merged, every block's
            soft targets made from the labels are one value, which under
            capture lives through every block. Each copy costs one
            elementwise pass, fused into the block's kernels with Inductor.
            ``False``: share them, as the partitioner left them.
        recompute_boundary_values: each block's segment (its head, local loss
            and early backward) recomputes the cheap elementwise values it
            reads from the forward (a GELU's pieces, casts), fused into its
            own kernels, where that reads fewer bytes across its segment
            boundary (`passes/recompute_boundary_values.py`), as the stock
            partitioner recomputes such values in the backward: a boundary
            passes every value that crosses it, written out and read back.
            ``True`` (default); ``False``: read them across the boundary.
        keep_inplace_writes: compile each side-stream segment so that
            Inductor can write a large value (8 MiB or more) over the buffer
            it is made from where one of its fusions would prevent it
            (`erase_fx.emit.inplace_fusion`): a local loss's logits and their
            gradient then share one buffer. Under capture each side stream
            keeps its own pool, as large as its segment's peak, so the memory
            is saved on every side stream, for one more read of each such
            buffer. ``True`` (default); ``False``: Inductor's own fusions.
        min_part_share: the cost check on gradient parts (an auxiliary head
            on a trunk it is not detached from, one tower of several over a
            shared front: `passes/split_at_sums.py`). Such a part runs early
            only if its estimated backward FLOPs are at least this share of
            the graph's whole backward; a smaller one stays in the backward
            (reason ``small_part`` in `erase_fx.explain`). Why: running a part
            early wins at most its own backward's time, while the segment
            boundary it cuts into the trunk's forward costs about the same
            whatever its size. ``0`` runs every part early. Whole blocks (a
            detached stage and its head) are not held to it, nor the pieces
            of a block that runs early in pieces (it launches whole or in
            pieces by readiness alone). A part kept back this way is listed
            on its own, so a part beside it that erase_fx cannot prove safe
            is reported (and raises under ``on_error="raise"``) as it is with
            the check off.
        graph_end_at_return: a graph's last block, ready only when its
            forward ends, runs there (`erase_fx.emit.graph_end`) also in a
            graph that ends at the forward's return (``True``), where only
            the backward follows it; then, when every block of the graph runs
            early, the backward has nothing left to compute but the scaling.
            ``False`` (default): only where more of the forward follows the
            graph (a graph break, a caller's uncompiled forward), as measured
            so far; in a single graph the last block stays in the backward,
            as stock does.
        stock_candidate: inside `erase_fx.compile_step`, the stock compilation
            of each graph with early blocks is one more candidate of the
            tuning (`erase_fx.capture_tuning`): each such graph is compiled
            twice, by erase_fx and by the stock backend
            (`erase_fx.backend.stock_backend`), and the step is warmed up
            and captured once more with the stock program; the tuning keeps
            it where erase's fastest candidate is slower than it by more than
            the tolerance (2%), or within it with more memory. What it trades:
            compile time (every such graph compiled twice) and one more
            warm-up and capture during the tuning, for a measured guarantee
            that the captured step is never slower than stock's. Not built
            under DDP, where the step updates parameters early
            (``compile_step(early_optimizer=True)`` and a graph with early
            updates planned), or with dynamic shapes; outside compile_step's
            captures the graph runs erase's program. ``False`` (default):
            not yet timed on a GPU.
    """

    partitioner: str = "min_cut"
    release_lag: int | str | None = AUTO
    side_cuda_streams: int | str | None = AUTO
    stages_on_side: bool | None = None
    copy_input_values: bool = True
    recompute_boundary_values: bool = True
    keep_inplace_writes: bool = True
    min_part_share: float = 0.05
    graph_end_at_return: bool = False
    stock_candidate: bool = False

    def __post_init__(self) -> None:
        _check_choice("partitioner", self.partitioner, PARTITIONERS, _TUNING)
        for name, named in (("release_lag", (AUTO, RECORD_STREAM)), ("side_cuda_streams", (AUTO,))):
            value = getattr(self, name)
            if value is not None and value not in named and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EraseOptionError(_TUNING + name, value,
                                       f"an integer >= 1, {', '.join(map(repr, named))} or None "
                                       f"(default {AUTO!r})")
        if self.stages_on_side is not None:
            _check_type("stages_on_side", self.stages_on_side, bool, _TUNING,
                        "True, False or None (default None)")
        for name in ("copy_input_values", "recompute_boundary_values", "keep_inplace_writes"):
            _check_type(name, getattr(self, name), bool, _TUNING, "True or False (default True)")
        for name in ("graph_end_at_return", "stock_candidate"):
            _check_type(name, getattr(self, name), bool, _TUNING, "True or False (default False)")
        if (isinstance(self.min_part_share, bool)
                or not isinstance(self.min_part_share, (int, float))
                or not 0 <= self.min_part_share <= 1):
            raise EraseOptionError(_TUNING + "min_part_share", self.min_part_share,
                                   "a share of the backward's FLOPs, from 0 to 1 (default 0.05)")

    @classmethod
    def from_options(cls, options: Tuning | Mapping[str, Any] | None) -> Tuning:
        """A `Tuning` from ``options={"tuning": ...}``: a `Tuning`, a mapping of its fields, or
        None (the defaults)."""
        if options is None:
            return cls()
        if isinstance(options, Tuning):
            return options
        if not isinstance(options, Mapping):
            raise EraseOptionError("tuning", options,
                                   "a dict of tuning settings or an erase_fx.config.Tuning")
        allowed = _defaults(cls)
        unknown = sorted(set(options) - set(allowed), key=str)
        if unknown:
            raise EraseOptionError.unknown(unknown, allowed, what="tuning setting")
        return cls(**options)


@dataclasses.dataclass(frozen=True)
class EraseConfig:
    """What erase_fx does with one compiled graph: the user's choices, and `Tuning`.

    Attributes:
        streams: number of side streams the early backward blocks are spread
            over, round-robin by block order (block ``i`` runs on side stream
            ``1 + i % streams``; stream 0 is the main stream, where the forward
            runs), each with its own cuBLAS workspace and, under capture, its
            own memory. On CPU the streams are virtual: segments run in
            program order. ``0``: no side stream and no segments: each early
            block's backward runs on the main stream where the schedule
            places it, and the forward compiles as one graph, so Inductor
            fuses across where the segment boundaries would be. No overlap;
            each block's activations are freed as soon as its backward has
            run, under CUDA graph capture too (one stream reuses its own
            memory), but Inductor may fuse work of several blocks into one
            late kernel and hold their values to it. Under DDP it leaves the
            all-reduce of every gradient to DDP's buckets (``early_allreduce``
            needs the side streams' program).
        inner: the compiler of each segment and of the backward:
            ``"inductor"`` (fused kernels; the graph is traced with Inductor's
            decompositions), ``"aot_eager"`` (each segment runs its FX code, as
            torch's ``aot_eager`` backend does), ``"eager"`` (each segment runs
            node by node through ``torch.fx.Interpreter``, for debugging).
        seed: the loss gradient the early backward is computed with. The
            backward returns ``T / seed * early_grad`` where ``T`` is the real
            loss gradient (1 for ``loss.backward()``, the scale for
            ``scaler.scale(loss).backward()``), multiplying in place, and skips
            that pass over the early grads (on the device) when ``T == seed``.
            ``None`` (default): 1, except in a graph that computes in float16,
            whose early blocks run at the loss gradient its last backward got
            (`erase_fx.emit.loss_seed`): float16 gradients computed at 1 and
            scaled to a GradScaler's ``T`` (65536 at its start) underflow where
            the backward run with ``T`` does not. Until its first backward such
            a graph runs as torch's ``aot_eager`` backend compiles it (eager's
            kernels); after the scaler backs off it may skip one more step. A
            given seed is bitwise as eager while ``T`` equals it, but an early
            backward that overflows at it does so at every step, and the
            scaler's skipped steps never end. bfloat16 and float32 need no
            seed.
        cudagraphs: replay the compiled forward (side streams included) and
            backward from CUDA graphs, so a step costs two launches instead
            of one per kernel. ``None`` (default): on for graphs on a CUDA
            device with static shapes; ``True``: the same (dynamic shapes
            still run without graphs, with a logged reason); ``False``: off.
            No effect on CPU. Inside a CUDA graph capture of the caller's
            (`erase_fx.compile_step`, or a whole training step captured by
            hand) the program runs as is, so that capture records it. See
            ``erase_fx/emit/cudagraphs.py`` for what keeps replay exact.
        overlap: run each early block on its side stream (``True``, default),
            or every segment on the main stream (``False``): the same
            segments and kernels in the same order, without overlap. What
            the overlap alone is worth, and the memory-first setting: each
            block's values are freed once its backward has run and the next
            block reuses the memory. No effect on CPU, where streams are
            virtual anyway.
        early_allreduce: under DistributedDataParallel, all-reduce each early
            block's gradients during the forward, as soon as its early backward
            ends (one flat buffer per block, on a communication stream;
            divided by the world size as DDP does), instead of at
            ``.backward()`` through DDP's buckets; DDP's reducer then skips
            them (a communication hook; see `erase_fx.ddp`). ``False``: DDP
            reduces every gradient, as without erase_fx. No effect without DDP.
        dump_dir: a folder to write each compiled graph's passes, segments,
            report, pass timings (``timings.json``) and schedule picture
            (``schedule.dot``) into (``graph_<n>/``; see `erase_fx.instruments`);
            ``ERASE_FX_DUMP`` sets it too. ``None`` writes nothing.
        on_error: what a failure inside erase_fx does: ``"fallback"`` logs a
            warning with the reason and compiles the graph on the stock path
            (no early block, gradients still exact); ``"raise"`` raises the
            `EraseError`. A block whose backward cannot be proven safe to run
            early (a mutation, an op not known to be linear in the loss
            gradient) stays in the backward under ``"fallback"`` and raises
            under ``"raise"``.
        tuning: the heuristics (`Tuning`), from ``options={"tuning": {...}}``
            (a dict of its fields, or a `Tuning`).

    See ``docs/performance.md`` for what ``streams``, ``overlap`` and
    ``cudagraphs`` cost and save on the measured models.
    """

    streams: int = 4
    inner: str = "inductor"
    seed: float | None = None
    cudagraphs: bool | None = None
    overlap: bool = True
    early_allreduce: bool = True
    dump_dir: str | None = None
    on_error: str = "fallback"
    tuning: Tuning = Tuning()

    def __post_init__(self) -> None:
        _check_type("streams", self.streams, int)
        if self.streams < 0:
            raise EraseOptionError("streams", self.streams,
                                   "an integer >= 0 (0: the forward in one graph, no side stream)")
        _check_choice("inner", self.inner, INNER_COMPILERS)
        _check_choice("on_error", self.on_error, ON_ERROR)
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, (int, float))
                                      or not math.isfinite(self.seed) or self.seed == 0):
            raise EraseOptionError("seed", self.seed, "a finite non-zero float, or None")
        if self.cudagraphs is not None:
            _check_type("cudagraphs", self.cudagraphs, bool)
        _check_type("overlap", self.overlap, bool)
        _check_type("early_allreduce", self.early_allreduce, bool)
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise EraseOptionError("dump_dir", self.dump_dir, "a folder path or None")
        # NB: a dict given for tuning (EraseConfig(tuning={...}), as in options) becomes a Tuning
        object.__setattr__(self, "tuning", Tuning.from_options(self.tuning))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> EraseConfig:
        """Build a config from ``torch.compile(..., options=...)``.

        ``ERASE_FX_DUMP`` fills ``dump_dir`` when the options leave it unset.
        A tuning setting given at the top level (``release_lag``, as before it
        moved) raises `EraseOptionError` saying where it goes now.
        """
        options = dict(options or {})
        moved = [name for name in options if name in _defaults(Tuning)]
        if moved:
            raise EraseOptionError.moved_to_tuning(moved[0], options[moved[0]])
        allowed = {**_defaults(cls), "tuning": _Shown("Tuning(): a dict of tuning settings, "
                                                      "erase_fx.config.Tuning")}
        unknown = sorted(set(options) - set(allowed), key=str)
        if unknown:
            raise EraseOptionError.unknown(unknown, allowed)
        if options.get("dump_dir") is None and os.environ.get("ERASE_FX_DUMP"):
            options["dump_dir"] = os.environ["ERASE_FX_DUMP"]
        return cls(**options)

    def replace(self, **changes: Any) -> EraseConfig:
        return dataclasses.replace(self, **changes)

    @property
    def early_seed(self) -> float:
        """The loss gradient the early backward runs with: ``seed``, 1 where it is None."""
        return 1.0 if self.seed is None else float(self.seed)
