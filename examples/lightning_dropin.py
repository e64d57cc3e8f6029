"""Lightning's ``Trainer`` with ``backend="erase"``: the drop-in.

    python examples/lightning_dropin.py

A LightningModule of three blocks, each Linear-ReLU with a small head and its
own cross-entropy; each block reads the last one's output detached, and the
losses are summed. Compiled the way Lightning's docs say (``torch.compile`` on
the module, then ``trainer.fit``), with ``backend="erase"``: erase_fx runs the
backward of each early block as soon as its forward ends (on a side CUDA
stream on a GPU), with gradients equal to eager's. It prints the early blocks
erase found and the final loss. The whole step in one CUDA graph:
``examples/lightning_whole_step.py``.
"""
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

import erase_fx


class LocalLosses(L.LightningModule):
    """Blocks trained by their own heads: each block's input is detached."""

    def __init__(self, d_in=16, width=32, classes=5, blocks=3):
        super().__init__()
        sizes = [d_in] + [width] * blocks
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(i, o), nn.ReLU())
                                    for i, o in zip(sizes, sizes[1:]))
        self.heads = nn.ModuleList(nn.Linear(width, classes) for _ in range(blocks))

    def forward(self, x, y):
        loss = 0
        for block, head in zip(self.blocks, self.heads):
            x = block(x.detach())
            loss = loss + F.cross_entropy(head(x), y)
        return loss

    def training_step(self, batch, batch_idx):
        return self(*batch)

    # NB: the loss is logged here, not in training_step: given a compiled module, Lightning
    # compiles training_step too (lightning/pytorch/utilities/compile.py:58), and Dynamo
    # fails on self.log there with any backend (it reads training_step's signature:
    # "'method' object has no attribute '__dict__'"; torch 2.13, Lightning 2.6).
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("loss", outputs["loss"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def random_batches(steps, batch=8, d_in=16, classes=5, seed=1):
    """One random batch ``(x, y)`` per step, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def fit(module, steps=20, **compile_kwargs):
    """Train ``module`` for ``steps`` steps, compiled with ``compile_kwargs`` (none: eager)."""
    model = torch.compile(module, **compile_kwargs) if compile_kwargs else module
    trainer = L.Trainer(max_steps=steps, accelerator="auto", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = torch.utils.data.DataLoader(random_batches(steps), batch_size=None)
    trainer.fit(model, data)
    return trainer


def main(steps=20, options=None):
    torch.manual_seed(0)
    module = LocalLosses()
    with erase_fx.collect_reports() as reports:
        trainer = fit(module, steps, backend="erase", options=options or {})
    for report in reports:
        for block in report.blocks:
            print(f"early block {block.id}: {', '.join(block.params)}")
        for rest in report.rejected:
            print(f"in the backward: {', '.join(rest.params)} ({rest.reason}: {rest.detail})")
    print(f"final loss {trainer.callback_metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
