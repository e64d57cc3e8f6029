"""copy_input_values_per_block: a large value made from the labels alone in the forward (soft
targets), which every block's loss and backward read once merged, is made by each block itself
for its early backward."""
import copy
import importlib

import pytest
import torch

import erase_fx
from erase_fx.config import EraseConfig, Tuning
from erase_fx.errors import GraphInvariantError
from erase_fx.passes import get_meta, pipeline
from erase_fx.passes.copy_input_values_per_block import check_input_values_per_block
from erase_fx.passes.graph import MIN_BYTES, loss_tails, made_from_inputs, returned_values, val_of
from erase_fx.passes.node_meta import NodeMeta, Role, is_early, set_meta
from erase_fx.passes.pass_result import PassContext
from erase_fx.report_text import format_report
from graphs import Chain, SoftLabelChain, Stages, assert_same_grads, chain_inputs

# NB: erase_fx.passes exports the pass function under the module's name
pass_module = importlib.import_module("erase_fx.passes.copy_input_values_per_block")

CLASSES = 8192  # a batch of 64 x 8192 fp32 classes: 2 MiB of soft targets from 64 labels
BATCH = 64
CTX = PassContext.of(EraseConfig())


def wide_chain_stages(stages_on_side: bool | None = None, copy_input_values: bool = True) -> Stages:
    torch.manual_seed(0)
    cfg = EraseConfig(inner="inductor",
                      tuning=Tuning(stages_on_side=stages_on_side,
                                    copy_input_values=copy_input_values))
    return Stages(SoftLabelChain(3, classes=CLASSES), chain_inputs(batch=BATCH, classes=CLASSES),
                  cfg, inner="inductor")


def large_cross_stream_reads(gm) -> list[tuple[str, str]]:
    """(producer, reader) of every value of MIN_BYTES or more that an early node reads from
    another stream (what CUDA graph capture holds until the join), but those the forward
    returns (saved for the backward: they live past the join anyway)."""
    returned = returned_values(gm.graph)
    found = []
    for node in gm.graph.nodes:
        if node.op in ("output", "placeholder") or get_meta(node).role is not Role.EARLY_BACKWARD:
            continue
        for arg in node.all_input_nodes:
            value = val_of(arg)
            if (arg.op != "placeholder" and arg not in returned
                    and get_meta(arg).stream != get_meta(node).stream
                    and isinstance(value, torch.Tensor)
                    and value.numel() * value.element_size() >= MIN_BYTES):
                found.append((arg.name, node.name))
    return found


@pytest.mark.parametrize("stages_on_side", [False, True])
def test_each_block_makes_its_own_label_mask(stages_on_side):
    stages = wide_chain_stages(stages_on_side)
    copies = stages.copied.artifact.copies
    assert stages.copied.modified and copies
    # every copied value has one copy per early block that reads it, each that block's own
    by_name = {n.name: n for n in stages.copied.gm.graph.nodes}
    for made in copies.values():
        owners = [get_meta(by_name[name]).block for name in made]
        assert owners == sorted(set(owners)) and len(owners) == 2
    assert large_cross_stream_reads(stages.assigned.gm) == []


@pytest.mark.parametrize("turned_off", ["option", "threshold"])
def test_without_copies_the_mask_crosses_streams(turned_off, monkeypatch):
    """The property above fails when nothing is copied (``copy_input_values=False``, or a
    mask below the size rule): the mask is made once and read by both early blocks on
    their side streams."""
    if turned_off == "threshold":
        monkeypatch.setattr(pass_module, "MIN_BYTES", 1 << 40)
    stages = wide_chain_stages(copy_input_values=turned_off == "threshold")
    assert not stages.copied.modified and stages.copied.gm is stages.fw
    crossing = large_cross_stream_reads(stages.assigned.gm)
    assert {reader for _, reader in crossing}, crossing


def test_small_values_and_returned_values_stay_shared():
    torch.manual_seed(0)
    stages = Stages(Chain(3), chain_inputs(), EraseConfig(inner="inductor"), inner="inductor")
    assert not stages.copied.modified and stages.copied.artifact.copies == {}


