"""GPU correctness on models users bring: ``python -m bench.check_models``.

Each model (torchvision's, as shipped and in detached stages with local
heads; a transformer chain with dropout; the paper's CTR model with dropout
in its blocks) trains a few SGD steps in train mode under:

- ``stock64``: stock ``torch.compile`` in float64: the reference;
- ``stock``: stock ``torch.compile`` in float32 (tf32 off): what Inductor's
  own rounding costs;
- ``erase``: ``backend="erase"`` with its defaults (CUDA graphs on);
- ``erase-nographs``: the same with ``cudagraphs: False``.

Random ops (dropout, stochastic depth) draw the same masks in all four:
the RNG is reseeded before every step, and Inductor's random numbers depend
on the seed and the element's index only, not on the dtype, on fusion or on
erase's segments. So each variant's distance from the reference is rounding,
and erase passes when its first-step gradients, its parameters after the last
step and its BatchNorm buffers are within twice stock's distance (plus 1e-6).
A trajectory can be unstable: a ReLU or a max-pool that flips after one step
moves the state far whatever caused the difference (DGL ResNet-18 at batch 8
on a CPU). So when erase's first-step gradients pass and its final state does
not, stock is trained again from parameters perturbed by 1e-6
(`PERTURBATION`); where that moves stock's own final state as far, erase's
state is held to twice the sum of both distances instead, and the verdict
says ``PASS (unstable trajectory ...)``. Gradients are never held to less.
A reference stock itself is far from (over 1e-2) is reported INVALID, not
passed. Random models also check that two steps on the same batch draw
different masks (fresh masks at every CUDA graph replay).

Prints a line per model and variant, then a table, and updates the current
table, ``bench/results/check_models.md`` (``--out``, rewritten after each
model; `bench.tables`): a model checked again replaces its row, the others
stay with their date and command (a CPU run updates a table only when
``--out`` names one). ``--budget-s`` stops starting models
and variants in time: the models not started are listed as skipped, a model
cut between variants is INCOMPLETE (counted as not passed). On an H200 a
torchvision model takes 80-110 s per variant, four variants each: GoogLeNet
alone needs about 6 minutes (``bench/device_run.sh models-a..d`` split the
suite into device calls). Needs a GPU (torchvision for the vision models).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn

import erase_fx
from bench.tables import default_out, this_run, update_table

STEPS = 3
LR = 0.05
INVALID_REFERENCE = 1e-2
#: relative size of the random change to stock's initial parameters that measures how far an
#: unstable trajectory moves by itself
PERTURBATION = 1e-6


def _vision(name: str, batch: int = 8, image: int = 32) -> Callable[[torch.device], tuple]:
    def build(device):
        from bench.vision import build_vision

        return build_vision(name, batch, image, device=device)
    return build


def _shipped(factory: str, batch: int = 8, image: int = 32, **kwargs) -> Callable:
    def build(device):
        import torchvision.models as models

        from bench.vision import CLASSES, Classified, vision_inputs

        net = getattr(models, factory)(num_classes=CLASSES, **kwargs)
        return Classified(net).to(device).train(), vision_inputs(batch, image, device)
    return build


def _gpt_dropout(device):
    from bench.models import GPTChain, GPTConfig, gpt_inputs

    cfg = GPTConfig.parse("gpt:4:128:64:4")
    model = GPTChain(cfg, amp_dtype=None)
    for block in model.blocks:
        block.mlp.append(nn.Dropout(0.1))
    return model.to(device).train(), gpt_inputs(cfg, device)


def _ctr_dropout(device):
    from bench.paper.ctr import DENSE_FEATURES, FIELDS, BlockChainCTR, ModelSizes

    sizes = ModelSizes(rows_per_field=(1000,) * FIELDS, embed_dim=16, bottom=(64, 32), width=128,
                       hidden=256, blocks=4)
    model = BlockChainCTR(sizes)
    for block in model.blocks:
        layers = list(block.mlp)
        block.mlp = nn.Sequential(*layers[:2], nn.Dropout(0.1), *layers[2:4], nn.Dropout(0.1),
                                  *layers[4:])
    batch = 64
    dense = torch.randn(batch, DENSE_FEATURES, device=device)
    sparse = torch.randint(0, 1000, (batch, FIELDS), device=device)
    labels = torch.randint(0, 2, (batch,), device=device).float()
    return model.to(device).train(), (dense, sparse, labels)


#: name -> (builder, has random ops). In priority order: the budget cuts the tail.
MODELS: dict[str, tuple[Callable, bool]] = {
    "gpt-dropout": (_gpt_dropout, True),
    "ctr-dropout": (_ctr_dropout, True),
    "tv-resnet18-dgl": (_vision("tv-resnet18-dgl"), False),
    "tv-googlenet-aux": (_vision("tv-googlenet-aux", image=64), True),
    "tv-mobilenet-dgl": (_vision("tv-mobilenet-dgl", image=64), True),
    "tv-efficientnet-dgl": (_vision("tv-efficientnet-dgl", image=64), True),
    "tv-vit-dgl": (_vision("tv-vit-dgl"), False),
    "tv-resnet18": (_vision("tv-resnet18"), False),
    "tv-mobilenet": (_shipped("mobilenet_v3_small", image=64), True),
    "tv-efficientnet": (_shipped("efficientnet_b0", image=64), True),
    "tv-vit-dropout": (_shipped("VisionTransformer", image_size=32, patch_size=4,
                                num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512,
                                dropout=0.1), True),
}
VARIANTS = ("stock64", "stock", "erase", "erase-nographs")
#: name -> erase options beside the defaults. GoogLeNet's two aux parts are 2.6% of the
#: backward each, under the cost check's ``min_part_share``: forced early, so this check
#: covers gradient parts on a real model (with the defaults it would compare stock to stock).
ERASE_OPTIONS: dict[str, dict] = {"tv-googlenet-aux": {"tuning": {"min_part_share": 0.0}}}


def compile_variant(name: str, model: nn.Module, erase_options: dict | None = None) -> Callable:
    if name.startswith("stock"):
        return torch.compile(model)
    options = {"cudagraphs": False} if name == "erase-nographs" else {}
    return torch.compile(model, backend="erase", options={**(erase_options or {}), **options})


def train(name: str, base: nn.Module, batch: tuple, steps: int,
          erase_options: dict | None = None) -> dict:
    """``steps`` SGD steps of variant ``name`` on ``batch``; grads of step 1, state at the end."""
    torch._dynamo.reset()
    double = name == "stock64"
    model = copy.deepcopy(base).to(torch.float64 if double else torch.float32)
    inputs = tuple(t.double() if double and t.is_floating_point() else t for t in batch)
    fn = compile_variant(name, model, erase_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    first_grads = None
    with erase_fx.collect_reports() as reports:
        for step in range(steps):
            torch.manual_seed(1000 + step)  # NB: the same masks in every variant
            optimizer.zero_grad(set_to_none=True)
            fn(*inputs).backward()
            if first_grads is None:
                first_grads = {k: p.grad.detach().double().clone()
                               for k, p in model.named_parameters() if p.grad is not None}
            optimizer.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    state = {k: v.detach().double().clone() for k, v in model.state_dict().items()
             if v.is_floating_point()}
    return {"grads": first_grads, "state": state, "reports": list(reports), "fn": fn,
            "model": model, "inputs": inputs}


def distance(run: dict, reference: dict, keys: tuple[str, ...] = ("grads", "state")) -> float:
    """The largest ||a - b|| / ||b|| over first-step grads and the final state (``keys``)."""
    worst = 0.0
    for key in keys:
        for name, ref in reference[key].items():
            value = run[key].get(name)
            if value is None:
                return float("inf")
            worst = max(worst, float((value - ref).norm() / ref.norm().clamp_min(1e-12)))
    return worst


def perturbed(base: nn.Module) -> nn.Module:
    """A copy of ``base`` with each floating parameter scaled by ``1 + PERTURBATION * N(0, 1)``
    (its own generator: the training steps' seeds are untouched)."""
    model = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                noise = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
                p.mul_(1 + PERTURBATION * noise)
    return model


def masks_are_fresh(run: dict) -> bool:
    """Two steps on one batch, no optimizer step between: the gradients differ (new masks)."""
    model, fn, inputs = run["model"], run["fn"], run["inputs"]
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        fn(*inputs).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return any(not torch.equal(a, b) for a, b in zip(*grads))


def check_model(name: str, builder: Callable, random: bool, device, steps: int,
                deadline: float = float("inf")) -> dict:
    """One model's row; a variant not started by ``deadline`` (``perf_counter``) is left out
    and the verdict says INCOMPLETE."""
    torch.manual_seed(0)
    base, batch = builder(device)
    row = {"model": name, "random": random}
    runs = {}
    for variant in VARIANTS:
        start = time.perf_counter()
        if start > deadline:
            row["verdict"] = f"INCOMPLETE (budget spent before {variant})"
            print(f"  {name}: {row['verdict']}", flush=True)
            return row
        try:
            runs[variant] = train(variant, base, batch, steps, ERASE_OPTIONS.get(name))
        except Exception as error:  # noqa: BLE001 - reported as a failure of this row
            row[variant] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(f"  {name} {variant}: FAIL ({row[variant]})", flush=True)
            continue
        print(f"  {name} {variant}: ran in {time.perf_counter() - start:.0f} s", flush=True)
    reference = runs.get("stock64")
    if reference is None or "stock" not in runs:
        row["verdict"] = "FAIL (no reference)"
        return row
    row["stock"] = distance(runs["stock"], reference)
    reports = runs.get("erase", {}).get("reports") or []
    row["blocks"] = sum(len(r.blocks) for r in reports)
    row["parts"] = sum(b.partials for r in reports for b in r.blocks)
    row["fallback"] = "; ".join(r.fallback_reason for r in reports if r.fallback_reason) or None
    verdicts = []
    bound = 2 * row["stock"] + 1e-6
    for variant in ("erase", "erase-nographs"):
        if variant not in runs:
            verdicts.append(f"{variant} FAIL")
            continue
        row[variant] = distance(runs[variant], reference)
        if row[variant] <= bound:
            verdicts.append(f"{variant} PASS")
        elif distance(runs[variant], reference, ("grads",)) > bound:
            verdicts.append(f"{variant} FAIL")
        else:  # the first step's gradients pass, the state after the last step does not
            if "unstable" not in row:
                row["unstable"] = distance(train("stock", perturbed(base), batch, steps),
                                           runs["stock"], ("state",))
            wider = 2 * (row["stock"] + row["unstable"]) + 1e-6
            verdicts.append(
                f"{variant} PASS (unstable trajectory: stock perturbed by {PERTURBATION:.0e} "
                f"ends {row['unstable']:.1e} from stock)" if row[variant] <= wider
                else f"{variant} FAIL")
    if random and "erase" in runs:
        row["fresh_masks"] = masks_are_fresh(runs["erase"])
        verdicts.append("masks " + ("PASS" if row["fresh_masks"] else "FAIL"))
    if row["stock"] > INVALID_REFERENCE:
        verdicts = [f"INVALID (stock is {row['stock']:.1e} from the reference)"]
    row["verdict"] = ", ".join(verdicts)
    print(f"{name}: {row['verdict']}", flush=True)
    return row


COLUMNS = ("model", "random", "early blocks", "parts", "stock vs fp64", "erase vs fp64",
           "erase (no graphs) vs fp64", "verdict", "fallback")


def cells(r: dict) -> dict[str, str]:
    """A model's row as the table's cells."""
    distances = {}
    for key, column in (("stock", "stock vs fp64"), ("erase", "erase vs fp64"),
                        ("erase-nographs", "erase (no graphs) vs fp64")):
        value = r.get(key, "-")
        distances[column] = f"{value:.2e}" if isinstance(value, float) else str(value)
    return {"model": r["model"], "random": "yes" if r["random"] else "no",
            "early blocks": str(r.get("blocks", "-")), "parts": str(r.get("parts", "-")),
            **distances, "verdict": r.get("verdict", "-"), "fallback": r.get("fallback") or ""}


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        row = cells(r)
        lines.append("| " + " | ".join(row[c] for c in COLUMNS) + " |")
    return "\n".join(lines)


def model_order(row: dict) -> tuple:
    """The table's order: `MODELS`' order, then any other model by name."""
    names = list(MODELS)
    return (names.index(row["model"]) if row["model"] in names else len(names), row["model"])


TITLE = "bench.check_models: the latest result of each model"
INTRO = """\
Written by `python -m bench.check_models` (on the GPU, `bash bench/device_run.sh
models-a..d`): each run replaces the rows of the models it checked and leaves the others;
`git log -p bench/results/check_models.md` shows what each run changed. Distances are from
stock `torch.compile` in float64 after a few SGD steps with the same masks; erase passes
within twice stock's float32 distance (plus 1e-6)."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--out", help="the table to update (default on a GPU: "
                        "bench/results/check_models.md; '' for none)")
    parser.add_argument("--device", default="cuda",
                        help="cuda (default); cpu runs the same checks for a smoke test")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.check_models needs a GPU (or --device cpu)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    out = default_out("check_models.md", args.device == "cuda", args.out)
    run = this_run("bench.check_models", argv)
    start = time.perf_counter()
    rows, skipped = [], []
    for name in args.models.split(","):
        if time.perf_counter() - start > args.budget_s:
            skipped.append(name)
            continue
        builder, random = MODELS[name]
        print(f"{name}:", flush=True)
        try:
            rows.append(check_model(name, builder, random, device, args.steps,
                                    deadline=start + args.budget_s))
        except ImportError as error:
            skipped.append(f"{name} ({error})")
        if out is not None and rows:
            update_table(out, title=TITLE, intro=INTRO, columns=COLUMNS, key=("model",),
                         rows=[cells(r) for r in rows], run=run, order=model_order)
    print()
    print(table(rows))
    if skipped:
        print(f"skipped: {', '.join(skipped)}")
    failed = [r["model"] for r in rows if "FAIL" in r.get("verdict", "FAIL")
              or "INCOMPLETE" in r.get("verdict", "")]
    print(f"{len(rows) - len(failed)} of {len(rows)} models passed" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
