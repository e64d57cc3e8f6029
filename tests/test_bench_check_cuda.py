"""bench.check_cuda judges each config's expected early work, found by the CPU analysis."""
import pytest
from bench.check_cuda import expected_early_work
from bench.models import ChainConfig


def test_a_chain_expects_every_block_but_the_last():
    assert expected_early_work(ChainConfig.parse("mlp:8:16:32:4")) == (3, 0, 0)


def test_towers_expect_parts_and_a_top_head_expects_pieces():
    blocks, parts, pieces = expected_early_work(ChainConfig.parse("mlp-towers:8:16:32:3"))
    assert blocks >= 1 and parts >= 1
    blocks, parts, pieces = expected_early_work(ChainConfig.parse("mlp-towers-top:8:16:32:3"))
    assert blocks >= 1 and pieces > 1


def test_stress_runs_read_each_release_lag_and_refuse_the_rest():
    from bench.check_cuda import stress_runs

    assert stress_runs("uncaptured,none,2") == [(False, None), (True, None), (True, 2)]
    for bad in ("0", "-1", "lag", ""):
        with pytest.raises(ValueError, match="is not uncaptured, none or an integer >= 1"):
            stress_runs(bad)


def test_bad_parts_or_lags_are_refused_before_the_gpu_is_touched(capsys):
    from bench.check_cuda import main

    for argv in (["--parts", "parity,bogus"], ["--release-lags", "none,0"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    assert "--release-lags: '0' is not" in capsys.readouterr().err


def test_each_check_is_a_row_named_by_what_it_ran(tmp_path, monkeypatch, capsys):
    """A check's row key holds its steps and allocator: a 300-step stress under
    cudaMallocAsync does not replace the 2,000-step one under the native allocator."""
    from bench import check_cuda
    from bench.tables import Run, read_table

    monkeypatch.setattr(check_cuda, "allocator_backend", lambda: "cudaMallocAsync")
    results = check_cuda.Results()
    stress = "stress mlp:8:16:32:4 cudagraphs=True release_lag=None, 300 steps"
    assert results.add(stress, "OK", "0 with any grad bit differing between 4 streams and 1")
    assert not results.add("two forwards then one backward, CUDA graphs on", "FAIL",
                           "max rel grad err 1.00e-03")
    assert capsys.readouterr().out.splitlines()[1] == (
        "two forwards then one backward, CUDA graphs on: max rel grad err 1.00e-03 FAIL")
    out = tmp_path / "check_cuda.md"
    check_cuda.write_table(out, results, Run("2026-12-04", "NVIDIA H200, torch 2.11.0",
                                             "python -m bench.check_cuda"))
    _, rows = read_table(out)
    assert [(row["check"], row["result"]) for row, _ in rows] == [
        (f"{stress} (cudaMallocAsync)", "OK"),
        ("two forwards then one backward, CUDA graphs on (cudaMallocAsync)", "FAIL")]
