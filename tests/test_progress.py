"""Progress lines while a graph compiles (erase_fx.progress)."""
import logging
import re

import torch

from erase_fx import progress
from graphs import Chain, chain_inputs


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_each_graph_says_what_it_compiles_and_how_long_it_took():
    lines = Lines()
    progress.log.addHandler(lines)
    try:
        model = Chain(3)
        compiled = torch.compile(model, backend="erase", options={"inner": "aot_eager"})
        compiled(*chain_inputs()).backward()
    finally:
        progress.log.removeHandler(lines)
    assert any(re.fullmatch(r"graph \d+: 2 early blocks; with aot_eager, in segments: "
                            r"compiling the forward", line) for line in lines.lines)
    assert any(re.fullmatch(r"graph \d+: forward compiled in \d+\.\d s", line)
               for line in lines.lines)
    assert any(re.fullmatch(r"graph \d+: backward compiled in \d+\.\d s", line)
               for line in lines.lines)


def test_the_default_handler_prints_to_stderr_unless_switched_off(monkeypatch):
    logger = logging.getLogger("erase_fx.progress")
    assert any(isinstance(h, logging.StreamHandler) for h in logger.handlers)
    assert logger.level == logging.INFO and not logger.propagate
    saved = list(logger.handlers)
    for handler in saved:
        logger.removeHandler(handler)
    try:
        monkeypatch.setenv("ERASE_FX_PROGRESS", "0")
        progress.install_default_handler()
        assert not logger.handlers
    finally:
        for handler in saved:
            logger.addHandler(handler)
