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
  2. seed nodes = backward nodes reading only tangents, seeds and constants
     (``expand(T)``, ``T / n``);
  3. the other backward nodes fall into connected components (networkx); each
     is an independent backward piece;
  4. a piece's *ready point* is its last forward producer: the last node that
     the forward outputs need and that the piece reads, directly or through
     tangent-free helpers (autograd puts nodes such as ``t(t_2)`` in the
     backward region although they read only forward values);
  5. a piece is an early block if it produces parameter gradients, reads the
     gradient of exactly one one-element output (the loss: 0-d, or ``[1]``
     as a loss accumulated into ``torch.zeros(1)``), its ready point comes
     before the latest ready point, and every op on its path from the tangent
     is known to be linear in it (`linearity_violation`) and mutates nothing;
  6. a piece that would stay in the backward although several loss terms
     reach it (a parameter two blocks share, a trunk whose auxiliary heads
     read it without detach) is split where the terms' gradients meet
     (`split_at_sums`, its own module): each loss term's part, the nodes
     only its gradient reaches, the trunk's own branch sums included, is
     judged as in 5, with the gradients it adds into the sums where it meets
     the others as *partial* outputs; those sums and what follows them stay
     in the backward (``joins_blocks``). A part must also be worth its
     boundary: one whose estimated backward FLOPs are under
     ``cfg.tuning.min_part_share`` of the whole backward's stays in the backward
     (``small_part``, the cost check below). The reasons say, in the model's
     module names, which loss terms meet where, and why a part cannot run
     early;
  7. with no ``cfg.seed`` given and no learned seed (``seed_input``: the
     backend gives a graph with float16 values one, `erase_fx.emit.loss_seed`),
     a piece whose backward computes in float16 stays in the backward
     (``float16_seed``): its early copy would run at seed 1 while a loss
     scaler's ``T`` is its scale, and float16 gradients computed at one and
     scaled to the other underflow (or overflow) where the backward run with
     ``T`` does not;
  8. an early block whose loss terms meet in such sums and become ready at
     different points is cut in pieces (`Component.pieces`): each term's
     part launches at its own ready point, the rest (the sums and what
     follows) after the last part, all on the block's stream (`_in_pieces`).

The cost check on parts: running a part early can win at most the time of
its own backward, since the trunk's backward still waits for the end of the
forward; what it costs is fixed by the graph, not by its size: a segment
boundary cut into the trunk's forward at its branch point (kernels that
Inductor would fuse across it, written on both sides) and its partials
handed to the backward. Measured on an H200 (GoogLeNet's two auxiliary
heads, each 2.6% of the backward's FLOPs: the step 1.06x of stock's with
them early), a small part loses more than it wins. Whole blocks (a detached
stage and its head) are not held to it: their early backward is the whole
of their gradient, and a chain's blocks are each 1/K of the backward.

Invariants out (`check_block_analysis`): blocks are disjoint, each has one
one-element tangent and a ready point that is a forward node, reads no node of
another component and is read outside only as gradients or gradient parts;
ids follow ready-point order. The pass does not change the graph: it returns
the input module, unmodified, with the `BlockAnalysis` as its artifact.

Before (excerpt of a joint graph, block 1 detached from block 2)::

    relu = relu(addmm);  local = mse_loss(addmm_1, y);  detach = detach(relu)
    ... block 2 forward ...; add = add(local, loss_2)
    expand = expand(tangents_1, ...)        # seed
    mse_loss_backward(expand, addmm_1, y)   # block 1 backward: component A
    ...                                     # block 2 backward: component B

