"""Small models, joint-graph tracing and gradient comparison shared by the tests."""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import default_partition

from erase_fx.emit import decompositions_for
from erase_fx.passes.graph import clone_module

# -- models ------------------------------------------------------------------


class TwoBlock(nn.Module):
    """Block 1 (with a local MSE head) feeds block 2 through a detach."""

    def __init__(self, d_in: int = 8, hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.b1 = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 16), nn.Tanh())
        self.head1 = nn.Linear(16, d_out)
        self.b2 = nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h1 = self.b1(x)
        local = F.mse_loss(self.head1(h1), y)
        out = self.b2(h1.detach())
        return local + F.cross_entropy(out, y.argmax(-1))


class TwoBlockNoDetach(TwoBlock):
    """The same model trained end to end (deep supervision): no stop-gradient, so only
    head 1's backward (and its part of block 1's gradient) can run early."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h1 = self.b1(x)
        local = F.mse_loss(self.head1(h1), y)
        return local + F.cross_entropy(self.b2(h1), y.argmax(-1))


class TwoBlockOneLoss(TwoBlock):
    """One loss at the end and no detach: nothing can run early."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b2(self.b1(x)), y.argmax(-1))


class TwoBlockSharedLayer(TwoBlock):
    """Block 2 reuses block 1's last layer (tied weights): their backwards meet in its grads."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h1 = self.b1(x)
        local = F.mse_loss(self.head1(h1), y)
        shared = self.b1[2]  # Linear(hidden, 16)
        out = self.b2(torch.tanh(shared(F.pad(h1.detach(), (0, shared.in_features - 16)))))
        return local + F.cross_entropy(out, y.argmax(-1))


class SharedLayerClipped(TwoBlockSharedLayer):
    """As TwoBlockSharedLayer, but block 1's loss clips its gradient: no part runs early."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h1 = self.b1(x)
        local = F.mse_loss(self.head1(ClipGrad.apply(h1)), y)
        shared = self.b1[2]
        out = self.b2(torch.tanh(shared(F.pad(h1.detach(), (0, shared.in_features - 16)))))
        return local + F.cross_entropy(out, y.argmax(-1))


class Towers(nn.Module):
    """A shared front trained by several towers, each with its own loss (no detach)."""

    def __init__(self, towers: int = 3, d: int = 16, classes: int = 5, as_tuple: bool = False):
        super().__init__()
        self.front = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, classes))
            for _ in range(towers))
        self.as_tuple = as_tuple

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        shared = self.front(x)
        losses = tuple(F.cross_entropy(tower(shared), labels) for tower in self.towers)
        return losses if self.as_tuple else sum(losses)


class TwoBlockRegularized(TwoBlock):
    """TwoBlock whose last loss adds a penalty on its logits: two loss terms meeting in the
    logits' gradient, the penalty's part elementwise only."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h1 = self.b1(x)
        local = F.mse_loss(self.head1(h1), y)
        out = self.b2(h1.detach())
        return local + F.cross_entropy(out, y.argmax(-1)) + 1e-2 * out.pow(2).mean()


class TowersWithTop(Towers):
    """Towers over a shared front, each with its loss, and a top model over the detached
    tower outputs (the last block): the towers' backward runs early, each tower's part as
    soon as that tower is ready."""

    def __init__(self, towers: int = 3, d: int = 16, classes: int = 5):
        super().__init__(towers, d, classes)
        self.top = nn.Linear(towers * classes, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shared = self.front(x)
        outputs = [tower(shared) for tower in self.towers]
        losses = [F.cross_entropy(out, labels) for out in outputs]
        top = self.top(torch.cat([out.detach() for out in outputs], dim=1))
        return sum(losses) + F.cross_entropy(top, labels)


class TowersInterleaved(TowersWithTop):
    """TowersWithTop computing each tower's loss right after the tower: the towers' parts
    become ready one after another, during the forward."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shared = self.front(x)
        outputs, loss = [], 0
        for tower in self.towers:
            outputs.append(tower(shared))
            loss = loss + F.cross_entropy(outputs[-1], labels)
        top = self.top(torch.cat([out.detach() for out in outputs], dim=1))
        return loss + F.cross_entropy(top, labels)


