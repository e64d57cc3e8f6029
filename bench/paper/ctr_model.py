"""The model of the CTR experiment (``bench/paper/ctr.py``): `BlockChainCTR`.

A DLRM-style front (`DLRMFront`: one embedding table for the 26 fields, a
bottom MLP ``13-512-256-E`` on the dense features, DLRM's pairwise dot
interaction of the 27 vectors, a projection to width ``d``), then six dense
blocks (`DenseBlock`) in a chain, each ``LayerNorm(h + MLP(h))`` with the
MLP ``Linear(d,h)-ReLU-Linear(h,h)-ReLU-Linear(h,d)``, and a click head
``Linear(d,1)``. Block k+1 reads block k's output *detached*; block 1 reads
the front as is, so the front trains through block 1's loss. We chose the
chain (rather than six towers over the shared features) because every block
then contributes to the final prediction and a frozen block visibly costs
NE. The interaction keeps the 351 dot products of distinct pairs by
multiplying the 27x27 matrix with a strict upper-triangle mask
(``--interaction mask``, the default): the same features as DLRM's
``index_select`` of the upper triangle (``--interaction select``), whose
backward under ``aot_eager`` (``new_zeros`` then ``index_add``) erase_fx
does not yet prove linear: ``erase/aot_eager`` would keep block 1 and the
front in the backward (4 early blocks instead of 5; Inductor's
decomposition is proven). The results' table of erase_fx's decisions shows,
per erase variant, which blocks ran early and why the others did not.

Every block has a BCE head on the click (its local loss); `group_of_param`
names a parameter by the group it belongs to (``front``, ``block1`` ..).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.paper.common import mlp
from bench.paper.ctr_data import DENSE_FEATURES, FIELDS


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """Sizes of `BlockChainCTR`."""

    rows_per_field: tuple[int, ...]
    embed_dim: int = 64
    bottom: tuple[int, ...] = (512, 256)
    width: int = 512
    hidden: int = 1024
    blocks: int = 6
    #: ``"select"``: DLRM's interaction, the upper triangle of the dot products
    #: picked with ``index_select``; ``"mask"``: the whole matrix times a
    #: strict upper-triangle mask (the same features, no index op).
    interaction: str = "mask"


class DLRMFront(nn.Module):
    """Embeddings, bottom MLP, DLRM's pairwise dot interaction, a projection to the block width."""

    def __init__(self, sizes: ModelSizes):
        super().__init__()
        self.interaction = sizes.interaction
        rows = sizes.rows_per_field
        # NB: one table for all fields (per-field row offsets): one lookup kernel, not 26.
        self.embedding = nn.Embedding(sum(rows), sizes.embed_dim)
        nn.init.normal_(self.embedding.weight, std=sizes.embed_dim ** -0.5)
        self.register_buffer("offsets", torch.tensor([0, *rows[:-1]]).cumsum(0),
                             persistent=False)
        self.bottom = mlp(DENSE_FEATURES, *sizes.bottom, sizes.embed_dim)
        vectors = FIELDS + 1
        upper = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pair_index", upper[0] * vectors + upper[1], persistent=False)
        self.register_buffer("pair_mask", torch.ones(vectors, vectors).triu(1).flatten(),
                             persistent=False)
        pairs = upper.shape[1] if sizes.interaction == "select" else vectors * vectors
        self.projection = mlp(sizes.embed_dim + pairs, sizes.width)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        bottom = self.bottom(dense)
        embedded = self.embedding(sparse + self.offsets)  # [B, 26, E]
        vectors = torch.cat([bottom.unsqueeze(1), embedded], dim=1)  # [B, 27, E]
        dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)  # [B, 729]
        if self.interaction == "select":
            pairs = dots.index_select(1, self.pair_index)  # [B, 351]: each pair once, as DLRM
        else:
            pairs = dots * self.pair_mask  # the same pairs, the other 378 entries zeroed
        return self.projection(torch.cat([bottom, pairs], dim=1))


class DenseBlock(nn.Module):
    """One dense subarchitecture, ``LayerNorm(h + MLP(h))``, and its click head.

    NB: the residual connection lets each block start close to its input's
    features: without it, a chain of six 3-layer blocks learned the planted
    clicks about twice as slowly (eval NE after 300 steps on the CPU sizes).
    """

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, width),
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.mlp(h))


class BlockChainCTR(nn.Module):
    """The DLRM front, then a chain of dense blocks, each with a local BCE head.

    ``forward(dense, sparse, labels)`` returns the training loss: the sum of
    the blocks' local losses (`block_losses`). `predict` returns the last block's
    click logits.

    Args:
        detach: block k+1 reads block k's output detached (False: the
            baseline, trained end to end).
        local_losses: blocks 1..K-1 have a local loss (False: only the last
            block's loss, the freezing artifact).
        local_weight: weight of blocks 1..K-1's local losses.
    """

    def __init__(self, sizes: ModelSizes, detach: bool = True, local_losses: bool = True,
                 local_weight: float = 1.0):
        super().__init__()
        self.detach, self.local_losses, self.local_weight = detach, local_losses, local_weight
        self.front = DLRMFront(sizes)
        self.blocks = nn.ModuleList(DenseBlock(sizes.width, sizes.hidden)
                                    for _ in range(sizes.blocks))

    def has_local_loss(self, index: int) -> bool:
        return self.local_losses or index == len(self.blocks) - 1

    def loss_weight(self, index: int) -> float:
        return 1.0 if index == len(self.blocks) - 1 else self.local_weight

    def block_losses(self, dense: torch.Tensor, sparse: torch.Tensor,
                     labels: torch.Tensor) -> list[torch.Tensor | None]:
        """Each block's weighted local loss (None for a block without one)."""
        h = self.front(dense, sparse)
        losses: list[torch.Tensor | None] = []
        for index, block in enumerate(self.blocks):
            h = block(h)
            if self.has_local_loss(index):
                logits = block.head(h).squeeze(-1)
                losses.append(self.loss_weight(index)
                              * F.binary_cross_entropy_with_logits(logits, labels))
            else:
                losses.append(None)
            if self.detach:
                # NB: the stop-gradient: later losses do not reach this block.
                h = h.detach()
        return losses

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        return sum(loss for loss in self.block_losses(dense, sparse, labels) if loss is not None)

    def predict(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        h = self.front(dense, sparse)
        for block in self.blocks:
            h = block(h)
        return self.blocks[-1].head(h).squeeze(-1)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """``front`` and ``block1`` .. ``blockK``: each block's own parameters (body and head)."""
        groups = {"front": list(self.front.parameters())}
        for index, block in enumerate(self.blocks):
            groups[f"block{index + 1}"] = list(block.parameters())
        return groups

    def loss_sources(self, group: str) -> list[int]:
        """The 0-based blocks whose local losses reach ``group``'s parameters (none: frozen).

        Detached: only the group's own block (the front's is block 1).
        Without detach (the baseline): its block and every later one.
        """
        index = 0 if group == "front" else int(group.removeprefix("block")) - 1
        reach = [index] if self.detach else range(index, len(self.blocks))
        return [i for i in reach if self.has_local_loss(i)]


def group_of_param(name: str) -> str:
    """``front.bottom.0.weight`` -> ``front``; ``blocks.2.head.bias`` -> ``block3``."""
    parts = name.replace("_orig_mod.", "").split(".")
    if "blocks" in parts:
        return f"block{int(parts[parts.index('blocks') + 1]) + 1}"
    return "front" if "front" in parts else name
