"""The kernels Inductor generates for one training step, stock against erase:
``python -m bench.kernel_counts``.

For each config (`bench.models.parse_config`: chains, gpt, torchvision
models) and each backend (``inductor``: stock ``torch.compile``; ``erase``:
``backend="erase"`` with Inductor inside, its CUDA graphs off), one forward
and backward is compiled and run, and the code Inductor wrote is read
(``torch._inductor.utils.run_and_get_code``): how many modules it compiled
(stock: a forward and a backward; erase: one per segment, and the backward),
how many fused kernels they define (Triton on a GPU, C++ on CPU), and the
extern calls they make (``mm``, ``addmm``, ``convolution``,
``convolution_backward``, ...), comments left out. What a segment boundary
costs in fusion shows as fused kernels erase has beyond stock; extern calls
(the matrix work) should match. A compile-time view, not a timing: CPU and
GPU code differ (layout choices such as channels-last are made for GPUs
only), so the GPU's figures are those a GPU run prints.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
import time
from collections.abc import Sequence

import torch
from torch._inductor.utils import run_and_get_code

from bench.models import build_config, parse_config

BACKENDS = ("inductor", "erase")
#: A fused kernel's definition in Inductor's output code (C++ on CPU, Triton on a GPU).
_FUSED = re.compile(r"^\w+ = async_compile\.(?:cpp_pybinding|cpp|triton)\(", re.M)
#: An extern call: ``extern_kernels.mm(...)`` or an aten op Inductor calls as is.
_EXTERN = re.compile(r"\b(?:extern_kernels\.(\w+)|torch\.ops\.aten\.(\w+)\.\w+)\(")


@dataclasses.dataclass(frozen=True)
class KernelCounts:
    """What Inductor generated for one step: modules compiled, fused kernels defined, extern
    calls by name."""

    modules: int
    fused: int
    externs: dict[str, int]

    @classmethod
    def of(cls, codes: Sequence[str]) -> KernelCounts:
        fused = 0
        externs: collections.Counter[str] = collections.Counter()
        for code in codes:
            fused += len(_FUSED.findall(code))
            for line in code.splitlines():
                if line.lstrip().startswith("#"):
                    continue
                for extern, aten in _EXTERN.findall(line):
                    externs[extern or aten] += 1
        return cls(len(codes), fused, dict(sorted(externs.items())))


def count_step(text: str, backend: str, device: torch.device) -> KernelCounts:
    """The kernels of one forward and backward of config ``text`` under ``backend``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = build_config(parse_config(text), device)
    options = {"inner": "inductor", "cudagraphs": False} if backend == "erase" else None
    compiled = torch.compile(model, backend=backend, options=options)

    def step():
        loss = compiled(*inputs)
        loss.backward()
        return loss

    _, codes = run_and_get_code(step)
    return KernelCounts.of(codes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tv-resnet18-dgl:8:32,tv-mobilenet-dgl:8:32",
                        help="comma-separated configs (bench.models.parse_config)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print("| config | backend | modules | fused kernels | extern calls |")
    print("|---|---|---|---|---|")
    for text in args.configs.split(","):
        for backend in BACKENDS:
            start = time.perf_counter()
            counts = count_step(text, backend, device)
            externs = ", ".join(f"{k} {v}" for k, v in counts.externs.items())
            print(f"| {text} | {backend} | {counts.modules} | {counts.fused} | {externs} |",
                  flush=True)
            print(f"{text} {backend}: compiled and ran in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
