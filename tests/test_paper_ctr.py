"""CPU smoke tests of the paper's CTR experiment (``bench/paper/ctr.py``): tiny sizes, few steps.

They check what the experiment claims, not its speed: the results file
follows the contract, erase with the ``aot_eager`` inner compiler trains
exactly as eager does, every block with a local loss gets a gradient, and a
block without one gets none (and erase_fx finds no early block there).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from paper_helpers import one_thread  # noqa: F401 - autouse fixture
from paper_helpers import run_experiment, single_thread

from bench.paper import common, ctr

CPU = torch.device("cpu")
BLOCKS = 3
#: A model small enough to compile in a few seconds; 3 blocks instead of 6
#: (the experiment takes any number).
TINY = ["--device", "cpu", "--seeds", "1", "--batch", "32", "--cap", "200", "--embed-dim", "4",
        "--bottom", "8", "--width", "8", "--hidden", "16", "--blocks", str(BLOCKS),
        "--eval-rows", "256", "--eval-every", "5", "--warmup", "2", "--audit-steps", "1,10",
        "--streams", "2"]
GROUPS = ["front", *(f"block{i}" for i in range(1, BLOCKS + 1))]


def test_ctr_results_follow_the_contract_and_erase_equals_eager(tmp_path):
    code, payload = run_experiment(ctr.main, "ctr", [*TINY, "--steps", "10", "--freeze-steps",
                                                     "0"], tmp_path)
    assert code == 0
    assert set(common.REQUIRED_KEYS) <= set(payload)
    assert set(common.META_KEYS) <= set(payload["meta"])
    assert payload["meta"]["command"].startswith("python -m bench.paper.ctr --device cpu")
    assert [f["kind"] for f in payload["figures"]] == ["line", "bar"]
    assert payload["data"]["failures"] == []
    # kept final parameters live on the host: the peak memory column is the run's own
    assert payload["meta"]["final_params_kept_on"] == "cpu"
    assert "includes the final parameters" not in payload["tables"][0]["caption"]

    runs = {run["variant"]: run for run in payload["data"]["runs"]}
    assert list(runs) == ["baseline", "eager", "erase/aot_eager"]
    assert all(run["error"] is None for run in runs.values())
    eager, erase = runs["eager"], runs["erase/aot_eager"]
    assert len(eager["losses"]) == 10
    assert erase["losses"] == eager["losses"]
    assert erase["ne_curve"] == eager["ne_curve"]
    exact = payload["data"]["exactness"]["erase/aot_eager vs eager"]
    assert exact["max_train_loss_diff"] == 0.0
    assert exact["final_ne_diff"] == 0.0
    assert exact["max_param_diff"] == 0.0
    # every block but the last runs its backward early
    (report,) = erase["erase_reports"]
    assert len(report["blocks"]) == BLOCKS - 1

    for run in runs.values():
        audited = [(row["step"], row["group"]) for row in run["audit"]]
        assert audited == [(step, group) for step in (1, 10) for group in GROUPS]
        assert all(row["status"] == "OK" and row["grad_norm"] > 0 for row in run["audit"])
        assert all(row["local_loss"] > 0 for row in run["audit"])
    # the detached front learns from block 1's loss only; the baseline's from all of them
    front = {run["variant"]: run["audit"][0]["loss_from"] for run in runs.values()}
    assert front == {"baseline": "L1+L2+L3", "eager": "L1", "erase/aot_eager": "L1"}


def test_blocks_without_local_loss_get_zero_gradient_and_no_early_block():
    sizes = ctr.DataSizes(cap=200)
    data = ctr.Dataset.make(sizes, steps=10, batch=32, eval_rows=256, seed=0, device=CPU)
    model_sizes = ctr.ModelSizes(tuple(sizes.rows_per_field()), embed_dim=4, bottom=(8,),
                                 width=8, hidden=16, blocks=BLOCKS)
    settings = ctr.Settings(CPU, steps=10, warmup=2, eval_every=5, audit_steps=(1, 10),
                            optimizer="adam", lr=2e-3, inner="aot_eager", streams=2)

    demo = ctr.freeze_demo(model_sizes, data, settings, seed=0, local_weight=1.0,
                           say=lambda _: None)

    eager, erase = demo["runs"]
    assert eager.error is None and erase.error is None
    assert erase.losses == eager.losses
    last = f"block{BLOCKS}"
    for run in (eager, erase):
        for row in run.audit:
            frozen = row["group"] != last
            assert (row["grad_norm"] == 0.0) is frozen, row
            assert row["status"] == ("FAIL" if frozen else "OK")
            assert row["loss_from"] == ("none" if frozen else f"L{BLOCKS}")
    assert [len(report["blocks"]) for report in erase.erase_reports] == [0]

    found = demo["explain"]
    assert found["no_local_loss"]["early_blocks"] == []
    assert [c["reason"] for c in found["no_local_loss"]["rejected"]] == ["last_block"]
    assert [c["groups"] for c in found["no_local_loss"]["rejected"]] == [[last]]
    assert [b["groups"] for b in found["with_local_losses"]["early_blocks"]] == [
        ["block1", "front"], *([f"block{i}"] for i in range(2, BLOCKS))]


def test_planted_data_is_fixed_by_its_seed_and_has_the_target_click_rate():
    sizes = ctr.DataSizes(cap=200, ctr=0.25)
    first = ctr.Dataset.make(sizes, steps=4, batch=1024, eval_rows=4096, seed=3, device=CPU)
    again = ctr.Dataset.make(sizes, steps=4, batch=1024, eval_rows=4096, seed=3, device=CPU)
    for a, b in zip(first.train + first.eval, again.train + again.eval):
        assert torch.equal(a, b)
    assert abs(first.train_ctr - 0.25) < 0.03
    assert 0.5 < first.oracle_ne < 0.95  # learnable: the planted model beats the base rate
    dense, sparse, labels = first.step_batch(1)
    assert dense.shape == (1024, ctr.DENSE_FEATURES) and sparse.shape == (1024, ctr.FIELDS)
    assert bool((sparse < torch.tensor(sizes.rows_per_field())).all())


def test_criteo_cardinalities_and_the_cap():
    assert len(ctr.CRITEO_KAGGLE_CARDINALITIES) == 26
    assert sum(ctr.CRITEO_KAGGLE_CARDINALITIES) == 33_762_577
    assert max(ctr.DataSizes(cap=1000).rows_per_field()) == 1000


def test_interactions_select_and_mask_compute_the_same_features():
    model_sizes = ctr.ModelSizes(tuple(ctr.DataSizes(cap=50).rows_per_field()), embed_dim=4,
                                 bottom=(8,), width=8, blocks=1)
    select = ctr.DLRMFront(dataclasses.replace(model_sizes, interaction="select"))
    mask = ctr.DLRMFront(model_sizes)
    dense, sparse = torch.randn(5, 13), torch.randint(0, 3, (5, 26))
    with torch.no_grad():
        pairs = select.pair_index
        # a mask projection whose weights on the masked-out entries are zero equals select's
        weight = torch.zeros(8, 4 + 27 * 27)
        weight[:, :4] = select.projection[0].weight[:, :4]
        weight[:, 4 + pairs] = select.projection[0].weight[:, 4:]
        mask.load_state_dict(select.state_dict() | {"projection.0.weight": weight})
        assert torch.allclose(select(dense, sparse), mask(dense, sparse), atol=1e-6)


def test_cuda_only_variants_are_refused_on_cpu_and_flags_override_the_preset():
    with pytest.raises(SystemExit):
        ctr.parse_args(["--device", "cpu", "--variants", "eager,erase+graphs"])
    args = ctr.parse_args(["--device", "cpu", "--quick", "--steps", "7"])
    assert args.steps == 7 and args.seeds == ctr.PRESETS["quick"]["seeds"]
    assert args.variants == ctr.CPU_DEFAULT_VARIANTS and args.inner == "aot_eager"


def test_the_rounding_control_starts_one_float_step_away_and_is_reported(tmp_path):
    code, payload = run_experiment(ctr.main, "ctr", [
        *TINY, "--steps", "4", "--freeze-steps", "0", "--audit-steps", "1",
        "--variants", "eager,eager/1ulp,erase/aot_eager"], tmp_path)
    assert code == 0
    runs = {run["variant"]: run for run in payload["data"]["runs"]}
    # one float step in every weight changes the run, but only by rounding
    assert runs["eager/1ulp"]["losses"] != runs["eager"]["losses"]
    assert max(abs(x - y) for x, y in zip(runs["eager/1ulp"]["losses"],
                                          runs["eager"]["losses"])) < 1e-4
    control = payload["data"]["exactness"]["eager/1ulp vs eager"]
    assert 0 < control["max_param_diff"] < 1e-3
    exact = next(t for t in payload["tables"] if t["caption"].startswith("Exactness"))
    flags = {(row[0], row[1]): row[-1] for row in exact["rows"]}
    assert flags == {("erase/aot_eager", "eager"): "yes", ("eager/1ulp", "eager"): "no (control)"}
    # the control is a curve of the NE figure, not a bar of the speed figure
    line, bar = payload["figures"]
    assert "eager/1ulp" in [s["label"] for s in line["series"]]
    assert "eager/1ulp" not in [s["label"] for s in bar["series"]]


def test_nudge_one_ulp_moves_every_weight_by_exactly_one_float_step():
    model = torch.nn.Linear(5, 3)
    before = [p.detach().clone() for p in model.parameters()]
    ctr.nudge_one_ulp(model)
    for old, new in zip(before, model.parameters()):
        assert torch.equal(new, torch.nextafter(old, torch.full_like(old, float("inf"))))
        assert (new > old).all()


MERGE_RUN = [*TINY, "--steps", "4", "--audit-steps", "1", "--variants", "eager,erase/aot_eager"]


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """A run of seeds 0 and 1, and the same seeds run as two parts (``a``: seed 0 with the
    freeze demonstration, ``b``: seed 1 without), written once for the merge tests."""
    root = tmp_path_factory.mktemp("split")
    whole, parts = root / "whole", root / "parts"
    with single_thread():  # NB: a module's fixture runs before the autouse one_thread
        run_experiment(ctr.main, "ctr", [*MERGE_RUN, "--seeds", "2"], whole)
        run_experiment(ctr.main, "a", [*MERGE_RUN, "--seed", "0", "--seeds", "1", "--name",
                                       "a"], parts)
        run_experiment(ctr.main, "b", [*MERGE_RUN, "--seed", "1", "--seeds", "1", "--name",
                                       "b", "--freeze-steps", "0"], parts)
    return whole / "ctr.json", parts / "a.json", parts / "b.json"


def test_a_run_split_over_seeds_merges_into_the_run_of_all_seeds(split_run, tmp_path):
    whole, a, b = split_run
    code, merged = run_experiment(ctr.main, "ctr", ["--merge", str(b), str(a)], tmp_path)
    assert code == 0
    expected = json.loads(whole.read_text())

    def trained(payload):
        return [(r["variant"], r["seed"], r["losses"], r["ne_curve"], r["audit"])
                for r in payload["data"]["runs"]]
    assert trained(merged) == trained(expected)
    assert merged["data"]["exactness"] == expected["data"]["exactness"]
    assert [r["audit"] for r in merged["data"]["freeze_demo"]["runs"]] == [
        r["audit"] for r in expected["data"]["freeze_demo"]["runs"]]
    assert [t["caption"] for t in merged["tables"]] == [t["caption"] for t in expected["tables"]]
    assert merged["summary"] == expected["summary"]
    assert merged["meta"]["seeds"] == 2
    assert merged["meta"]["command"].startswith("python -m bench.paper.ctr --merge")
    assert [(p["file"], p["seeds"]) for p in merged["meta"]["merged_from"]] == [
        ("b.json", [1]), ("a.json", [0])]


def test_merge_refuses_files_that_are_not_parts_of_one_run(split_run, tmp_path):
    _, a, b = split_run
    # NB: a part run with another flag, as its settings record it
    other = json.loads(b.read_text())
    other["meta"]["settings"]["lr"] = 1e-3
    lr = tmp_path / "lr.json"
    lr.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="differ in lr"):
        ctr.merge([a, lr], "ctr", "python -m bench.paper.ctr --merge")
    with pytest.raises(ValueError, match="a seed is in two files"):
        ctr.merge([a, a], "ctr", "python -m bench.paper.ctr --merge")
    with pytest.raises(ValueError, match="a results file or more"):
        ctr.merge([], "ctr", "python -m bench.paper.ctr --merge")
    # one file: the same runs summarized again
    again = ctr.merge([a], "ctr", "python -m bench.paper.ctr --merge a.json")
    assert [(r["variant"], r["seed"], r["losses"], r["qps"]) for r in again["data"]["runs"]] == [
        (r["variant"], r["seed"], r["losses"], r["qps"])
        for r in json.loads(a.read_text())["data"]["runs"]]


def test_merge_says_which_parts_kept_final_parameters_on_the_gpu(split_run, tmp_path):
    _, a, b = split_run
    # a part written before the fix: its peak memory counted the kept parameters
    old = json.loads(b.read_text())
    del old["meta"]["final_params_kept_on"]
    (tmp_path / "b.json").write_text(json.dumps(old))
    merged = ctr.merge([a, tmp_path / "b.json"], "ctr", "merge")
    assert merged["meta"]["final_params_kept_on"] == "cpu for seeds 0, gpu for seeds 1"
    assert "final parameters kept on: cpu for seeds 0, gpu for seeds 1" in (
        merged["tables"][0]["caption"])
    alone = ctr.merge([a], "ctr", "merge")
    assert "final parameters kept on" not in alone["tables"][0]["caption"]
