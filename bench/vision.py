"""Models users bring: torchvision networks as benchmark and check configs.

`build_vision(name, batch, image)` returns ``(model, (images, labels))``: the
model in train mode, whose ``forward(images, labels)`` returns the training
loss, and one random batch (``images [B, 3, image, image]``, ``labels`` in
``[0, CLASSES)``). Every model is torchvision's own (``weights=None``,
``num_classes=CLASSES``), cut where its name says:

==========================  =====================================================  ============
name                        what                                                   early blocks
==========================  =====================================================  ============
``tv-resnet18``             ``resnet18`` as shipped, cross-entropy                  none
``tv-resnet18-dgl``         ``resnet18`` in 4 stages (stem+layer1, layer2,          3
                            layer3, layer4), each stage's input detached; a
                            local conv head (`ConvHead`) after each of the first
                            three, the model's own pool+fc after the last
``tv-googlenet-aux``        ``googlenet(aux_logits=True, init_weights=True)``,      none (2 aux
                            as shipped: ``CE + 0.3 * (CE(aux1) + CE(aux2))``        parts, 2.6%
                            (dropout: random)                                       each; 2 with
                                                                                   ``/all-parts``)
``tv-mobilenet-dgl``        ``mobilenet_v3_small`` features in 3 detached chunks    2
                            (``features[:4]``, ``[4:9]``, ``[9:]``), a conv head
                            after the first two, its own classifier after the
                            last (dropout: random)
``tv-efficientnet-dgl``     ``efficientnet_b0`` features in 3 detached chunks       2
                            (``[:3]``, ``[3:5]``, ``[5:]``), conv heads, its own
                            classifier (stochastic depth and dropout: random)
``tv-vit-dgl``              ``VisionTransformer`` (8 layers, width 384, 6 heads,    3
                            MLP 1536, patch ``image // 8``: 64 patches) in 4
                            detached chunks of 2 layers; a token head
                            (LayerNorm, mean over tokens, linear) after the
                            first three, its own ``ln`` + class token + head
                            after the last
==========================  =====================================================  ============

The ``-dgl`` forms are decoupled greedy learning (each stage trained by its
own local loss, the loss being their sum): what erase_fx runs early. A
config is written ``name:B:image`` (`VisionConfig`), e.g.
``tv-resnet18-dgl:256:32``; `DEFAULTS` has the benchmark's sizes. Models
marked random sample masks in every step, so their gradients differ from
eager's by sampling, not by error (`VisionConfig.random`). torchvision is
imported only when a model is built; without it, parsing works and
`build_vision` raises ImportError.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES = 100
#: name -> (batch, image) of the benchmark's config.
DEFAULTS = {
    "tv-resnet18": (256, 32),
    "tv-resnet18-dgl": (256, 32),
    "tv-googlenet-aux": (128, 64),
    "tv-mobilenet-dgl": (256, 64),
    "tv-efficientnet-dgl": (128, 64),
    "tv-vit-dgl": (256, 32),
}
VISION_NAMES = tuple(DEFAULTS)
#: Models with dropout or stochastic depth.
RANDOM = ("tv-googlenet-aux", "tv-mobilenet-dgl", "tv-efficientnet-dgl")
#: The benchmark's vision configs, ``name:B:image``.
VISION_CONFIGS = tuple(f"{name}:{b}:{i}" for name, (b, i) in DEFAULTS.items())
HEAD_WIDTH = 128
AUX_WEIGHT = 0.3


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """``name:B:image``: a model of `VISION_NAMES`, batch B, square images of side ``image``."""

    name: str
    batch: int
    image: int

    @classmethod
    def parse(cls, text: str) -> VisionConfig:
        name, *numbers = text.split(":")
        if name not in VISION_NAMES or len(numbers) != 2:
            raise ValueError(f"config {text!r} is not name:B:image with name one of "
                             f"{', '.join(VISION_NAMES)}")
        return cls(name, *(int(n) for n in numbers))

    @property
    def kind(self) -> str:
        return self.name

    @property
    def random(self) -> bool:
        return self.name in RANDOM

    def __str__(self) -> str:
        return f"{self.name}:{self.batch}:{self.image}"


class ConvHead(nn.Module):
    """A local head on a feature map: conv 3x3, BatchNorm, ReLU, global pool, linear."""

    def __init__(self, channels: int, classes: int = CLASSES, width: int = HEAD_WIDTH):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(1),
            nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class DetachedStages(nn.Module):
    """Stages in order, each one's input detached, each with its head; loss = sum of the heads' CE.

    ``heads[-1]`` is the model's own classifier; the others are local heads.
    """

    def __init__(self, stages: Sequence[nn.Module], heads: Sequence[nn.Module]):
        super().__init__()
        if len(stages) != len(heads):
            raise ValueError(f"{len(stages)} stages need as many heads, not {len(heads)}")
        self.stages = nn.ModuleList(stages)
        self.heads = nn.ModuleList(heads)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h, loss = images, None
        for k, (stage, head) in enumerate(zip(self.stages, self.heads)):
            h = stage(h if k == 0 else h.detach())
            local = F.cross_entropy(head(h), labels)
            loss = local if loss is None else loss + local
        return loss


class Classified(nn.Module):
    """A shipped classifier trained end to end: ``CE(net(images), labels)``."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(images), labels)


