"""Running a test's work in several processes (gloo): spawn, collect each rank's record."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp


def spawn_ranks(worker: Callable[..., None], world: int, args: Sequence[Any],
                timeout: float = 600) -> dict[int, Any]:
    """Run ``worker(rank, *args, queue)`` in ``world`` spawned processes; what each puts
    on the queue as ``(rank, record)``, by rank."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=worker, args=(rank, *args, queue))
                 for rank in range(world)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=timeout) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    return results


def each_rank(records: dict[int, Any], name: str, world: int) -> list[dict[str, Any]]:
    """Scenario ``name``'s record on every rank; a rank's error fails the test."""
    out = []
    for rank in range(world):
        record = records[rank][name]
        assert "error" not in record, f"rank {rank}: {record.get('error')}"
        out.append(record)
    return out