def test_copies_are_made_right_before_their_first_reader():
    stages = wide_chain_stages()
    nodes = list(stages.copied.gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for made in stages.copied.artifact.copies.values():
        for name in made:
            made_here = next(n for n in nodes if n.name == name)
            first = min(position[u] for u in made_here.users)
            between = nodes[position[made_here] + 1:first]
            # only other copies (of the same block) may sit between a copy and its first reader
            assert all(n.name.endswith(name[name.rindex("_block_"):]) for n in between), between


def test_check_rejects_a_block_reading_another_blocks_copy():
    stages = wide_chain_stages()
    result = stages.copied
    check_input_values_per_block(result, CTX)
    gm = result.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    first, second = next(iter(result.artifact.copies.values()))
    reader = next(iter(by_name[second].users))
    reader.replace_input_with(by_name[second], by_name[first])
    with pytest.raises(GraphInvariantError, match="copy_input_values_per_block"):
        check_input_values_per_block(result, CTX)


@pytest.mark.parametrize("stages_on_side", [False, True])
@pytest.mark.parametrize("blocks", [2, 3])
def test_gradients_match_stock_inductor_with_copies(blocks, stages_on_side, monkeypatch):
    """Every parameter's gradient as stock Inductor's; with 2 blocks the soft targets the
    early block shares with the last block's loss are made on the main stream
    (`assign_streams`), with 3 each early block's loss reads them in its block."""
    copied = []

    def spy(gm, ctx):
        result = pass_module.copy_input_values_per_block(gm, ctx)
        copied.append(result.artifact.copies)
        return result

    monkeypatch.setattr(pipeline.COPY_INPUT_VALUES_PER_BLOCK, "run", spy)
    torch.manual_seed(1)
    model = SoftLabelChain(blocks, classes=CLASSES)
    stock = copy.deepcopy(model)
    inputs = chain_inputs(batch=BATCH, classes=CLASSES)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="erase", options={
        "inner": "inductor", "on_error": "raise", "tuning": {"stages_on_side": stages_on_side}})
    compiled(*inputs).backward()
    torch._dynamo.reset()
    torch.compile(stock)(*inputs).backward()
    assert copied and copied[0], copied
    assert_same_grads(stock, model, rtol=1e-4, atol=1e-6)


def test_dynamic_batch_sizes_are_copied_at_their_hints_and_stay_exact(monkeypatch):
    """With a symbolic batch the mask's size is judged at its hint; the copies read the
    batch size the graph already computes, and gradients match stock Inductor's."""
    copied = []

    def spy(gm, ctx):
        result = pass_module.copy_input_values_per_block(gm, ctx)
        copied.append(result.artifact.copies)
        return result

    monkeypatch.setattr(pipeline.COPY_INPUT_VALUES_PER_BLOCK, "run", spy)
    torch.manual_seed(2)
    model = SoftLabelChain(3, classes=CLASSES)
    stock = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="erase", dynamic=True,
                             options={"inner": "inductor", "on_error": "raise"})
    compiled_stock = torch.compile(stock, dynamic=True)
    for batch in (BATCH, BATCH + 8):
        inputs = chain_inputs(batch=batch, classes=CLASSES)
        compiled(*inputs).backward()
        compiled_stock(*inputs).backward()
    assert copied and copied[0], copied
    assert_same_grads(stock, model, rtol=1e-4, atol=1e-6)


def test_the_report_and_explain_say_what_each_block_copies():
    (report,) = erase_fx.explain(SoftLabelChain(3, classes=CLASSES), *chain_inputs(
        batch=BATCH, classes=CLASSES), erase_options={"inner": "inductor"})
    assert report.input_copies == 1  # the soft targets
    assert report.input_copy_bytes == BATCH * CLASSES * 4
    assert "each block makes its own copy of 1 value made from the inputs alone (2.0 MiB;" in (
        format_report(report))
    fallen = report.with_fallback("injected")
    assert fallen.input_copies == 0 and "own copy" not in format_report(fallen)
    (shared,) = erase_fx.explain(SoftLabelChain(3, classes=CLASSES), *chain_inputs(
        batch=BATCH, classes=CLASSES), erase_options={"inner": "inductor",
                                                      "tuning": {"copy_input_values": False}})
    assert shared.input_copies == 0 and "own copy" not in format_report(shared)


def large_input_values_read_across_streams(gm) -> list[tuple[str, str]]:
    """(producer, reader) of every value of MIN_BYTES or more made from the inputs alone
    that any node (a block's loss tail, the last block's loss) reads from another stream,
    but those the forward returns."""
    returned = returned_values(gm.graph)
    nodes = list(gm.graph.nodes)
    from_inputs = made_from_inputs(nodes)
    found = []
    for node in nodes:
        if node.op in ("output", "placeholder"):
            continue
        for arg in node.all_input_nodes:
            value = val_of(arg)
            if (arg in from_inputs and arg not in returned
                    and get_meta(arg).stream != get_meta(node).stream
                    and isinstance(value, torch.Tensor)
                    and value.numel() * value.element_size() >= MIN_BYTES):
                found.append((arg.name, node.name))
    return found


