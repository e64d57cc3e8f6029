"""erase_fx.emit.inplace_fusion: fusions refused where they would block a large in-place write.

The predicate runs on Inductor's own scheduler nodes (CPU compiles of small
graphs), so these tests also pin the scheduler attributes it reads
(``name_to_buf``, ``NodeUser.can_inplace``, ``ancestors``, ``read_writes``,
the size hints) on the installed torch.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.compiler.config as compiler_config
import torch.nn as nn
from torch._inductor import config as inductor_config
from torch._inductor.virtualized import V

import erase_fx
from bench.check_inplace_fusion import (
    compile_once,
    soft_target_head,
    softmax_head,
    writes_over_matmul,
)
from bench.models import GPTChain, GPTConfig, gpt_inputs
from graphs import assert_same_grads
from erase_fx.emit import inductor_segments, inplace_fusion
from erase_fx.emit.inplace_fusion import CACHE_KEY_TAG, keep_inplace_writes

MiB = 1 << 20


def compile_under(fn, inputs, min_bytes):
    torch._dynamo.reset()
    with keep_inplace_writes(min_bytes=min_bytes) as handler, \
            inductor_config.patch(fx_graph_cache=False):
        got = torch.compile(fn)(*inputs)
    return handler.refused, got


def head_inputs(rows=512, cols=4096):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(rows, 64, generator=generator), torch.randn(64, cols, generator=generator),
            torch.randint(0, cols, (rows, 1), generator=generator))


def test_a_fusion_that_blocks_a_large_inplace_write_is_refused_and_results_are_unchanged():
    refused, _, same = compile_once("cpu", keep=True, rows=512, cols=4096)
    assert same
    assert refused, "the softmax over B, read again by the loss value, must be refused a fusion"
    assert all(r.nbytes >= MiB for r in refused)
    assert all(r.buffer.startswith("buf") and r.writer.startswith("op") for r in refused)


def test_a_loss_over_soft_targets_is_left_out_of_the_gradients_kernel_so_it_writes_over_b():
    """The soft-target loss value reads B at the gradient's own index and needs none of its
    result; fused with the gradient it is a reader Inductor counts as not done, and the
    gradient gets a buffer of its own. Stock Inductor writes it apart from B on CPU too."""
    stock_refused, stock_code, stock_same = compile_once("cpu", keep=False, rows=512,
                                                         head=soft_target_head)
    refused, code, same = compile_once("cpu", keep=True, rows=512, head=soft_target_head)
    assert stock_same and same
    assert stock_refused is None and not writes_over_matmul(stock_code)
    assert refused and writes_over_matmul(code)


def test_the_check_reads_inductors_reuse_lines():
    mm = "    extern_kernels.mm(arg0_1, arg1_1, out=buf0)\n"
    kept = mm + "    buf3 = buf0; del buf0  # reuse\n    triton_poi_fused_div_exp_sub_2.run(buf3)\n"
    stock = mm + "    buf5 = buf4; del buf4  # reuse\n    del buf0\n"
    assert writes_over_matmul(kept) and not writes_over_matmul(stock)


def test_buffers_under_the_threshold_are_left_to_inductor():
    refused, _ = compile_under(softmax_head, head_inputs(), min_bytes=64 * MiB)
    assert refused == []


def test_no_refusal_when_every_other_reader_needs_the_writers_result():
    """The loss value read from the softmax itself: fused or not, nothing else holds B."""

    def head(a, w, target):
        b = a @ w
        m = b.amax(1, keepdim=True)
        e = (b - m).exp()
        p = e / e.sum(1, keepdim=True)
        return p, p.gather(1, target).log().mean()

    refused, (p, value) = compile_under(head, head_inputs(), min_bytes=MiB)
    want = head(*head_inputs())
    assert refused == []
    torch.testing.assert_close(p, want[0])
    torch.testing.assert_close(value, want[1])


def test_the_handler_and_the_cache_key_tag_are_set_inside_only():
    before_tag, before_choices = compiler_config.cache_key_tag, V.choices
    with keep_inplace_writes() as handler:
        assert V.choices is handler
        assert CACHE_KEY_TAG in compiler_config.cache_key_tag
        # every other choice is Inductor's own
        assert handler.should_use_persistent_reduction == before_choices.should_use_persistent_reduction
    assert compiler_config.cache_key_tag == before_tag
    assert V.choices is not handler
    assert copy.copy(handler).min_bytes == handler.min_bytes


def test_it_keeps_a_users_own_choices_and_cache_key_tag():
    from torch._inductor.choices import InductorChoices

    class Cautious(InductorChoices):
        mine = True

        @staticmethod
        def can_fuse(scheduler, node1, node2, shared_data_score):
            return False

    with V.set_choices_handler(Cautious()), compiler_config.patch(cache_key_tag="mine"):
        with keep_inplace_writes() as handler:
            assert handler.mine  # every other choice is the user's
            assert not handler.can_fuse(None, None, None, 1)  # the user's refusal stands
            assert compiler_config.cache_key_tag.startswith("mine|")
        assert isinstance(V.choices, Cautious) and compiler_config.cache_key_tag == "mine"


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(16, 3) for _ in range(2))

    def forward(self, x, labels):
        loss = 0
        for stage, head in zip(self.stages, self.heads):
            x = stage(x.detach())
            loss = loss + nn.functional.cross_entropy(head(x), labels)
        return loss


@pytest.mark.parametrize("keep", [True, False])
def test_side_stream_segments_compile_inside_it_when_the_option_is_on(monkeypatch, keep):
    calls = []
    real = inplace_fusion.keep_inplace_writes

    @contextlib.contextmanager
    def recording(*args, **kwargs):
        with real(*args, **kwargs) as handler:
            calls.append(compiler_config.cache_key_tag)
            yield handler

    monkeypatch.setattr(inplace_fusion, "keep_inplace_writes", recording)
    torch._dynamo.reset()
    model = TwoBlocks()
    options = {"on_error": "raise", "tuning": {"keep_inplace_writes": keep}}
    with erase_fx.collect_reports() as reports:
        torch.compile(model, backend="erase", options=options)(
            torch.randn(8, 16), torch.randint(0, 3, (8,))).backward()
    assert reports[-1].blocks, "the model must have early blocks"
    assert (len(calls) > 0) == keep
    assert all(CACHE_KEY_TAG in tag for tag in calls)
    assert inductor_segments.inplace_fusion is inplace_fusion


@pytest.mark.parametrize("kind", ["gpt", "gpt-soft"])
def test_gradients_equal_eagers_with_fusions_refused(monkeypatch, kind):
    """A transformer chain with local LM heads (fp32; hard labels, or label-smoothed targets
    whose loss value reads every logit), the threshold lowered so that its side segments'
    logits (4 MiB here) are written in place: every grad equals eager's, on a batch the
    compilation never saw."""
    refused = []
    real = inplace_fusion.keep_inplace_writes

    @contextlib.contextmanager
    def lowered(min_bytes=None):
        with real(min_bytes=64 << 10) as handler:
            yield handler
        refused.extend(handler.refused)

    monkeypatch.setattr(inplace_fusion, "keep_inplace_writes", lowered)
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig.parse(f"{kind}:2:64:64:3")
    model = GPTChain(cfg, amp_dtype=None)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="erase", options={"on_error": "raise"})
    with inductor_config.patch(fx_graph_cache=False):
        compiled(*gpt_inputs(cfg, torch.device("cpu"))).backward()
    model.zero_grad(set_to_none=True)
    tokens, targets = gpt_inputs(cfg, torch.device("cpu"))
    compiled(tokens, targets).backward()
    reference(tokens, targets).backward()
    assert refused, "the side segments' logits must be written in place"
    assert_same_grads(reference, model, rtol=1e-4, atol=1e-6)
