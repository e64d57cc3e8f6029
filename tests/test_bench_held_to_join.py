"""bench.held_to_join: what a captured forward holds to the join, measured on CPU."""
import re

import pytest

from bench import held_to_join


CPU = held_to_join.torch.device("cpu")


@pytest.fixture(scope="module")
def held():
    # NB: aot_eager keeps the cross-entropy whole (fast); the tail of an Inductor-decomposed
    # loss is pinned in tests/test_assign_streams.py
    return {on_side: held_to_join.measure("gpt:2:64:32:3", CPU, "aot_eager", on_side)
            for on_side in (False, True)}


def test_with_stages_on_main_a_gpt_chain_holds_its_blocks_activations_to_the_join(held):
    on_main = held[False].kinds
    assert set(on_main) == set(held_to_join.KINDS)
    assert on_main["main -> side"] > 0  # the blocks' activations, read by their early backward
    assert on_main["returned"] > 0
    # two early blocks' scalar losses (fp32) cross to the main stream, not their log-softmax
    assert on_main["side -> main"] <= 2 * 4 * 64, on_main


def test_with_stages_on_side_streams_only_stage_outputs_cross_and_activations_are_freed(held):
    on_side, on_main = held[True].kinds, held[False].kinds
    assert on_side["main -> side"] == 0
    # what crosses is one batch x tokens x d stage output per early stage (fp32) and scalars
    stage_output = 2 * 32 * 64 * 4
    crossing = on_side["side -> side"] + on_side["side -> main"]
    assert stage_output <= crossing <= 2 * stage_output + 2 * 4 * 64, on_side
    assert sum(on_side.values()) < sum(on_main.values()) - on_main["main -> side"] / 2
    assert on_side["returned"] == on_main["returned"]


def test_each_streams_high_water_mark_shows_where_the_activations_are_made():
    """Stages on the main stream: the main stream makes every block's activations and holds
    them to the join; on side streams each side stream makes its blocks' and frees them
    after each block's backward: the main stream's high-water mark drops by what it held
    for the blocks, and the sum over streams drops too (two blocks a side stream)."""
    on_main = held_to_join.measure("gpt:4:64:128:5", CPU, "aot_eager", False, 2)
    on_side = held_to_join.measure("gpt:4:64:128:5", CPU, "aot_eager", True, 2)
    moved = on_main.kinds["main -> side"]
    assert moved > 0 and on_side.kinds["main -> side"] == 0
    assert on_main.stream_peaks[0] - on_side.stream_peaks[0] >= 0.9 * moved
    assert sum(on_side.stream_peaks.values()) < sum(on_main.stream_peaks.values())
    assert set(on_side.stream_peaks) == {0, 1, 2}


def test_the_observer_restores_the_program_after_it():
    from erase_fx.emit import program

    original, capturing = program.StreamProgram._run_captured, program.stream_capturing
    launch = program.StreamProgram._launch
    with held_to_join.recording() as found:
        assert program.StreamProgram._run_captured is not original
        assert program.StreamProgram._launch is not launch
        assert program.stream_capturing is not capturing
    assert program.StreamProgram._run_captured is original and program.stream_capturing is capturing
    assert program.StreamProgram._launch is launch
    assert found == []


def test_the_largest_held_values_name_their_kind_and_the_segment_that_made_them(held):
    held = held[False]
    assert 0 < len(held.largest) <= held_to_join.LARGEST
    sizes = [value.size for value in held.largest]
    assert sizes == sorted(sizes, reverse=True)
    assert all(value.kind != "returned" for value in held.largest)
    top = held.largest[0]
    assert top.kind == "main -> side" and top.made_by.startswith("seg_"), top
    assert re.fullmatch(r"\d+\.\d MiB main -> side: b?float\d+\[\d+(, \d+)*\] from seg_\w+",
                        str(top)), top


def test_folded_side_streams_peak_on_the_cuda_streams_they_run_on(held):
    """`Tuning.side_cuda_streams`: the side streams on one CUDA stream hold their
    blocks' values in one pool, whose peak is less than the sum of theirs; what is held at
    the join does not change (the release plan is the logical streams')."""
    apart = held[True]
    folded = held_to_join.measure("gpt:2:64:32:3", CPU, "aot_eager", True, 4, 1)
    assert set(apart.stream_peaks) == {0, 1, 2} and set(folded.stream_peaks) == {0, 1}
    side = sum(v for s, v in apart.stream_peaks.items() if s)
    assert folded.stream_peaks[1] < side
    assert folded.kinds == apart.kinds
