"""assign_streams: main stream for the forward, round-robin side streams, sync points."""
import importlib

import pytest
import torch

from erase_fx.config import EraseConfig, Tuning
from erase_fx.errors import GraphInvariantError
from erase_fx.passes import MAIN_STREAM, OwnerReason, Role, assign_streams, get_meta
from erase_fx.passes.assign_streams import check_stream_assignment, stream_of_block
from erase_fx.passes.graph import clone_module, output_node
from erase_fx.passes.node_meta import NodeMeta, set_meta
from erase_fx.passes.ownership import decide_ownership
from erase_fx.passes.pass_result import PassContext, PassResult
from graphs import (
    Chain,
    SoftLabelChain,
    Stages,
    chain_inputs,
    main_reads_of_side_values,
    targets,
)

aten = torch.ops.aten


def check_streams(gm):
    check_stream_assignment(PassResult(gm, True), PassContext.of(EraseConfig()))


def streams_by_block(gm):
    found = {}
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if node.op != "output" and meta.role is Role.EARLY_BACKWARD:
            found.setdefault(meta.block, set()).add(meta.stream)
    return found


@pytest.mark.parametrize("streams, expected", [
    (1, {0: {1}, 1: {1}, 2: {1}}),
    (2, {0: {1}, 1: {2}, 2: {1}}),
    (4, {0: {1}, 1: {2}, 2: {3}}),
])
def test_blocks_go_round_robin_over_side_streams(streams, expected):
    stages = Stages(Chain(4), chain_inputs(), EraseConfig(inner="aot_eager", streams=streams))
    assert streams_by_block(stages.assigned.gm) == expected


@pytest.mark.parametrize("stages_on_side", [False, True])
def test_syncs_are_recorded_on_every_cross_stream_edge(stages_on_side):
    stages = Stages(Chain(3), chain_inputs(),
                    EraseConfig(inner="aot_eager", tuning=Tuning(stages_on_side=stages_on_side)))
    gm = stages.assigned.gm
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if node.op == "output":
            side_inputs = {a.name for a in node.all_input_nodes if get_meta(a).stream != MAIN_STREAM}
            assert side_inputs and set(meta.waits_for) == side_inputs
            continue
        crossing = {a.name for a in node.all_input_nodes if get_meta(a).stream != meta.stream}
        assert set(meta.waits_for) == crossing
        if meta.stream == MAIN_STREAM and not meta.after_join:
            # before the join the main stream waits only for stages (their output)
            assert all(get_meta(a).stage for a in node.all_input_nodes if a.name in meta.waits_for)
            assert stages_on_side or meta.waits_for == ()


def test_heads_and_local_losses_run_on_their_block_stream_and_the_sum_after_the_join():
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager",
                                                          tuning=Tuning(stages_on_side=False)))
    gm = stages.assigned.gm
    side_forward = {}
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if node.op != "output" and meta.role is Role.FORWARD and meta.block is not None:
            side_forward.setdefault(meta.block, []).append(targets(gm, [node.name])[0])
    # each early block's head (t, addmm) and loss (log_softmax, nll_loss) left the main stream
    assert set(side_forward) == {0, 1}
    for ops in side_forward.values():
        assert {"addmm", "_log_softmax", "nll_loss_forward"} <= set(ops)
        assert "native_layer_norm" not in ops  # the stage itself stays on the critical path
    after_join = [n for n in gm.graph.nodes if n.op != "output" and get_meta(n).after_join]
    assert "add" in targets(gm, [n.name for n in after_join])
    # the last stage (not an early block) is not delayed to after the join
    assert not any(targets(gm, [n.name])[0] == "native_layer_norm" for n in after_join)


def ops_by_reason(stages) -> dict[tuple[int | None, OwnerReason], set[str]]:
    """The ops of the forward by (owner, reason), from `assign_streams`' artifact."""
    gm = stages.assigned.gm
    found: dict[tuple[int | None, OwnerReason], set[str]] = {}
    for name, owned in stages.assigned.artifact.owners.items():
        found.setdefault(owned, set()).update(targets(gm, [name]))
    return found


