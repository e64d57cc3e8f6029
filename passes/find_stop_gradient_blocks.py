"""find_stop_gradient_blocks: which parts of the backward can run early.

What: a dataflow analysis of AOTAutograd's joint forward-backward graph. It
splits the backward into independent pieces and decides, for each, whether it
can be computed during the forward (an *early block*) or must stay in the
backward (a *rejected component*, with the reason).

Why dataflow and not ``detach`` nodes: autograd inserts ``detach`` for its
own saved outputs, and Inductor's decompositions turn a user's ``detach`` into
``alias`` and then remove it. A stop-gradient shows up instead as a *cut* in
the backward: the backward of a detached block shares no node with the
backward of what follows it.

How:
  1. backward region = the nodes that transitively read a tangent;
  2. seed nodes = backward nodes reading only tangents (``expand(T)``, ``T / n``);
  3. the other backward nodes fall into connected components (networkx); each
     is an independent backward piece;
  4. a piece's *ready point* is its last forward producer: the last node that
     the forward outputs need and that the piece reads, directly or through
     tangent-free helpers (autograd puts nodes such as ``t(t_2)`` in the
     backward region although they read only forward values);
  5. a piece is an early block if it produces parameter gradients, reads the
     gradient of exactly one 0-dim output (the loss), its ready point comes
     before the latest ready point, and every op on its path from the tangent
     is known to be linear in it (`linearity_violation`) and mutates nothing;
  6. a piece that would stay in the backward although several loss terms
     reach it only through sums of gradients (a parameter two blocks share,
     an activation read without detach) is split at those sums
     (`split_at_sums`): each loss term's part is judged as in 5, with the
     gradients it adds into the sums as *partial* outputs; the sums and what
     follows them stay in the backward (``joins_blocks``). Where no part can
     run early, the reason's detail names the sums;
  7. an early block whose loss terms meet in such sums and become ready at
     different points is cut in pieces (`Component.pieces`): each term's
     part launches at its own ready point, the rest (the sums and what
     follows) after the last part, all on the block's stream (`_in_pieces`).

Invariants out (`check_block_analysis`): blocks are disjoint, each has one
0-dim tangent and a ready point that is a forward node; ids follow ready-point
order. The pass does not change the graph.

Before (excerpt of a joint graph, block 1 detached from block 2)::

    relu = relu(addmm);  local = mse_loss(addmm_1, y);  detach = detach(relu)
    ... block 2 forward ...; add = add(local, loss_2)
    expand = expand(tangents_1, ...)        # seed
    mse_loss_backward(expand, addmm_1, y)   # block 1 backward: component A
    ...                                     # block 2 backward: component B

After: ``BlockAnalysis(blocks=(Block(id=0, ready_after="addmm_1", ...),),
rejected=(Rejected(component B, reason=LAST_BLOCK),))``.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

import networkx as nx
import torch
import torch.fx as fx

from erase_fx.config import EraseConfig
from erase_fx.errors import GraphInvariantError
from erase_fx.passes.flops import node_flops
from erase_fx.passes.graph import is_primal, is_tangent, output_values, topo_positions
from erase_fx.passes.linearity import linearity_violation

PASS_NAME = "find_stop_gradient_blocks"


class RejectReason(str, enum.Enum):
    """Why a backward component stays in the backward."""

    NO_PARAMETER_GRAD = "no_parameter_grad"
    LAST_BLOCK = "last_block"
    SEVERAL_TANGENTS = "several_tangents"
    NOT_SCALAR_TANGENT = "not_scalar_tangent"
    MUTATION = "mutation"
    NOT_LINEAR = "not_linear"
    JOINS_BLOCKS = "joins_blocks"

    @property
    def is_unsupported(self) -> bool:
        """A block that could run early but that erase_fx cannot prove safe."""
        return self in (RejectReason.MUTATION, RejectReason.NOT_LINEAR)


@dataclasses.dataclass(frozen=True)
class Component:
    """One independent piece of the backward, by node names of the joint graph.

    Attributes:
        nodes: the piece's backward nodes, in graph order.
        seeds: tangent-only nodes it reads (``expand(tangents_1)``...).
        helpers: tangent-free nodes only the backward reads, which it needs.
        tangents: the tangents it depends on.
        ready_after: its last forward producer (the node it can start after).
        grad_outputs: (primal index, node name) of each gradient it produces.
        flops: estimated FLOPs of its nodes.
        partials: its nodes that sums outside it read: the part of a gradient
            it adds to the other parts (empty for a whole component).
        pieces: for an early component whose loss terms meet in sums of
            gradients and become ready at different points, its nodes in
            pieces: each term's part, then the rest (the sums and what
            follows them), in launch order; empty otherwise.
        piece_ready: the ready point of each piece.
    """

    nodes: tuple[str, ...]
    seeds: tuple[str, ...]
    helpers: tuple[str, ...]
    tangents: tuple[str, ...]
    ready_after: str
    grad_outputs: tuple[tuple[int, str], ...]
    flops: int
    partials: tuple[str, ...] = ()
    pieces: tuple[tuple[str, ...], ...] = ()
    piece_ready: tuple[str, ...] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.nodes) + len(self.seeds) + len(self.helpers)


@dataclasses.dataclass(frozen=True)
class Block:
    """A component that runs early."""

    id: int
    component: Component
    tangent: str
    params: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A component that stays in the backward, and why."""

    component: Component
    reason: RejectReason
    detail: str
    node: str | None
    params: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BlockAnalysis:
    """The decisions about one joint graph.

    Attributes:
        blocks: the early blocks, in ready-point order.
        rejected: the components that stay in the backward, with reasons.
        backward_flops: estimated FLOPs of the whole backward.
        num_fwd_outputs: how many joint-graph outputs are forward outputs
            (gradient ``i`` of primal ``i`` is output ``num_fwd_outputs + i``).
    """

    blocks: tuple[Block, ...]
    rejected: tuple[Rejected, ...]
    backward_flops: int
    num_fwd_outputs: int

    @property
    def early_flops(self) -> int:
        return sum(b.component.flops for b in self.blocks)


