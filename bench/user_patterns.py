"""Detached blocks with local losses as users write them: ``python -m bench.user_patterns``.

erase_fx's own models return a 0-d loss from one graph and nothing else. Code
from outside differs (issue 36): a loss accumulator of shape ``[1]``, graph
breaks between blocks (an ``autograd.Function`` instance kept on the module,
a ``.item()`` for logging, a data-dependent op), outputs with history that
nobody differentiates (activations captured by forward hooks, a mean kept on
the module), a Lightning ``Trainer`` around the model, a ``transformers``
model with probes. Each pattern here is a small model of one such habit,
tiny enough to train a few steps on a CPU in seconds:

- ``ff_accumulator``: a Forward-Forward net, its goodness losses added into
  ``torch.zeros(1)``, inputs normalised by a Function instance, ``.item()``
  logged per layer (Dynamo skips its forward and compiles each layer alone);
- ``ff_one_graph``: the same net without the Function instance and ``.item()``: one
  graph, so its ``[1]``-shaped loss reaches erase;
- ``vgg_local_loss``: conv blocks (BatchNorm) that each return ``(h, loss)``;
- ``hooked_activations``: forward hooks keep each block's activation in a dict;
- ``logged_on_module``: each block keeps ``self.last_mean = h.mean(0)``;
- ``data_dependent_between``: only the labelled rows (``nonzero``) go past block 0;
- ``lightning_module``: a ``LightningModule`` trained by ``lightning.Trainer``;
- ``gpt2_probes``: a tiny ``transformers`` GPT-2 with a detached probe per layer.

`PATTERNS` maps each name to its `Pattern`: a factory returning ``(model,
example_inputs, loss_of)`` (``loss_of`` maps the model's output to the loss;
here always the model's own loss), fresh batches, the optimizer, and, for
Lightning, its own training loop. `train` trains one pattern eager, with
stock Inductor or with erase and records every step's gradients; `blocks_found`
counts the early blocks erase finds in a real compiled training step.

``main`` compiles each pattern with erase (``on_error="raise"``, so a crash of
erase_fx's own code shows instead of falling back) and prints a table: the
graphs compiled, the early blocks, the share of the backward's FLOPs that runs
early, why the rest stays in the backward, whether the gradients equal eager's
(``aot_eager`` inside: bitwise), what ``erase_fx.explain`` finds, and with
``--inductor`` how far erase with Inductor inside is from eager against stock
Inductor's own distance. Needs ``lightning`` and ``transformers`` (the ``test``
extra); CPU only.

For the GPU, `PatternConfig` (``pattern-<name>:B[:width[:depth]]``) and
`build_pattern` give each pattern but Lightning's (``bench.frameworks`` times
Lightning) at a size where a step takes milliseconds on an H200
(`BENCH_SIZES`, `PATTERN_CONFIGS`): `bench.run` configs, timed with each
pattern's own ``loss_of`` (``bash bench/device_run.sh patterns-a``).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import erase_fx

#: Seed of every model's initial parameters (each factory call builds the same model).
MODEL_SEED = 0
#: Seed of the batches a training run draws, one fresh batch per step.
DATA_SEED = 1
STEPS = 3
#: erase's options where gradients must equal eager's bitwise: no code generation, no fallback.
EXACT = {"inner": "aot_eager", "on_error": "raise"}
#: erase with Inductor inside, as users get it, but a crash of erase's own code raises.
INDUCTOR = {"on_error": "raise"}

Batch = tuple[Any, ...]
LossOf = Callable[[Any], torch.Tensor]


def own_loss(output: torch.Tensor) -> torch.Tensor:
    """The model returns its loss."""
    return output


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run the block under ``torch.manual_seed(seed)`` and restore the global RNG after it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# -- ff_accumulator ---------------------------------------------------------------


class UnitLength(torch.autograd.Function):
    """Each row scaled to unit length, its backward written out: the custom normalisation
    Forward-Forward code applies to every layer's input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        norm = x.norm(dim=1, keepdim=True) + 1e-4
        y = x / norm
        ctx.save_for_backward(y, norm)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        y, norm = ctx.saved_tensors
        return (grad - y * (grad * y).sum(dim=1, keepdim=True)) / norm