class TwoBlockTwoOutputs(TwoBlock):
    """Returns (loss, logits): two tangents; block 1's backward reads only the loss's."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1 = self.b1(x)
        local = F.mse_loss(self.head1(h1), y)
        out = self.b2(h1.detach())
        return local + F.cross_entropy(out, y.argmax(-1)), out


class Chain(nn.Module):
    """K detached stages, each Linear-ReLU-Linear-LayerNorm with a local CE head."""

    def __init__(self, stages: int = 3, d: int = 16, hidden: int = 32, classes: int = 5):
        super().__init__()
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d), nn.LayerNorm(d))
            for _ in range(stages)
        )
        self.heads = nn.ModuleList(nn.Linear(d, classes) for _ in range(stages))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = x.new_zeros(())
        h = x
        for stage, head in zip(self.stages, self.heads):
            h = stage(h)
            loss = loss + F.cross_entropy(head(h), labels)
            h = h.detach()
        return loss


class OneElementLossChain(Chain):
    """A Chain whose loss is accumulated into ``torch.zeros(1)``: shape ``[1]``, not 0-d."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = torch.zeros(1, device=x.device)
        h = x
        for stage, head in zip(self.stages, self.heads):
            h = stage(h)
            loss = loss + F.cross_entropy(head(h), labels)
            h = h.detach()
        return loss


class SlotLossChain(Chain):
    """A Chain whose local losses are written into the slots of one tensor
    (``losses[:, k] = local``, shape ``[1, K]``) that the model returns; the caller sums it."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = torch.zeros(1, len(self.stages), device=x.device)
        h = x
        for k, (stage, head) in enumerate(zip(self.stages, self.heads)):
            h = stage(h)
            losses[:, k] = F.cross_entropy(head(h), labels)
            h = h.detach()
        return losses


class LoggedChain(Chain):
    """A Chain that keeps each stage's mean activation on the module for logging: tensors with
    history that nobody differentiates, so each stage's backward reads their tangents too."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = x.new_zeros(())
        h = x
        self.logged = []
        for stage, head in zip(self.stages, self.heads):
            h = stage(h)
            self.logged.append(h.mean(0))
            loss = loss + F.cross_entropy(head(h), labels)
            h = h.detach()
        return loss


class HookedChain(Chain):
    """A Chain whose stages' outputs forward hooks capture (as feature extractors do)."""

    def __init__(self, stages: int = 3):
        super().__init__(stages)
        self.captured: dict[int, torch.Tensor] = {}
        for i, stage in enumerate(self.stages):
            stage.register_forward_hook(
                lambda module, args, out, i=i: self.captured.__setitem__(i, out))


class LossAndLocalLosses(Chain):
    """Returns the loss and each stage's local loss (for logging): one-element outputs
    besides the loss; the loss is the one autograd starts from."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        h, locals_ = x, []
        for stage, head in zip(self.stages, self.heads):
            h = stage(h)
            locals_.append(F.cross_entropy(head(h), labels))
            h = h.detach()
        return sum(locals_), locals_


class SoftLabelChain(Chain):
    """A Chain whose heads learn label-smoothed targets made in the forward
    (``one_hot(labels) * 0.9 + 0.1 / classes``): one batch x classes value, the same in every
    block, that each block's loss and its backward read."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = x.new_zeros(())
        h = x
        for stage, head in zip(self.stages, self.heads):
            h = stage(h)
            logits = head(h)
            classes = logits.shape[-1]
            soft = F.one_hot(labels, classes).to(logits.dtype) * 0.9 + 0.1 / classes
            loss = loss - (soft * F.log_softmax(logits, -1)).sum(-1).mean()
            h = h.detach()
        return loss


class BatchNormBlocks(nn.Module):
    """Detached blocks with BatchNorm: running stats are buffers mutated in the forward."""

    def __init__(self):
        super().__init__()
        self.b1 = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head1 = nn.Linear(16, 3)
        self.b2 = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.b1(x)
        local = F.cross_entropy(self.head1(h), labels)
        return local + F.cross_entropy(self.b2(h.detach()), labels)


class GraphBreakChain(Chain):
    """A 4-stage Chain with a graph break after stage 1 (two Dynamo graphs)."""

    def __init__(self):
        super().__init__(stages=4)

    def stage(self, i: int, h: torch.Tensor, labels: torch.Tensor):
        h = self.stages[i](h)
        return h.detach(), F.cross_entropy(self.heads[i](h), labels)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h, loss0 = self.stage(0, x, labels)
        h, loss1 = self.stage(1, h, labels)
        torch._dynamo.graph_break()
        h, loss2 = self.stage(2, h, labels)
        h, loss3 = self.stage(3, h, labels)
        return loss0 + loss1 + loss2 + loss3