def find_stop_gradient_blocks(
    gm: fx.GraphModule,
    cfg: EraseConfig,
    *,
    num_fwd_outputs: int,
    primal_names: Sequence[str] = (),
) -> BlockAnalysis:
    """Analyse a joint graph; see the module docstring.

    Args:
        gm: AOTAutograd's joint graph (``primals_*``, ``tangents_*`` inputs;
            forward outputs then one gradient per primal).
        cfg: the compilation's settings (unused by the analysis today; kept so
            every pass has the same contract).
        num_fwd_outputs: how many of the outputs are forward outputs.
        primal_names: a name per primal (e.g. a parameter's qualified name),
            used in the report; ``primals_<i>`` where missing.
    """
    del cfg
    graph = gm.graph
    nodes = list(graph.nodes)
    position = topo_positions(graph)
    dataflow = nx.DiGraph()
    dataflow.add_nodes_from(nodes)
    dataflow.add_edges_from((arg, node) for node in nodes for arg in node.all_input_nodes)

    outputs = output_values(graph)
    tangents = [n for n in nodes if is_tangent(n) and n.users]
    backward: set[fx.Node] = set(tangents)
    for tangent in tangents:
        backward |= nx.descendants(dataflow, tangent)
    backward = {n for n in backward if n.op != "output"}

    seeds: set[fx.Node] = set()
    for node in nodes:
        if node in backward and node.op == "call_function" and all(
            a in seeds or is_tangent(a) for a in node.all_input_nodes
        ):
            seeds.add(node)

    forward_outputs = [o for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node)]
    required_forward = _ancestors_of(dataflow, forward_outputs) | set(forward_outputs)
    required_forward |= {n for n in nodes if n.op == "placeholder" and not is_tangent(n)}

    core = [n for n in nodes if n in backward and n not in seeds and not is_tangent(n)]
    grad_index = {
        out: i for i, out in enumerate(outputs[num_fwd_outputs:]) if isinstance(out, fx.Node)
    }
    primal_label = _primal_labels(graph, primal_names)
    # Tangent-free nodes that no forward output needs: the helpers autograd
    # leaves in the backward region.
    helper_pool = dataflow.subgraph(
        n for n in nodes if n not in backward and n not in required_forward
    )

    components = []
    undirected = dataflow.subgraph(core).to_undirected(as_view=True)
    for members in nx.connected_components(undirected):
        components.append(
            _describe(members, seeds, helper_pool, required_forward, grad_index, position)
        )
    by_name = {n.name: n for n in nodes}

    def ready_position(comp: Component) -> int:
        return position[by_name[comp.ready_after]]

    # NB: deterministic order please: by ready point, then by first node.
    components.sort(key=lambda c: (ready_position(c), position[by_name[c.nodes[0]]]))
    with_grads = [c for c in components if c.grad_outputs]
    latest = max((ready_position(c) for c in with_grads), default=-1)

    def params_of(comp: Component) -> tuple[str, ...]:
        return tuple(primal_label[i] for i, _ in sorted(comp.grad_outputs))

    def describe(members: set[fx.Node]) -> Component:
        return _describe(members, seeds, helper_pool, required_forward, grad_index, position)

    early: list[Component] = []
    rejected: list[Rejected] = []
    for comp in components:
        reason, detail, node = _reject_reason(comp, by_name, latest, position)
        if reason is None:
            early.append(_in_pieces(comp, by_name, seeds, describe, latest, position) or comp)
            continue
        split = None
        if reason in (RejectReason.LAST_BLOCK, RejectReason.SEVERAL_TANGENTS):
            split = split_at_sums(comp, by_name, seeds, describe)
        if split is not None:
            parts, rest, sums, terms = split
            judged = [(part, _reject_reason(part, by_name, latest, position)) for part in parts]
            if any(why[0] is None for _, why in judged):
                for part, (part_reason, part_detail, part_node) in judged:
                    if part_reason is None:
                        early.append(part)
                    else:
                        rejected.append(Rejected(part, part_reason, part_detail, part_node,
                                                 params_of(part)))
                rejected.append(Rejected(
                    rest, RejectReason.JOINS_BLOCKS,
                    f"adds up the gradient parts of {terms} loss terms "
                    f"({_sums_text(sums, comp, primal_label)}: a parameter they share, or a "
                    f"value read without detach), then runs in the backward", None,
                    params_of(rest)))
                continue
        detail += _joined_by_sums(comp, by_name, seeds, primal_label)
        rejected.append(Rejected(comp, reason, detail, node, params_of(comp)))
    early.sort(key=lambda c: (ready_position(c), position[by_name[c.nodes[0]]]))
    blocks = [Block(i, comp, comp.tangents[0], params_of(comp)) for i, comp in enumerate(early)]

    analysis = BlockAnalysis(
        blocks=tuple(blocks),
        rejected=tuple(rejected),
        backward_flops=sum(node_flops(n) for n in backward),
        num_fwd_outputs=num_fwd_outputs,
    )
    check_block_analysis(gm, analysis)
    return analysis