After: ``PassResult(gm, modified=False, artifact=BlockAnalysis(blocks=(Block(id=0,
ready_after="addmm_1", ...),), rejected=(Rejected(component B, reason=LAST_BLOCK),)))``.
"""
from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import networkx as nx
import torch
import torch.fx as fx

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.flops import node_flops
from erase_fx.passes.graph import (
    is_one_element,
    is_primal,
    is_tangent,
    output_values,
    tangent_outputs,
    topo_positions,
    upstream_of_seed,
    val_of,
)
from erase_fx.passes.linearity import linearity_violation
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult
from erase_fx.passes.split_at_sums import (
    Meeting,
    TermSplit,
    held_text,
    is_sum,
    meetings,
    split_at_sums,
    term_names,
)

PASS_NAME = "find_stop_gradient_blocks"


class RejectReason(str, enum.Enum):
    """Why a backward component stays in the backward."""

    NO_PARAMETER_GRAD = "no_parameter_grad"
    LAST_BLOCK = "last_block"
    NOT_SCALAR_TANGENT = "not_scalar_tangent"
    MUTATION = "mutation"
    NOT_LINEAR = "not_linear"
    JOINS_BLOCKS = "joins_blocks"
    SMALL_PART = "small_part"
    FLOAT16_SEED = "float16_seed"

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
    """A component that runs early.

    Attributes:
        id: the block's index, in ready-point order.
        component: its nodes.
        tangent: the loss tangent ``T`` its early backward is seeded for.
        params: the parameters whose gradients it computes.
        other_tangents: the other tangents it reads (outputs kept for logging, or
            captured by hooks): their part of its gradients is computed in the
            backward (`schedule_early_backward`), and costs nothing when they get
            no gradient.
        at_graph_end: its backward is ready only when the graph's forward ends
            (the last block of a chain; a graph's only block when graph breaks
            separate blocks): it runs there, while what follows the graph runs
            (the next graphs' forwards), instead of in the backward.
        loss_seed: the one-element value its backward reads the loss tangent
            through (`Dataflow.loss_seed`): the tangent itself for a loss of
            one element; an element of it for a loss written into a slot of a
            larger tensor (``losses[:, i] = local``). The early copy is seeded
            there; empty means the tangent.
    """

    id: int
    component: Component
    tangent: str
    params: tuple[str, ...]
    other_tangents: tuple[str, ...] = ()
    at_graph_end: bool = False
    loss_seed: str = ""

    @property
    def seed_node(self) -> str:
        """The node the early copy is seeded at: `loss_seed`, or the tangent."""
        return self.loss_seed or self.tangent


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A component that stays in the backward, and why.

    Attributes:
        component: its nodes.
        reason: why, as a kind.
        detail: why, in words: the model's module names where it helps, a
            node name only beside them.
        node: the graph node the reason is about, if any.
        params: the parameters whose gradients it computes.
        meetings: for a component several loss terms reach, where their
            gradients are summed (`split_at_sums`); empty otherwise.
    """

    component: Component
    reason: RejectReason
    detail: str
    node: str | None
    params: tuple[str, ...]
    meetings: tuple[Meeting, ...] = ()


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

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        """The analysis's dump: its decisions as JSON (``gm`` is the joint graph, dumped
        before the pass)."""
        del gm
        return (DumpFile(".json", "the blocks and rejected components, as data",
                         json.dumps(dataclasses.asdict(self), indent=2, default=str) + "\n"),)


def find_stop_gradient_blocks(gm: fx.GraphModule, ctx: PassContext) -> PassResult[BlockAnalysis]:
    """Analyse a joint graph; see the module docstring.

    Returns the input module, unmodified, with the `BlockAnalysis` as the
    artifact; the pipeline checks it with `check_block_analysis`.

    Args:
        gm: AOTAutograd's joint graph (``primals_*``, ``tangents_*`` inputs;
            forward outputs then one gradient per primal).
        ctx: ``cfg.tuning.min_part_share``, the smallest share of the backward's
            estimated FLOPs a gradient part runs early with; and, given:
            ``num_fwd_outputs``, how many of the outputs are forward outputs;
            ``primal_names`` (optional), a name per primal (e.g. a parameter's
            qualified name), used in the report, ``primals_<i>`` where missing;
            ``graph_end`` (optional, False): a component ready only when the
            forward ends, whose loss terms do not meet in sums, runs early there
            (`Block.at_graph_end`) instead of staying in the backward
            (``last_block``). The caller says whether its program can run it
            there (side streams, no data parallel); ``seed_input`` (optional):
            the placeholder of a learned loss seed, which lets float16 blocks
            run early (rule 7).
    """
    num_fwd_outputs: int = ctx.given["num_fwd_outputs"]
    primal_names: Sequence[str] = ctx.given.get("primal_names", ())
    graph_end: bool = ctx.given.get("graph_end", False)
    facts = Dataflow.of(gm.graph, num_fwd_outputs, primal_names)
    components = sorted((facts.describe(members) for members in facts.backward_pieces()),
                        key=facts.order)
    latest = max((facts.ready_position(c) for c in components if c.grad_outputs), default=-1)
    backward_flops = sum(node_flops(n) for n in facts.backward)
    early, rejected = _judge_components(components, facts, latest, backward_flops,
                                        ctx.cfg.tuning.min_part_share, graph_end,
                                        ctx.cfg.seed is None and not ctx.given.get("seed_input"))
    early.sort(key=lambda judged: facts.order(judged[0]))
    blocks = []
    for i, (comp, (loss, seed, _)) in enumerate(early):
        blocks.append(Block(i, comp, loss, facts.params_of(comp),
                            tuple(t for t in comp.tangents if t != loss),
                            at_graph_end=facts.ready_position(comp) >= latest,
                            loss_seed="" if seed == loss else seed))
    analysis = BlockAnalysis(
        blocks=tuple(blocks),
        rejected=tuple(rejected),
        backward_flops=backward_flops,
        num_fwd_outputs=num_fwd_outputs,
    )
    return PassResult(gm, modified=False, artifact=analysis)


@dataclasses.dataclass(frozen=True)
class Dataflow:
    """The dataflow facts of a joint graph, computed once; every judgement reads them.

    Attributes:
        graph: the joint graph.
        edges: its dataflow (an edge from each input to its user).
        position: each node's index in graph order.
        by_name: each node by name.
        backward: the nodes that transitively read a tangent (the output excluded).
        seeds: backward nodes that read only tangents and seeds (``expand(T)``).
        required_forward: what the forward outputs need, and the primals.
        grad_index: each gradient output's node -> the primal it is the gradient of.
        primal_label: a name per primal, for reports.
        helper_pool: tangent-free nodes no forward output needs (the helpers
            autograd leaves in the backward region, such as ``t(t_2)``).
        output_position: each tangent's name -> the graph position of the forward
            output it is the gradient of (from AOTAutograd's descriptors, where the
            graph has them).
    """

    graph: fx.Graph
    edges: nx.DiGraph
    position: Mapping[fx.Node, int]
    by_name: Mapping[str, fx.Node]
    backward: AbstractSet[fx.Node]
    seeds: AbstractSet[fx.Node]
    required_forward: AbstractSet[fx.Node]
    grad_index: Mapping[fx.Node, int]
    primal_label: Sequence[str]
    helper_pool: nx.DiGraph
    output_position: Mapping[str, int]

    @classmethod
    def of(cls, graph: fx.Graph, num_fwd_outputs: int,
           primal_names: Sequence[str] = ()) -> Dataflow:
        nodes = list(graph.nodes)
        edges = nx.DiGraph()
        edges.add_nodes_from(nodes)
        edges.add_edges_from((arg, node) for node in nodes for arg in node.all_input_nodes)
        outputs = output_values(graph)
        tangents = [n for n in nodes if is_tangent(n) and n.users]
        backward: set[fx.Node] = set(tangents)
        for tangent in tangents:
            backward |= nx.descendants(edges, tangent)
        backward = {n for n in backward if n.op != "output"}
        seeds: set[fx.Node] = set()
        for node in nodes:
            # NB: a constant (``full([1], 0)``, no inputs) is read as the tangents are: the
            # zeros Inductor's decompositions write into a loss tensor's slots
            if node in backward and node.op == "call_function" and all(
                a in seeds or is_tangent(a) or _is_constant(a) for a in node.all_input_nodes
            ):
                seeds.add(node)
        forward_outputs = [o for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node)]
        required = _ancestors_of(edges, forward_outputs) | set(forward_outputs)
        required |= {n for n in nodes if n.op == "placeholder" and not is_tangent(n)}
        position = topo_positions(graph)
        return cls(
            graph=graph,
            edges=edges,
            position=position,
            by_name={n.name: n for n in nodes},
            backward=frozenset(backward),
            seeds=frozenset(seeds),
            required_forward=frozenset(required),
            grad_index={out: i for i, out in enumerate(outputs[num_fwd_outputs:])
                        if isinstance(out, fx.Node)},
            primal_label=_primal_labels(graph, primal_names),
            helper_pool=edges.subgraph(
                n for n in nodes if n not in backward and n not in required),
            output_position={tangent.name: position[output] for tangent, output
                             in tangent_outputs(graph, num_fwd_outputs).items()},
        )

    def backward_pieces(self) -> list[set[fx.Node]]:
        """The connected components of the backward, seeds and tangents left out."""
        core = [n for n in self.graph.nodes
                if n in self.backward and n not in self.seeds and not is_tangent(n)]
        return list(nx.connected_components(self.edges.subgraph(core).to_undirected(
            as_view=True)))

    def describe(self, members: set[fx.Node]) -> Component:
        return _describe(members, self.seeds, self.helper_pool, self.required_forward,
                         self.grad_index, self.position)

    def ready_position(self, comp: Component) -> int:
        return self.position[self.by_name[comp.ready_after]]

    def order(self, comp: Component) -> tuple[int, int]:
        """NB: deterministic order please: by ready point, then by first node."""
        return self.ready_position(comp), self.position[self.by_name[comp.nodes[0]]]

    def loss_seed(self, comp: Component) -> LossSeed | None:
        """The tangent ``comp``'s early backward is seeded for, the one-element value it
        reads that tangent through (the tangent itself when it has one element), and why
        its backward is not linear from there (`LossSeed`); None when it reads no such
        value.

        Of the tangents with such a value, the gradient of the output the forward makes
        last (a loss accumulated as ``total = total + local`` and returned beside
        ``local``, kept for logging, is ``total``).

        NB: any choice is exact: the other tangents' part of the gradient is computed in
        the backward. The choice decides which part runs early.
        """
        found = []
        for name in comp.tangents:
            seed = self._one_element_seed(comp, self.by_name[name])
            if seed is not None:
                found.append((name, seed.name))
        if not found:
            return None
        tangent, seed = max(found, key=lambda pair: (self.output_position.get(pair[0], -1),
                                                     self.position[self.by_name[pair[0]]]))
        # NB: an element other than the tangent is only chosen where what follows it is linear
        nonlinear = self.linearity_after(comp, seed) if seed == tangent else None
        return LossSeed(tangent, seed, nonlinear)

    def _one_element_seed(self, comp: Component, tangent: fx.Node) -> fx.Node | None:
        """A one-element value every path from ``tangent`` into ``comp`` passes through:
        ``tangent`` itself if it has one element; for a loss written into slots of a
        larger tensor (``losses[:, i] = local``), the element the block's loss gradient is
        read from (``select(tangents_1, 1, i)`` and what autograd makes of it). What makes
        it runs in the backward as it is; what follows it must be linear in it. Of such
        values, the nearest the tangent from which the rest is linear. None when none.

        NB: the nearest the tangent, not the component: the early copy then computes from
        the seed what the backward computes from the element (a mean's ``1 / n`` too), and
        with the element equal to the seed (``losses.sum().backward()``) its gradients are
        bitwise the backward's, not rounded once more by a scale.
        """
        if is_one_element(tangent.meta.get("val")):
            return tangent
        seeds = {self.by_name[n] for n in comp.seeds}
        reach = ({tangent} | nx.descendants(self.edges, tangent)) & (seeds | {tangent})
        members = {self.by_name[n] for n in comp.nodes}
        frontier = {a for m in members for a in m.all_input_nodes if a in reach}
        if not frontier:
            return None
        paths = self.edges.subgraph(reach)
        common = set.intersection(*({f} | nx.ancestors(paths, f) for f in frontier))
        for seed in sorted(common, key=self.position.__getitem__):
            if not is_one_element(seed.meta.get("val")) or self.tangents_of(seed) != {tangent}:
                continue
            around = paths.subgraph(n for n in reach if n is not seed)
            if any(f is not seed and f in around and nx.has_path(around, tangent, f)
                   for f in frontier):
                continue
            if self.linearity_after(comp, seed.name) is None:
                return seed
        return None

    def linearity_after(self, comp: Component, seed: str) -> tuple[str, str] | None:
        """Why ``comp``'s backward is not linear in the tangents once the loss seed ``seed``
        is given, as ``(node, reason)``; None when it is."""
        upstream = upstream_of_seed(self.by_name[seed], set(comp.seeds))
        dependent = {self.by_name[n] for n in comp.tangents + comp.seeds + comp.nodes}
        for name in comp.seeds + comp.nodes:
            if name in upstream:
                continue  # NB: computed from the tangent as it is: need not be linear
            why = linearity_violation(self.by_name[name], dependent)
            if why is not None:
                return name, why
        return None

    def tangents_of(self, node: fx.Node) -> set[fx.Node]:
        """The tangents ``node`` depends on."""
        return {a for a in nx.ancestors(self.edges, node) | {node} if is_tangent(a)}

    def params_of(self, comp: Component) -> tuple[str, ...]:
        return tuple(self.primal_label[i] for i, _ in sorted(comp.grad_outputs))

    def cut(self, comp: Component) -> _Cut | None:
        grad_label = {node: self.primal_label[i] for node, i in self.grad_index.items()}
        return _cut(comp, self.by_name, self.seeds, self.required_forward, self.position,
                    self.describe, grad_label)


