"""bench.paper.digits on CPU: a tiny end-to-end run, exactness of erase against eager, the data."""
import json

import pytest
import torch

from bench.paper import digits
from bench.paper.common import validate_results

TINY = ["--device", "cpu", "--size", "8", "--width", "32", "--layers", "3", "--batch", "64",
        "--epochs", "2", "--steps", "2", "--warmup", "1"]


@pytest.fixture(autouse=True)
def one_thread():
    """NB: one intra-op thread: on a loaded 2-core runner two threads spin against each other."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_cpu_run_writes_contract_json_and_erase_matches_eager_exactly(tmp_path):
    code = digits.main([*TINY, "--variants", "eager,erase", "--on-error", "raise",
                        "--out-dir", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "digits.json").read_text())
    assert validate_results(results) == []
    eager, erase = results["data"]["runs"]
    assert (eager["variant"], erase["variant"]) == ("eager", "erase")
    # 3 detached layers: the first two are early blocks.
    assert results["tables"][2]["rows"] == [[3, 2, 2]]
    assert erase["compiled"] == {"early_blocks": 2, "rejected": [], "fallback": []}
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
        "eager", "compile", "erase", "erase-1stream")
    assert "erase-aot_eager" in digits.variants_for(digits.VARIANTS, cpu, "inductor")
