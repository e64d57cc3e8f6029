"""Random DAGs of layers with local heads, detaches and tied layers: erase equals eager bitwise.

Each model is drawn from a seed: every layer reads one or two earlier values,
each maybe detached; some layers reuse an earlier layer's weights; some get a
cross-entropy head with a weight. So the graphs mix whole early blocks, parts
of gradients summed in the backward, and components that stay whole. With
``aot_eager`` and ``loss.backward()`` erase's gradients must equal eager's
exactly; with a scaled loss, within rounding.
"""
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import erase_fx
from graphs import check_parity

D, CLASSES = 12, 4
SEEDS = range(12)


class RandomGraph(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        rng = random.Random(seed)
        n = rng.randint(3, 7)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(n))
        self.heads = nn.ModuleList(nn.Linear(D, CLASSES) for _ in range(n))
        self.plan = []
        for i in range(n):
            sources = rng.sample(range(i + 1), k=min(i + 1, rng.choice([1, 1, 2])))
            detached = [rng.random() < 0.4 for _ in sources]
            layer = i if i == 0 or rng.random() < 0.8 else rng.randrange(i)  # tied weights
            head = i == n - 1 or rng.random() < 0.6
            weight = rng.choice([1.0, 1.0, 0.5, 2.0])
            activation = rng.choice([torch.relu, torch.tanh, F.gelu])
            self.plan.append((sources, detached, layer, head, weight, activation))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        values, loss = [x], 0
        for i, (sources, detached, layer, head, weight, activation) in enumerate(self.plan):
            value = activation(self.layers[layer](sum(
                values[s].detach() if d else values[s] for s, d in zip(sources, detached))))
            values.append(value)
            if head:
                loss = loss + weight * F.cross_entropy(self.heads[i](value), labels)
        return loss


def inputs():
    return torch.randn(5, D), torch.randint(0, CLASSES, (5,))


@pytest.fixture(scope="module")
def parts_seen():
    seen = []
    yield seen
    # NB: the seeds must exercise gradient parts, or this file tests less than it says
    assert sum(seen) >= 3, f"only {sum(seen)} of the random graphs had gradient parts"


#: every gradient part early, however small: the graphs are here to exercise the schedule
ALL_PARTS = {"tuning": {"min_part_share": 0.0}}


@pytest.mark.parametrize("seed", SEEDS)
def test_random_graph_gradients_equal_eager_bitwise(seed, parts_seen):
    torch.manual_seed(seed)
    with erase_fx.collect_reports() as reports:
        check_parity(RandomGraph(seed), inputs, options=ALL_PARTS, steps=2, rtol=0, atol=0)
    parts_seen.append(any(b.partials for r in reports for b in r.blocks))


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_random_graph_with_a_scaled_loss(seed):
    torch.manual_seed(seed)
    check_parity(RandomGraph(seed), inputs, options=ALL_PARTS, steps=2,
                 loss_of=lambda loss: 3.0 * loss)


@pytest.fixture(scope="module")
def blocks_seen_in_one_graph():
    seen = []
    yield seen
    # NB: most seeds must have early blocks, or streams=0 is tested on stock graphs only
    assert sum(seen) >= 4, f"only {sum(seen)} of the random graphs had early blocks"


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_random_graph_in_one_graph_equals_eager_bitwise(seed, blocks_seen_in_one_graph):
    # streams=0: the same early backward, the forward compiled whole on the main stream
    torch.manual_seed(seed)
    with erase_fx.collect_reports() as reports:
        check_parity(RandomGraph(seed), inputs, options={**ALL_PARTS, "streams": 0}, steps=2,
                     rtol=0, atol=0)
    blocks_seen_in_one_graph.append(any(r.blocks for r in reports))


@pytest.fixture(scope="module")
def stages_seen_on_side():
    seen = []
    yield seen
    # NB: with 2 side streams the auto rule puts stages on side once blocks outnumber them
    assert sum(seen) >= 2, f"only {sum(seen)} of the random graphs ran stages on side streams"


@pytest.mark.parametrize("stages_on_side", [None, False], ids=["auto", "stages-on-main"])
@pytest.mark.parametrize("seed", SEEDS[:6])
def test_random_graph_on_two_side_streams_equals_eager_bitwise(seed, stages_on_side,
                                                               stages_seen_on_side):
    # streams=2, the setting docs/performance.md gives chains of many blocks: a stream runs
    # several blocks, each block's stage on its stream when blocks outnumber the streams
    torch.manual_seed(seed)
    options = {"streams": 2, "tuning": {"min_part_share": 0.0, "stages_on_side": stages_on_side}}
    with erase_fx.collect_reports() as reports:
        check_parity(RandomGraph(seed), inputs, options=options, steps=2, rtol=0, atol=0)
    if stages_on_side is None:
        stages_seen_on_side.append(any(r.stages_on_side for r in reports))