@pytest.mark.parametrize("stages_on_side", [False, True])
def test_each_blocks_loss_tail_reads_its_own_copy(stages_on_side):
    """Five blocks on four side streams: each early block's loss (``mul(soft, logsm)``, a
    forward node `assign_streams` runs in the block) reads the block's own copy of the soft
    targets, as its backward does; the original is read by the last block's loss alone, on
    the main stream, and made right before it (Inductor fuses it there), so no stream reads
    the soft targets from another (held until the join under CUDA graph capture)."""
    torch.manual_seed(0)
    stages = Stages(SoftLabelChain(5, classes=CLASSES), chain_inputs(batch=BATCH, classes=CLASSES),
                    EraseConfig(inner="inductor", streams=4,
                                tuning=Tuning(stages_on_side=stages_on_side)),
                    inner="inductor")
    ((original, made),) = stages.copied.artifact.copies.items()
    assert len(made) == 4
    assert large_input_values_read_across_streams(stages.assigned.gm) == []
    nodes = list(stages.copied.gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    for name in made:  # the block's loss tail and its backward read its copy, in its block
        block = get_meta(by_name[name]).block
        forward = [u for u in by_name[name].users if not is_early(u)]
        assert [u.target for u in forward] == [torch.ops.aten.mul.Tensor], forward
        assigned = {n.name: n for n in stages.assigned.gm.graph.nodes}
        assert {get_meta(assigned[u.name]).block for u in forward} == {block}
    (reader,) = by_name[original].users
    assert nodes.index(reader) == nodes.index(by_name[original]) + 1
    assigned = {n.name: n for n in stages.assigned.gm.graph.nodes}
    assert get_meta(assigned[original]).stream == get_meta(assigned[reader.name]).stream == 0


def test_a_loss_tail_is_a_forward_node_that_feeds_the_loss_sum_only():
    """`loss_tails`: the soft-label product of each early block's loss is its block's (the
    block's backward reads its log-softmax), the last block's is no block's."""
    torch.manual_seed(0)
    stages = Stages(SoftLabelChain(3, classes=CLASSES), chain_inputs(batch=BATCH, classes=CLASSES),
                    EraseConfig(inner="inductor"), inner="inductor")
    graph = stages.fw.graph
    nodes = list(graph.nodes)
    tails = loss_tails(graph, nodes, made_from_inputs(nodes))
    losses = [n for n in nodes
              if n.target is torch.ops.aten.mul.Tensor and not is_early(n)
              and val_of(n).shape == (BATCH, CLASSES)
              and any(u.target is torch.ops.aten.sum.dim_IntList for u in n.users)]
    assert len(losses) == 3, losses
    assert [tails.get(n) for n in losses] == [(0, None), (1, None), None]


@pytest.mark.parametrize("stages_on_side", [False, True])
def test_gradients_match_eager_on_fresh_inputs_with_loss_tails_on_copies(stages_on_side):
    """Five blocks on four side streams, compiled once: every parameter's gradient as eager's
    on inputs the compilation never saw."""
    torch.manual_seed(3)
    model = SoftLabelChain(5, classes=CLASSES)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="erase", options={
        "inner": "inductor", "on_error": "raise", "streams": 4,
        "tuning": {"stages_on_side": stages_on_side}})
    compiled(*chain_inputs(batch=BATCH, classes=CLASSES)).backward()
    model.zero_grad(set_to_none=True)
    inputs = chain_inputs(batch=BATCH, classes=CLASSES)
    compiled(*inputs).backward()
    eager(*inputs).backward()
    assert_same_grads(eager, model, rtol=1e-4, atol=1e-5)


# -- hand-built forwards: the cases CSE can make ------------------------------------------

aten = torch.ops.aten
MASK = torch.empty(BATCH, CLASSES, device="meta")  # 2 MiB of fp32


