"""bench.paper.common: the commit recorded in results, tables, and erase's compile summary."""
import logging
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from bench.paper import common


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_says_when_the_tree_is_not_the_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path)
    assert common.git_commit() is None  # not a checkout
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", "code.py")
    git(tmp_path, "commit", "-q", "-m", "one")
    sha = common.git_commit()
    assert sha and not sha.endswith("-dirty")
    # what the experiments write does not make the tree dirty
    (tmp_path / "bench" / "results" / "paper").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "paper" / "digits.json").write_text("{}")
    assert common.git_commit() == sha
    # an edited or a new file does (a copied tree with a stale .git shows up like this)
    (tmp_path / "code.py").write_text("x = 2\n")
    assert common.git_commit() == f"{sha}-dirty"
    git(tmp_path, "checkout", "-q", "code.py")
    (tmp_path / "new.py").write_text("")
    assert common.git_commit() == f"{sha}-dirty"


def test_table_checks_its_rows():
    assert common.table("c", ("a", "b"), [(1, 2)]) == {
        "caption": "c", "columns": ["a", "b"], "rows": [[1, 2]]}
    with pytest.raises(ValueError, match="rows \\[1\\] do not have 2 cells"):
        common.table("c", ["a", "b"], [[1, 2], [3]])


def test_compile_summary_records_failed_cuda_graph_captures():
    block = SimpleNamespace()
    rejected = [SimpleNamespace(reason="last_block", detail="-"),
                SimpleNamespace(reason="not_linear", detail="clamp")]
    report = SimpleNamespace(blocks=[block, block], rejected=rejected, fallback_reason=None)
    with common.capture_erase_warnings() as warnings:
        logging.getLogger("erase_fx").warning(
            "erase_fx %s: CUDA graph %s; running without it", "graph 0", "capture failed: X")
        logging.getLogger("erase_fx").warning("erase_fx graph 0: something else")
    logging.getLogger("erase_fx").warning("erase_fx: after the block, not captured")
    summary = common.compile_summary([report], warnings)
    assert summary == {
        "early_blocks": 2, "rejected": ["not_linear: clamp"], "fallback": [],
        "cudagraph_failures": ["erase_fx graph 0: CUDA graph capture failed: X; running without "
                               "it"],
    }
    assert common.compiled_notes(summary) == ["not_linear: clamp",
                                              summary["cudagraph_failures"][0]]


def test_erase_variants_options(monkeypatch):
    seen = {}
    monkeypatch.setattr(common.torch, "compile",
                        lambda model, **kwargs: seen.setdefault(len(seen), kwargs))
    model = object()
    assert common.compile_variant("eager", model, inner="inductor", streams=2) is model
    for name in ("compile", "erase", "erase+graphs", "erase/aot_eager", "erase/one-stream"):
        common.compile_variant(name, model, inner="inductor", streams=2)
    assert seen[0] == {"backend": "inductor"}
    options = [seen[i]["options"] for i in (1, 2, 3, 4)]
    assert [(o["inner"], o["cudagraphs"]) for o in options] == [
        ("inductor", False), ("inductor", True), ("aot_eager", False), ("inductor", False)]
    assert all(o["streams"] == 2 and o["on_error"] == "fallback" for o in options)
    # the one-stream control is the backend's overlap=False: nothing is patched
    assert [o.get("overlap", True) for o in options] == [True, True, True, False]


def test_the_training_helpers_are_one_copy_shared_with_the_installed_demo():
    from erase_fx import _training, demo

    for name in ("build_seeded", "mlp", "normalized_entropy", "binary_entropy"):
        assert getattr(common, name) is getattr(_training, name)
    assert demo.build_seeded is _training.build_seeded and demo.mlp is _training.mlp
    assert not hasattr(demo, "_mlp")


def test_normalized_entropy_is_one_for_the_base_rate_and_build_seeded_is_reproducible():
    import torch

    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    base_rate = torch.full((4,), 0.25).logit()
    assert common.normalized_entropy(base_rate, labels) == pytest.approx(1.0)
    first = common.build_seeded(lambda: common.mlp(3, 4, 2), seed=5)
    second = common.build_seeded(lambda: common.mlp(3, 4, 2), seed=5)
    assert [type(m).__name__ for m in first] == ["Linear", "ReLU", "Linear", "ReLU"]
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
