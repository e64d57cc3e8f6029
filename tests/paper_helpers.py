"""What the tests of ``bench/paper`` share: the CPU setting and running an experiment.

Import the fixture into a test module to turn it on there::

    from paper_helpers import one_thread  # noqa: F401 - autouse fixture
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.paper.common import validate_results


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread inside: the tiny kernels gain nothing from more, and on a loaded
    2-core runner two threads spin against each other."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def one_thread():
    """`single_thread` around each test (a module's fixture takes it itself: it runs first)."""
    with single_thread():
        yield


def run_experiment(main: Callable[[Sequence[str]], int], name: str, args: Sequence[str],
                   results_dir: Path) -> tuple[int, dict[str, Any]]:
    """``main(args)`` writing into ``results_dir``: its exit status and ``<name>.json``.

    The results are checked against the contract of ``bench/paper/README.md``.
    """
    code = main([*args, "--results-dir", str(results_dir)])
    results = json.loads((results_dir / f"{name}.json").read_text())
    assert validate_results(results) == []
    return code, results
