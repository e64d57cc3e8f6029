"""The value every pass returns, and the dump text it renders.

Every pass of the pipeline (`passes/pipeline.py`) returns a `PassResult`: the
module the next pass reads (a new one from a structural pass, the input
itself from an analysis), whether it differs from the input, and, where the
pass decides more than a module, an *artifact*: that decision as data
(`BlockAnalysis`, `JointPartition`, the segments, `DeferredScaling`).

A result renders its own dump (`PassResult.render`): its artifact's files
when it has one (`Artifact.render`), else the module's code. Rendering is
text only, done only when a dump asks for it; the instruments
(`erase_fx.instruments`) add the headers and write the files.

What every pass reads besides its module is a `PassContext`: the config,
the results of the passes before it in its list, and what the caller of
the list gave (`passes/pipeline.py`). Every pass is
``pass_name(gm, ctx) -> PassResult`` and every check
``check_name(result, ctx) -> None``.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar

import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.passes.node_meta import get_meta


@dataclasses.dataclass(frozen=True)
class DumpFile:
    """One file of a step's dump.

    Attributes:
        suffix: appended to the step's stem (``04_partition_joint_graph``):
            ``.py``, ``.fwd.py``, ``.segments.json``...
        part: what the file holds, in words, for its provenance header.
        text: the file's content.
    """

    suffix: str
    part: str
    text: str


class Artifact(Protocol):
    """What a pass decided besides its module; renders the step's dump files."""

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        """The dump files of the result whose module is ``gm``."""
        ...


A = TypeVar("A", bound=Artifact)


@dataclasses.dataclass(frozen=True)
class PassResult(Generic[A]):
    """A pass's result: the module (the input is never mutated), whether it differs from the
    input, and the pass's artifact (None for a pass that only rewrites the module)."""

    gm: fx.GraphModule
    modified: bool
    artifact: A | None = None

    def render(self) -> tuple[DumpFile, ...]:
        """The step's dump files: the artifact's, else the module's code."""
        if self.artifact is None:
            return (DumpFile(".py", "the module the pass returned", graph_text(self.gm)),)
        return tuple(self.artifact.render(self.gm))


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass and its check read besides the module.

    Attributes:
        cfg: the compilation's settings.
        results: the results of the passes before it in its list, by pass name.
        given: what the caller of the list gave (`run_passes`' keywords):
            ``num_fwd_outputs`` (find_stop_gradient_blocks, partition_joint_graph),
            ``primal_names`` and ``graph_end`` (find_stop_gradient_blocks),
            ``joint_inputs`` and ``partition_kwargs`` (partition_joint_graph: AOT's),
            ``unused_tangents`` (specialize_unused_tangents).
    """

    cfg: EraseConfig
    results: Mapping[str, PassResult]
    given: Mapping[str, Any]

    @classmethod
    def of(cls, cfg: EraseConfig, results: Mapping[str, PassResult] | None = None,
           **given: Any) -> PassContext:
        """A context for a pass or check called alone (tests): ``results``, the earlier
        passes' results it reads, by name; ``given``, as `run_passes` takes it."""
        return cls(cfg, types.MappingProxyType(dict(results or {})),
                   types.MappingProxyType(given))

    def artifact(self, name: str) -> Any:
        """The artifact of the earlier pass ``name``."""
        return self.results[name].artifact


def graph_text(gm: fx.GraphModule) -> str:
    """The module's code, with each node's erase_fx decision as a comment."""
    code = gm.print_readable(print_output=False, include_stride=False)
    # NB: source-location comments hold absolute paths; dumps must diff clean.
    lines = [line for line in code.splitlines() if not line.lstrip().startswith("# File:")]
    notes = []
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta is not None and (meta.block is not None or meta.stream or meta.waits_for
                                 or meta.after_join):
            flags = "".join((f" piece={meta.piece}" if meta.piece is not None else "",
                             " stage" if meta.stage else "",
                             " after_join" if meta.after_join else ""))
            notes.append(
                f"#   {node.name}: role={meta.role.value} block={meta.block} "
                f"stream={meta.stream} waits_for={list(meta.waits_for)}{flags}"
            )
    if notes:
        lines.append("# erase_fx node decisions:")
        lines.extend(notes)
    return "\n".join(lines) + "\n"