def _judge_components(
    components: Sequence[Component],
    facts: Dataflow,
    latest: int,
    backward_flops: int,
    min_part_share: float,
    graph_end: bool,
    float16_needs_seed: bool,
) -> tuple[list[tuple[Component, LossSeed]], list[Rejected]]:
    """Each component early (whole, in pieces, or its parts split at sums), with its loss
    seed, or rejected, and why.

    A part split at sums runs early only with at least ``min_part_share`` of
    the backward's estimated FLOPs (``backward_flops``). With ``graph_end``, a
    component ready only when the forward ends runs early there, unless its
    loss terms meet in sums (then its parts are judged as before); one that
    would not run there either is rejected for what keeps it (no loss, say),
    not for being last.
    """

    def judge(comp: Component) -> _Verdict:
        return _reject_reason(comp, facts, latest, float16_needs_seed)

    def judge_at_end(comp: Component) -> _Verdict:
        # NB: the ready point judged as if a later one existed: the graph's end
        return _reject_reason(comp, facts, latest + 1, float16_needs_seed)

    def judge_part(part: Component) -> _Verdict:
        why = judge(part)
        if why.reason is None and part.flops < min_part_share * backward_flops:
            return _small_part_reason(part.flops / backward_flops, min_part_share)
        return why

    early: list[tuple[Component, LossSeed]] = []
    rejected: list[Rejected] = []
    for comp in components:
        verdict = judge(comp)
        reason, detail, node, loss = verdict
        if reason is None:
            pieces = _in_pieces(comp, facts.cut(comp), facts.by_name, facts.seeds,
                                facts.position, judge)
            early.append((pieces or comp, loss))  # NB: pieces keep the whole's nodes and seeds
            continue
        cut = facts.cut(comp)
        if graph_end and reason is RejectReason.LAST_BLOCK and cut is None:
            at_end = judge_at_end(comp)
            if at_end.reason is None:
                early.append((comp, at_end.loss))
                continue
            # NB: at the graph's end it would stay all the same: say what keeps it there
            reason, detail, node, _ = at_end
        if cut is None:
            rejected.append(Rejected(comp, reason, detail, node, facts.params_of(comp)))
            continue
        judged = [judge_part(part) for part in cut.parts]
        # NB: a part kept back only by the cost check is listed on its own, as the split found it
        if reason in _SPLIT_REASONS and any(why.reason in (None, RejectReason.SMALL_PART)
                                            for why in judged):
            early += [(part, why.loss) for part, why in zip(cut.parts, judged)
                      if why.reason is None]
            rejected += _left_in_backward(cut, judged, facts.params_of)
            continue
        detail += _met_in_sums_text(cut, judged if reason in _SPLIT_REASONS else None)
        rejected.append(Rejected(comp, reason, detail, node, facts.params_of(comp),
                                 cut.meetings))
    return early, rejected


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


