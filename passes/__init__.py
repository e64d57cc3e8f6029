"""erase_fx's graph passes, in pipeline order.

Each pass is a pure function ``(gm, ctx) -> PassResult`` of a GraphModule and a
`PassContext` (the `EraseConfig`, the data the earlier passes decided, what the
caller gave): it never mutates its input, and its invariants are checked after
it (``check_*(result, ctx)``). The lists
`JOINT_PASSES`, `FORWARD_PASSES`, `BACKWARD_PASSES` and their driver,
`run_passes`, are in `pipeline.py`. See README.md in this folder.

On the AOT joint graph::

    merge_common_subexpressions joint -> joint with its tangent-free repeats merged (the stock
                                partitioner's CSE, run before the blocks are cloned)
    find_stop_gradient_blocks   analysis -> the joint + BlockAnalysis (blocks, rejected + reasons)
      split_at_sums             (used by it) a component's loss terms, their parts, where they meet
    schedule_early_backward     joint -> joint with early blocks cloned into the forward
    partition_joint_graph       joint -> forward + JointPartition(forward, backward), early grads
                                kept in the forward (the stock partitioner, its CSE off)

On the forward module::

    copy_input_values_per_block forward -> forward where each block makes its own copy of a
                                large value made from inputs alone that others read too
    assign_streams              forward -> forward with streams and sync points
      ownership                 (used by it) each node's owner, main or a block, and why
    recompute_boundary_values   forward -> forward where each block segment recomputes the
                                cheap elementwise values it would read across its boundary
    split_segments              forward -> split module + ordered per-stream segments

On the backward module::

    defer_grad_scaling          backward -> backward returning early grads unscaled + scales
                                + DeferredScaling
    specialize_unused_tangents  backward -> the backward for a step where the outputs besides
                                the loss that early blocks read get no gradient
"""
from erase_fx.passes.assign_streams import StreamAssignment, assign_streams, stream_of_block
from erase_fx.passes.defer_grad_scaling import DeferredScaling, ScaledGrad, defer_grad_scaling
from erase_fx.passes.find_stop_gradient_blocks import (
    Block,
    BlockAnalysis,
    Component,
    Rejected,
    RejectReason,
    find_stop_gradient_blocks,
)
from erase_fx.passes.node_meta import MAIN_STREAM, NodeMeta, Role, get_meta
from erase_fx.passes.ownership import (
    OwnerReason,
    Ownership,
    decide_ownership,
    stages_go_to_side_streams,
)
from erase_fx.passes.partition_joint_graph import (
    JointPartition,
    partition_joint_graph,
    stock_partition,
)
from erase_fx.passes.copy_input_values_per_block import (
    InputValueCopies,
    copy_input_values_per_block,
)
from erase_fx.passes.pass_result import Artifact, DumpFile, PassResult
from erase_fx.passes.recompute_boundary_values import (
    BoundaryRecomputes,
    recompute_boundary_values,
)
from erase_fx.passes.schedule_early_backward import schedule_early_backward
from erase_fx.passes.split_at_sums import Meeting, TermSplit, split_at_sums
from erase_fx.passes.split_segments import Segment, SegmentedForward, Segments, split_segments
from erase_fx.passes.pipeline import (
    BACKWARD_PASSES,
    FORWARD_PASSES,
    JOINT_PASSES,
    UNUSED_TANGENT_BACKWARD_PASSES,
    Pass,
    PassContext,
    module_given_to,
    run_pass,
    run_passes,
)

__all__ = [
    "BACKWARD_PASSES",
    "FORWARD_PASSES",
    "JOINT_PASSES",
    "UNUSED_TANGENT_BACKWARD_PASSES",
    "MAIN_STREAM",
    "Artifact",
    "Block",
    "BlockAnalysis",
    "BoundaryRecomputes",
    "Component",
    "DeferredScaling",
    "DumpFile",
    "InputValueCopies",
    "JointPartition",
    "Meeting",
    "NodeMeta",
    "Ownership",
    "Pass",
    "PassContext",
    "PassResult",
    "OwnerReason",
    "RejectReason",
    "Rejected",
    "Role",
    "ScaledGrad",
    "Segment",
    "SegmentedForward",
    "Segments",
    "StreamAssignment",
    "TermSplit",
    "assign_streams",
    "copy_input_values_per_block",
    "decide_ownership",
    "defer_grad_scaling",
    "find_stop_gradient_blocks",
    "get_meta",
    "module_given_to",
    "partition_joint_graph",
    "recompute_boundary_values",
    "run_pass",
    "run_passes",
    "schedule_early_backward",
    "split_at_sums",
    "split_segments",
    "stock_partition",
    "stages_go_to_side_streams",
    "stream_of_block",
]