class FFLayer(nn.Module):
    """A Forward-Forward layer: ReLU(Linear) of its input scaled to unit length by a
    `UnitLength` *instance* kept on the layer (``self.norm_fn.apply``)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.norm_fn = UnitLength()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(self.norm_fn.apply(x)))


class ForwardForwardNet(nn.Module):
    """Layers trained by their own goodness (mean squared activity): high on positive data,
    low on negative data. Each layer reads the last one's output detached; the losses go
    into a ``[1]``-shaped accumulator, and each layer's loss is logged with ``.item()``."""

    def __init__(self, sizes: Sequence[int] = (16, 32, 32, 32), threshold: float = 2.0):
        super().__init__()
        self.layers = nn.ModuleList(FFLayer(i, o) for i, o in zip(sizes, sizes[1:]))
        self.threshold = threshold
        self.layer_losses: list[float] = [0.0] * len(self.layers)

    def forward(self, x_pos: torch.Tensor, x_neg: torch.Tensor) -> torch.Tensor:
        n = x_pos.shape[0]
        h = torch.cat([x_pos, x_neg])
        loss = torch.zeros(1, device=h.device)
        for i, layer in enumerate(self.layers):
            h = layer(h.detach())
            goodness = h.pow(2).mean(dim=1)
            layer_loss = F.softplus(torch.cat([self.threshold - goodness[:n],
                                               goodness[n:] - self.threshold])).mean()
            self.layer_losses[i] = layer_loss.item()
            loss = loss + layer_loss
        return loss


