"""EraseConfig: defaults, validation, options and the dump environment variable."""
import dataclasses

import pytest

from erase_fx import EraseConfig, EraseOptionError


def test_defaults_are_documented_values():
    cfg = EraseConfig()
    assert (cfg.streams, cfg.inner, cfg.partitioner, cfg.seed, cfg.cudagraphs, cfg.dump_dir,
            cfg.on_error) == (4, "inductor", "min_cut", 1.0, None, None, "fallback")


def test_every_field_is_documented_in_the_docstring():
    for field in dataclasses.fields(EraseConfig):
        assert f"{field.name}:" in EraseConfig.__doc__


def test_from_options_and_frozen():
    cfg = EraseConfig.from_options({"streams": 2, "inner": "aot_eager"})
    assert cfg.streams == 2 and cfg.inner == "aot_eager"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.streams = 3


def test_unknown_option_lists_the_allowed_ones_with_defaults():
    with pytest.raises(EraseOptionError) as excinfo:
        EraseConfig.from_options({"strems": 2})
    text = str(excinfo.value)
    assert "'strems'" in text
    for field in dataclasses.fields(EraseConfig):
        assert f"{field.name} (default {field.default!r})" in text


def test_dump_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ERASE_FX_DUMP", str(tmp_path))
    assert EraseConfig.from_options(None).dump_dir == str(tmp_path)
    assert EraseConfig.from_options({"dump_dir": "elsewhere"}).dump_dir == "elsewhere"


@pytest.mark.parametrize("changes", [
    {"streams": -1}, {"streams": 1.5}, {"seed": float("inf")}, {"seed": "1"}, {"dump_dir": 3},
    {"cudagraphs": 1}, {"copy_input_values": 1}, {"recompute_boundary_values": 1},
    {"keep_inplace_writes": "yes"},
    {"stages_on_side": "yes"},
    {"min_part_share": -0.01}, {"min_part_share": 1.5}, {"min_part_share": float("nan")},
    {"min_part_share": True}, {"min_part_share": "0.1"},
    {"release_lag": 0}, {"release_lag": True}, {"release_lag": "2"}, {"release_lag": "Auto"},
    {"side_cuda_streams": 0}, {"side_cuda_streams": False}, {"side_cuda_streams": 2.0},
])
def test_bad_values(changes):
    with pytest.raises(EraseOptionError):
        EraseConfig(**changes)


@pytest.mark.parametrize("value", [None, 1, 3, "auto"])
def test_release_lag_and_side_cuda_streams_values(value):
    assert EraseConfig(release_lag=value).release_lag == value
    assert EraseConfig(side_cuda_streams=value).side_cuda_streams == value