class LossSeed(NamedTuple):
    """Where a component's early backward is seeded (`Dataflow.loss_seed`).

    Attributes:
        tangent: the loss tangent it is seeded for.
        seed: the one-element value it reads that tangent through: the tangent itself
            when it has one element.
        nonlinear: why its backward is not linear in the tangents from ``seed`` on, as
            ``(node, reason)`` (`Dataflow.linearity_after`); None when it is.
    """

    tangent: str
    seed: str
    nonlinear: tuple[str, str] | None


class _Verdict(NamedTuple):
    """Why a component stays in the backward (``reason`` None: it may run early), the node
    the reason is about, and the loss seed found on the way (None where not reached)."""

    reason: RejectReason | None
    detail: str
    node: str | None
    loss: LossSeed | None = None


def _reject_reason(comp: Component, facts: Dataflow, latest: int,
                   float16_needs_seed: bool) -> _Verdict:
    by_name = facts.by_name
    if not comp.grad_outputs and not comp.partials:
        return _Verdict(RejectReason.NO_PARAMETER_GRAD, "produces no gradient of a graph input",
                        None)
    if facts.ready_position(comp) >= latest:
        return _Verdict(
            RejectReason.LAST_BLOCK,
            "its backward is ready only when the forward ends: nothing later to overlap",
            comp.ready_after,
        )
    loss = facts.loss_seed(comp)
    if loss is None:
        shapes = ", ".join(f"{name} {tuple(by_name[name].meta['val'].shape)}"
                           for name in comp.tangents)
        return _Verdict(
            RejectReason.NOT_SCALAR_TANGENT,
            f"reads no gradient of a one-element output (a loss), nor an element of one, "
            f"only of larger outputs ({shapes})",
            comp.tangents[0],
        )
    for name in comp.seeds + comp.nodes + comp.helpers:
        node = by_name[name]
        if _mutates(node):
            return _Verdict(RejectReason.MUTATION, f"{node.target} mutates its input", name, loss)
    if loss.nonlinear is not None:
        return _Verdict(RejectReason.NOT_LINEAR, loss.nonlinear[1], loss.nonlinear[0], loss)
    if float16_needs_seed:
        in_float16 = next((name for name in comp.seeds + comp.nodes
                           if getattr(val_of(by_name[name]), "dtype", None) == torch.float16),
                          None)
        if in_float16 is not None:
            return _Verdict(RejectReason.FLOAT16_SEED, FLOAT16_SEED_DETAIL, in_float16, loss)
    return _Verdict(None, "", None, loss)


