"""The Python state around a capture, and the guards checked before every replay.

A capture executes no kernel, but it runs the step's Python: ``zero_grad``
sets ``.grad`` to None and the backward points it at graph memory, an
optimizer may add state, a GradScaler marks its optimizers unscaled.
`PythonState`, taken just before a capture, puts those references back after
a failed one and finds the changes a replay could not reproduce (an LR
scheduler inside the step, optimizer state made during the capture, a
parameter reassigned).

`Guards`, taken right after a capture, is what the graph reads or writes
that Python could change, and its cheap check before every replay: the
modules, optimizers and scalers still alive and the same, the names the
step's code reads unchanged (`erase_fx.step.uses.Binding`), every watched
dict (a module's parameters, buffers and submodules, an optimizer's groups
and state) holding the same values, every tensor at the same address,
``training`` and ``requires_grad`` as they were, and each ``.grad`` the
same or one the step replaces itself (put back).
"""
from __future__ import annotations

import operator
import weakref
from itertools import chain
from typing import Any

import torch

from erase_fx.emit.cudagraphs import data_ptrs_equal
from erase_fx.step.uses import MISSING, PLAIN, StepUses

_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")


def _parameters_of(modules: list[torch.nn.Module],
                   optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for p in module._parameters.values():
            if p is not None:
                seen.setdefault(id(p), p)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _same(a: Any, b: Any) -> bool:
    """Equal hyperparameters: tensors by identity, tuples item by item, the rest by ``==``."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_same, a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd value: treat it as changed
        return False


class PythonState:
    """The Python-visible references a capture may touch, taken just before it.

    A capture executes no kernel, but it runs the step's Python: ``zero_grad``
    sets ``.grad`` to None and the backward points it at graph memory, an
    optimizer may add state, a GradScaler marks its optimizers unscaled. After
    a failed capture `restore` puts the references back, so the uncaptured
    call that follows starts from the state before the capture;
    `changed_by_capture` finds the changes a replay could not reproduce.
    """

    def __init__(self, uses: StepUses):
        self.modules = uses.all_modules()
        self.optimizers = uses.live(uses.optimizers)
        self.scalers = uses.live(uses.scalers)
        self.params = _parameters_of(self.modules, self.optimizers)
        self.grads = [p.grad for p in self.params]
        self.module_dicts = [(d, dict(d)) for m in self.modules
                             for d in (m._parameters, m._buffers, m._modules)]
        self.opt_states = [(o.state, {p: (s, dict(s)) for p, s in o.state.items()})
                           for o in self.optimizers]
        self.groups = [(o.param_groups, list(o.param_groups),
                        [(g, dict(g)) for g in o.param_groups]) for o in self.optimizers]
        self.scaler_states = []
        for scaler in self.scalers:
            states = getattr(scaler, "_per_optimizer_states", None)
            if isinstance(states, dict):
                self.scaler_states.append(
                    (scaler, states, {k: dict(v) for k, v in states.items()}))

    def tensors(self) -> list[torch.Tensor]:
        """Parameters, buffers and optimizer state tensors (to find the step's device)."""
        out = list(self.params)
        out += [b for m in self.modules for b in m._buffers.values() if b is not None]
        for _, saved in self.opt_states:
            out += [v for _, content in saved.values() for v in content.values()
                    if isinstance(v, torch.Tensor)]
        return out

    def restore(self) -> None:
        """Put back every reference taken here (a failed or refused capture)."""
        for p, grad in zip(self.params, self.grads):
            if p.grad is not grad:
                p.grad = grad
        for d, saved in self.module_dicts:
            if not _same_dict(d, saved):
                d.clear()
                d.update(saved)
        for state, saved in self.opt_states:
            for p in [p for p in state if p not in saved]:
                del state[p]
            for p, (entry, content) in saved.items():
                if state.get(p) is not entry:
                    state[p] = entry
                if not _same_dict(entry, content):
                    entry.clear()
                    entry.update(content)
        for groups, saved_list, saved in self.groups:
            if len(groups) != len(saved_list) or not all(map(operator.is_, groups, saved_list)):
                groups[:] = saved_list
            for group, content in saved:
                if not _same_dict(group, content):
                    group.clear()
                    group.update(content)
        for scaler, states, saved in self.scaler_states:
            scaler._per_optimizer_states = states
            states.clear()
            states.update({k: dict(v) for k, v in saved.items()})

    def changed_by_capture(self, uses: StepUses) -> tuple[str, str] | None:
        """(what, fix) for a change the capture made that replays would not repeat, if any."""
        old = {id(o) for o in self.optimizers}
        for o in uses.stepped:
            if id(o) not in old and o.state:
                return (f"{type(o).__name__} first stepped during the capture, creating its "
                        "state there (an optimizer made inside the step?): a replay would reset "
                        "it", "create the optimizer outside the step, and let warm-up create "
                        "its state")
        for o, (groups, saved_list, saved) in zip(self.optimizers, self.groups):
            if len(groups) != len(saved_list):
                return (f"the step adds param groups to {type(o).__name__}",
                        "add them outside the step")
            for i, (group, content) in enumerate(saved):
                for key in sorted(set(group) | set(content), key=str):
                    if key != "params" and not _same(group.get(key, MISSING),
                                                      content.get(key, MISSING)):
                        return (f"the step changes {type(o).__name__}.param_groups[{i}]"
                                f"[{key!r}] in Python (an LR scheduler inside the step?): a "
                                "replay would keep the capture's value",
                                "change hyperparameters outside the step (a float lr then "
                                "recaptures; a tensor lr with capturable=True, changed with "
                                "fill_(), does not)")
        for o, (state, saved) in zip(self.optimizers, self.opt_states):
            for p, entry in state.items():
                old = saved.get(p)
                if old is None or entry is not old[0] or not _same_dict(entry, old[1]):
                    return (f"{type(o).__name__} created or replaced its state during the "
                            "capture (an optimizer made inside the step, or an out-of-place "
                            "state update): a replay would reset it",
                            "create the optimizer outside the step, and let warm-up create its "
                            "state")
        for d, saved in self.module_dicts:
            for key, value in d.items():
                if saved.get(key, MISSING) is not value and value is not None:
                    return (f"the step reassigns {key!r} of a module (an out-of-place update of a "
                            "parameter or buffer): a replay would read its old memory",
                            f"update {key!r} in place (copy_, mul_, add_)")
        return None


def _same_dict(d: dict, saved: dict) -> bool:
    return len(d) == len(saved) and all(d.get(k, MISSING) is v for k, v in saved.items())


class Guards:
    """What a captured graph reads or writes that Python could change, and its cheap check.

    Taken right after the capture. `check` returns None when a replay is
    exact (after putting back gradients the step replaces itself), else why
    not, for the log. The common case costs one identity comparison per
    value of each watched dict (a module's parameters, buffers and
    submodules, an optimizer's param groups and state) and per parameter's
    ``.grad``, and one C++ pass over the data pointers.
    """

    def __init__(self, uses: StepUses, before: PythonState):
        modules = uses.all_modules()
        optimizers = uses.live(uses.optimizers)
        roots = _roots(uses.live(uses.modules))
        self.refs = [weakref.ref(x) for x in roots + optimizers + uses.live(uses.scalers)]
        self.bindings = list(uses.bindings)
        # NB: [dict, its values, its keys, label]; the values are refreshed when a value was
        # replaced by an equal one (a float lr set again), so the fast path stays fast.
        self.dicts: list[list[Any]] = []
        self.lists: list[tuple[list, tuple, str]] = []
        names = _module_names(roots)
        for m in modules:
            name = names.get(id(m), type(m).__name__)
            for kind, d in (("parameters", m._parameters), ("buffers", m._buffers),
                            ("submodules", m._modules)):
                if d:
                    self._watch(d, f"{kind} of {name}")
        for o in optimizers:
            oname = type(o).__name__
            self.lists.append((o.param_groups, tuple(o.param_groups), f"{oname}.param_groups"))
            for i, group in enumerate(o.param_groups):
                self.lists.append((group["params"], tuple(group["params"]),
                                   f"{oname}.param_groups[{i}]['params']"))
                self._watch(group, f"{oname}.param_groups[{i}]")
            self._watch(o.state, f"{oname}.state")
            for j, p in enumerate(_parameters_of([], [o])):
                state = o.state.get(p)
                if state:
                    self._watch(state, f"{oname} state of parameter {j}")
        seen: dict[int, tuple[torch.Tensor, str]] = {}
        for d, values, keys, label in self.dicts:
            for key, value in zip(keys, values):
                if isinstance(value, torch.Tensor):
                    seen.setdefault(id(value), (value, f"{label}[{_key_text(key)}]"))
        self.tensors = [t for t, _ in seen.values()]
        self.tensor_labels = [label for _, label in seen.values()]
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.ptr_indices = list(range(len(self.tensors)))
        self._flatten_dicts()
        self.modules = modules
        self.training = tuple(map(_TRAINING, modules))
        self.params = _parameters_of(modules, optimizers)
        self.requires_grad = tuple(map(_REQUIRES_GRAD, self.params))
        self.grads = tuple(map(_GRAD, self.params))
        grad_before = {id(p): g for p, g in zip(before.params, before.grads)}
        # NB: a grad the step replaced during the capture (zero_grad(set_to_none=True), then
        # backward) is rewritten by every replay without being read: it can be put back.
        self.replaced = [id(p) in grad_before and grad_before[id(p)] is not g
                         for p, g in zip(self.params, self.grads)]

    def _watch(self, d: dict, label: str) -> None:
        self.dicts.append([d, tuple(d.values()), tuple(d.keys()), label])

    def _flatten_dicts(self) -> None:
        # NB: one pass in C over every watched value (itertools, map) instead of a Python loop
        self.dict_objects = [w[0] for w in self.dicts]
        self.dict_lengths = tuple(map(len, self.dict_objects))
        self.dict_values = tuple(chain.from_iterable(w[1] for w in self.dicts))

    def check(self) -> str | None:
        """None when the graph may replay (gradients the step replaces are put back), else why."""
        for ref in self.refs:
            if ref() is None:
                return "a module, optimizer or scaler the step used was deleted"
        for binding in self.bindings:
            if not binding.holds():
                return binding.describe()
        if tuple(map(len, self.dict_objects)) != self.dict_lengths or not all(map(
                operator.is_, chain.from_iterable(map(dict.values, self.dict_objects)),
                self.dict_values)):
            for watched in self.dicts:
                why = _compare(watched)
                if why is not None:
                    return why
            self._flatten_dicts()
        for lst, items, label in self.lists:
            if len(lst) != len(items) or not all(map(operator.is_, lst, items)):
                return f"{label} changed"
        if not data_ptrs_equal(self.tensors, self.ptrs, self.ptr_indices):
            for t, ptr, label in zip(self.tensors, self.ptrs, self.tensor_labels):
                if t.data_ptr() != ptr:
                    return (f"{label} moved to other memory (model.to, load_state_dict with "
                            "assign=True, p.data = ...)")
        if tuple(map(_TRAINING, self.modules)) != self.training:
            return "a module switched between train() and eval()"
        if tuple(map(_REQUIRES_GRAD, self.params)) != self.requires_grad:
            return "a parameter's requires_grad changed"
        grads = tuple(map(_GRAD, self.params))
        if not all(map(operator.is_, grads, self.grads)):
            for now, want, replaced in zip(grads, self.grads, self.replaced):
                if now is not want and not replaced:
                    return ("the .grad of a parameter the step accumulates into (no zero_grad "
                            "inside the step) was changed outside the step")
            for p, now, want in zip(self.params, grads, self.grads):
                if now is not want:
                    p.grad = want
        return None


def _compare(watched: list[Any]) -> str | None:
    """Why a watched dict's change breaks the graph, or None (and refresh) if it does not."""
    d, values, keys, label = watched
    if len(d) == len(values) and all(map(operator.is_, d.values(), values)):
        return None
    if len(d) != len(keys) or any(k not in d for k in keys):
        return f"{label} gained or lost an entry"
    for key, old in zip(keys, values):
        new = d[key]
        if new is old:
            continue
        if not isinstance(old, PLAIN + (tuple,)) or not isinstance(new, PLAIN + (tuple,)):
            return f"{label}[{_key_text(key)}] was replaced"
        if not _same(new, old):
            hint = ""
            if "param_groups" in label:
                hint = ("; Python numbers are frozen into the graph: a tensor lr "
                        "(lr=torch.tensor(...) on the device with capturable=True, changed "
                        "with fill_()) changes without a recapture")
            return f"{label}[{_key_text(key)}] changed from {old!r} to {new!r}{hint}"
    watched[1], watched[2] = tuple(d.values()), tuple(d.keys())
    return None


def _key_text(key: Any) -> str:
    return "a parameter" if isinstance(key, torch.Tensor) else repr(key)


def _roots(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules that are no other one's submodule."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def _module_names(modules: list[torch.nn.Module]) -> dict[int, str]:
    """Readable names for guard messages: each module's path under the first module holding it."""
    names: dict[int, str] = {}
    for top in modules:
        if id(top) in names:
            continue
        prefix = type(top).__name__
        for name, module in top.named_modules():
            names.setdefault(id(module), f"{prefix}.{name}" if name else prefix)
    return names
