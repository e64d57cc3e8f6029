"""split_at_sums: where a backward component's loss terms meet, and each term's part.

What: a backward component (see find_stop_gradient_blocks) that several loss
terms reach without a detach between them: auxiliary heads on a trunk
(GoogLeNet), towers over a shared front, a layer two blocks share. Each term's
gradient flows on its own from its loss until it is summed with another
term's: autograd accumulates the gradient of a value (or a parameter) read in
two places with ``add``. This module finds, for each loss term, its *part*
(the nodes only that term's gradient reaches) and the *join* sums where
different terms' gradients meet. find_stop_gradient_blocks judges each part
as a block of its own; the joins and what follows them (the *rest*) need
every term's gradient, so they stay in the backward.

Why reach and not "cut at every sum": a trunk's own multi-branch blocks
(``f(x) + g(x)``, an Inception block's ``cat`` of branches) sum gradients
too, but of ONE loss term. Cutting there would end the main term at the
first such block below the loss, so an auxiliary term that joins two blocks
further down would seem to meet nothing. A sum is a join only when its
inputs carry different sets of loss terms.

How:
  1. loss terms (`loss_terms`): take every sum out of the component; each
     piece left that reads a seed or a tangent starts a term (a term's
     backward forks from one node, so its nodes before the first sum are one
     piece);
  2. reach (`term_reach`): for each node, the terms whose gradients flow into
     it: a term's own piece, and the union over the node's inputs, in one
     pass in graph order;
  3. a term's part is the nodes only it reaches. It splits off when only
     sums read it from the rest (the graph's output may read it too: a
     gradient) and it has matrix work (an elementwise penalty's part is not
     worth a stream); otherwise the term is *held* in the rest, with why.

Invariants out (`check_term_split`): the parts are disjoint; each reads, in
the component, only its own nodes (so it can run before the rest); the rest
reads a part only through sums; every join is a sum whose inputs carry
different sets of terms.

Before (excerpt of a joint graph's backward; the trunk ``inc4.1 -> inc5.0``,
with ``aux2`` branching off at ``inc4.1``'s output)::

    convolution_backward ...; getitem_34 ...    # the main loss, through inc5.0's branches
    add_4 = add(max_pool2d_with_indices_backward_1, getitem_34)   # inc5.0's branches
    add_5 = add(add_4, getitem_37)                                # (one term: not joins)
    _adaptive_avg_pool2d_backward = ...         # the aux2 loss, through aux2
    add_6 = add(add_5, _adaptive_avg_pool2d_backward)             # join: main meets aux2
    slice_1 = slice(add_6, ...) ...             # inc4.1's backward: the rest

After: ``TermSplit(terms=(<aux2's backward>, <fc's and inc5's backward, add_4, add_5>),
parts=(0, 1), rest={add_6, slice_1, ...}, joins=(add_6,))``.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet

import networkx as nx
import torch
import torch.fx as fx

from erase_fx.errors import GraphInvariantError
from erase_fx.passes.flops import node_flops
from erase_fx.passes.graph import is_tangent

#: NB: this analysis runs inside find_stop_gradient_blocks; its errors name that pass.
PASS_NAME = "find_stop_gradient_blocks"

#: Ops that sum two gradients (autograd's accumulation of a value used twice).
SUM_OPS = (torch.ops.aten.add.Tensor,)


def is_sum(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SUM_OPS


@dataclasses.dataclass(frozen=True)
class TermSplit:
    """A component's loss terms, the part of each, and the sums where they meet.

    Attributes:
        terms: each loss term's part: the nodes only its gradient reaches (its
            own multi-branch sums included), in forward order (`loss_terms`).
        parts: the indices of the terms whose part splits off: only sums read
            it from the rest, and it has matrix work.
        held: (index, reader) of each other term: ``reader`` is the op, not a
            sum, through which the rest reads its part, or None where the
            part has no matrix work. Its nodes are in ``rest``.
        rest: the component's nodes outside the split-off parts: the sums
            where the terms meet, what follows them, and the held terms.
        joins: the sums whose inputs carry different sets of terms, in graph
            order.
        reach: for each node of the component, the indices of the terms
            whose gradients flow into it.
    """

    terms: tuple[frozenset[fx.Node], ...]
    parts: tuple[int, ...]
    held: tuple[tuple[int, fx.Node | None], ...]
    rest: frozenset[fx.Node]
    joins: tuple[fx.Node, ...]
    reach: Mapping[fx.Node, frozenset[int]]


def split_at_sums(
    members: Collection[fx.Node],
    seeds: AbstractSet[fx.Node],
    forward: AbstractSet[fx.Node],
    position: Mapping[fx.Node, int],
) -> TermSplit | None:
    """The loss terms of a component and where they meet; None for fewer than two terms.

    Args:
        members: the component's backward nodes (no seeds, no helpers).
        seeds: the backward nodes that read only tangents (``expand(T)``...).
        forward: the nodes the forward computes (to order the terms).
        position: each node's index in graph order (a topological order).
    """
    members = frozenset(members)
    pieces = loss_terms(members, seeds, forward, position)
    if len(pieces) < 2:
        return None
    reach = term_reach(members, pieces, position)
    ordered = sorted(members, key=position.__getitem__)
    terms = tuple(frozenset(n for n in ordered if reach[n] == {i}) for i in range(len(pieces)))
    parts, held = [], []
    for index, nodes in enumerate(terms):
        reader = _reader_not_a_sum(nodes, members, position)
        if reader is None and sum(node_flops(n) for n in nodes) > 0:
            parts.append(index)
        else:
            held.append((index, reader))
    rest = members.difference(*(terms[i] for i in parts))
    joins = tuple(n for n in ordered if is_sum(n) and _carries_different_terms(n, reach))
    split = TermSplit(terms, tuple(parts), tuple(held), rest, joins, reach)
    check_term_split(split, members)
    return split


def loss_terms(
    members: AbstractSet[fx.Node],
    seeds: AbstractSet[fx.Node],
    forward: AbstractSet[fx.Node],
    position: Mapping[fx.Node, int],
) -> list[frozenset[fx.Node]]:
    """Where each loss term's gradient starts: the pieces of the component once its sums
    are taken out that read a seed or a tangent.

    Pieces that read neither (the backward after a sum) start no term. The
    terms are in forward order: by the last forward value each reads (an
    auxiliary head's loss before the main loss), then by first node.
    """
    inside = {n for n in members if not is_sum(n)}
    graph = nx.Graph()
    graph.add_nodes_from(inside)
    graph.add_edges_from((n, a) for n in inside for a in n.all_input_nodes if a in inside)
    seeded = [frozenset(piece) for piece in nx.connected_components(graph)
              if any(a in seeds or is_tangent(a) for n in piece for a in n.all_input_nodes)]

    def forward_order(piece: frozenset[fx.Node]) -> tuple[int, int]:
        read = [position[a] for n in piece for a in n.all_input_nodes if a in forward]
        return max(read, default=-1), min(position[n] for n in piece)

    return sorted(seeded, key=forward_order)


def term_reach(
    members: AbstractSet[fx.Node],
    pieces: Sequence[AbstractSet[fx.Node]],
    position: Mapping[fx.Node, int],
) -> dict[fx.Node, frozenset[int]]:
    """For each member, the indices of the loss terms whose gradients flow into it."""
    term_of = {n: i for i, piece in enumerate(pieces) for n in piece}
    reach: dict[fx.Node, frozenset[int]] = {}
    # NB: graph order is topological: every member's inputs are done before it.
    for node in sorted(members, key=position.__getitem__):
        found = {term_of[node]} if node in term_of else set()
        for arg in node.all_input_nodes:
            found |= reach.get(arg, frozenset())
        reach[node] = frozenset(found)
    return reach


def _reader_not_a_sum(nodes: frozenset[fx.Node], members: frozenset[fx.Node],
                      position: Mapping[fx.Node, int]) -> fx.Node | None:
    """The first node of the rest that reads the part ``nodes`` and is not a sum, if any."""
    readers = {u for n in nodes for u in n.users
               if u in members and u not in nodes and not is_sum(u)}
    return min(readers, key=position.__getitem__, default=None)


def _carries_different_terms(node: fx.Node, reach: Mapping[fx.Node, frozenset[int]]) -> bool:
    return len({reach[a] for a in node.all_input_nodes if a in reach}) > 1


def check_term_split(split: TermSplit, members: frozenset[fx.Node]) -> None:
    """Invariants of a split; raises GraphInvariantError on a violation."""
    taken: set[fx.Node] = set()
    for index in split.parts:
        part = split.terms[index]
        if taken & part:
            raise GraphInvariantError(PASS_NAME, "two loss terms' parts share nodes",
                                      node=min(n.name for n in taken & part))
        taken |= part
        for node in part:
            outside = [a for a in node.all_input_nodes if a in members and a not in part]
            if outside:
                raise GraphInvariantError(PASS_NAME, "a loss term's part reads the rest",
                                          node=node.name)
            if any(u in split.rest and not is_sum(u) for u in node.users):
                raise GraphInvariantError(
                    PASS_NAME, "the rest reads a loss term's part other than through a sum",
                    node=node.name)
    for join in split.joins:
        if not is_sum(join) or not _carries_different_terms(join, split.reach):
            raise GraphInvariantError(PASS_NAME, "a join must sum different loss terms",
                                      node=join.name)


# -- in words: which loss terms, and where in the model they meet ----------------


@dataclasses.dataclass(frozen=True)
class Meeting:
    """One place where the gradients of several loss terms are summed.

    Attributes:
        terms: the loss terms that meet there, by name (see `term_names`).
        where: the place in the model's words: ``"the gradient of an output
            of inc4.1, which inc5.0 and aux2 read"`` or ``"the gradient of
            b1.2.weight, a parameter they share"``.
        node: the sum in the joint graph (the last of a chain of sums).
    """

    terms: tuple[str, ...]
    where: str
    node: str

    @property
    def sentence(self) -> str:
        return f"{_terms_text(self.terms)} meet in {self.where}"


def term_names(split: TermSplit, position: Mapping[fx.Node, int]) -> tuple[str, ...]:
    """A name a user recognises for each loss term: the module its part runs in.

    The longest module path all of the part's nodes share (``aux2`` for an
    auxiliary head), else the module nearest the loss (``fc`` for the main
    loss, whose part spans the head and the trunk's last blocks), else the
    function that computed the loss (``cross_entropy``).
    """
    names = []
    for index, nodes in enumerate(split.terms):
        ordered = sorted(nodes, key=position.__getitem__)
        paths = [p for p in map(module_path, ordered) if p]
        name = _common_path(paths) or (paths[0] if paths else None)
        if name:
            names.append(f"the loss through {name}")
            continue
        function = next((f for f in map(_source_function, ordered) if f), None)
        names.append(f"the loss term from {function}" if function else f"loss term {index + 1}")
    return _unique(names)


def meetings(
    split: TermSplit,
    names: Sequence[str],
    grad_label: Mapping[fx.Node, str],
    position: Mapping[fx.Node, int],
) -> tuple[Meeting, ...]:
    """Where the split's loss terms meet, one `Meeting` per chain of sums with a join.

    A value read in k places gets its gradient from a chain of k - 1 sums;
    the chain's last sum (read by something other than a sum) names the
    meeting, and its summands say which modules read the value.

    Args:
        names: each term's name (`term_names`).
        grad_label: the parameter label of each gradient output node.
    """
    members = frozenset(split.reach)
    joins = set(split.joins)
    found: list[Meeting] = []
    shared: dict[tuple[str, ...], list[fx.Node]] = {}  # parameters, by the terms meeting
    for last in sorted(members, key=position.__getitem__):
        if not is_sum(last) or _feeds_only_sums(last, members):
            continue
        chain, summands = _sum_chain(last, members)
        if not chain & joins:
            continue
        terms = tuple(names[i] for i in sorted(split.reach[last]))
        if last in grad_label:
            shared.setdefault(terms, []).append(last)
            continue
        where = _where(last, summands, split.reach, members, position)
        found.append(Meeting(terms, where, last.name))
    for terms, sums in shared.items():
        labels = [grad_label[s] for s in sums]
        where = (f"the gradient of {labels[0]}, a parameter they share" if len(labels) == 1
                 else f"the gradients of {_and(labels)}, parameters they share")
        found.append(Meeting(terms, where, sums[0].name))
    return tuple(found)


def held_text(split: TermSplit, names: Sequence[str]) -> list[str]:
    """Why each held term's part does not split off, in words."""
    texts = []
    for index, reader in split.held:
        if reader is None:
            texts.append(f"{names[index]} does no matrix work before it meets the others: "
                         f"not worth a stream of its own")
        else:
            op = getattr(getattr(reader.target, "overloadpacket", None), "__name__", reader.name)
            place = _origin(reader)
            texts.append(f"{names[index]} meets the others in {op}"
                         + (f" (the backward of {place})" if place else "")
                         + ", not in a sum of gradients: erase_fx splits only at sums")
    return texts


def _sum_chain(last: fx.Node, members: frozenset[fx.Node]) -> tuple[set[fx.Node], list[fx.Node]]:
    """The sums whose results only ``last``'s chain reads, and the values they add up."""
    chain, summands, stack = set(), [], [last]
    while stack:
        node = stack.pop()
        chain.add(node)
        for arg in node.all_input_nodes:
            if arg not in members:
                continue
            if is_sum(arg) and _feeds_only_sums(arg, members):
                stack.append(arg)
            else:
                summands.append(arg)
    return chain, summands


def _feeds_only_sums(node: fx.Node, members: frozenset[fx.Node]) -> bool:
    """Whether only sums read ``node``: a link inside a chain of sums, not its end."""
    return all(u in members and is_sum(u) for u in node.users)


def _where(last: fx.Node, summands: list[fx.Node], reach: Mapping[fx.Node, frozenset[int]],
           members: frozenset[fx.Node], position: Mapping[fx.Node, int]) -> str:
    """The value whose gradient ``last`` sums: who made it and who read it, by module."""
    groups: dict[frozenset[int], list[str]] = {}
    for node in sorted(summands, key=position.__getitem__):
        origin = _origin(node)
        if origin:
            groups.setdefault(reach[node], []).append(origin)
    # NB: one reader per set of terms (a trunk block's branches are one reader), in term order
    by_terms = sorted(groups.items(), key=lambda item: sorted(item[0]))
    readers = _unique_keep_order(p for p in (_common_path(g) for _, g in by_terms) if p)
    users = [u for u in last.users if u in members]
    producer = _common_path([p for p in map(_origin, users) if p])
    if producer and len(readers) > 1:
        return f"the gradient of an output of {producer}, which {_and(readers)} read"
    if len(readers) > 1:
        return f"the gradient of a value that {_and(readers)} read"
    if producer:
        return f"the gradient of an output of {producer}"
    return f"a sum of gradients (node {last.name})"


_ROOT = re.compile(r"^(L\['[^']*'\]|self(?=\.|$))")
#: Dynamo's path through a module whose ``__dict__`` the forward changes (``self.x = ...``):
#: ``.__dict__['_modules']['stages']`` for ``._modules['stages']``
_DICT_ITEM = re.compile(r"\.__dict__\['(_modules|_parameters|_buffers)'\]\['([^']*)'\]")
_ITEM = re.compile(r"\._modules\['([^']*)'\]|\[['\"]?([^\]'\"]*)['\"]?\]")


def module_path(node: fx.Node) -> str | None:
    """The qualified name of the module whose forward made ``node`` (``inc4.1.b2``), or None.

    Backward nodes carry their forward op's module stack as
    ``fwd_nn_module_stack``; Dynamo writes a path as ``L['self'].inc4.1.b2``.
    """
    stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack")
    if not stack:
        return None
    entry = list(stack.values())[-1]
    raw = entry[0] if isinstance(entry, tuple) else entry
    if not isinstance(raw, str):
        return None
    raw = _DICT_ITEM.sub(lambda m: f"._modules['{m.group(2)}']", raw)
    path = _ITEM.sub(lambda m: "." + (m.group(1) or m.group(2)), _ROOT.sub("", raw))
    return path.strip(".") or None


def _origin(node: fx.Node) -> str | None:
    """Where in the model ``node`` comes from: its module's path, else the function
    (``chunk``, ``cat``) whose forward made it, or None."""
    return module_path(node) or _source_function(node)


def _source_function(node: fx.Node) -> str | None:
    """The name of the function or module class whose forward made ``node``, or None."""
    stack = node.meta.get("fwd_source_fn_stack") or node.meta.get("source_fn_stack")
    if not stack:
        return None
    source = stack[-1][1] if isinstance(stack[-1], tuple) else stack[-1]
    name = source if isinstance(source, str) else getattr(source, "__name__", None)
    return name if isinstance(name, str) else None


def _common_path(paths: Sequence[str]) -> str | None:
    """The longest module path every one of ``paths`` lies in, or None."""
    if not paths:
        return None
    return ".".join(os.path.commonprefix([p.split(".") for p in paths])) or None


def _terms_text(names: Sequence[str]) -> str:
    """``the losses through aux2 and fc`` from ``the loss through aux2`` and ``... fc``."""
    prefix = "the loss through "
    if len(names) > 1 and all(n.startswith(prefix) for n in names):
        return "the losses through " + _and([n[len(prefix):] for n in names])
    return _and(list(names))


def _and(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _unique_keep_order(items) -> list[str]:
    return list(dict.fromkeys(items))


def _unique(names: list[str]) -> tuple[str, ...]:
    """Names made distinct: a repeated one gets its term's number."""
    counts = {n: names.count(n) for n in names}
    return tuple(n if counts[n] == 1 else f"{n} (term {i + 1})" for i, n in enumerate(names))