#: Why a block whose backward computes in float16 stays in the backward unless a seed is given.
FLOAT16_SEED_DETAIL = (
    "its backward computes in float16, where gradients computed at seed 1 and scaled by the "
    "loss gradient T afterwards underflow (or overflow) where the backward run with T does "
    "not: under a loss scaler (GradScaler) T is the scale, and this graph has no learned "
    "seed. Set options={'seed': s}, s the scale your scaler runs at, to run it early, or "
    "train in bfloat16")


def _small_part_reason(share: float, min_part_share: float) -> _Verdict:
    return _Verdict(RejectReason.SMALL_PART,
                    f"its backward is {share:.1%} of the graph's estimated backward FLOPs, "
                    f"under min_part_share ({min_part_share:.1%}): run early it would win "
                    f"less than the segment boundary it cuts into the forward costs", None)


#: Reasons for which a component is split where its loss terms meet: its
#: parts may run early although the whole cannot.
_SPLIT_REASONS = (RejectReason.LAST_BLOCK,)


@dataclasses.dataclass(frozen=True)
class _Cut:
    """A component cut where its loss terms meet (`split_at_sums`), as Components.

    Attributes:
        parts: the parts that split off, each with its ``partials`` (its
            nodes that the sums in ``rest`` read).
        part_names: the loss term of each part, in words.
        rest: the other nodes: the sums where the terms meet, what follows
            them, and the terms whose parts do not split off.
        split: the split, node by node.
        names: every loss term, in words.
        meetings: where the terms' gradients are summed.
    """

    parts: tuple[Component, ...]
    part_names: tuple[str, ...]
    rest: Component
    split: TermSplit
    names: tuple[str, ...]
    meetings: tuple[Meeting, ...]


