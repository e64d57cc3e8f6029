"""bench.paper.digits on CPU: a tiny end-to-end run, exactness of erase against eager, the data,
and the paper rows."""
import pytest
import torch
from paper_helpers import one_thread  # noqa: F401 - autouse fixture
from paper_helpers import run_experiment

from bench.paper import digits

TINY = ["--device", "cpu", "--size", "8", "--width", "32", "--layers", "3", "--batch", "64",
        "--epochs", "2", "--steps", "2", "--warmup", "1"]


def test_cpu_run_writes_contract_json_and_erase_matches_eager_exactly(tmp_path):
    code, results = run_experiment(digits.main, "digits",
                                   [*TINY, "--variants", "eager,erase", "--on-error", "raise"],
                                   tmp_path)
    assert code == 0
    eager, erase = results["data"]["runs"]
    assert (eager["variant"], erase["variant"]) == ("eager", "erase")
    # 3 detached layers: the first two are early blocks.
    assert results["tables"][2]["rows"] == [[3, 2, 2]]
    assert erase["compiled"] == {"early_blocks": 2, "rejected": [], "fallback": [],
                                 "cudagraph_failures": []}
    # inner aot_eager on CPU: trained weights and every head's accuracy equal eager's exactly
    assert erase["must_equal_eager"] and erase["equal_to_eager"]
    assert erase["max_param_diff"] == 0.0
    assert erase["accuracy"] == eager["accuracy"] and len(erase["accuracy"]) == 3
    assert erase["train_steps"] == 2 * (1347 // 64)
    for row in results["paper_comparison"]:
        assert row["verdict"] in ("better", "equal", "worse", "not comparable")


def test_digits_are_the_sklearn_set_split_and_upsampled():
    data = digits.load_digits(size=28, seed=0)
    assert data.x_train.shape == (1347, 784) and data.x_test.shape == (450, 784)
    assert sorted(data.y_test.unique().tolist()) == list(range(10))
    assert abs(data.x_train.mean().item()) < 1e-5
    again = digits.load_digits(size=8, seed=0)
    assert again.features == 64
    torch.testing.assert_close(again.y_test, data.y_test)  # same split, whatever the size


def test_batches_drop_the_partial_batch_and_repeat_their_order():
    data = digits.load_digits(size=8)
    first = [y for _, y in digits.batches(data, 500, 2, seed=3)]
    second = [y for _, y in digits.batches(data, 500, 2, seed=3)]
    assert len(first) == 4 and all(y.numel() == 500 for y in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_backward_verdict_band():
    assert digits.backward_verdict(0.58) == "equal"
    assert digits.backward_verdict(0.62) == "equal"
    assert digits.backward_verdict(0.70) == "better"
    assert digits.backward_verdict(0.20) == "worse"


def test_variants_on_cpu_drop_graphs_and_the_duplicate_exactness_run():
    cpu = torch.device("cpu")
    assert digits.variants_for(digits.VARIANTS, cpu, "aot_eager") == (
        "eager", "compile", "erase", "erase/one-stream")
    assert "erase/aot_eager" in digits.variants_for(digits.VARIANTS, cpu, "inductor")


def timing(variant, forward_ms, backward_ms):
    return {"variant": variant, "forward_ms": forward_ms, "backward_ms": backward_ms,
            "total_ms": forward_ms + backward_ms}


@pytest.mark.parametrize("with_stock", [True, False])
def test_erase_and_erase_graphs_get_a_verdict_each(with_stock):
    rows = [timing("eager", 1.0, 2.0), timing("compile", 1.0, 1.5), timing("erase", 2.0, 1.6),
            timing("erase+graphs", 0.5, 0.8)]
    if not with_stock:
        rows.pop(1)
    comparison = digits.paper_comparison(rows)
    verdicts = {row["erase_fx"]: row["verdict"] for row in comparison}
    expected = {"-20% backward time (erase vs eager)": "worse",
                "-60% backward time (erase+graphs vs eager)": "equal"}
    if with_stock:
        expected |= {"+7% backward time (erase vs stock torch.compile)": "worse",
                     "-47% backward time (erase+graphs vs stock torch.compile)": "worse"}
    assert {k: v for k, v in verdicts.items() if "backward time" in k} == expected
    graphs_notes = [row["note"] for row in comparison if "erase+graphs vs" in row["erase_fx"]]
    assert all("part of the difference is replay" in note for note in graphs_notes)
    # every backward row says what the forward and the total step paid
    notes = {row["erase_fx"]: row["note"] for row in comparison}
    assert notes["-20% backward time (erase vs eager)"].endswith(
        "inside the forward: forward +100.0%, total step +20.0% vs eager")
    total = comparison[-1]
    assert total["verdict"] == "not comparable"
    assert total["erase_fx"].startswith("erase +20.0% vs eager")
    assert "; erase+graphs -56.7% vs eager" in total["erase_fx"]


def test_paper_rows_without_an_erase_variant_say_so():
    (row,) = digits.paper_comparison([timing("eager", 1.0, 2.0)])
    assert (row["erase_fx"], row["verdict"]) == ("not measured", "not comparable")
