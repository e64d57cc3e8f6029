"""Benchmark models: chains of K detached stages with local losses.

Each stage is ``Linear(d,h)-ReLU-Linear(h,h)-ReLU-Linear(h,d)-LayerNorm(d)``
with a local head ``Linear(d, out)``; stage k+1 reads stage k's output
detached; the loss is the sum of the local losses. A front end feeds stage 0
(not detached, so it trains through stage 0's loss):

- ``ctr``: one ``Embedding(26 * 50000, 64)`` holding all 26 categorical
  fields (per-field offsets), a bottom MLP ``13-512-256-64`` on the dense
  features, and a projection ``27 * 64 -> d``; BCE-with-logits heads on a
  click label.
- ``mlp``: ``Linear(784, d)``; 10-class cross-entropy heads.

``ctr-towers`` and ``mlp-towers`` arrange the same stages as K towers over
the shared front instead: every tower reads the front's output (nothing is
detached), so the towers' backwards meet in the sum of the front output's
gradients; erase_fx runs each tower's part early but the last, and the
front's backward after the sum. ``ctr-towers-top`` and ``mlp-towers-top``
add a top head over the detached tower outputs (the last block): then the
towers' backward and the front's run early as one block in pieces, each
tower's part as soon as that tower is ready.

A chain config is written ``kind:B:d:h:K``, e.g. ``ctr:1024:512:1024:6``.

``gpt:B:d:T:K`` (`GPTConfig`, `GPTChain`): a token embedding, then K
detached pre-LN transformer blocks (causal SDPA attention, MLP), each with
a local LM head (LayerNorm, linear to a vocabulary of 8192, cross-entropy on
the next tokens); d/64 heads; bf16 autocast; ``gpt-soft:B:d:T:K`` learns
label-smoothed soft targets made in the forward instead; ``gpt-fp16:B:d:T:K`` runs under
float16 autocast, its loss scaled by a GradScaler's first scale (2**16, fixed). ``tv-<name>:B:image``: the
torchvision models of `bench.vision`. ``pattern-<name>:B[:width[:depth]]``: the
patterns of user code in `bench.user_patterns` at bench sizes, each with its own
``loss_of`` (`bench.user_patterns.PatternConfig`). `parse_config` reads every kind,
`build_config` gives a config's model (whose output is the loss) and batch, and
`build_with_loss` the model, the batch and the pattern's ``loss_of`` (bench.run's).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

CTR_FIELDS = 26
CTR_DENSE = 13
CTR_ROWS_PER_FIELD = 50_000
CTR_EMBED = 64


#: Config kinds: the data and front (ctr, mlp), as a chain or as towers.
KINDS = ("ctr", "mlp", "ctr-towers", "mlp-towers", "ctr-towers-top", "mlp-towers-top")


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    kind: str  # one of KINDS
    batch: int
    d: int
    h: int
    stages: int

    @classmethod
    def parse(cls, text: str) -> ChainConfig:
        kind, *numbers = text.split(":")
        if kind not in KINDS or len(numbers) != 4:
            raise ValueError(f"config {text!r} is not kind:B:d:h:K with kind one of "
                             f"{', '.join(KINDS)}")
        return cls(kind, *(int(n) for n in numbers))

    @property
    def data(self) -> str:
        """``ctr`` or ``mlp``: the inputs, front and heads."""
        return self.kind.split("-")[0]

    @property
    def towers(self) -> bool:
        """Stages as towers over the shared front (else a detached chain)."""
        return "-towers" in self.kind

    @property
    def top(self) -> bool:
        """A top head over the detached tower outputs."""
        return self.kind.endswith("-top")

    def __str__(self) -> str:
        return f"{self.kind}:{self.batch}:{self.d}:{self.h}:{self.stages}"


class Stage(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d), nn.LayerNorm(d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class CtrFront(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.embedding = nn.Embedding(CTR_FIELDS * CTR_ROWS_PER_FIELD, CTR_EMBED)
        self.register_buffer(
            "offsets", torch.arange(CTR_FIELDS) * CTR_ROWS_PER_FIELD, persistent=False
        )
        self.bottom = nn.Sequential(
            nn.Linear(CTR_DENSE, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
            nn.Linear(256, CTR_EMBED), nn.ReLU(),
        )
        self.projection = nn.Linear((CTR_FIELDS + 1) * CTR_EMBED, d)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(sparse + self.offsets)  # [B, 26, 64]
        features = torch.cat([self.bottom(dense).unsqueeze(1), embedded], dim=1)
        return self.projection(features.flatten(1))


class DetachedChain(nn.Module):
    """A front end, then K stages, each with a local head; stage inputs detached.

    With a ``*-towers`` config every stage reads the front's output instead.
    """

    def __init__(self, cfg: ChainConfig, detach: bool = True):
        super().__init__()
        self.cfg = cfg
        self.detach = detach
        self.front = CtrFront(cfg.d) if cfg.data == "ctr" else nn.Linear(784, cfg.d)
        out = 1 if cfg.data == "ctr" else 10
        self.stages = nn.ModuleList(Stage(cfg.d, cfg.h) for _ in range(cfg.stages))
        self.heads = nn.ModuleList(nn.Linear(cfg.d, out) for _ in range(cfg.stages))
        self.top = nn.Linear(cfg.stages * cfg.d, out) if cfg.top else None

    def local_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.cfg.data == "ctr":
            return F.binary_cross_entropy_with_logits(logits.squeeze(-1), labels)
        return F.cross_entropy(logits, labels)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *features, labels = inputs
        front = h = self.front(*features)
        loss, outputs = None, []
        for stage, head in zip(self.stages, self.heads):
            h = stage(front if self.cfg.towers else h)
            local = self.local_loss(head(h), labels)
            loss = local if loss is None else loss + local
            if self.detach:
                h = h.detach()
            if self.top is not None:
                outputs.append(h.detach())
        if self.top is not None:
            loss = loss + self.local_loss(self.top(torch.cat(outputs, dim=1)), labels)
        return loss


def make_inputs(cfg: ChainConfig, device: torch.device, generator: torch.Generator | None = None):
    """A fresh random batch: (dense, sparse, labels) for ctr, (pixels, labels) for mlp."""
    b = cfg.batch
    if cfg.data == "ctr":
        dense = torch.randn(b, CTR_DENSE, device=device, generator=generator)
        sparse = torch.randint(0, CTR_ROWS_PER_FIELD, (b, CTR_FIELDS), device=device,
                               generator=generator)
        labels = torch.randint(0, 2, (b,), device=device, generator=generator).float()
        return dense, sparse, labels
    pixels = torch.randn(b, 784, device=device, generator=generator)
    labels = torch.randint(0, 10, (b,), device=device, generator=generator)
    return pixels, labels


def step_flops(cfg: ChainConfig) -> int:
    """Matrix FLOPs of one forward+backward step (3x the forward's multiply-adds x 2)."""
    b, d, h = cfg.batch, cfg.d, cfg.h
    out = 1 if cfg.data == "ctr" else 10
    stage = d * h + h * h + h * d + d * out
    if cfg.data == "ctr":
        front = CTR_DENSE * 512 + 512 * 256 + 256 * CTR_EMBED + (CTR_FIELDS + 1) * CTR_EMBED * d
    else:
        front = 784 * d
    return 6 * b * (front + cfg.stages * stage)


class PaperSchedule(nn.Module):
    """The ERASE paper's eager scheme, written by hand, around a `DetachedChain`.

    Inside the forward, stage k's forward, its local loss and that loss's
    ``backward()`` run on side stream ``k % streams``; stage k+1 starts (on
    its own stream) as soon as stage k's forward is done (an event), so stage
    k's backward overlaps stage k+1's forward. The last stage's loss is
    returned with its graph (the caller's ``backward()`` runs it); the other
    local losses are added detached. Gradients equal eager's. Needs CUDA.
    """

    def __init__(self, chain: DetachedChain, streams: int = 4):
        super().__init__()
        if not chain.detach or chain.cfg.towers:
            raise ValueError("the paper's scheme needs the detached chain")
        self.chain = chain
        self.streams = [torch.cuda.Stream() for _ in range(streams)]

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        chain = self.chain
        *features, labels = inputs
        main = torch.cuda.current_stream()
        h = chain.front(*features)
        ready = torch.cuda.Event()
        ready.record(main)
        last = len(chain.stages) - 1
        early_losses = []
        for k, (stage, head) in enumerate(zip(chain.stages, chain.heads)):
            stream = self.streams[k % len(self.streams)]
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                h.record_stream(stream)
                labels.record_stream(stream)
                out = stage(h)
                local = chain.local_loss(head(out), labels)
                ready = torch.cuda.Event()
                ready.record(stream)
                if k == last:
                    final = local
                else:
                    local.backward()  # the early backward, on this side stream
                    early_losses.append(local.detach())
            h = out.detach()
        for stream in self.streams:
            main.wait_stream(stream)
        for value in [final, *early_losses]:
            value.record_stream(main)
        return final + sum(early_losses)


def mlp_factory():
    """``erase-fx explain|profile bench.models:mlp_factory``: the mlp:512:1024:2048:6 chain."""
    cfg = ChainConfig.parse("mlp:512:1024:2048:6")
    return DetachedChain(cfg), make_inputs(cfg, torch.device("cpu"))


def ctr_factory():
    """``erase-fx explain|profile bench.models:ctr_factory``: the ctr:4096:1024:2048:6 chain."""
    cfg = ChainConfig.parse("ctr:4096:1024:2048:6")
    return DetachedChain(cfg), make_inputs(cfg, torch.device("cpu"))


# -- gpt: detached transformer blocks with local LM heads ---------------------------

GPT_VOCAB = 8192
GPT_HEAD_DIM = 64


#: Label smoothing of ``gpt-soft`` configs' soft targets.
GPT_SMOOTHING = 0.1
#: The GPT configs' kinds (`GPTConfig`).
GPT_KINDS = ("gpt", "gpt-soft", "gpt-fp16")
#: ``gpt-fp16``'s loss scale: a GradScaler's first (``init_scale``).
GPT_FP16_LOSS_SCALE = 2.0 ** 16


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """``gpt:B:d:T:K``: batch B of T tokens, width d (d/64 heads), K detached blocks.
    ``gpt-soft:B:d:T:K``: the same, each head learning label-smoothed soft targets made in
    the forward (`GPTChain`). ``gpt-fp16:B:d:T:K``: under float16 autocast instead of
    bfloat16, its loss scaled by `GPT_FP16_LOSS_SCALE` (the loss gradient a GradScaler
    gives at its start, held fixed: a GradScaler's step reads its inf check on the host,
    which no step capture takes); erase_fx learns it as its seed."""

    batch: int
    d: int
    seq: int
    blocks: int
    soft_targets: bool = False
    fp16: bool = False

    @property
    def kind(self) -> str:
        return "gpt-soft" if self.soft_targets else "gpt-fp16" if self.fp16 else "gpt"

    @classmethod
    def parse(cls, text: str) -> GPTConfig:
        kind, *numbers = text.split(":")
        if kind not in GPT_KINDS or len(numbers) != 4:
            raise ValueError(f"config {text!r} is not one of "
                             + ", ".join(f"{k}:B:d:T:K" for k in GPT_KINDS))
        cfg = cls(*(int(n) for n in numbers), soft_targets=kind == "gpt-soft",
                  fp16=kind == "gpt-fp16")
        if cfg.d % GPT_HEAD_DIM:
            raise ValueError(f"config {text!r}: d must be a multiple of {GPT_HEAD_DIM} "
                             f"(heads of {GPT_HEAD_DIM})")
        return cfg

    @property
    def heads(self) -> int:
        return self.d // GPT_HEAD_DIM

    def __str__(self) -> str:
        return f"{self.kind}:{self.batch}:{self.d}:{self.seq}:{self.blocks}"


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-LN: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (MLP 4d, GELU)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTChain(nn.Module):
    """Token and position embeddings, then K transformer blocks, each with a local LM head.

    Block k+1 reads block k's output detached; every block's head
    (LayerNorm, ``Linear(d, 8192)``) has its own next-token cross-entropy;
    the loss is their sum. The embeddings train through block 0's loss.
    With ``cfg.soft_targets`` (``gpt-soft``) each head learns label-smoothed
    targets instead, made in the forward from the next tokens (``one_hot *
    (1 - GPT_SMOOTHING) + GPT_SMOOTHING / 8192``, fp32, one tokens x
    vocabulary value that every block reads): the case
    ``copy_input_values_per_block`` and the soft-target rules of
    ``assign_streams`` are for.

    Precision: fp32 parameters under bf16 autocast inside the forward
    (``amp_dtype``), the usual mixed-precision training (Adam keeps fp32
    state, the logits are bf16 and the cross-entropy runs in fp32, as
    autocast puts it); ``amp_dtype=None`` runs fp32 (CPU tests).
    """

    def __init__(self, cfg: GPTConfig, amp_dtype: torch.dtype | None = torch.bfloat16):
        super().__init__()
        self.cfg = cfg
        self.amp_dtype = amp_dtype
        self.embed = nn.Embedding(GPT_VOCAB, cfg.d)
        self.position = nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(TransformerBlock(cfg.d, cfg.heads) for _ in range(cfg.blocks))
        self.heads = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(cfg.d), nn.Linear(cfg.d, GPT_VOCAB, bias=False))
            for _ in range(cfg.blocks))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(tokens.device.type, dtype=self.amp_dtype or torch.bfloat16,
                            enabled=self.amp_dtype is not None):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.embed(tokens) + self.position(positions)
            loss = None
            soft = None
            for k, (block, head) in enumerate(zip(self.blocks, self.heads)):
                h = block(h if k == 0 else h.detach())
                logits = head(h).flatten(0, 1)
                if self.cfg.soft_targets:
                    if soft is None:
                        soft = (F.one_hot(targets.flatten(), GPT_VOCAB).float()
                                * (1 - GPT_SMOOTHING) + GPT_SMOOTHING / GPT_VOCAB)
                    local = -(soft * F.log_softmax(logits.float(), -1)).sum(-1).mean()
                else:
                    local = F.cross_entropy(logits, targets.flatten())
                loss = local if loss is None else loss + local
        return loss * GPT_FP16_LOSS_SCALE if self.cfg.fp16 else loss


