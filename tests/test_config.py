"""EraseConfig and Tuning: defaults, validation, options and the dump environment variable."""
import dataclasses

import pytest

from erase_fx import EraseConfig, EraseOptionError, make_backend
from erase_fx.config import Tuning

#: A user's choices: the public options, at most 8 (issue 38).
PUBLIC = ("streams", "inner", "seed", "cudagraphs", "overlap", "early_allreduce", "dump_dir",
          "on_error")


def test_defaults_are_documented_values():
    cfg = EraseConfig()
    assert (cfg.streams, cfg.inner, cfg.seed, cfg.cudagraphs, cfg.dump_dir,
            cfg.on_error) == (4, "inductor", None, None, None, "fallback")
    assert cfg.early_seed == 1.0 and EraseConfig(seed=1024).early_seed == 1024.0
    assert cfg.tuning == Tuning()
    assert (cfg.tuning.partitioner, cfg.tuning.release_lag, cfg.tuning.min_part_share) == (
        "min_cut", "auto", 0.05)


def test_the_public_options_are_a_users_choices_and_the_rest_is_tuning():
    fields = [f.name for f in dataclasses.fields(EraseConfig)]
    assert fields == [*PUBLIC, "tuning"] and len(PUBLIC) <= 8


@pytest.mark.parametrize("cls", [EraseConfig, Tuning])
def test_every_field_is_documented_in_the_docstring(cls):
    for field in dataclasses.fields(cls):
        assert f"{field.name}:" in cls.__doc__


def test_docstrings_say_what_and_why_not_what_was_measured():
    for text in (EraseConfig.__doc__, Tuning.__doc__):
        for figure in ("H200", "2026-", "bench/results", "step.md", "x of stock"):
            assert figure not in text


def test_every_tuning_setting_is_described_in_the_performance_docs():
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "performance.md").read_text()
    section = docs[docs.index("## Tuning settings"):]
    for field in dataclasses.fields(Tuning):
        assert f"| `{field.name}` | `{field.default!r}`".replace("'", '"') in section


def test_from_options_and_frozen():
    cfg = EraseConfig.from_options({"streams": 2, "inner": "aot_eager"})
    assert cfg.streams == 2 and cfg.inner == "aot_eager"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.streams = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tuning.release_lag = 2


def test_tuning_from_options_as_a_dict_or_a_tuning():
    cfg = EraseConfig.from_options({"tuning": {"release_lag": 2, "stages_on_side": False}})
    assert cfg.tuning == Tuning(release_lag=2, stages_on_side=False)
    assert EraseConfig.from_options({"tuning": Tuning(min_part_share=0.0)}).tuning.min_part_share == 0
    assert EraseConfig(tuning={"partitioner": "default"}).tuning.partitioner == "default"
    assert EraseConfig.from_options({"tuning": None}).tuning == Tuning()
    make_backend(tuning=Tuning(keep_inplace_writes=False))  # checked at once


def test_unknown_option_lists_the_allowed_ones_with_defaults():
    with pytest.raises(EraseOptionError) as excinfo:
        EraseConfig.from_options({"strems": 2})
    text = str(excinfo.value)
    assert "'strems'" in text
    for name in PUBLIC:
        default = next(f.default for f in dataclasses.fields(EraseConfig) if f.name == name)
        assert f"{name} (default {default!r})" in text
    assert "tuning (default Tuning(): a dict of tuning settings" in text


def test_unknown_tuning_setting_lists_the_allowed_ones_with_defaults():
    with pytest.raises(EraseOptionError) as excinfo:
        EraseConfig.from_options({"tuning": {"relase_lag": 2}})
    text = str(excinfo.value)
    assert "unknown tuning setting(s) 'relase_lag'" in text
    for field in dataclasses.fields(Tuning):
        assert f"{field.name} (default {field.default!r})" in text


@pytest.mark.parametrize("name, value", [
    ("release_lag", 2), ("side_cuda_streams", None), ("partitioner", "default"),
    ("stages_on_side", True), ("copy_input_values", False), ("min_part_share", 0.0),
])
def test_an_old_option_name_at_the_top_level_says_where_it_went(name, value):
    with pytest.raises(EraseOptionError) as excinfo:
        EraseConfig.from_options({"inner": "aot_eager", name: value})
    assert (f"{name} is a tuning setting now: options={{'tuning': {{{name!r}: {value!r}}}}}"
            in str(excinfo.value))
    with pytest.raises(EraseOptionError, match="is a tuning setting now"):
        make_backend(**{name: value})


def test_dump_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ERASE_FX_DUMP", str(tmp_path))
    assert EraseConfig.from_options(None).dump_dir == str(tmp_path)
    assert EraseConfig.from_options({"dump_dir": "elsewhere"}).dump_dir == "elsewhere"


@pytest.mark.parametrize("changes", [
    {"streams": -1}, {"streams": 1.5}, {"seed": float("inf")}, {"seed": "1"}, {"dump_dir": 3},
    {"cudagraphs": 1}, {"tuning": 3}, {"tuning": {"release_lag": 0}},
])
def test_bad_values(changes):
    with pytest.raises(EraseOptionError):
        EraseConfig(**changes)


@pytest.mark.parametrize("changes", [
    {"partitioner": "greedy"},
    {"copy_input_values": 1}, {"recompute_boundary_values": 1},
    {"keep_inplace_writes": "yes"},
    {"stock_candidate": 1}, {"stock_candidate": None},
    {"stages_on_side": "yes"},
    {"min_part_share": -0.01}, {"min_part_share": 1.5}, {"min_part_share": float("nan")},
    {"min_part_share": True}, {"min_part_share": "0.1"},
    {"release_lag": 0}, {"release_lag": True}, {"release_lag": "2"}, {"release_lag": "Auto"},
    {"side_cuda_streams": 0}, {"side_cuda_streams": False}, {"side_cuda_streams": 2.0},
])
def test_bad_tuning_values_name_the_setting(changes):
    ((name, _),) = changes.items()
    with pytest.raises(EraseOptionError, match=f"tuning.{name}="):
        Tuning(**changes)
    with pytest.raises(EraseOptionError, match=f"tuning.{name}="):
        EraseConfig.from_options({"tuning": changes})


@pytest.mark.parametrize("value", [None, 1, 3, "auto"])
def test_release_lag_and_side_cuda_streams_values(value):
    assert Tuning(release_lag=value).release_lag == value
    assert Tuning(side_cuda_streams=value).side_cuda_streams == value