def _ancestors_of(dataflow: nx.DiGraph, targets: Sequence[fx.Node]) -> set[fx.Node]:
    # NB: one reverse traversal from all targets, not one per target.
    sink = object()
    dataflow.add_node(sink)
    dataflow.add_edges_from((t, sink) for t in targets)
    try:
        return nx.ancestors(dataflow, sink)
    finally:
        dataflow.remove_node(sink)


def _describe(
    members: set[fx.Node],
    seeds: set[fx.Node],
    helper_pool: nx.DiGraph,
    required_forward: set[fx.Node],
    grad_index: dict[fx.Node, int],
    position: dict[fx.Node, int],
) -> Component:
    used_seeds: set[fx.Node] = set()
    stack = [a for m in members for a in m.all_input_nodes if a in seeds]
    while stack:
        seed = stack.pop()
        if seed not in used_seeds:
            used_seeds.add(seed)
            stack.extend(a for a in seed.all_input_nodes if a in seeds)

    direct = {a for m in members for a in m.all_input_nodes}
    helpers: set[fx.Node] = set()
    for arg in direct:
        if arg in helper_pool:
            helpers.add(arg)
            helpers |= nx.ancestors(helper_pool, arg)
    frontier = {a for n in members | helpers for a in n.all_input_nodes if a in required_forward}

    tangents: set[fx.Node] = set()
    for node in members | used_seeds:
        tangents |= {a for a in node.all_input_nodes if is_tangent(a)}

    ready = max(frontier, key=position.__getitem__) if frontier else None
    if ready is None:  # reads no forward value: ready once the inputs are
        ready = max(
            (n for n in position if n.op == "placeholder" and not is_tangent(n)),
            key=position.__getitem__,
        )
    by_position = position.__getitem__
    return Component(
        nodes=tuple(n.name for n in sorted(members, key=by_position)),
        seeds=tuple(n.name for n in sorted(used_seeds, key=by_position)),
        helpers=tuple(n.name for n in sorted(helpers, key=by_position)),
        tangents=tuple(n.name for n in sorted(tangents, key=by_position)),
        ready_after=ready.name,
        grad_outputs=tuple(
            (grad_index[n], n.name) for n in sorted(members, key=by_position) if n in grad_index
        ),
        flops=sum(node_flops(n) for n in members | used_seeds | helpers),
    )


