"""partition_joint_graph: the stock partitioner, with early gradients kept in the forward.

What: splits the rewritten joint graph into forward and backward modules with
torch's own partitioner (``min_cut_rematerialization_partition`` or
``default_partition``, per ``cfg.tuning.partitioner``).

Why a wrapper: the early gradients are read only by the backward
(``mul(early_grad, T)``), so a partitioner is free to recompute them there,
undoing the schedule (min-cut does, when it finds that cheaper to save).
Exposing them as temporary extra forward outputs forces them into the
forward; they are then saved tensors of the forward, and the extra outputs are
stripped from the forward module again. The forward's copy of a learned seed
(``Role.LOSS_SEED``) is kept the same way: recomputed in the backward from the
seed's input, it would read the value a later backward set.

The stock partitioner merges common subexpressions first; here it does not
(``torch._functorch.config.cse`` off while it runs): `merge_common_subexpressions`
merged the joint graph's tangent-free ones before `schedule_early_backward`
cloned each block's backward, and merging again would make the clones of one
helper (a cross-entropy's label mask, in every block and in the backward) one
forward value, saved for the backward.

Invariants out (`check_partition`): the forward module returns the original
forward outputs first, then the saved values; every early gradient node is
computed in the forward; the backward module's inputs are saved values then
tangents, as AOTAutograd expects.

The result: ``PassResult(fw, modified=True, artifact=JointPartition(fw, bw))``:
the forward is the module the forward's passes go on with; the backward waits
for the first ``.backward()``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import (
    default_partition,
    min_cut_rematerialization_partition,
)

from erase_fx.config import EraseConfig
from erase_fx.errors import GraphInvariantError
from erase_fx.passes.graph import clone_module, output_node
from erase_fx.passes.flops import node_flops
from erase_fx.passes.node_meta import Role, get_meta
from erase_fx.passes.pass_result import DumpFile, PassContext, PassResult, graph_text

PASS_NAME = "partition_joint_graph"

#: Whether the stock partitioner merges common subexpressions here (its default does; see
#: the module docstring for why erase_fx's does not; ``bench``'s ``/late-cse`` sets it).
PARTITIONER_CSE = False

STOCK_PARTITIONERS = {
    "min_cut": min_cut_rematerialization_partition,
    "default": default_partition,
}


@dataclasses.dataclass(frozen=True)
class JointPartition:
    """The two modules the partition made."""

    fw: fx.GraphModule
    bw: fx.GraphModule

    def render(self, gm: fx.GraphModule) -> tuple[DumpFile, ...]:
        del gm  # NB: the result's module is the forward, ``self.fw``
        return (DumpFile(".fwd.py", "the forward module", graph_text(self.fw)),
                DumpFile(".bwd.py", "the backward module", graph_text(self.bw)))


def stock_partition(
    gm: fx.GraphModule, joint_inputs: Any, cfg: EraseConfig, *, num_fwd_outputs: int, **kwargs: Any
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The partitioner erase_fx uses for the stock path (no early block).

    ``kwargs`` are AOTAutograd's (``static_lifetime_input_indices``) and, under
    stock Inductor, ``compiler="inductor"``, which min-cut's recomputation
    choices depend on and the default partitioner does not take.
    """
    if cfg.tuning.partitioner != "min_cut":
        kwargs.pop("compiler", None)
    return STOCK_PARTITIONERS[cfg.tuning.partitioner](
        gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
    )


def partition_joint_graph(gm: fx.GraphModule, ctx: PassContext) -> PassResult[JointPartition]:
    """Forward and backward modules with every early gradient in the forward.

    Reads ``ctx.cfg.tuning.partitioner`` and, given, AOTAutograd's ``joint_inputs``,
    ``num_fwd_outputs`` and ``partition_kwargs`` (optional), handed to the stock
    partitioner (`stock_partition`). The pipeline checks the result with
    `check_partition`.
    """
    joint_inputs = ctx.given["joint_inputs"]
    num_fwd_outputs: int = ctx.given["num_fwd_outputs"]
    kwargs = dict(ctx.given.get("partition_kwargs", {}))
    joint, _ = clone_module(gm)
    out = output_node(joint.graph)
    outputs = list(out.args[0])
    kept = [n for n in joint.graph.nodes
            if (m := get_meta(n)) and m.role is Role.EARLY_BACKWARD and m.grad_of is not None]
    # NB: the early parts of gradients that sums in the backward add up, too
    kept += [n.args[0] for n in joint.graph.nodes
             if (m := get_meta(n)) and m.role is Role.PARTIAL_SCALE and n.args[0] not in kept]
    # NB: and the forward's copy of a learned seed, which the backward divides T by: read
    # from the seed input in the backward, it would see the value a later backward set
    kept += [n for n in joint.graph.nodes if (m := get_meta(n)) and m.role is Role.LOSS_SEED]
    k = len(kept)
    out.args = (tuple(outputs[:num_fwd_outputs] + kept + outputs[num_fwd_outputs:]),)
    descs = out.meta.get("desc")
    if descs is not None:
        out.meta["desc"] = list(descs[:num_fwd_outputs]) + _saved_descs(k) + list(
            descs[num_fwd_outputs:]
        )
    joint.recompile()

    # NB: merge_common_subexpressions merged the joint before the blocks were cloned; the
    # partitioner's own CSE would merge each block's clones back into one forward value.
    with functorch_config.patch(cse=PARTITIONER_CSE):
        fw, bw = stock_partition(joint, joint_inputs, ctx.cfg,
                                 num_fwd_outputs=num_fwd_outputs + k, **kwargs)

    fw_out = output_node(fw.graph)
    fw_outputs = list(fw_out.args[0])
    fw_out.args = (tuple(fw_outputs[:num_fwd_outputs] + fw_outputs[num_fwd_outputs + k:]),)
    fw_descs = fw_out.meta.get("desc")
    if fw_descs is not None:
        fw_out.meta["desc"] = list(fw_descs[:num_fwd_outputs]) + list(
            fw_descs[num_fwd_outputs + k:]
        )
    fw.graph.eliminate_dead_code()
    fw.graph.lint()
    fw.recompile()
    return PassResult(fw, modified=True, artifact=JointPartition(fw, bw))


def _saved_descs(k: int) -> list[Any]:
    # NB: AOT zips output descs with outputs and silently truncates on a length
    # mismatch, so the temporary outputs get descriptors of their own.
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    return [SavedForBackwardsAOTOutput(1_000_000 + j) for j in range(k)]


def check_partition(result: PassResult[JointPartition], ctx: PassContext) -> None:
    """No early-backward work that costs FLOPs was moved back into the backward.

    NB: the partitioner may still recompute a cheap view of an early gradient
    (``t(mm)``) in the backward from the saved ``mm``; that is free.

    And the backward does not read a learned seed's input (given: ``seed_input``), only
    the forward's copy of it.
    """
    seed_input = ctx.given.get("seed_input")
    if seed_input is not None and any(
            n.name == seed_input for n in result.artifact.bw.graph.find_nodes(op="placeholder")):
        raise GraphInvariantError(PASS_NAME, "the backward reads the learned seed's input",
                                  node=seed_input)
    for node in result.artifact.bw.graph.nodes:
        meta = get_meta(node)
        if meta is not None and meta.role is Role.EARLY_BACKWARD and node_flops(node) > 0:
            raise GraphInvariantError(
                PASS_NAME, "early-backward matrix work was moved into the backward", node=node.name
            )
