"""Dump the compiled programs of the bench configs on CPU, to compare two trees.

What a refactoring must leave alone is the program erase_fx builds: every
pass's graph, the segments, the report (`erase_fx.instruments` writes them,
without paths, ids or times). This compiles each config on the CPU with
``dump_dir`` set, runs one forward and backward, and leaves one folder per
config; ``timings.json``, the one file that differs from run to run, is
removed. Two trees compare with ``diff -r``::

    python -m bench.dump_programs /tmp/before            # on the old tree
    python -m bench.dump_programs /tmp/after             # on the new one
    diff -r /tmp/before /tmp/after && echo identical

The configs are the bench's kinds at CPU sizes (``--configs`` to choose);
``--inner aot_eager`` skips Inductor (faster, same passes).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

#: One config of every kind the bench has on CPU (vision needs torchvision).
DEFAULT_CONFIGS = (
    "mlp:32:64:128:4",
    "ctr:64:64:128:4",
    "mlp-towers:32:64:128:3",
    "ctr-towers-top:64:64:128:3",
    "gpt:2:64:32:3",
    "gpt-soft:2:64:32:3",
)


def dump_config(text: str, out: Path, inner: str) -> None:
    """Compile config ``text`` with erase on the CPU and dump its program into ``out``."""
    from bench.models import GPTChain, build_config, parse_config

    torch._dynamo.reset()
    cfg = parse_config(text)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model, inputs = build_config(cfg, torch.device("cpu"), generator)
    if isinstance(model, GPTChain):
        model.amp_dtype = None  # bf16 autocast on CPU is slow and not what the GPU runs
    compiled = torch.compile(model, backend="erase",
                             options={"dump_dir": str(out), "inner": inner, "on_error": "raise"})
    compiled(*inputs).backward()
    for timings in out.rglob("timings.json"):
        timings.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (replaced)")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    args = parser.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    for text in args.configs:
        print(f"dumping {text}", file=sys.stderr, flush=True)
        dump_config(text, args.out / text.replace(":", "_"), args.inner)
    print(f"wrote {len(args.configs)} programs under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