class ClipGrad(torch.autograd.Function):
    """Identity whose backward clips the incoming gradient: not linear in it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.clamp(-1e-3, 1e-3)


class ClippedChain(Chain):
    """A Chain whose first stage clips its gradient: the block cannot run early."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = ClipGrad.apply(self.stages[0](x))
        loss = F.cross_entropy(self.heads[0](h), labels)
        h = h.detach()
        for stage, head in zip(self.stages[1:], self.heads[1:]):
            h = stage(h)
            loss = loss + F.cross_entropy(head(h), labels)
            h = h.detach()
        return loss


class AttentionStage(nn.Module):
    """Causal self-attention (fused SDPA or written out) and a local head."""

    def __init__(self, d: int = 16, heads: int = 2, classes: int = 5, fused: bool = True):
        super().__init__()
        self.heads, self.fused = heads, fused
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return out.transpose(1, 2).reshape(b, t, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attend(x)
        return h, F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class StageChain(nn.Module):
    """Stages that each return (output, local loss); each stage reads the last one detached."""

    def __init__(self, stages: Sequence[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = 0
        for stage in self.stages:
            x, local = stage(x, y)
            loss = loss + local
            x = x.detach()
        return loss


def attention_chain(stages: int = 3, fused: bool = True) -> StageChain:
    """Detached attention stages with local losses (a transformer's shape, tiny)."""
    return StageChain([AttentionStage(fused=fused) for _ in range(stages)])


class SelectStage(nn.Module):
    """A stage that picks features with a tensor built in the forward (a graph constant)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.body, self.head = nn.Linear(d, d), nn.Linear(d // 2, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.body(x).relu()
        picked = torch.index_select(z, 1, torch.tensor([0, 2, 4, 6]))
        return z, F.binary_cross_entropy_with_logits(self.head(picked).squeeze(-1), y)


def select_chain(stages: int = 3) -> StageChain:
    return StageChain([SelectStage() for _ in range(stages)])


class Inception(nn.Module):
    """GoogLeNet's block, tiny: 1x1, 1x1 -> 3x3 and pool -> 1x1 branches, concatenated.

    Its input's gradient is a sum of the three branches' gradients: sums of
    ONE loss term's gradient, inside the trunk.
    """

    def __init__(self, channels: int = 12):
        super().__init__()
        c = channels // 3
        self.b1 = nn.Conv2d(channels, c, 1)
        self.b2 = nn.Sequential(nn.Conv2d(channels, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b3 = nn.Conv2d(channels, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.max_pool2d(x, 3, stride=1, padding=1)
        return torch.cat([F.relu(self.b1(x)), F.relu(self.b2(x)), F.relu(self.b3(pooled))], 1)


class InceptionAux(nn.Module):
    """GoogLeNet's auxiliary head, tiny (no dropout: eager and compiled draw alike)."""

    def __init__(self, channels: int = 12, classes: int = 5):
        super().__init__()
        self.conv = nn.Conv2d(channels, 4, 1)
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(F.adaptive_avg_pool2d(x, 2)))
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


class TinyGoogLeNet(nn.Module):
    """GoogLeNet's shape: auxiliary heads on the trunk, no detach, ``blocks`` Inception
    blocks after each head's branch point; loss = CE + 0.3 * (aux1 + aux2).

    Each auxiliary loss is computed right after its head, so its head's backward can
    run while the trunk goes on; its gradient meets the main loss's at the branch
    point, through ``blocks`` blocks of the trunk's own branch sums.
    """

    def __init__(self, blocks: int = 2, channels: int = 12, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.inc3 = Inception(channels)
        self.aux1 = InceptionAux(channels, classes)
        self.inc4 = nn.Sequential(*(Inception(channels) for _ in range(blocks)))
        self.aux2 = InceptionAux(channels, classes)
        self.inc5 = nn.Sequential(*(Inception(channels) for _ in range(blocks)))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.inc3(F.relu(self.stem(x)))
        aux1 = F.cross_entropy(self.aux1(h), labels)
        h = self.inc4(h)
        aux2 = F.cross_entropy(self.aux2(h), labels)
        out = self.fc(self.inc5(h).mean((2, 3)))
        return F.cross_entropy(out, labels) + 0.3 * (aux1 + aux2)


def googlenet_inputs(batch: int = 2, size: int = 6, classes: int = 5):
    return torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))


class Branches(nn.Module):
    """A multi-branch block of Linear layers: two branches concatenated plus a third
    summed, ``cat([relu(f(x)), tanh(g(x))]) + gelu(h(x))`` (no residual)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.f, self.g, self.h = nn.Linear(d, d // 2), nn.Linear(d, d // 2), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.relu(self.f(x)), torch.tanh(self.g(x))], -1) + F.gelu(self.h(x))


class AuxTrunk(nn.Module):
    """A trunk of `Branches` blocks with an auxiliary head after the stem, no detach, and
    ``blocks`` blocks between the head's branch point and the main head."""

    def __init__(self, blocks: int = 2, d: int = 16, classes: int = 5, weight: float = 0.3):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.aux = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, classes))
        self.trunk = nn.Sequential(*(Branches(d) for _ in range(blocks)))
        self.head = nn.Linear(d, classes)
        self.weight = weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        aux = F.cross_entropy(self.aux(h), labels)
        return F.cross_entropy(self.head(self.trunk(h)), labels) + self.weight * aux


