"""bench.driver_overhead: erase's runtime above stock on a tiny model, interleaved rounds."""
import pytest

from bench import driver_overhead


def test_it_times_both_backends_and_prints_the_difference(capsys):
    assert driver_overhead.main(["--inner", "aot_eager", "--rounds", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 interleaved rounds of 2 steps" in out
    assert "stock" in out and "erase" in out and "erase's runtime above stock:" in out


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        driver_overhead.main(["--rounds", "0"])
