"""What one graph's compilation is given, and what it decides, as frozen data.

AOTAutograd calls `erase_fx.compilation.GraphCompilation` back in stages
(partition, then the forward's compile, then, at the first ``.backward()``,
the backward's), so a compilation decides in stages too; each stage records
what it decided once, here:

    CompileRequest  what the backend gives, before AOTAutograd calls back
"""
from __future__ import annotations

import dataclasses
from typing import Any

from erase_fx.config import EraseConfig


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """What the backend gives one graph's compilation: fixed for its life.

    Attributes:
        cfg: the settings.
        graph_id: the backend's sequence number for the graph (0, 1, ...).
        input_names: each input of the Dynamo graph, by the name users know it by
            (`erase_fx.names.input_names`).
        output_names: each output of the Dynamo graph, named with where the user's code
            makes it (`erase_fx.names.output_names`).
        ends_at_graph_break: Dynamo ended this graph at a graph break: more of the
            forward follows it, which its last block's backward can overlap
            (`erase_fx.emit.graph_end`).
        data_parallel: the DDP module whose forward this graph is part of
            (`erase_fx.ddp`), or None.
        require_early_blocks: a whole graph kept from Dynamo's DDP optimizer: without
            early blocks, it is handed back to be split (`erase_fx.ddp.NoEarlyBlocks`).
    """

    cfg: EraseConfig
    graph_id: int
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    ends_at_graph_break: bool = False
    data_parallel: Any = None
    require_early_blocks: bool = False

    @property
    def runs_graph_end(self) -> bool:
        """Whether a block ready only when the forward ends runs there
        (`erase_fx.emit.graph_end`): where more of the forward follows the graph (Dynamo
        ended it at a graph break), for the program to overlap. NB: the program runs such
        a block or leaves it to the backward, so it needs segments (side streams); under
        DDP the early all-reduce needs every early gradient made in the forward. A graph
        that ends at the forward's return keeps its last block in the backward, as stock
        does: nothing but the backward would follow it."""
        return (self.ends_at_graph_break and self.cfg.streams > 0
                and self.data_parallel is None)