class AuxTrunkClipped(AuxTrunk):
    """AuxTrunk whose auxiliary head clips its gradient: its part cannot run early."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        aux = F.cross_entropy(self.aux(ClipGrad.apply(h)), labels)
        return F.cross_entropy(self.head(self.trunk(h)), labels) + self.weight * aux


class AuxTrunkSplit(AuxTrunk):
    """AuxTrunk whose auxiliary head reads one half of the stem's features (``chunk``) and
    the trunk both halves: the losses' gradients of the first half meet in a sum, but the
    main loss's gradient of the second half reaches the stem through ``cat`` (chunk's
    backward), not a sum, so only the auxiliary term's part splits off."""

    def __init__(self, blocks: int = 2, d: int = 16, classes: int = 5):
        super().__init__(blocks, d, classes)
        self.aux = nn.Sequential(nn.Linear(d // 2, d), nn.ReLU(), nn.Linear(d, classes))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        first, second = h.chunk(2, -1)
        aux = F.cross_entropy(self.aux(first), labels)
        main = self.head(self.trunk(torch.cat([first, second * 2.0], -1)))
        return F.cross_entropy(main, labels) + self.weight * aux


def select_inputs(batch: int = 6):
    return torch.randn(batch, 8), torch.rand(batch)


def attention_inputs(batch: int = 2, t: int = 8, d: int = 16, classes: int = 5):
    return torch.randn(batch, t, d), torch.randint(0, classes, (batch, t))


class InFloat16(nn.Module):
    """``inner`` under float16 autocast, its loss small (1e-4 x): float16 gradients computed
    at seed 1 underflow where a GradScaler's scale keeps them."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, labels):
        with torch.autocast("cpu", dtype=torch.float16):
            return self.inner(x, labels) * 1e-4


def Float16Chain(stages: int = 3) -> InFloat16:  # noqa: N802 - a model, as the classes here
    """`Chain` under float16 autocast (`InFloat16`)."""
    return InFloat16(Chain(stages))


def chain_inputs(batch: int = 6, d: int = 16, classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, d), torch.randint(0, classes, (batch,))


def two_block_inputs(batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 8), torch.randn(batch, 4)


# -- joint graphs ------------------------------------------------------------


class JointGraph:
    """A joint graph AOTAutograd traced, as a partition function received it."""

    def __init__(self, gm: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int, kwargs: dict):
        self.gm = gm
        self.joint_inputs = joint_inputs
        self.num_fwd_outputs = num_fwd_outputs
        self.kwargs = kwargs


def trace_joint(model: nn.Module, *args: Any, inner: str = "aot_eager") -> JointGraph:
    """The joint forward-backward graph of ``model(*args)`` (first Dynamo graph)."""
    captured: list[JointGraph] = []

    def partition(gm, joint_inputs, *, num_fwd_outputs, **kwargs):
        if not captured:
            captured.append(JointGraph(clone_module(gm)[0], joint_inputs, num_fwd_outputs, kwargs))
        return default_partition(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        partition_fn=partition,
        decompositions=decompositions_for(inner),
    )
    torch._dynamo.reset()
    torch.compile(copy.deepcopy(model), backend=backend)(*args)
    torch._dynamo.reset()
    return captured[0]


def targets(gm: fx.GraphModule, names: Sequence[str]) -> list[str]:
    """The op (without overload) of each named node, e.g. ``["mm", "t"]``."""
    by_name = {n.name: n for n in gm.graph.nodes}
    return [_op_name(by_name[name]) for name in names]


def _op_name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


# -- gradient comparison -------------------------------------------------------


def assert_same_grads(
    reference: nn.Module, candidate: nn.Module, *, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Every parameter's grad of ``candidate`` equals ``reference``'s (None where None)."""
    ref_params = dict(reference.named_parameters())
    for name, param in candidate.named_parameters():
        expected = ref_params[name].grad
        if expected is None:
            assert param.grad is None, f"{name}: eager has no grad, erase has one"
            continue
        assert param.grad is not None, f"{name}: erase has no grad"
        torch.testing.assert_close(param.grad, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def check_parity(
    model: nn.Module,
    make_inputs: Callable[[], tuple[Any, ...]],
    *,
    options: dict | None = None,
    steps: int = 2,
    loss_of: Callable[[Any], torch.Tensor] = lambda out: out,
    dynamic: bool | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> tuple[nn.Module, nn.Module]:
    """Train-step eager and erase copies of ``model`` on the same fresh inputs.

    After every step, every parameter's grad must match. Returns (eager, erased).
    """
    eager = copy.deepcopy(model)
    erased = copy.deepcopy(model)
    options = {"inner": "aot_eager", "on_error": "raise", **(options or {})}
    compiled = torch.compile(erased, backend="erase", options=options, dynamic=dynamic)
    for _ in range(steps):
        inputs = make_inputs()
        for module in (eager, erased):
            module.zero_grad(set_to_none=True)
        loss_of(eager(*inputs)).backward()
        loss_of(compiled(*inputs)).backward()
        assert_same_grads(eager, erased, rtol=rtol, atol=atol)
    return eager, erased


# -- stream assignments ------------------------------------------------------------


def main_reads_of_side_values(gm: fx.GraphModule) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each side-stream value a main-stream node of a stream-annotated
    forward reads (under capture, held until the join)."""
    from erase_fx.passes import MAIN_STREAM, get_meta

    found = []
    for node in gm.graph.nodes:
        if node.op == "output" or get_meta(node).stream != MAIN_STREAM:
            continue
        found += [(arg.name, tuple(arg.meta["val"].shape)) for arg in node.all_input_nodes
                  if get_meta(arg).stream != MAIN_STREAM]
    return found


# -- running graphs on real values ------------------------------------------------


def real_values(gm: fx.GraphModule, *, generator: torch.Generator | None = None) -> dict[str, Any]:
    """Fresh random real values for each placeholder of ``gm``, by name.

    Floats are normal samples; integers (class labels) are 0 or 1; SymInts take
    their example hint.
    """
    values = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        if isinstance(val, torch.SymInt):
            values[node.name] = int(val.node.hint)
        elif val.dtype.is_floating_point:
            values[node.name] = torch.randn(tuple(val.shape), dtype=val.dtype, generator=generator)
        else:
            values[node.name] = torch.randint(0, 2, tuple(val.shape), dtype=val.dtype,
                                              generator=generator)
    return values


def run_joint(gm: fx.GraphModule, values: dict[str, Any]) -> list[Any]:
    """Call a joint graph (``forward(primals, tangents)``) with values by placeholder name."""
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    primal_values = [values[n] for n in placeholders if n.startswith("primals")]
    tangent_values = [values[n] for n in placeholders if n.startswith("tangents")]
    forward_outputs, grads = gm(primal_values, tangent_values)
    return [*forward_outputs, *grads]


def assert_outputs_close(actual: Sequence[Any], expected: Sequence[Any]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is None or not isinstance(e, torch.Tensor):
            assert a == e, f"output {i}"
        else:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"output {i}: {m}")


class Stages:
    """Every intermediate of the pass pipeline for one model, for pass tests: the joint and
    forward pass lists, run (and checked) by their driver, as compilation runs them."""

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...], cfg: Any, inner: str = "aot_eager",
                 graph_end: bool = False):
        from erase_fx.passes import FORWARD_PASSES, JOINT_PASSES, run_passes

        self.cfg = cfg
        self.joint = trace_joint(model, *inputs, inner=inner)
        joint = run_passes(JOINT_PASSES, self.joint.gm, cfg,
                           num_fwd_outputs=self.joint.num_fwd_outputs,
                           joint_inputs=self.joint.joint_inputs, partition_kwargs=self.joint.kwargs,
                           graph_end=graph_end)
        self.analysis = joint["find_stop_gradient_blocks"].artifact
        self.scheduled = joint["schedule_early_backward"]
        partition = joint["partition_joint_graph"].artifact
        self.fw, self.bw = partition.fw, partition.bw
        forward = run_passes(FORWARD_PASSES, self.fw, cfg)
        self.copied = forward["copy_input_values_per_block"]
        self.assigned = forward["assign_streams"]
        self.recomputed = forward["recompute_boundary_values"]
        self.segmented = forward["split_segments"]


class EagerOnly(nn.Module):
    """A forward Dynamo never compiles."""

    @torch._dynamo.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().sum()


def eager_only_factory() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """For ``erase-fx explain graphs:eager_only_factory``: nothing to compile."""
    return EagerOnly(), (torch.randn(3, requires_grad=True),)
