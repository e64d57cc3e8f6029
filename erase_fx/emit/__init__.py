"""Emission: compile each segment with the inner compiler and drive them on streams."""
from erase_fx.emit.inner import compile_graph, compile_segment, decompositions_for
from erase_fx.emit.program import StreamProgram, Step
from erase_fx.emit.streams import CudaStreams, StreamOps, VirtualStreams

__all__ = [
    "CudaStreams",
    "Step",
    "StreamOps",
    "StreamProgram",
    "VirtualStreams",
    "compile_graph",
    "compile_segment",
    "decompositions_for",
]
