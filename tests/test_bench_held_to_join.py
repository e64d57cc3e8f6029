"""bench.held_to_join: what a captured forward holds to the join, measured on CPU."""
from bench import held_to_join


def test_a_gpt_chain_holds_its_blocks_activations_and_only_scalar_losses_from_side_streams():
    # NB: aot_eager keeps the cross-entropy whole (fast); the tail of an Inductor-decomposed
    # loss is pinned in tests/test_assign_streams.py
    held = held_to_join.measure("gpt:2:64:32:3", held_to_join.torch.device("cpu"), "aot_eager")
    assert set(held) == set(held_to_join.KINDS)
    assert held["main -> side"] > 0  # the blocks' activations, read by their early backward
    assert held["returned"] > 0
    # two early blocks' scalar losses (fp32) cross to the main stream, not their log-softmax
    assert held["side -> main"] <= 2 * 4 * 64, held


def test_the_observer_restores_the_program_and_frees_again_after_it():
    from erase_fx.emit import program

    original = program.StreamProgram._run
    with held_to_join.recording() as found:
        assert program.StreamProgram._run is not original
    assert program.StreamProgram._run is original and found == []