def _reject_reason(
    comp: Component,
    by_name: dict[str, fx.Node],
    latest: int,
    position: dict[fx.Node, int],
) -> tuple[RejectReason | None, str, str | None]:
    if not comp.grad_outputs and not comp.partials:
        return RejectReason.NO_PARAMETER_GRAD, "produces no gradient of a graph input", None
    if position[by_name[comp.ready_after]] >= latest:
        return (
            RejectReason.LAST_BLOCK,
            "its backward is ready only when the forward ends: nothing later to overlap",
            comp.ready_after,
        )
    if len(comp.tangents) != 1:
        return (
            RejectReason.SEVERAL_TANGENTS,
            f"reads the gradients of {len(comp.tangents)} outputs ({', '.join(comp.tangents)})",
            None,
        )
    tangent = by_name[comp.tangents[0]]
    value = tangent.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        return (
            RejectReason.NOT_SCALAR_TANGENT,
            f"reads the gradient of a non-scalar output ({tangent.name})",
            tangent.name,
        )
    dependent = {tangent} | {by_name[n] for n in comp.seeds + comp.nodes}
    for name in comp.seeds + comp.nodes + comp.helpers:
        node = by_name[name]
        if _mutates(node):
            return RejectReason.MUTATION, f"{node.target} mutates its input", name
    for name in comp.seeds + comp.nodes:
        why = linearity_violation(by_name[name], dependent)
        if why is not None:
            return RejectReason.NOT_LINEAR, why, name
    return None, "", None


#: Ops that sum two gradients (autograd's accumulation of a value used twice).
_SUM_OPS = (torch.ops.aten.add.Tensor,)


def joining_sums(comp: Component, by_name: dict[str, fx.Node],
                 seeds: set[fx.Node]) -> tuple[list[set[fx.Node]], list[fx.Node]]:
    """The pieces of ``comp`` that read a loss gradient once its sums are taken out, and
    the sums that join them (none when fewer than two pieces).

    Two loss terms whose backwards meet only in a sum (``add``) of gradients
    form one component: a parameter both blocks use, or an activation both
    read with no detach between. Taking the sums out leaves one piece per
    such loss term (pieces that read no seed or tangent, the backward after
    a sum, do not count).
    """
    members = [by_name[name] for name in comp.nodes]
    sums = [n for n in members if n.target in _SUM_OPS]
    rest = set(members) - set(sums)
    graph = nx.Graph()
    graph.add_nodes_from(rest)
    graph.add_edges_from((n, a) for n in rest for a in n.all_input_nodes if a in rest)
    seeded = [piece for piece in nx.connected_components(graph)
              if any(a in seeds or is_tangent(a) for n in piece for a in n.all_input_nodes)]
    if len(seeded) < 2:
        return seeded, []
    piece_of = {n: i for i, piece in enumerate(seeded) for n in piece}
    joining = [s for s in sums
               if len({piece_of[a] for a in _summands(s, sums) if a in piece_of}) > 1]
    return seeded, joining


def split_at_sums(
    comp: Component,
    by_name: dict[str, fx.Node],
    seeds: set[fx.Node],
    describe: Callable[[set[fx.Node]], Component],
) -> tuple[list[Component], Component, list[fx.Node], int] | None:
    """``comp`` split into the parts of its loss terms and the rest, or None.

    A part is a piece of `joining_sums` that reads no sum (so no other part)
    and has matrix work (a piece of elementwise ops, a regularizer's, say,
    is not worth a stream of its own): it can run on its own, and its values
    that the sums read are its ``partials``. The rest (the sums, the other
    pieces, what follows) reads the parts only through the sums. Returns
    (parts, rest, joining sums, number of loss terms).
    """
    pieces, sums = joining_sums(comp, by_name, seeds)
    if not sums:
        return None
    all_sums = {n for n in (by_name[name] for name in comp.nodes) if n.target in _SUM_OPS}
    parts = [piece for piece in pieces
             if not any(a in all_sums for n in piece for a in n.all_input_nodes)
             and sum(node_flops(n) for n in piece) > 0]
    if not parts:
        return None
    members = {by_name[name] for name in comp.nodes}
    rest = members.difference(*parts)
    described = []
    for piece in parts:
        part = describe(piece)
        partials = tuple(n.name for n in (by_name[name] for name in part.nodes)
                         if any(user in rest for user in n.users))
        described.append(dataclasses.replace(part, partials=partials))
    return described, describe(rest), sums, len(pieces)


