"""The one place that reads and writes ``node.meta["erase_fx"]``.

Every node a pass creates or classifies carries a frozen `NodeMeta`: its role,
the early block it belongs to, the stream it runs on, and the inputs it must
wait for because another stream produced them. Nodes without the key are
stock nodes that erase_fx has not touched. FX copies ``node.meta`` shallowly
in ``node_copy`` (and so do the stock partitioners), which is safe because the
value is immutable.
"""
from __future__ import annotations

import dataclasses
import enum

import torch.fx as fx

META_KEY = "erase_fx"

#: The stream every forward node runs on; side streams are 1..streams.
MAIN_STREAM = 0


class Role(str, enum.Enum):
    FORWARD = "forward"
    #: A node of an early block's backward, cloned into the forward.
    EARLY_BACKWARD = "early_backward"
    #: The backward's ``mul(early_grad, T / seed)`` that returns an early gradient.
    GRAD_SCALE = "grad_scale"
    #: The backward's ``mul(early_part, T / seed)`` that a sum of gradient parts reads.
    PARTIAL_SCALE = "partial_scale"
    #: The forward's copy of a learned loss seed (`erase_fx.emit.loss_seed`): the seed its
    #: early blocks run at, saved for the backward, which divides ``T`` by it.
    LOSS_SEED = "loss_seed"


@dataclasses.dataclass(frozen=True)
class NodeMeta:
    """What erase_fx decided about one node.

    Attributes:
        role: forward node, or part of an early block's backward.
        block: the early block's id (``None`` for forward nodes).
        grad_of: for the node that computes an early gradient, the index of
            the primal (joint-graph input) it is the gradient of.
        stream: the stream the node runs on, set by ``assign_streams``.
        waits_for: names of the node's inputs produced on another stream: a
            sync point the emitted program must honour before this node runs.
        after_join: a main-stream node that reads side-stream values (the sum
            of the local losses): it runs after the main stream has waited
            for the side streams.
        piece: for a block cloned in pieces (`Component.pieces`), which piece
            the node belongs to; each piece launches at its own ready point,
            on the block's stream, after the pieces before it.
        stage: a forward node of the block's own stage (``block`` set): the
            forward whose activations the block's early backward reads, run
            on the block's side stream before its head
            (``Tuning.stages_on_side``), so those activations are made,
            read and freed on one stream. Other streams read only the
            stage's values they need (its output), once it has run.
        at_graph_end: a node of a block whose backward is ready only when the
            graph's forward ends (`Block.at_graph_end`): it runs there, on its
            side stream, while what follows the graph runs, or, when this
            graph's backward does not come, in the backward
            (`erase_fx.emit.program`).
    """

    role: Role
    block: int | None = None
    grad_of: int | None = None
    stream: int | None = None
    waits_for: tuple[str, ...] = ()
    after_join: bool = False
    piece: int | None = None
    stage: bool = False
    at_graph_end: bool = False


def get_meta(node: fx.Node) -> NodeMeta | None:
    return node.meta.get(META_KEY)


def set_meta(node: fx.Node, meta: NodeMeta) -> None:
    node.meta[META_KEY] = meta


def update_meta(node: fx.Node, **changes) -> NodeMeta:
    """Replace some fields of the node's meta (a FORWARD meta if it had none)."""
    meta = dataclasses.replace(get_meta(node) or NodeMeta(Role.FORWARD), **changes)
    node.meta[META_KEY] = meta
    return meta


def is_early(node: fx.Node) -> bool:
    """Whether the node belongs to an early block's backward."""
    meta = get_meta(node)
    return meta is not None and meta.role is Role.EARLY_BACKWARD


#: Whose early nodes read a value: (block, piece).
Owner = tuple[int, "int | None"]


def early_owner(node: fx.Node) -> Owner | None:
    """The (block, piece) of an early node; None for any other node, and for a node of a
    block at the graph's end (`NodeMeta.at_graph_end`): it reads the forward's values as
    the main stream does, after every other block."""
    if not is_early(node):
        return None
    meta = get_meta(node)
    if meta.at_graph_end:
        return None
    return meta.block, meta.piece
