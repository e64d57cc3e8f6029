"""Lightning's ``Trainer`` with the whole training step in one CUDA graph.

    python examples/lightning_whole_step.py

The module of ``examples/lightning_dropin.py``, compiled the same way
(``torch.compile(module, backend="erase")``, then ``trainer.fit``), with
manual optimization: its step (zero_grad, forward, ``manual_backward``,
``opt.step()``) is a method decorated by ``compile_manual_step``, which
captures it in one CUDA graph after two warm-up steps and replays it, while
the Trainer counts every step (``max_steps``, ``global_step``). The optimizer
must be capturable (Adam with ``capturable=True``; a tensor ``lr`` changes
without a new capture). Without a GPU the step runs as written, and it says so.
"""
import torch
from lightning_dropin import LocalLosses, fit

from erase_fx.integrations.lightning import compile_manual_step


class WholeStep(LocalLosses):
    def __init__(self, **sizes):
        super().__init__(**sizes)
        self.automatic_optimization = False

    @compile_manual_step
    def step(self, x, y):
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        loss = self(x, y)
        self.manual_backward(loss)
        opt.step()
        return loss.detach()

    def training_step(self, batch, batch_idx):
        return self.step(*batch)  # NB: not batch_idx: each new value would be a new capture

    def configure_optimizers(self):
        lr = torch.tensor(1e-3, device=self.device)
        # NB: capturable (the step count stays on the GPU) needs CUDA; off it, nothing is captured
        return torch.optim.Adam(self.parameters(), lr=lr, capturable=self.device.type == "cuda")


def main(steps=20, options=None):
    torch.manual_seed(0)
    module = WholeStep()
    trainer = fit(module, steps, backend="erase", options=options or {})
    step = module.step
    print(f"{trainer.global_step} steps: {step.compiled.captures} capture(s), "
          f"{step.compiled.replays} replays; uncaptured: {step.uncaptured_reason}")
    print(f"final loss {trainer.callback_metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
