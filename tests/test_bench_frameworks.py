"""bench.frameworks in its smoke mode: Lightning rows on CPU, the table printed last."""
import pytest

from bench import frameworks


def test_the_smoke_mode_prints_the_table_last(capsys):
    pytest.importorskip("lightning")
    # NB: two rows keep it short: the automatic and the manual (compile_manual_step) paths;
    # the other rows change only torch.compile's arguments
    assert frameworks.main(["--smoke", "--rows", "erase+graphs,erase+step"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    header, _, drop_in, step = lines[-4:]
    assert header.startswith("| config | row | median ms")
    assert drop_in.startswith("| mlp:8:16:32:3 | erase+graphs |")
    assert step.startswith("| mlp:8:16:32:3 | erase+step |")
    assert "| 2 |" in drop_in and "| 2 |" in step  # the early blocks found
    assert "CUDA is not available" in step
    assert "nothing is captured" in lines[-5]


def test_unknown_rows_are_named():
    with pytest.raises(SystemExit):
        frameworks.main(["--smoke", "--rows", "erase"])