def test_each_node_has_one_owner_and_the_reason_it_is_there():
    """The artifact says whose each node is and why: each early block's backward is its own
    (early), so is its head (head: only the block reads it) and its loss's tail after the
    saved log-softmax (loss_tail: only the scalar crosses the join); the stages and the loss
    sum are the main stream's, the sum after the join; a getitem is where its op is. The
    meta agrees."""
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="inductor",
                                                          tuning=Tuning(stages_on_side=False)),
                    inner="inductor")
    ops = ops_by_reason(stages)
    for block in (0, 1):
        assert {"addmm", "amax", "exp"} <= ops[(block, OwnerReason.HEAD)]  # log-softmax
        assert "gather" in ops[(block, OwnerReason.LOSS_TAIL)]
        assert "mm" in ops[(block, OwnerReason.EARLY)]
    assert {"var_mean", "gather", "add"} <= ops[(None, OwnerReason.MAIN)]  # stages, last loss
    assert ops[(None, OwnerReason.WITH_PRODUCER)] == {"getitem"}  # var_mean's, a stage's
    assert {owned[1] for owned in stages.assigned.artifact.owners.values()} == {
        OwnerReason.MAIN, OwnerReason.EARLY, OwnerReason.HEAD, OwnerReason.LOSS_TAIL,
        OwnerReason.WITH_PRODUCER}
    by_name = {n.name: n for n in stages.assigned.gm.graph.nodes}
    for name, (block, _) in stages.assigned.artifact.owners.items():
        assert get_meta(by_name[name]).block == block


def test_ownership_is_decided_on_the_graph_as_it_is_and_cannot_be_changed():
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    gm = stages.copied.gm
    code = gm.code
    ownership = decide_ownership(list(gm.graph.nodes), stages.cfg)
    assert gm.code == code
    with pytest.raises(TypeError):
        ownership.owner[next(iter(gm.graph.nodes))] = 0
    assert ownership.named() == stages.assigned.artifact.owners


def test_an_early_node_the_main_stream_reads_moves_to_it_with_its_inputs():
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    fw, _ = clone_module(stages.fw)
    graph = fw.graph
    early = [n for n in graph.nodes if (m := get_meta(n)) and m.role is Role.EARLY_BACKWARD
             and m.block == 0 and m.grad_of is not None]
    target = early[-1]
    out = output_node(graph)
    with graph.inserting_before(out):
        reader = graph.call_function(aten.neg.default, (target,))
    reader.meta["val"] = target.meta["val"]
    set_meta(reader, NodeMeta(Role.FORWARD))
    out.args = (tuple(out.args[0]) + (reader,),)
    fw.recompile()

    assigned = assign_streams(fw, PassContext.of(stages.cfg)).gm
    by_name = {n.name: n for n in assigned.graph.nodes}
    moved = by_name[target.name]
    assert get_meta(moved).stream == MAIN_STREAM
    assert decide_ownership(list(fw.graph.nodes), stages.cfg).named()[target.name] == (
        None, OwnerReason.SHARED)
    assert all(get_meta(a).stream == MAIN_STREAM for a in moved.all_input_nodes)
    check_streams(assigned)


def test_check_catches_a_missing_sync_point():
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager"))
    gm, _ = clone_module(stages.assigned.gm)
    node = next(n for n in gm.graph.nodes if get_meta(n).waits_for and n.op != "output")
    set_meta(node, NodeMeta(get_meta(node).role, get_meta(node).block, stream=get_meta(node).stream))
    with pytest.raises(GraphInvariantError, match="sync point missing"):
        check_streams(gm)


def test_local_loss_tails_run_in_their_block_so_only_scalars_cross_the_join():
    """With Inductor's decompositions a cross-entropy is log-softmax, then gather, mean and
    scaling, and the partitioner keeps the log-softmax for the tail; CSE shares the labels'
    processing between heads. The tail of each early block's loss runs on the block's
    stream: the main stream reads only the scalar loss after the join, never a head's
    batch x classes activations (which would live until the end of the forward)."""
    stages = Stages(Chain(4), chain_inputs(), EraseConfig(inner="inductor",
                                                          tuning=Tuning(stages_on_side=False)),
                    inner="inductor")
    gm = stages.assigned.gm
    crossing = main_reads_of_side_values(gm)
    assert crossing, "the loss sum reads the early blocks' losses after the join"
    assert all(shape == () for _, shape in crossing), crossing
    gathers = [n for n in gm.graph.nodes if n.target is aten.gather.default]
    assert len(gathers) == 4
    assert sorted(get_meta(n).stream for n in gathers) == [MAIN_STREAM, 1, 2, 3]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("blocks", [2, 3])