def gpt_inputs(cfg: GPTConfig, device: torch.device, generator: torch.Generator | None = None):
    """(tokens, next tokens): random token ids, ``[B, T]`` each."""
    tokens = torch.randint(0, GPT_VOCAB, (cfg.batch, cfg.seq + 1), device=device,
                           generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gpt_flops(cfg: GPTConfig) -> int:
    """Matrix FLOPs of a step: 6 x tokens x multiply-adds per token (attention causal: half)."""
    d, t = cfg.d, cfg.seq
    per_block = 12 * d * d + d * GPT_VOCAB + t * d  # qkv+proj 4d², MLP 8d², head, QK and AV / 2
    return 6 * cfg.batch * t * cfg.blocks * per_block


# -- every config kind ----------------------------------------------------------------


def parse_config(text: str):
    """A `ChainConfig`, `GPTConfig`, `bench.vision.VisionConfig` or
    `bench.user_patterns.PatternConfig` from its text."""
    kind = text.split(":")[0]
    if kind in GPT_KINDS:
        return GPTConfig.parse(text)
    if kind.startswith("tv-"):
        from bench.vision import VisionConfig

        return VisionConfig.parse(text)
    if kind.startswith("pattern-"):
        from bench.user_patterns import PatternConfig

        return PatternConfig.parse(text)
    if kind in KINDS:
        return ChainConfig.parse(text)
    from bench.user_patterns import BENCH_SIZES
    from bench.vision import VISION_NAMES

    raise ValueError(f"config {text!r}: kind {kind!r} is not one of {', '.join(KINDS)} "
                     f"(kind:B:d:h:K), gpt, gpt-soft or gpt-fp16 (gpt:B:d:T:K), "
                     f"{', '.join(VISION_NAMES)} "
                     f"(name:B:image), "
                     f"{', '.join('pattern-' + name for name in BENCH_SIZES)} "
                     f"(pattern-<name>:B[:width[:depth]])")


class WithLoss(nn.Module):
    """``model`` whose output ``loss_of`` maps to the loss, as a module that returns the loss
    (for tools that call ``model(*inputs).backward()``)."""

    def __init__(self, model: nn.Module, loss_of):
        super().__init__()
        self.model = model
        self.loss_of = loss_of

    def forward(self, *inputs):
        return self.loss_of(self.model(*inputs))


def build_config(cfg, device: torch.device, generator: torch.Generator | None = None):
    """``(model, inputs)`` of any config: the model on ``device`` in train mode, one batch;
    ``model(*inputs)`` is the loss (a pattern whose output is not, wrapped in `WithLoss`).
    bench.run takes `build_with_loss` instead, and applies the loss outside the compiled
    model, as the pattern's users do."""
    model, inputs, loss_of = build_with_loss(cfg, device, generator)
    if loss_of is None:
        return model, inputs
    from bench.user_patterns import own_loss

    return (model if loss_of is own_loss else WithLoss(model, loss_of)), inputs


def build_with_loss(cfg, device: torch.device, generator: torch.Generator | None = None):
    """``(model, inputs, loss_of)`` of any config: ``loss_of`` maps ``model(*inputs)`` to the
    loss; None for every config but the patterns' (their models return the loss). A pattern
    config's is the pattern's own (today `bench.user_patterns.own_loss`, the identity, for
    each: bench.run applies it all the same)."""
    if isinstance(cfg, ChainConfig):
        return DetachedChain(cfg).to(device), make_inputs(cfg, device, generator), None
    if isinstance(cfg, GPTConfig):
        model = GPTChain(cfg, amp_dtype=torch.float16) if cfg.fp16 else GPTChain(cfg)
        return model.to(device), gpt_inputs(cfg, device, generator), None
    from bench.user_patterns import PatternConfig, build_pattern

    if isinstance(cfg, PatternConfig):
        return build_pattern(cfg, device, generator)
    from bench.vision import build_vision

    return (*build_vision(cfg.name, cfg.batch, cfg.image, device=device, generator=generator),
            None)


def config_flops(cfg) -> int | None:
    """Matrix FLOPs of one step, where counted (chains and gpt; None for vision)."""
    if isinstance(cfg, ChainConfig):
        return step_flops(cfg)
    if isinstance(cfg, GPTConfig):
        return gpt_flops(cfg)
    return None


def is_random(cfg) -> bool:
    """Dropout or stochastic depth in the model: gradients differ from eager's by sampling."""
    return bool(getattr(cfg, "random", False))


def takes_paper_scheme(cfg) -> bool:
    """The paper's eager scheme (`PaperSchedule`) needs a detached chain."""
    return isinstance(cfg, ChainConfig) and not cfg.towers
