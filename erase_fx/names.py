"""Readable names of the inputs of a Dynamo graph: parameters by their qualified names.

AOTAutograd's flat inputs are the module's own parameters and buffers (none
when Dynamo lifts them, the default) followed by the graph's placeholders.
Dynamo names a lifted parameter by its source (``L['self']._modules['stages']
._modules['0']._parameters['weight']``); reports say ``stages.0.weight``.
"""
from __future__ import annotations

import re

import torch.fx as fx

_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")
_SOURCE_LOCAL = re.compile(r"^[LG]\['([^']*)'\]$")


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
    parts = _SOURCE_PART.findall(name)
    if parts:
        return ".".join(parts)
    local = _SOURCE_LOCAL.match(name)
    return local.group(1) if local else name