def _cut(
    comp: Component,
    by_name: dict[str, fx.Node],
    seeds: set[fx.Node],
    forward: set[fx.Node],
    position: dict[fx.Node, int],
    describe: Callable[[set[fx.Node]], Component],
    grad_label: Mapping[fx.Node, str],
) -> _Cut | None:
    """``comp`` cut where its loss terms meet, or None when fewer than two terms reach it."""
    split = split_at_sums([by_name[name] for name in comp.nodes], seeds, forward, position)
    if split is None:
        return None
    parts = []
    for index in split.parts:
        part = describe(set(split.terms[index]))
        partials = tuple(n.name for n in (by_name[name] for name in part.nodes)
                         if any(user in split.rest for user in n.users))
        parts.append(dataclasses.replace(part, partials=partials))
    names = term_names(split, position)
    return _Cut(
        parts=tuple(parts),
        part_names=tuple(names[i] for i in split.parts),
        rest=describe(set(split.rest)),
        split=split,
        names=names,
        meetings=meetings(split, names, grad_label, position),
    )


def _in_pieces(
    comp: Component,
    cut: _Cut | None,
    by_name: dict[str, fx.Node],
    seeds: set[fx.Node],
    position: dict[fx.Node, int],
    judge: Callable[[Component], _Verdict],
) -> Component | None:
    """An early component cut into pieces that launch at their own ready points, or None.

    Its loss terms' parts (`split_at_sums`) run as soon as each is ready,
    and the rest after the last of them, all on the block's stream. Only
    when every part could run early on its own, they become ready at two
    points at least, and the rest mutates nothing and is linear in the parts
    (with seed ``s`` the rest reads the parts' values at seed ``s``).
    """
    if cut is None or not cut.parts:
        return None
    parts, rest = list(cut.parts), cut.rest
    if any(judge(part).reason is not None for part in parts):
        return None
    if len({part.ready_after for part in parts}) < 2:
        return None
    dependent = {by_name[n] for n in comp.tangents} | seeds
    dependent |= {by_name[n] for part in parts for n in part.nodes}
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