def test_a_loss_reading_soft_targets_made_after_its_launch_point_runs_in_its_block(
        inner, blocks):
    """Soft targets made from the labels in the forward: the first block's backward reads
    its own copy (`copy_input_values_per_block`), made from the labels' one-hot before the
    soft targets themselves, so its loss, which reads the soft targets, reads a main value
    made after the block's launch point. It runs in the block all the same (the launch
    point moves past those elementwise ops): only scalars cross to the main stream, never
    the block's batch x classes log-softmax. With one early block (2 blocks) the last
    block's loss reads the soft targets too: they are made on the main stream, not in the
    early block's head, so that loss reads no block value but its scalar."""
    torch.manual_seed(0)
    stages = Stages(SoftLabelChain(blocks, classes=8192), chain_inputs(batch=64, classes=8192),
                    EraseConfig(inner=inner, tuning=Tuning(stages_on_side=False)), inner=inner)
    assert stages.copied.modified  # the copies that moved the launch point before the targets
    crossing = main_reads_of_side_values(stages.assigned.gm)
    assert crossing and all(shape == () for _, shape in crossing), crossing
    reasons = {why for _, why in stages.assigned.artifact.owners.values()}
    assert (OwnerReason.INPUT_VALUE in reasons) == (blocks == 2)


class LateLossTerm(torch.nn.Module):
    """Two detached blocks; the first block's loss adds a term without gradient that reads
    its log-probabilities (batch x classes) and a scale made from the labels alone, after
    the second stage's matrix product (program order)."""

    def __init__(self, d=16, classes=8192):
        super().__init__()
        self.stage0, self.stage1 = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.head0, self.head1 = torch.nn.Linear(d, classes), torch.nn.Linear(d, classes)

    def forward(self, x, labels):
        h0 = self.stage0(x)
        logits0 = self.head0(h0)
        h1 = self.stage1(h0.detach())
        scale = (labels.float() * 0.125).mean()
        term = (torch.log_softmax(logits0, -1).detach() * scale).mean()
        loss0 = torch.nn.functional.cross_entropy(logits0, labels) + term
        return loss0 + torch.nn.functional.cross_entropy(self.head1(h1), labels)


def _block_launch_index(stages) -> tuple[int, int]:
    """(index of block 0's first segment, index of the main segment with stage 1's product)."""
    segments = stages.segmented.segments
    block = next(k for k, s in enumerate(segments) if s.block == 0)
    product = next(k for k, s in enumerate(segments) if s.block is None and any(
        n.target is aten.addmm.default and any(a.target is aten.detach.default
                                               for a in n.all_input_nodes)
        for n in getattr(stages.segmented.gm, s.name).graph.nodes))
    return block, product


def test_a_block_never_waits_for_matrix_work_to_run_its_loss_tail(monkeypatch):
    """The first block's loss adds a term that reads a scale the main stream makes from the
    labels only after the next stage's matrix product: the block still launches before that
    product (the term stays on the main stream); were the product not matrix work, the term
    would join the block and the block would launch after it."""
    def stages():
        torch.manual_seed(0)
        return Stages(LateLossTerm(), chain_inputs(batch=64, classes=8192),
                      EraseConfig(inner="aot_eager"))

    block, product = _block_launch_index(stages())
    assert block < product
    module = importlib.import_module("erase_fx.passes.ownership")
    monkeypatch.setattr(module, "node_flops", lambda node: 0)
    block, product = _block_launch_index(stages())
    assert block > product


class LateSharedSoftTargets(torch.nn.Module):
    """Two detached blocks that learn one set of soft targets, made after the second
    stage's matrix product (program order)."""

    def __init__(self, d=16, classes=8192):
        super().__init__()
        self.stage0, self.stage1 = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.head0, self.head1 = torch.nn.Linear(d, classes), torch.nn.Linear(d, classes)

    def forward(self, x, labels):
        h0 = self.stage0(x)
        logits0 = self.head0(h0)
        h1 = self.stage1(h0.detach())
        soft = torch.nn.functional.one_hot(labels, logits0.shape[-1]).float() * 0.9 + 0.1 / 8192
        loss0 = -(soft * torch.log_softmax(logits0, -1)).sum(-1).mean()
        return loss0 - (soft * torch.log_softmax(self.head1(h1), -1)).sum(-1).mean()


@pytest.mark.parametrize("copy_input_values", [True, False])
def test_shared_soft_targets_never_delay_the_block(copy_input_values, monkeypatch):
    """Soft targets the early block and the last block's loss both read, made after the next
    stage's product. With `copy_input_values_per_block` the block's loss and backward read
    its own copy, and the original is made for the last block's loss alone: the block
    launches before that product, matrix work or not. Without copies, made on the main
    stream they would make the block wait for that product, so they stay in the block's
    head; were the product not matrix work, they would go to the main stream and the block
    would launch after it."""
    def stages():
        torch.manual_seed(0)
        return Stages(LateSharedSoftTargets(), chain_inputs(batch=64, classes=8192),
                      EraseConfig(inner="aot_eager",
                                  tuning=Tuning(copy_input_values=copy_input_values)))

    block, product = _block_launch_index(stages())
    assert block < product
    module = importlib.import_module("erase_fx.passes.ownership")
    monkeypatch.setattr(module, "node_flops", lambda node: 0)
    block, product = _block_launch_index(stages())
    assert (block < product) if copy_input_values else (block > product)