class AuxiliaryLoss(nn.Module):
    """GoogLeNet's training loss: ``CE(logits) + 0.3 * (CE(aux1) + CE(aux2))`` (train mode)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.net(images)
        aux = F.cross_entropy(out.aux_logits1, labels) + F.cross_entropy(out.aux_logits2, labels)
        return F.cross_entropy(out.logits, labels) + AUX_WEIGHT * aux


class PooledClassifier(nn.Module):
    """A CNN's own head: its global pool, flatten, its classifier."""

    def __init__(self, pool: nn.Module, classifier: nn.Module):
        super().__init__()
        self.pool, self.classifier = pool, classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(x), 1))


class PatchEmbedding(nn.Module):
    """A VisionTransformer's input: patches, class token prepended, position embedding, dropout."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.patch_size, self.hidden_dim = vit.patch_size, vit.hidden_dim
        self.conv_proj = vit.conv_proj
        self.class_token = vit.class_token
        self.pos_embedding = vit.encoder.pos_embedding
        self.dropout = vit.encoder.dropout

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(images)  # [B, hidden, H/p, W/p]
        x = x.flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class TokenHead(nn.Module):
    """A local head on transformer tokens: LayerNorm, mean over tokens, linear."""

    def __init__(self, hidden: int, classes: int = CLASSES):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


class ClassTokenHead(nn.Module):
    """A VisionTransformer's own head: its final LayerNorm, the class token, its heads."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.ln, self.heads = vit.encoder.ln, vit.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads(self.ln(x)[:, 0])


def _torchvision():
    try:
        import torchvision.models as models
    except ImportError as error:  # NB: the CPU test machines have no torchvision
        raise ImportError(f"bench.vision needs torchvision ({error})") from error
    return models


def build_model(name: str, image: int) -> nn.Module:
    """The model of ``name`` (`VISION_NAMES`) for square images of side ``image``, train mode."""
    if name not in VISION_NAMES:
        raise ValueError(f"unknown vision model {name!r}; known: {', '.join(VISION_NAMES)}")
    models = _torchvision()
    if name == "tv-resnet18":
        model = Classified(models.resnet18(num_classes=CLASSES))
    elif name == "tv-resnet18-dgl":
        net = models.resnet18(num_classes=CLASSES)
        stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1)
        model = DetachedStages(
            [stem, net.layer2, net.layer3, net.layer4],
            [ConvHead(64), ConvHead(128), ConvHead(256), PooledClassifier(net.avgpool, net.fc)])
    elif name == "tv-googlenet-aux":
        model = AuxiliaryLoss(models.googlenet(num_classes=CLASSES, aux_logits=True,
                                               init_weights=True))
    elif name == "tv-mobilenet-dgl":
        net = models.mobilenet_v3_small(num_classes=CLASSES)
        f = net.features
        model = DetachedStages(
            [f[:4], f[4:9], f[9:]],
            [ConvHead(_out_channels(f[:4])), ConvHead(_out_channels(f[4:9])),
             PooledClassifier(net.avgpool, net.classifier)])
    elif name == "tv-efficientnet-dgl":
        net = models.efficientnet_b0(num_classes=CLASSES)
        f = net.features
        model = DetachedStages(
            [f[:3], f[3:5], f[5:]],
            [ConvHead(_out_channels(f[:3])), ConvHead(_out_channels(f[3:5])),
             PooledClassifier(net.avgpool, net.classifier)])
    else:  # tv-vit-dgl
        if image % 8:
            raise ValueError(f"tv-vit-dgl needs an image side divisible by 8, not {image}")
        vit = models.VisionTransformer(image_size=image, patch_size=image // 8, num_layers=8,
                                       num_heads=6, hidden_dim=384, mlp_dim=1536,
                                       num_classes=CLASSES)
        layers = list(vit.encoder.layers)
        model = DetachedStages(
            [nn.Sequential(PatchEmbedding(vit), *layers[:2]), nn.Sequential(*layers[2:4]),
             nn.Sequential(*layers[4:6]), nn.Sequential(*layers[6:])],
            [TokenHead(384), TokenHead(384), TokenHead(384), ClassTokenHead(vit)])
    return model.train()


def _out_channels(chunk: nn.Module) -> int:
    """The channels a chunk of conv blocks puts out (its last conv's)."""
    convs = [m for m in chunk.modules() if isinstance(m, nn.Conv2d)]
    return convs[-1].out_channels


def vision_inputs(batch: int, image: int, device: torch.device | str = "cpu",
                  generator: torch.Generator | None = None):
    """A random batch: ``images [B, 3, image, image]`` and ``labels [B]`` in ``[0, CLASSES)``."""
    images = torch.randn(batch, 3, image, image, device=device, generator=generator)
    labels = torch.randint(0, CLASSES, (batch,), device=device, generator=generator)
    return images, labels


def build_vision(name: str, batch: int, image: int, *, device: torch.device | str = "cpu",
                 generator: torch.Generator | None = None) -> tuple[nn.Module, tuple]:
    """``(model, (images, labels))`` of vision model ``name`` on ``device``: see the module doc.

    ``model(images, labels)`` returns the training loss; the model is in
    train mode. ``generator`` (on ``device``) makes the batch reproducible;
    the weights come from torch's global RNG (seed it for the same model).
    """
    model = build_model(name, image).to(device)
    return model, vision_inputs(batch, image, device, generator)