def _left_in_backward(
    cut: _Cut,
    judged: list[_Verdict],
    params_of: Callable[[Component], tuple[str, ...]],
) -> list[Rejected]:
    """What of a cut component stays in the backward: the parts that cannot run early
    (each with its reason and its loss term), then the rest (``joins_blocks``)."""
    left = [Rejected(part, reason, f"{detail} ({name}, up to where it meets the other loss "
                     f"terms)", node, params_of(part))
            for part, name, (reason, detail, node, _) in zip(cut.parts, cut.part_names, judged)
            if reason is not None]
    left.append(Rejected(cut.rest, RejectReason.JOINS_BLOCKS, _joins_text(cut), None,
                         params_of(cut.rest), cut.meetings))
    return left


def _joins_text(cut: _Cut) -> str:
    """Why the rest of a cut component stays in the backward, in words."""
    text = (f"adds up the gradient parts of {len(cut.names)} loss terms and runs in the "
            f"backward: from where they meet on, it needs every term's gradient")
    if cut.meetings:
        text += " (" + "; ".join(m.sentence for m in cut.meetings) + ")"
    held = held_text(cut.split, cut.names)
    return text + "".join(f"; {h}" for h in held)


def _met_in_sums_text(
    cut: _Cut, judged: list[_Verdict] | None
) -> str:
    """A note for a rejected component that several loss terms reach: where they meet,
    and (``judged``: each part's reason) why no part of it can run early."""
    if not cut.split.joins:
        return (f"; {len(cut.names)} loss terms meet in it, but not in sums of gradients"
                + "".join(f"; {h}" for h in held_text(cut.split, cut.names)))
    text = (f"; {len(cut.names)} loss terms meet in it only in sums of gradients ("
            + "; ".join(m.sentence for m in cut.meetings) + ")")
    if judged is None:
        return text
    why = [f"{name}: {why.detail}" for name, why in zip(cut.part_names, judged)]
    why += held_text(cut.split, cut.names)
    return text + ", and no term's part can run early on its own (" + "; ".join(why) + ")"