def _stage_and_block_nodes(gm):
    """Per block: its stage's nodes and its other nodes (head, loss, early backward)."""
    stage, rest = {}, {}
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if node.op != "output" and meta.block is not None:
            (stage if meta.stage else rest).setdefault(meta.block, []).append(node)
    return stage, rest


def test_each_early_blocks_stage_runs_on_its_stream_so_its_activations_never_cross():
    """With `stages_on_side` block b's stage runs on b's side stream before its
    head: what its early backward reads is made on that stream, and other streams read only
    the stage's output (the next stage's input) and scalars."""
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager",
                                                          tuning=Tuning(stages_on_side=True)))
    gm = stages.assigned.gm
    stage, rest = _stage_and_block_nodes(gm)
    assert set(stage) == set(rest) == {0, 1}
    owners = stages.assigned.artifact.owners
    assert {owners[n.name][1] for nodes in stage.values() for n in nodes} <= {
        OwnerReason.STAGE, OwnerReason.WITH_PRODUCER}
    for block, nodes in stage.items():
        assert {get_meta(n).stream for n in nodes} == {stream_of_block(block, stages.cfg)}
        assert "native_layer_norm" in targets(gm, [n.name for n in nodes])
        for node in rest[block]:
            for arg in node.all_input_nodes:
                if arg.op not in ("placeholder", "get_attr"):
                    crosses = get_meta(arg).stream != get_meta(node).stream
                    assert not crosses or arg.meta["val"].dim() == 0, (node.name, arg.name)
        # the stage's values other streams read: its output (a batch x d tensor) and scalars
        exported = {a for n in gm.graph.nodes if n.op != "output"
                    for a in n.all_input_nodes if a in nodes
                    and get_meta(n).stream != get_meta(a).stream}
        assert [a for a in exported if a.meta["val"].dim() > 0] == [
            next(a for a in exported if a.meta["val"].dim() > 0)]
    # the last stage (not an early block) runs on the main stream, before the join
    last = [n for n in gm.graph.nodes if n.op != "output" and get_meta(n).stream == MAIN_STREAM
            and not get_meta(n).after_join]
    assert "native_layer_norm" in targets(gm, [n.name for n in last])


@pytest.mark.parametrize("cfg", [
    EraseConfig(inner="aot_eager", streams=2, tuning=Tuning(stages_on_side=False)),
    EraseConfig(inner="aot_eager", streams=1, tuning=Tuning(stages_on_side=True)),
    EraseConfig(inner="aot_eager", streams=4),
], ids=["off", "one-side-stream", "auto-a-block-per-stream"])
def test_stages_stay_on_the_main_stream_when_off_with_one_side_stream_or_a_block_per_stream(cfg):
    stages = Stages(Chain(4), chain_inputs(), cfg)
    stage, rest = _stage_and_block_nodes(stages.assigned.gm)
    assert stage == {} and set(rest) == {0, 1, 2}


def test_by_default_stages_go_to_side_streams_when_blocks_outnumber_them():
    """3 early blocks on 2 side streams: stream 1 runs blocks 0 and 2, and reuses block 0's
    memory for block 2 only if block 0's activations were made on it."""
    stages = Stages(Chain(4), chain_inputs(), EraseConfig(inner="aot_eager", streams=2))
    stage, rest = _stage_and_block_nodes(stages.assigned.gm)
    assert set(stage) == set(rest) == {0, 1, 2}
    assert {get_meta(n).stream for n in stage[0] + stage[2]} == {1}


def test_check_catches_a_stage_that_reads_a_blocks_head():
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="aot_eager",
                                                          tuning=Tuning(stages_on_side=True)))
    gm, _ = clone_module(stages.assigned.gm)
    stage, rest = _stage_and_block_nodes(gm)
    head = next(n for n in rest[0] if get_meta(n).role is Role.FORWARD)
    reader = stage[1][-1]
    graph = gm.graph
    with graph.inserting_after(reader):
        bad = graph.call_function(aten.add.Tensor, (reader, head))
    bad.meta["val"] = reader.meta["val"]
    set_meta(bad, NodeMeta(Role.FORWARD, block=1, stream=get_meta(reader).stream, stage=True,
                           waits_for=(head.name,)))
    with pytest.raises(GraphInvariantError, match="a stage reads a block's head"):
        check_streams(gm)
