"""What `keep_inplace_writes` does to one kernel group: ``python -m bench.check_inplace_fusion``.

Compiles `softmax_head` (a matmul's output ``B``, softmax statistics over it,
a same-size value made from ``B`` and the statistics, and a loss value that
reads ``B`` at each row's target) with stock Inductor and inside
`erase_fx.emit.inplace_fusion.keep_inplace_writes`, and prints for each the
fusions refused, the kernel calls and the buffers written in place
(``# reuse`` lines) of the generated code, and whether both compute the same.
On a GPU the expected difference: stock writes the softmax into a buffer of
its own, the kept form writes it over ``B``; the check passes when both equal
eager and, on a GPU, the kept form refused a fusion and writes over ``B``.
Runs on CPU too (``--device cpu``), where Inductor's C++ kernels write over
``B`` either way. ``--head soft`` compiles `soft_target_head` instead: the loss
of label-smoothed targets made from the labels, which reads ``B`` at every
index (the local heads of ``gpt-soft``). A GPU run updates its section (head
and device) of ``bench/results/check_inplace_fusion.md`` (``--out``; a CPU
run only when ``--out`` names a file; `bench.tables`).
"""
from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Sequence

import torch

from bench.tables import default_out, this_run, update_sections


def softmax_head(a: torch.Tensor, w: torch.Tensor, target: torch.Tensor):
    """``B = a @ w``; returns (softmax of B, loss value read from B at ``target``), as a
    cross-entropy's forward and backward make them: from B and its log-sum-exp."""
    b = a @ w
    m = b.amax(1, keepdim=True)
    lse = m + (b - m).exp().sum(1, keepdim=True).log()
    value = (lse - b.gather(1, target)).mean()
    return (b - lse).exp(), value


def soft_target_head(a: torch.Tensor, w: torch.Tensor, target: torch.Tensor,
                     smoothing: float = 0.1):
    """``B = a @ w``; returns (the gradient of the soft-target cross-entropy over B, its value),
    as a label-smoothed loss's forward and backward make them: targets made from the labels,
    a value that reads B at every index, and a same-size gradient made from B."""
    b = a @ w
    m = b.amax(1, keepdim=True)
    log_probs = b - (m + (b - m).exp().sum(1, keepdim=True).log())
    classes = b.shape[1]
    labels = target == torch.arange(classes, device=b.device)  # NB: as gpt-soft's heads
    soft = labels.float() * (1 - smoothing) + smoothing / classes
    value = -(soft * log_probs).sum(1).mean()
    return (log_probs.exp() - soft) / b.shape[0], value


HEADS = {"target": softmax_head, "soft": soft_target_head}


def compile_once(device: str, keep: bool, rows: int = 2048, cols: int = 4096,
                 head=softmax_head):
    """(refused fusions or None, generated code, outputs equal eager's) of one compile."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from erase_fx.emit.inplace_fusion import keep_inplace_writes

    torch._dynamo.reset()
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(rows, 64, device=device, generator=generator)
    w = torch.randn(64, cols, device=device, generator=generator)
    target = torch.randint(0, cols, (rows, 1), device=device, generator=generator)
    keeping = keep_inplace_writes(min_bytes=1 << 20) if keep else contextlib.nullcontext()
    with keeping as handler, config.patch(fx_graph_cache=False):
        got, code = run_and_get_code(torch.compile(head), a, w, target)
    want = head(a, w, target)
    # NB: the softmax is exp(B - lse) with lse near 30: fp32 rounding of lse (another sum
    # order than eager's) moves it by a few 1e-6, relative
    same = all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(got, want))
    return getattr(handler, "refused", None), code[0], same


def writes_over_matmul(code: str) -> bool:
    """Whether the generated code writes a value over the matmul's output (the buffer its
    ``extern_kernels.mm`` writes)."""
    made = re.search(r"extern_kernels\.mm\(.*out=(buf\d+)\)", code)
    return made is not None and any(
        f"del {made.group(1)}" in line and line.rstrip().endswith("# reuse")
        for line in code.splitlines())


def call_lines(code: str) -> list[str]:
    """The kernel calls and in-place reuses of a generated module's ``call``."""
    body = code[code.index("def call("):]
    body = body[:body.index("\n    return ")] if "\n    return " in body else body
    return [line.strip() for line in body.splitlines()
            if "# reuse" in line or ".run(" in line or "extern_kernels." in line
            or line.strip().startswith("cpp_fused")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--head", choices=sorted(HEADS), default="target",
                        help="target: a loss read at each row's target (softmax_head); soft: "
                             "label-smoothed targets (soft_target_head)")
    parser.add_argument("--out", help="the sections file to update (default on a GPU: "
                        "bench/results/check_inplace_fusion.md; '' for none)")
    args = parser.parse_args(argv)
    ok, printed = True, []

    def say(line: str) -> None:
        print(line)
        printed.append(line)

    for keep in (False, True):
        refused, code, same = compile_once(args.device, keep, head=HEADS[args.head])
        over = writes_over_matmul(code)
        say(f"{'keep_inplace_writes' if keep else 'stock'} on {args.device}: refused {refused}, "
            f"same as eager: {same}, writes over the matmul's output: {over}")
        for line in call_lines(code):
            say(f"    {line}")
        ok &= same
        if keep and args.device == "cuda":
            # NB: on CPU Inductor's C++ kernels write over it either way
            ok &= bool(refused) and over
    say("PASS" if ok else "FAIL")
    out = default_out("check_inplace_fusion.md", args.device == "cuda", args.out)
    if out is not None:
        update_sections(out, title=TITLE, intro=INTRO,
                        sections=[(f"--head {args.head} on {args.device}",
                                   "```\n" + "\n".join(printed) + "\n```")],
                        run=this_run("bench.check_inplace_fusion", argv))
    return 0 if ok else 1


TITLE = "bench.check_inplace_fusion: the kernels of one head, stock and kept in place"
INTRO = """\
Written by `python -m bench.check_inplace_fusion` (on the GPU, `bash bench/device_run.sh
soft-d`): a section per head and device, each replaced by the next run of the same;
`git log -p bench/results/check_inplace_fusion.md` shows what each run changed. Each: the
fusions refused, the kernel calls and in-place reuses of the generated code, stock then
with `keep_inplace_writes`, and the verdict (PASS: both equal eager and, on a GPU, the
kept form writes over the matmul's output)."""


if __name__ == "__main__":
    raise SystemExit(main())
