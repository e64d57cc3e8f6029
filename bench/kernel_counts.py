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
``convolution_backward``, ...), comments left out; ``--differences`` lists
the fused kernels, by name (the ops each fuses), that one backend has more of
than the other. What a segment boundary
costs in fusion shows as fused kernels erase has beyond stock; extern calls
(the matrix work) should match. A compile-time view, not a timing: CPU and
GPU code differ (layout choices such as channels-last are made for GPUs
only), so the GPU's figures are those a GPU run prints. A GPU run updates the
current table, ``bench/results/kernel_counts.md`` (``--out``; a CPU run only
when ``--out`` names a file; `bench.tables`): a config, device and backend
counted again replaces its row.
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
from bench.tables import default_out, this_run, update_table

BACKENDS = ("inductor", "erase")
#: A fused kernel's definition in Inductor's output code (C++ on CPU, Triton on a GPU).
_FUSED = re.compile(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\(", re.M)
#: An extern call: ``extern_kernels.mm(...)`` or an aten op Inductor calls as is.
_EXTERN = re.compile(r"\b(?:extern_kernels\.(\w+)|torch\.ops\.aten\.(\w+)\.\w+)\(")


@dataclasses.dataclass(frozen=True)
class KernelCounts:
    """What Inductor generated for one step: modules compiled, fused kernels defined, extern
    calls by name."""

    modules: int
    fused: int
    externs: dict[str, int]
    #: fused kernels by name without their number (``triton_poi_fused_relu_3`` ->
    #: ``triton_poi_fused_relu``): the ops each fused
    names: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, codes: Sequence[str]) -> KernelCounts:
        names: collections.Counter[str] = collections.Counter()
        externs: collections.Counter[str] = collections.Counter()
        for code in codes:
            names.update(re.sub(r"_\d+$", "", name) for name in _FUSED.findall(code))
            for line in code.splitlines():
                if line.lstrip().startswith("#"):
                    continue
                for extern, aten in _EXTERN.findall(line):
                    externs[extern or aten] += 1
        return cls(len(codes), sum(names.values()), dict(sorted(externs.items())),
                   dict(sorted(names.items())))

    def beyond(self, other: KernelCounts) -> dict[str, int]:
        """The fused kernels (by name) this has more of than ``other``, and how many more."""
        return {name: n - other.names.get(name, 0) for name, n in self.names.items()
                if n > other.names.get(name, 0)}


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
    parser.add_argument("--differences", action="store_true",
                        help="after the table, the fused kernels (by name: the ops they fuse) "
                        "each backend has more of than the other")
    parser.add_argument("--out", help="the table to update (default on a GPU: "
                        "bench/results/kernel_counts.md; '' for none)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = default_out("kernel_counts.md", device.type == "cuda", args.out)
    rows = []
    print("| config | backend | modules | fused kernels | extern calls |")
    print("|---|---|---|---|---|")
    found: dict[str, dict[str, KernelCounts]] = {}
    for text in args.configs.split(","):
        for backend in BACKENDS:
            start = time.perf_counter()
            counts = found.setdefault(text, {})[backend] = count_step(text, backend, device)
            externs = ", ".join(f"{k} {v}" for k, v in counts.externs.items())
            print(f"| {text} | {backend} | {counts.modules} | {counts.fused} | {externs} |",
                  flush=True)
            rows.append({"config": text, "device": device.type, "backend": backend,
                         "modules": str(counts.modules), "fused kernels": str(counts.fused),
                         "extern calls": externs})
            print(f"{text} {backend}: compiled and ran in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    if args.differences:
        for text, counts in found.items():
            for more, fewer in (("erase", "inductor"), ("inductor", "erase")):
                extra = counts[more].beyond(counts[fewer])
                print(f"\n{text}: fused kernels {more} has beyond {fewer}'s"
                      + ("" if extra else ": none"))
                for name, n in sorted(extra.items(), key=lambda item: (-item[1], item[0])):
                    print(f"- {n} x {name}")
    if out is not None:
        update_table(out, title=TITLE, intro=INTRO,
                     columns=("config", "device", "backend", "modules", "fused kernels",
                              "extern calls"),
                     key=("config", "device", "backend"), rows=rows,
                     run=this_run("bench.kernel_counts", argv),
                     order=lambda row: (row["config"], row["device"], row["backend"]))
    return 0


TITLE = "bench.kernel_counts: the kernels Inductor writes for a step, stock against erase"
INTRO = """\
Written by `python -m bench.kernel_counts` (on the GPU, `bash bench/device_run.sh
kernels-a`): a row per config, device and backend, replaced when counted again; `git log -p
bench/results/kernel_counts.md` shows what each run changed. Modules compiled, fused kernels
defined, extern calls by name (`--differences` prints the fused kernels one backend has
beyond the other's)."""


if __name__ == "__main__":
    sys.exit(main())
