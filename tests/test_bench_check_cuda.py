"""bench.check_cuda judges each config's expected early work, found by the CPU analysis."""
from bench.check_cuda import expected_early_work
from bench.models import ChainConfig


def test_a_chain_expects_every_block_but_the_last():
    assert expected_early_work(ChainConfig.parse("mlp:8:16:32:4")) == (3, 0, 0)


def test_towers_expect_parts_and_a_top_head_expects_pieces():
    blocks, parts, pieces = expected_early_work(ChainConfig.parse("mlp-towers:8:16:32:3"))
    assert blocks >= 1 and parts >= 1
    blocks, parts, pieces = expected_early_work(ChainConfig.parse("mlp-towers-top:8:16:32:3"))
    assert blocks >= 1 and pieces > 1
