"""The pure parts of CUDA graph replay, on CPU: which outputs alias inputs, and liveness.

The replay itself needs a GPU; ``bench/check_cuda.py`` checks it there.
"""
import torch

from erase_fx.emit.cudagraphs import AliasOf, _OwnedMemory, plan_outputs, realize_outputs


def test_plan_marks_outputs_that_live_in_input_memory():
    saved = torch.randn(4, 3)
    tangent = torch.randn(2)
    own = torch.randn(5)
    passthrough, view = saved, saved[1:].t()
    plan = plan_outputs([own, passthrough, view, None], [saved, tangent])
    assert plan[0] is own
    assert plan[1] == AliasOf(0, (4, 3), (3, 1), 0)
    assert plan[2] == AliasOf(0, (3, 3), (1, 3), 3)
    assert plan[3] is None


def test_realized_outputs_are_fresh_aliases_of_this_replays_inputs():
    saved, own = torch.randn(4, 3), torch.randn(5)
    plan = plan_outputs([own, saved, saved[1:].t()], [saved])
    next_saved = torch.randn(4, 3)  # the same memory in a real replay; here another tensor
    first, whole, view = realize_outputs(plan, [next_saved])
    assert first is not own and first.data_ptr() == own.data_ptr()
    assert torch.equal(first, own)
    assert whole is not next_saved and whole.data_ptr() == next_saved.data_ptr()
    assert torch.equal(view, next_saved[1:].t())
    assert view.data_ptr() == next_saved[1:].data_ptr()


def test_owned_memory_is_in_use_while_an_alias_lives():
    static = torch.randn(8)
    memory = _OwnedMemory([static, None, torch.empty(0)])
    assert not memory.in_use()
    (alias,) = realize_outputs([static], [])
    assert memory.in_use()
    grad = alias.detach()  # what AccumulateGrad stores as .grad
    del alias
    assert memory.in_use()
    del grad
    assert not memory.in_use()