class Forward:
    """A forward graph built node by node, early nodes marked with their block."""

    def __init__(self):
        self.graph = torch.fx.Graph()
        self.labels = self.input("labels", torch.empty(BATCH, dtype=torch.int64, device="meta"))
        self.acts = self.input("acts", MASK)
        self.column = self.node(aten.unsqueeze.default, (self.labels, 1),
                                torch.empty(BATCH, 1, dtype=torch.int64, device="meta"))

    def input(self, name, val):
        node = self.graph.placeholder(name)
        node.meta["val"] = val
        return node

    def node(self, op, args, val=MASK, block=None, name=None):
        node = self.graph.call_function(op, args, name=name)
        node.meta["val"] = val
        if block is not None:
            set_meta(node, NodeMeta(Role.EARLY_BACKWARD, block=block))
        return node

    def mask(self, block=None, name="mask"):
        """A batch x classes mask made from the labels alone."""
        ones = self.node(aten.full.default, ([BATCH, CLASSES], 1.0), block=block)
        return self.node(aten.mul.Tensor, (ones, self.column), block=block, name=name)

    def run(self, *outputs):
        self.graph.output(tuple(outputs))
        gm = torch.fx.GraphModule(torch.nn.Module(), self.graph)
        code = gm.code
        result = pass_module.copy_input_values_per_block(gm, CTX)
        assert gm.code == code  # the input is never mutated
        check_input_values_per_block(result, CTX)
        return result, {n.name: n for n in result.gm.graph.nodes}


def test_a_forward_node_merged_onto_a_blocks_value_keeps_reading_the_originals():
    """CSE merged a forward node onto block 0's neg(mask): the forward still reads it, and it
    reads the original mask, never a copy made for block 0."""
    f = Forward()
    mask = f.mask(block=0)
    neg = f.node(aten.neg.default, (mask,), block=0, name="neg")
    in_block_0 = f.node(aten.mul.Tensor, (f.acts, neg), block=0)
    in_block_1 = f.node(aten.mul.Tensor, (f.acts, mask), block=1)
    forward = f.node(aten.mul.Tensor, (f.acts, neg), name="forward")
    result, nodes = f.run(in_block_0, in_block_1, forward)
    assert [a.name for a in nodes["forward"].all_input_nodes] == ["acts", "neg"]
    assert [a.name for a in nodes["neg"].all_input_nodes] == ["mask"]
    assert result.artifact.copies["mask"] == ("mask_block_0", "mask_block_1")


def test_a_copy_whose_only_reader_went_away_is_not_listed():
    """Block 1's neg(mask) is read by blocks 2 and 3 only: they get copies of both, block 1's
    copy of the mask (made for its neg) goes with the original neg."""
    f = Forward()
    mask = f.mask(block=1)
    in_block_0 = f.node(aten.mul.Tensor, (f.acts, mask), block=0)
    neg = f.node(aten.neg.default, (mask,), block=1, name="neg")
    readers = [f.node(aten.mul.Tensor, (f.acts, neg), block=b) for b in (2, 3)]
    result, nodes = f.run(in_block_0, *readers)
    assert "neg" not in nodes and "mask_block_1" not in nodes
    assert result.artifact.copies == {"mask": ("mask_block_0", "mask_block_2", "mask_block_3"),
                                      "neg": ("neg_block_2", "neg_block_3")}


def test_a_value_saved_for_the_backward_is_read_not_copied():
    """The mask is returned (saved for the backward): the row-scaled mask both blocks read is
    copied, reading the saved mask as it is."""
    f = Forward()
    mask = f.mask()
    scaled = f.node(aten.mul.Tensor, (mask, 0.5), name="scaled")
    readers = [f.node(aten.mul.Tensor, (f.acts, scaled), block=b) for b in (0, 1)]
    result, nodes = f.run(*readers, mask)
    assert result.artifact.copies == {"scaled": ("scaled_block_0", "scaled_block_1")}
    assert all([a.name for a in nodes[f"scaled_block_{b}"].all_input_nodes] == ["mask"]
               for b in (0, 1))


def test_an_op_outside_aten_and_prims_is_never_copied():
    """A custom op may draw random numbers without saying so: its value stays shared."""
    f = Forward()
    noise = f.node(torch.ops.erase_fx_test.noisy_mask.default, (f.column,), name="noise")
    readers = [f.node(aten.mul.Tensor, (f.acts, noise), block=b) for b in (0, 1)]
    result, _ = f.run(*readers)
    assert not result.modified and result.artifact.copies == {}


@torch.library.custom_op("erase_fx_test::noisy_mask", mutates_args=())
def _noisy_mask(column: torch.Tensor) -> torch.Tensor:
    return torch.rand(column.shape[0], CLASSES, device=column.device)


@_noisy_mask.register_fake
def _(column):
    return column.new_empty(column.shape[0], CLASSES, dtype=torch.float32)