def _in_pieces(
    comp: Component,
    by_name: dict[str, fx.Node],
    seeds: set[fx.Node],
    describe: Callable[[set[fx.Node]], Component],
    latest: int,
    position: dict[fx.Node, int],
) -> Component | None:
    """An early component cut into pieces that launch at their own ready points, or None.

    Its loss terms' parts (`split_at_sums`) run as soon as each is ready,
    and the rest after the last of them, all on the block's stream. Only
    when every part could run early on its own, they become ready at two
    points at least, and the rest mutates nothing and is linear in the parts
    (with seed ``s`` the rest reads the parts' values at seed ``s``).
    """
    split = split_at_sums(comp, by_name, seeds, describe)
    if split is None:
        return None
    parts, rest, _, _ = split
    if any(_reject_reason(part, by_name, latest, position)[0] is not None for part in parts):
        return None
    if len({part.ready_after for part in parts}) < 2:
        return None
    tangent = by_name[comp.tangents[0]]
    dependent = {tangent} | seeds | {by_name[n] for part in parts for n in part.nodes}
    dependent |= {by_name[n] for n in rest.nodes}
    for name in rest.nodes + rest.helpers:
        if _mutates(by_name[name]):
            return None
    if any(linearity_violation(by_name[name], dependent) is not None for name in rest.nodes):
        return None
    parts.sort(key=lambda part: position[by_name[part.ready_after]])
    return dataclasses.replace(
        comp, pieces=(*(part.nodes for part in parts), rest.nodes),
        piece_ready=(*(part.ready_after for part in parts), rest.ready_after))


def _sums_text(sums: list[fx.Node], comp: Component, primal_label: list[str]) -> str:
    grad_of = {name: primal_label[i] for i, name in comp.grad_outputs}
    return ", ".join(f"of {grad_of[s.name]}" if s.name in grad_of else f"at {s.name}"
                     for s in sums)


def _summands(node: fx.Node, sums: list[fx.Node]) -> list[fx.Node]:
    """The non-sum nodes a sum (or a tree of sums) adds up."""
    found, stack = [], list(node.all_input_nodes)
    while stack:
        arg = stack.pop()
        if arg in sums:
            stack.extend(arg.all_input_nodes)
        else:
            found.append(arg)
    return found


def _joined_by_sums(comp: Component, by_name: dict[str, fx.Node], seeds: set[fx.Node],
                    primal_label: list[str]) -> str:
    """A note for a rejected component that several losses reach only through sums."""
    pieces, sums = joining_sums(comp, by_name, seeds)
    if not sums:
        return ""
    return (f"; the backwards of {len(pieces)} loss terms meet in it only through sums of "
            f"gradients ({_sums_text(sums, comp, primal_label)}): a parameter they share, or "
            f"a value one reads without detach")


def _mutates(node: fx.Node) -> bool:
    if node.meta.get("partitioner_tag") == "must_be_in_backward":
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _primal_labels(graph: fx.Graph, primal_names: Sequence[str]) -> list[str]:
    labels = []
    for i, node in enumerate(n for n in graph.nodes if is_primal(n)):
        labels.append(primal_names[i] if i < len(primal_names) else node.name)
    return labels


def check_block_analysis(gm: fx.GraphModule, analysis: BlockAnalysis) -> None:
    """Invariants of the analysis; raises GraphInvariantError on a violation."""
    by_name = {n.name: n for n in gm.graph.nodes}
    seen: set[str] = set()
    for expected_id, block in enumerate(analysis.blocks):
        comp = block.component
        if block.id != expected_id:
            raise GraphInvariantError(PASS_NAME, f"block ids out of order at {block.id}")
        overlap = seen & set(comp.nodes)
        if overlap:
            raise GraphInvariantError(PASS_NAME, "blocks share nodes", node=sorted(overlap)[0])
        seen |= set(comp.nodes)
        tangent = by_name[block.tangent]
        if comp.tangents != (block.tangent,) or tangent.meta["val"].dim() != 0:
            raise GraphInvariantError(PASS_NAME, "a block must read one 0-dim tangent",
                                      node=block.tangent)
        members = set(comp.nodes)
        for name in comp.nodes:
            outside = [u for u in by_name[name].users if u.name not in members]
            allowed = ((lambda u: u.op == "output" or u.target in _SUM_OPS)
                       if name in comp.partials else (lambda u: u.op == "output"))
            if not all(allowed(u) for u in outside) or (name in comp.partials and not outside):
                raise GraphInvariantError(
                    PASS_NAME, "a block's nodes may be read outside it only as gradients (by "
                    "the output) or as gradient parts (by sums)", node=name)
        if comp.pieces and (sorted(n for piece in comp.pieces for n in piece)
                            != sorted(comp.nodes) or len(comp.piece_ready) != len(comp.pieces)):
            raise GraphInvariantError(PASS_NAME, "a block's pieces must split its nodes",
                                      node=comp.nodes[0])
        ready = by_name[comp.ready_after]
        if is_tangent(ready) or ready.name in seen:
            raise GraphInvariantError(PASS_NAME, "ready point is not a forward node",
                                      node=ready.name)