def _is_constant(node: fx.Node) -> bool:
    """A pure op with no input nodes (``full([1], 0)``): the same value every step."""
    return node.op == "call_function" and not node.all_input_nodes and not node.is_impure()


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


def check_block_analysis(result: PassResult[BlockAnalysis], ctx: PassContext) -> None:
    """Invariants of the analysis; raises GraphInvariantError on a violation."""
    gm, analysis = result.gm, result.artifact
    by_name = {n.name: n for n in gm.graph.nodes}
    components = [b.component for b in analysis.blocks] + [r.component for r in analysis.rejected]
    # NB: blocks come first, so block k's nodes are owned by k
    owner = {name: i for i, comp in enumerate(components) for name in comp.nodes}

    seen: set[str] = set()
    for expected_id, block in enumerate(analysis.blocks):
        comp = block.component
        if block.id != expected_id:
            raise GraphInvariantError(PASS_NAME, f"block ids out of order at {block.id}")
        overlap = seen & set(comp.nodes)
        if overlap:
            raise GraphInvariantError(PASS_NAME, "blocks share nodes", node=sorted(overlap)[0])
        seen |= set(comp.nodes)
        seed = by_name[block.seed_node]
        if (sorted(comp.tangents) != sorted((block.tangent, *block.other_tangents))
                or not is_one_element(seed.meta["val"])
                or not (seed.name == block.tangent or seed.name in comp.seeds)):
            raise GraphInvariantError(PASS_NAME, "a block is seeded at a one-element value of "
                                      "its loss tangent, which it reads; the other tangents it "
                                      "reads are its other tangents", node=block.seed_node)
        members = set(comp.nodes)
        for name in comp.nodes:
            foreign = [a.name for a in by_name[name].all_input_nodes
                       if owner.get(a.name, expected_id) != expected_id]
            if foreign:
                raise GraphInvariantError(
                    PASS_NAME, "a block reads a node of another component (it could not run "
                    "before that component)", node=name)
            outside = [u for u in by_name[name].users if u.name not in members]
            allowed = ((lambda u: u.op == "output" or is_sum(u))
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