class InlineNormFFLayer(nn.Module):
    """An `FFLayer` that normalises its input with plain tensor ops (no Function)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x / (x.norm(dim=1, keepdim=True) + 1e-4)))


class OneGraphForwardForwardNet(ForwardForwardNet):
    """`ForwardForwardNet` without what breaks its graph (the Function instance, ``.item()``):
    Dynamo compiles its whole forward, ``[1]``-shaped loss accumulator included."""

    def __init__(self, sizes: Sequence[int] = (16, 32, 32, 32), threshold: float = 2.0):
        nn.Module.__init__(self)
        self.layers = nn.ModuleList(InlineNormFFLayer(i, o) for i, o in zip(sizes, sizes[1:]))
        self.threshold = threshold

    def forward(self, x_pos: torch.Tensor, x_neg: torch.Tensor) -> torch.Tensor:
        n = x_pos.shape[0]
        h = torch.cat([x_pos, x_neg])
        loss = torch.zeros(1, device=h.device)
        for layer in self.layers:
            h = layer(h.detach())
            goodness = h.pow(2).mean(dim=1)
            loss = loss + F.softplus(torch.cat([self.threshold - goodness[:n],
                                                goodness[n:] - self.threshold])).mean()
        return loss


def ff_accumulator() -> tuple[nn.Module, Batch, LossOf]:
    with _seeded(MODEL_SEED):
        model = ForwardForwardNet()
    return model, _ff_batch(torch.Generator().manual_seed(0)), own_loss


def ff_one_graph() -> tuple[nn.Module, Batch, LossOf]:
    with _seeded(MODEL_SEED):
        model = OneGraphForwardForwardNet()
    return model, _ff_batch(torch.Generator().manual_seed(0)), own_loss


def _ff_batch(generator: torch.Generator) -> Batch:
    return (torch.randn(8, 16, generator=generator) + 1.0,
            torch.randn(8, 16, generator=generator))


# -- vgg_local_loss ---------------------------------------------------------------


class LocalLossConvBlock(nn.Module):
    """Conv-BN-ReLU-MaxPool with its own classifier head; returns ``(h.detach(), loss)``."""

    def __init__(self, cin: int, cout: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                  nn.Linear(4 * cout, classes))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        loss = F.cross_entropy(self.head(h), y)
        return h.detach(), loss


class LocalLossVGG(nn.Module):
    """VGG-ish conv blocks trained by local losses, then a classifier on the last one."""

    def __init__(self, widths: Sequence[int] = (8, 16), classes: int = 10, image: int = 16):
        super().__init__()
        chans = (3, *widths)
        self.blocks = nn.ModuleList(LocalLossConvBlock(i, o, classes)
                                    for i, o in zip(chans, chans[1:]))
        side = image >> len(widths)
        self.classifier = nn.Linear(widths[-1] * side * side, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses = []
        h = x
        for block in self.blocks:
            h, loss = block(h, y)
            losses.append(loss)
        losses.append(F.cross_entropy(self.classifier(h.flatten(1)), y))
        return sum(losses)


def vgg_local_loss() -> tuple[nn.Module, Batch, LossOf]:
    with _seeded(MODEL_SEED):
        model = LocalLossVGG()
    return model, _image_batch(torch.Generator().manual_seed(0)), own_loss


def _image_batch(generator: torch.Generator) -> Batch:
    return (torch.randn(4, 3, 16, 16, generator=generator),
            torch.randint(0, 10, (4,), generator=generator))


# -- MLPs of detached blocks: hooked_activations, logged_on_module, data_dependent_between


class Block(nn.Module):
    """Linear-ReLU with a classifier head; ``forward`` returns the hidden activation."""

    def __init__(self, d_in: int, d: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, d), nn.ReLU())
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class DetachedMLP(nn.Module):
    """Blocks trained by their heads' cross-entropy, each reading the last one detached."""

    def __init__(self, d_in: int = 16, d: int = 32, classes: int = 5, blocks: int = 3,
                 block: type[Block] = Block):
        super().__init__()
        sizes = (d_in, *[d] * blocks)
        self.blocks = nn.ModuleList(block(i, o, classes) for i, o in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = 0.0
        h = x
        for block in self.blocks:
            h = block(h)
            loss = loss + F.cross_entropy(block.head(h), y)
            h = h.detach()
        return loss


def watch_activations(model: nn.Module) -> dict[str, torch.Tensor]:
    """Keep each block's latest output in a dict, by forward hooks (feature inspection)."""
    activations: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            activations[name] = output
        return hook

    for name, block in model.blocks.named_children():
        block.register_forward_hook(keep(f"block{name}"))
    return activations


def hooked_activations() -> tuple[nn.Module, Batch, LossOf]:
    with _seeded(MODEL_SEED):
        model = DetachedMLP()
    model.activations = watch_activations(model)
    return model, _vector_batch(torch.Generator().manual_seed(0)), own_loss


def _vector_batch(generator: torch.Generator) -> Batch:
    return torch.randn(8, 16, generator=generator), torch.randint(0, 5, (8,), generator=generator)


class LoggingBlock(Block):
    """A `Block` that keeps its output's mean on itself for logging (with its history; nothing
    asks for its gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        self.last_mean = h.mean(0)
        return h


def logged_on_module() -> tuple[nn.Module, Batch, LossOf]:
    with _seeded(MODEL_SEED):
        model = DetachedMLP(block=LoggingBlock)
    return model, _vector_batch(torch.Generator().manual_seed(0)), own_loss


class LabelledRowsMLP(DetachedMLP):
    """Block 0 learns from every row (unlabelled rows, ``y == -1``, ignored by its loss); only
    the labelled rows, found with ``nonzero``, go on to the later blocks."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        first, *rest = self.blocks
        h = first(x)
        loss = F.cross_entropy(first.head(h), y, ignore_index=-1)
        labelled = (y >= 0).nonzero().squeeze(1)
        h, y = h.detach()[labelled], y[labelled]
        for block in rest:
            h = block(h)
            loss = loss + F.cross_entropy(block.head(h), y)
            h = h.detach()
        return loss


def data_dependent_between() -> tuple[nn.Module, Batch, LossOf]:
    with _seeded(MODEL_SEED):
        model = LabelledRowsMLP()
    return model, _half_labelled_batch(torch.Generator().manual_seed(0)), own_loss


def _half_labelled_batch(generator: torch.Generator) -> Batch:
    """Half the rows labelled, at random places (the same count each step: one shape)."""
    x, y = _vector_batch(generator)
    unlabelled = torch.randperm(len(y), generator=generator)[: len(y) // 2]
    y[unlabelled] = -1
    return x, y


# -- lightning_module -------------------------------------------------------------


def _lightning_module_class() -> type:
    import lightning as L

    class LocalLossLightning(L.LightningModule):
        """Detached blocks with local heads, as a LightningModule: ``forward`` returns the
        summed local losses, ``training_step`` returns it, and the loss is logged once the
        step ends.

        NB: not by ``self.log`` in ``training_step``: Lightning compiles ``training_step``
        too, and Dynamo (torch 2.13, Lightning 2.6) fails tracing ``self.log``
        (``InternalTorchDynamoError: 'method' object has no attribute '__dict__'``) with any
        backend, stock ones included.
        """

        def __init__(self, d_in: int = 16, d: int = 32, classes: int = 5, blocks: int = 3):
            super().__init__()
            sizes = (d_in, *[d] * blocks)
            self.blocks = nn.ModuleList(Block(i, o, classes) for i, o in zip(sizes, sizes[1:]))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            losses = []
            for block in self.blocks:
                x = block(x)
                losses.append(F.cross_entropy(block.head(x), y))
                x = x.detach()
            return torch.stack(losses).sum()

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            return self(*batch)

        def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
            self.log("train_loss", outputs["loss"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return LocalLossLightning


def lightning_module() -> tuple[nn.Module, Batch, LossOf]:
    with _seeded(MODEL_SEED):
        model = _lightning_module_class()()
    return model, _vector_batch(torch.Generator().manual_seed(0)), own_loss


def train_with_lightning(model: nn.Module, forward: Callable, batches: list[Batch]) -> list[dict]:
    """Train ``model`` (``forward``: itself or its ``torch.compile``) by ``lightning.Trainer``,
    one step per batch; the gradients each step's optimizer step sees."""
    import lightning as L

    grads: list[dict] = []

    class RecordGrads(L.Callback):
        def on_before_optimizer_step(self, trainer: Any, module: nn.Module, optimizer: Any) -> None:
            grads.append(_grads_of(module))

    with _quiet_lightning():
        trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[RecordGrads()])
        loader = torch.utils.data.DataLoader(batches, batch_size=None)
        trainer.fit(forward, train_dataloaders=loader)
    return grads


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """No banner lines ("GPU available: False") and no advice about DataLoader workers."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        # NB: Lightning 2.6's own use of a torch.utils._pytree API torch 2.13 deprecates
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


# -- gpt2_probes ------------------------------------------------------------------


class GPT2WithProbes(nn.Module):
    """A GPT-2 language model and a linear probe per layer that reads the layer's hidden
    states detached and predicts the current token; the probes' losses add to the LM's."""

    def __init__(self, layers: int = 2, width: int = 32, vocab: int = 64, context: int = 16,
                 heads: int = 2):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        # NB: no dropout, so eager, stock Inductor and erase compare on rounding alone
        config = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers,
                            n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=vocab - 1, eos_token_id=vocab - 1)
        self.gpt = GPT2LMHeadModel(config)
        self.probes = nn.ModuleList(nn.Linear(width, vocab) for _ in range(layers))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.gpt(input_ids, labels=input_ids, output_hidden_states=True)
        loss = out.loss
        for probe, hidden in zip(self.probes, out.hidden_states[1:]):
            logits = probe(hidden.detach())
            loss = loss + F.cross_entropy(logits.flatten(0, 1), input_ids.flatten())
        return loss


def gpt2_probes() -> tuple[nn.Module, Batch, LossOf]:
    with _seeded(MODEL_SEED):
        model = GPT2WithProbes()
    return model, _token_batch(torch.Generator().manual_seed(0)), own_loss


def _token_batch(generator: torch.Generator) -> Batch:
    return (torch.randint(0, 64, (2, 16), generator=generator),)


# -- patterns and training --------------------------------------------------------


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One habit of user code.

    Attributes:
        name: the pattern's name.
        factory: builds ``(model, example_inputs, loss_of)``; the same parameters each call.
        sample: a fresh batch from a generator (one per training step).
        optimizer: the optimizer users would train it with.
        lightning: trained by ``lightning.Trainer`` (its module's own optimizer), not by a loop.
    """

    name: str
    factory: Callable[[], tuple[nn.Module, Batch, LossOf]]
    sample: Callable[[torch.Generator], Batch]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = _sgd
    lightning: bool = False


PATTERNS: dict[str, Pattern] = {p.name: p for p in (
    Pattern("ff_accumulator", ff_accumulator, _ff_batch, _adam),
    Pattern("ff_one_graph", ff_one_graph, _ff_batch, _adam),
    Pattern("vgg_local_loss", vgg_local_loss, _image_batch),
    Pattern("hooked_activations", hooked_activations, _vector_batch),
    Pattern("logged_on_module", logged_on_module, _vector_batch),
    Pattern("data_dependent_between", data_dependent_between, _half_labelled_batch),
    Pattern("lightning_module", lightning_module, _vector_batch, lightning=True),
    Pattern("gpt2_probes", gpt2_probes, _token_batch, _adam),
)}


@dataclasses.dataclass
class Run:
    """What one training run recorded.

    Attributes:
        grads: each step's gradients, by parameter name (None where a parameter had none).
        state: the model's state after the last step (parameters, BatchNorm's buffers).
        reports: the reports of the graphs erase compiled (empty for eager and stock).
    """

    grads: list[dict[str, torch.Tensor | None]]
    state: dict[str, torch.Tensor]
    reports: list[erase_fx.GraphReport]


def compile_kwargs(variant: str, options: dict | None = None) -> dict | None:
    """``torch.compile``'s arguments for ``"eager"`` (None), ``"inductor"`` or ``"erase"``."""
    if variant == "eager":
        return None
    if variant == "inductor":
        return {"backend": "inductor"}
    if variant == "erase":
        return {"backend": "erase", "options": dict(options if options is not None else EXACT)}
    raise ValueError(f"unknown variant {variant!r}; expected eager, inductor or erase")


def train(pattern: Pattern | str, variant: str = "eager", options: dict | None = None,
          steps: int = STEPS) -> Run:
    """Train a fresh copy of ``pattern``'s model for ``steps`` steps, a fresh batch each.

    ``variant``: ``"eager"``, ``"inductor"`` (stock) or ``"erase"`` (with ``options``,
    `EXACT` by default). Every variant starts from the same parameters and sees the same
    batches; the model is compiled the way its users compile it (the module, by
    ``torch.compile(model, ...)``).
    """
    pattern = PATTERNS[pattern] if isinstance(pattern, str) else pattern
    model, _, loss_of = pattern.factory()
    kwargs = compile_kwargs(variant, options)
    forward = torch.compile(model, **kwargs) if kwargs else model
    generator = torch.Generator().manual_seed(DATA_SEED)
    batches = [pattern.sample(generator) for _ in range(steps)]
    with erase_fx.collect_reports() as reports, _seeded(DATA_SEED):
        if pattern.lightning:
            grads = train_with_lightning(model, forward, batches)
        else:
            grads = []
            optimizer = pattern.optimizer(model.parameters())
            for batch in batches:
                optimizer.zero_grad(set_to_none=True)
                loss_of(forward(*batch)).backward()
                grads.append(_grads_of(model))
                optimizer.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Run(grads, state, list(reports))


def _grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def blocks_found(pattern: Pattern | str, options: dict | None = None) -> int:
    """How many early blocks erase finds in one real compiled training step of ``pattern``,
    summed over the graphs it compiles (`EXACT` options unless given)."""
    return sum(len(r.blocks) for r in train(pattern, "erase", options, steps=1).reports)


def mismatches(run: Run, reference: Run) -> list[str]:
    """The gradients (``step k: name``) and state entries of ``run`` not bitwise equal to
    ``reference``'s; empty when every one is."""
    found = []
    for step, (got, expected) in enumerate(zip(run.grads, reference.grads)):
        for name, ref in expected.items():
            value = got.get(name)
            differ = (value is None) != (ref is None) or (
                ref is not None and not torch.equal(value, ref))
            if differ:
                found.append(f"step {step}: {name}")
    if len(run.grads) != len(reference.grads):
        found.append(f"{len(run.grads)} steps recorded, eager {len(reference.grads)}")
    found += [f"state: {name}" for name, ref in reference.state.items()
              if not torch.equal(run.state[name], ref)]
    return found


def distance(run: Run, reference: Run) -> float:
    """The largest ``||a - b|| / ||b||`` over every step's gradients and the final floating
    state (as `bench.check_models` measures); inf where a gradient is missing on one side only."""
    pairs = [(got.get(name), ref) for got, expected in zip(run.grads, reference.grads)
             for name, ref in expected.items()]
    pairs += [(run.state.get(name), ref) for name, ref in reference.state.items()
              if ref.is_floating_point()]
    worst = 0.0
    for value, ref in pairs:
        if value is None or ref is None:
            if value is not ref:
                return float("inf")
            continue
        worst = max(worst, float((value.double() - ref.double()).norm()
                                 / ref.double().norm().clamp_min(1e-12)))
    return worst


def within_stock(erase: float, stock: float) -> bool:
    """erase's distance from eager against stock Inductor's: twice it plus 1e-6, the bound
    `bench.check_models` holds erase to (Inductor's segments fuse and round differently)."""
    return erase <= 2 * stock + 1e-6


# -- bench configs: each pattern at a GPU's size (bench.run) --------------------------

#: Inputs of the vector patterns at bench size: 784 features (a flattened 28 x 28 image), and
#: the classes of every pattern's heads but the GPT-2's.
BENCH_FEATURES, BENCH_CLASSES = 784, 10
#: The VGG's images (3 x 64 x 64); the GPT-2's sequences (256 tokens of a vocabulary of 8192).
BENCH_IMAGE, BENCH_CONTEXT, BENCH_VOCAB = 64, 256, 8192
#: pattern -> its bench config's default (batch, width, depth) (`PatternConfig`): a step of
#: milliseconds on an H200.
BENCH_SIZES = {
    "ff_accumulator": (1024, 2048, 4),
    "ff_one_graph": (1024, 2048, 4),
    "vgg_local_loss": (256, 64, 4),
    "hooked_activations": (1024, 2048, 4),
    "logged_on_module": (1024, 2048, 4),
    "data_dependent_between": (1024, 2048, 4),
    "gpt2_probes": (16, 768, 6),
}
#: Patterns with no bench config, and why.
NOT_BENCHED = {"lightning_module": "bench.frameworks times Lightning's Trainer "
                                   "(python -m bench.frameworks)"}
#: The bench configs at their default sizes, in `BENCH_SIZES` order.
PATTERN_CONFIGS = tuple(f"pattern-{name}:{b}:{w}:{d}" for name, (b, w, d) in BENCH_SIZES.items())


@dataclasses.dataclass(frozen=True)
class PatternConfig:
    """``pattern-<name>:B[:width[:depth]]``: a pattern of `PATTERNS` at a bench size.

    Omitted numbers take the pattern's `BENCH_SIZES`; the config's text is always the
    full form (``pattern-ff_one_graph:1024`` is ``pattern-ff_one_graph:1024:2048:4``).
    What the numbers are, per pattern (`build_pattern`):

    - ``ff_accumulator``, ``ff_one_graph``: B positive and B negative rows of 784
      features, ``depth`` Forward-Forward layers of ``width`` units;
    - ``vgg_local_loss``: B images 3 x 64 x 64, ``depth`` conv blocks of ``width``,
      ``2 width``, ``4 width``, ... channels, each with its head, then the classifier;
    - ``hooked_activations``, ``logged_on_module``, ``data_dependent_between``: B rows of
      784 features, ``depth`` blocks Linear(width)-ReLU with a 10-class head each (half the
      rows labelled for ``data_dependent_between``: the same count each batch);
    - ``gpt2_probes``: B sequences of 256 tokens (vocabulary 8192), a GPT-2 of ``depth``
      layers of ``width`` (heads of 64: ``width`` a multiple of 64, or one head under 64)
      and a probe per layer.
    """

    name: str
    batch: int
    width: int
    depth: int

    @classmethod
    def parse(cls, text: str) -> PatternConfig:
        kind, *numbers = text.split(":")
        name = kind.removeprefix("pattern-")
        if name in NOT_BENCHED:
            raise ValueError(f"config {text!r}: {name} has no bench config: "
                             f"{NOT_BENCHED[name]}")
        if not kind.startswith("pattern-") or name not in BENCH_SIZES:
            raise ValueError(f"config {text!r} is not pattern-<name>:B[:width[:depth]] with "
                             f"name one of {', '.join(BENCH_SIZES)}")
        if not 1 <= len(numbers) <= 3 or not all(n.isdigit() for n in numbers):
            raise ValueError(f"config {text!r} is not pattern-<name>:B[:width[:depth]] "
                             "(positive integers)")
        given = [int(n) for n in numbers]
        cfg = cls(name, *given, *BENCH_SIZES[name][len(given):])
        cfg.check(text)
        return cfg

    def check(self, text: str) -> None:
        """Raise ValueError where the pattern cannot be built at this size."""
        if self.batch < 2 or self.width < 1 or self.depth < 2:
            raise ValueError(f"config {text!r}: batch at least 2, width at least 1, depth at "
                             "least 2 (one early block, then the last)")
        if self.name == "vgg_local_loss" and BENCH_IMAGE >> self.depth < 2:
            raise ValueError(f"config {text!r}: {self.depth} pooling blocks leave no 2 x 2 map "
                             f"of a {BENCH_IMAGE} x {BENCH_IMAGE} image")
        if self.name == "gpt2_probes" and self.width >= 64 and self.width % 64:
            raise ValueError(f"config {text!r}: width a multiple of 64 (heads of 64), or "
                             "under 64 (one head)")

    @property
    def kind(self) -> str:
        return f"pattern-{self.name}"

    def __str__(self) -> str:
        return f"{self.kind}:{self.batch}:{self.width}:{self.depth}"


def build_pattern(cfg: PatternConfig, device: torch.device | str = "cpu",
                  generator: torch.Generator | None = None) -> tuple[nn.Module, Batch, LossOf]:
    """``(model, inputs, loss_of)`` of a bench config: the pattern's model at ``cfg``'s size
    on ``device`` (the same parameters each call), one batch drawn from ``generator`` (on
    ``device``), and the pattern's own ``loss_of`` (its factory's). Raises ImportError,
    naming the config, where the pattern needs a package that is not installed."""
    device = torch.device(device)
    model = pattern_model(cfg, device)
    loss_of = PATTERNS[cfg.name].factory()[2]
    return model, _BENCH_INPUTS[cfg.name](cfg, device, generator), loss_of


def pattern_model(cfg: PatternConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The model of `build_pattern` alone: the same parameters each call."""
    try:
        with _seeded(MODEL_SEED):
            model = _BENCH_MODELS[cfg.name](cfg)
    except ImportError as error:
        raise ImportError(f"{cfg} needs {error.name or 'a package'} ({error})") from error
    return model.to(device)


def _ff_sizes(cfg: PatternConfig) -> tuple[int, ...]:
    return (BENCH_FEATURES, *[cfg.width] * cfg.depth)


def _bench_hooked(cfg: PatternConfig) -> nn.Module:
    model = DetachedMLP(BENCH_FEATURES, cfg.width, BENCH_CLASSES, cfg.depth)
    model.activations = watch_activations(model)
    return model


_BENCH_MODELS: dict[str, Callable[[PatternConfig], nn.Module]] = {
    "ff_accumulator": lambda cfg: ForwardForwardNet(_ff_sizes(cfg)),
    "ff_one_graph": lambda cfg: OneGraphForwardForwardNet(_ff_sizes(cfg)),
    "vgg_local_loss": lambda cfg: LocalLossVGG(
        tuple(cfg.width << k for k in range(cfg.depth)), BENCH_CLASSES, BENCH_IMAGE),
    "hooked_activations": _bench_hooked,
    "logged_on_module": lambda cfg: DetachedMLP(BENCH_FEATURES, cfg.width, BENCH_CLASSES,
                                                cfg.depth, block=LoggingBlock),
    "data_dependent_between": lambda cfg: LabelledRowsMLP(BENCH_FEATURES, cfg.width,
                                                          BENCH_CLASSES, cfg.depth),
    "gpt2_probes": lambda cfg: GPT2WithProbes(cfg.depth, cfg.width, BENCH_VOCAB, BENCH_CONTEXT,
                                              heads=max(1, cfg.width // 64)),
}


def _bench_ff_batch(cfg: PatternConfig, device: torch.device,
                    generator: torch.Generator | None) -> Batch:
    shape = (cfg.batch, BENCH_FEATURES)
    return (torch.randn(shape, device=device, generator=generator) + 1.0,
            torch.randn(shape, device=device, generator=generator))


def _bench_vector_batch(cfg: PatternConfig, device: torch.device,
                        generator: torch.Generator | None) -> Batch:
    return (torch.randn(cfg.batch, BENCH_FEATURES, device=device, generator=generator),
            torch.randint(0, BENCH_CLASSES, (cfg.batch,), device=device, generator=generator))


def _bench_half_labelled_batch(cfg: PatternConfig, device: torch.device,
                               generator: torch.Generator | None) -> Batch:
    x, y = _bench_vector_batch(cfg, device, generator)
    unlabelled = torch.randperm(cfg.batch, device=device, generator=generator)[: cfg.batch // 2]
    y[unlabelled] = -1
    return x, y


def _bench_image_batch(cfg: PatternConfig, device: torch.device,
                       generator: torch.Generator | None) -> Batch:
    return (torch.randn(cfg.batch, 3, BENCH_IMAGE, BENCH_IMAGE, device=device,
                        generator=generator),
            torch.randint(0, BENCH_CLASSES, (cfg.batch,), device=device, generator=generator))


def _bench_token_batch(cfg: PatternConfig, device: torch.device,
                       generator: torch.Generator | None) -> Batch:
    return (torch.randint(0, BENCH_VOCAB, (cfg.batch, BENCH_CONTEXT), device=device,
                          generator=generator),)


_Sample = Callable[[PatternConfig, torch.device, torch.Generator | None], Batch]
_BENCH_INPUTS: dict[str, _Sample] = {
    "ff_accumulator": _bench_ff_batch,
    "ff_one_graph": _bench_ff_batch,
    "vgg_local_loss": _bench_image_batch,
    "hooked_activations": _bench_vector_batch,
    "logged_on_module": _bench_vector_batch,
    "data_dependent_between": _bench_half_labelled_batch,
    "gpt2_probes": _bench_token_batch,
}


# -- the table --------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    pattern: str
    graphs: int = 0
    blocks: int = 0
    early_share: float = 0.0
    left: str = ""
    grads: str = ""
    explain: str = ""
    inductor: str = ""


def measure(pattern: Pattern, inductor: bool) -> Row:
    """One pattern's row: erase (`EXACT`) against eager; ``inductor``: also erase with
    Inductor inside against stock Inductor's distance from eager."""
    row = Row(pattern.name)
    eager = train(pattern, "eager")
    torch._dynamo.reset()
    try:
        erased = train(pattern, "erase", EXACT)
    except Exception as error:  # noqa: BLE001 - a crash is this pattern's finding
        row.grads = f"crash: {_one_line(error)}"
        torch._dynamo.reset()
        erased = train(pattern, "erase", {**EXACT, "on_error": "fallback"})
    else:
        wrong = mismatches(erased, eager)
        row.grads = "bitwise" if not wrong else f"DIFFER ({len(wrong)}: {wrong[0]}, ...)"
    reports = erased.reports
    row.graphs = len(reports)
    row.blocks = sum(len(r.blocks) for r in reports)
    backward = sum(r.backward_flops for r in reports)
    row.early_share = sum(r.early_flops for r in reports) / backward if backward else 0.0
    reasons = collections.Counter(r.reason for report in reports for r in report.rejected)
    fallbacks = collections.Counter(r.fallback_reason for r in reports
                                    if r.fallback_reason and r.fallback_reason != "no early block")
    row.left = ", ".join([f"{reason} x{n}" for reason, n in sorted(reasons.items())]
                         + [f"fallback: {reason} x{n}" for reason, n in fallbacks.items()])
    row.explain = _explained(pattern)
    if inductor:
        row.inductor = _inductor_verdict(pattern, eager)
    return row


def _explained(pattern: Pattern) -> str:
    """The early blocks ``erase_fx.explain`` finds on the example inputs, or its error."""
    torch._dynamo.reset()
    model, inputs, _ = pattern.factory()
    try:
        reports = erase_fx.explain(model, *inputs, erase_options={"on_error": "raise"})
    except Exception as error:  # noqa: BLE001 - reported in the table
        return f"error: {_one_line(error)}"
    return f"{sum(len(r.blocks) for r in reports)} in {len(reports)} graph(s)"


def _inductor_verdict(pattern: Pattern, eager: Run) -> str:
    torch._dynamo.reset()
    stock = distance(train(pattern, "inductor"), eager)
    torch._dynamo.reset()
    try:
        erase = distance(train(pattern, "erase", INDUCTOR), eager)
    except Exception as error:  # noqa: BLE001 - reported in the table
        return f"crash: {_one_line(error)}"
    verdict = "PASS" if within_stock(erase, stock) else "FAIL"
    return f"{verdict} ({erase:.1e} vs stock {stock:.1e})"


def _one_line(error: BaseException, limit: int = 160) -> str:
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(rows: Sequence[Row], inductor: bool) -> str:
    head = ["pattern", "graphs", "early blocks", "early share", "left in the backward",
            "grads vs eager (aot_eager)", "explain"] + (["Inductor vs stock"] if inductor else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.pattern, str(r.graphs), str(r.blocks), f"{r.early_share:.0%}", r.left or "-",
                 r.grads, r.explain] + ([r.inductor] if inductor else [])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--inductor", action="store_true",
                        help="also train with Inductor inside, against stock Inductor (slower)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.patterns:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(measure(PATTERNS[name], args.inductor))
    print(f"torch {torch.__version__}, {STEPS} steps, erase options {EXACT}")
    print(table(rows, args.inductor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
