"""Readable names of the inputs and outputs of a Dynamo graph.

Inputs: parameters by their qualified names.

AOTAutograd's flat inputs are the module's own parameters and buffers (none
when Dynamo lifts them, the default) followed by the graph's placeholders.
Dynamo names a lifted parameter by its source (``L['self']._modules['stages']
._modules['0']._parameters['weight']``); reports say ``stages.0.weight``.
"""
from __future__ import annotations

import os
import re

import torch.fx as fx

from erase_fx.graph_breaks import TORCH_ROOT
from erase_fx.report import short_path

_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")
_SOURCE_LOCAL = re.compile(r"^[LG]\['([^']*)'\]$")
#: the same attribute reached through ``__dict__`` (a forward that sets ``self.x = ...``)
_SOURCE_DICT_PART = re.compile(r"\.__dict__\['(_(?:modules|parameters|buffers))'\]\['([^']*)'\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def input_names(gm: fx.GraphModule) -> list[str]:
    """A readable name for each flat input AOTAutograd sees (see the module docstring)."""
    names = [n for n, _ in gm.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in gm.named_buffers(remove_duplicate=False)]
    for node in gm.graph.find_nodes(op="placeholder"):
        names.append(source_name(node))
    return names


def source_name(node: fx.Node) -> str:
    """The qualified name of the module attribute a placeholder stands for, or its target."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return str(node.target)
    name = source.name() if callable(source.name) else source.name
    name = _SOURCE_DICT_PART.sub(lambda m: f".{m.group(1)}['{m.group(2)}']", name)
    parts = _SOURCE_PART.findall(name)
    if parts:
        return ".".join(parts)
    local = _SOURCE_LOCAL.match(name)
    return local.group(1) if local else name


def output_names(gm: fx.GraphModule) -> list[str]:
    """A readable name for each output of a Dynamo graph: the value's name and where in the
    user's code it is made (``mean, made at model.py:42: self.logged.append(h.mean(0))``),
    from the node's ``stack_trace``; the name alone where there is none."""
    out = gm.graph.find_nodes(op="output")[0]
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return [_described(v) if isinstance(v, fx.Node) else repr(v) for v in values]


def _described(node: fx.Node) -> str:
    where = user_line(node.meta.get("stack_trace") or "")
    return f"{node.name}, made at {where}" if where else node.name


def user_line(stack_trace: str) -> str | None:
    """``file:line: code`` of the innermost frame of a formatted stack trace that is not in
    torch's own sources (the user's line), or None; the file as a graph break's
    (`erase_fx.report.short_path`)."""
    lines = stack_trace.splitlines()
    found = None
    for i, line in enumerate(lines):
        frame = _FRAME.search(line)
        if frame is None or os.path.abspath(frame.group(1)).startswith(TORCH_ROOT):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        found = f"{short_path(frame.group(1))}:{frame.group(2)}" + (
            f": {code}" if code else "")
    return found
