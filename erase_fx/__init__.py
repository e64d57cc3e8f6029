"""erase_fx: run the backward of detached blocks early, on side CUDA streams.

``torch.compile(model, backend="erase")`` finds each block whose output is
detached and that has its own loss, runs its backward right after its
forward, on a side stream, overlapping the rest of the forward, and returns
gradients equal to eager.
"""
from erase_fx.backend import erase_backend, make_backend
from erase_fx.config import EraseConfig
from erase_fx.errors import (
    EraseDistributedError,
    EraseError,
    EraseOptionError,
    EraseRuntimeError,
    GraphInvariantError,
    StepCaptureError,
    UnsupportedBlockError,
)
from erase_fx import progress
from erase_fx.explain import explain
from erase_fx.report import BlockReport, GraphReport, RejectedReport, collect_reports
from erase_fx.step import CompiledStep, compile_step

__version__ = "0.1.0"

progress.install_default_handler()

__all__ = [
    "BlockReport",
    "CompiledStep",
    "EraseConfig",
    "EraseDistributedError",
    "EraseError",
    "EraseOptionError",
    "EraseRuntimeError",
    "GraphInvariantError",
    "GraphReport",
    "RejectedReport",
    "StepCaptureError",
    "UnsupportedBlockError",
    "collect_reports",
    "compile_step",
    "erase_backend",
    "explain",
    "make_backend",
]
