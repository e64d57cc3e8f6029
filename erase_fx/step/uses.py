"""What a step uses: the modules, optimizers and scalers it was seen to use, and its names.

`compile_step` guards what a captured graph reads or writes that Python could
change (`erase_fx.step.guards`); first it must know what that is. Two ways:

- hooks while the step runs uncaptured or is captured (`StepUses.recording`):
  torch's optimizer step pre-hook for every optimizer (the optimizers that
  step), and, from the first warm-up to the end of the first capture attempt,
  a forward pre-hook for every module (the modules that run; see
  `StepUses.install_module_hook` for why only then);
- the step's code (`bindings_of`): its globals, closure cells and ``self``
  attributes that hold modules, optimizers, scalers, tensors or plain
  values, and those of the functions of its own module it calls. Each such
  name becomes a guard (`Binding`): still the same object, or an equal plain
  value.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

#: A missing value (a name no longer bound, a key not in a dict).
MISSING = object()
#: Values compared by equality: Python numbers, strings, torch's dtypes and devices, enums.
PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
         torch.layout, torch.memory_format, enum.Enum)


class StepUses:
    """The modules, optimizers and scalers a step was seen to use (held weakly), and its names.

    Attributes:
        active: the hooks record (only while the step runs, `recording`).
        modules, optimizers, scalers: by id, a weak reference to each.
        bindings: the names the step's code reads (`scan`).
        stepped: the optimizers that stepped during the current call, held strongly (an
            optimizer made inside the step dies with it).
    """

    def __init__(self) -> None:
        self.active = False
        self.modules: dict[int, weakref.ref] = {}
        self.optimizers: dict[int, weakref.ref] = {}
        self.scalers: dict[int, weakref.ref] = {}
        self.bindings: list[Binding] = []
        self.stepped: list[torch.optim.Optimizer] = []
        self._module_hook: Any = None
        self._module_hook_done = False

    def on_module(self, module: torch.nn.Module, args: Any) -> None:
        """Global forward pre-hook: remember a module that ran in the step."""
        # NB: under Dynamo the hook is traced: do nothing there, or Dynamo guards on what
        # it touched; the OptimizedModule of torch.compile(module) runs it in Python.
        if torch.compiler.is_compiling() or not self.active:
            return None
        _remember(self.modules, module)
        return None

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook: remember an optimizer that stepped in the step."""
        if self.active:
            _remember(self.optimizers, optimizer)
            if all(o is not optimizer for o in self.stepped):
                self.stepped.append(optimizer)
        return None

    def scan(self, fn: Callable[..., Any]) -> None:
        """Find what the step's code names directly; those names become guards."""
        self.bindings = bindings_of(fn)
        for binding in self.bindings:
            value = binding.value
            if isinstance(value, torch.nn.Module):
                _remember(self.modules, value)
            elif isinstance(value, torch.optim.Optimizer):
                _remember(self.optimizers, value)
            elif isinstance(value, torch.amp.GradScaler):
                _remember(self.scalers, value)

    def live(self, kind: dict[int, weakref.ref]) -> list[Any]:
        return [obj for obj in (ref() for ref in kind.values()) if obj is not None]

    def all_modules(self) -> list[torch.nn.Module]:
        """Every module known, with all its submodules, once each, in a stable order."""
        seen: dict[int, torch.nn.Module] = {}
        for top in self.live(self.modules):
            for module in top.modules():
                seen.setdefault(id(module), module)
        return list(seen.values())

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the optimizers that step (and, while installed, the modules that run)."""
        handle = register_optimizer_step_pre_hook(self.on_optimizer_step)
        self.active = True
        self.stepped = []
        try:
            with warnings.catch_warnings():
                # NB: torch warns that a global hook also fires for the OptimizedModule
                # of torch.compile(module): that is what finds it.
                warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` "
                                        r"when there are global hooks")
                yield
        finally:
            self.active = False
            handle.remove()

    # -- the module hook

    @property
    def module_hook_installed(self) -> bool:
        return self._module_hook is not None

    def install_module_hook(self, owner: Any) -> None:
        """From the first warm-up on: torch's forward pre-hook for every module, removed when
        discovery ends (`end_module_discovery`) or ``owner`` (the compiled step) dies.

        NB: Dynamo can guard on torch's global module hooks (their number and keys:
        registering a new hook around each call recompiled a compiled ``nn.Sequential`` at
        every call, on torch 2.13), so the hook is installed once, up to the end of the first
        capture attempt (of the tuning of the ``"auto"`` options, when the first capture
        starts one), and then removed for good; later warm-ups find modules through the
        step's code and the optimizers' parameters.
        """
        if self._module_hook is None and not self._module_hook_done:
            self._module_hook = register_module_forward_pre_hook(self.on_module)
            weakref.finalize(owner, self._module_hook.remove)

    def end_module_discovery(self) -> None:
        """The module hook goes for good after the first capture attempt."""
        if self._module_hook is not None:
            self._module_hook.remove()
            self._module_hook = None
        self._module_hook_done = True


def _remember(kind: dict[int, weakref.ref], obj: Any) -> None:
    ref = kind.get(id(obj))
    if ref is None or ref() is not obj:
        kind[id(obj)] = weakref.ref(obj)


# -- the names the step's code reads ------------------------------------------------


@dataclasses.dataclass(eq=False)
class Binding:
    """A name the step's code reads: a global, a closure cell or an attribute of ``self``."""

    container: Any  # a dict (module globals, an object's __dict__) or a closure cell
    key: str
    value: Any
    plain: bool  # a plain value, compared by equality (else the same object)

    def current(self) -> Any:
        if isinstance(self.container, dict):
            return self.container.get(self.key, MISSING)
        try:
            return self.container.cell_contents
        except ValueError:
            return MISSING

    def holds(self) -> bool:
        now = self.current()
        return now is self.value or (self.plain and type(now) is type(self.value)
                                     and now == self.value)

    def restore(self) -> None:
        """Put the capture-time value back (the step assigned it during a refused capture)."""
        if isinstance(self.container, dict):
            self.container[self.key] = self.value
        else:
            self.container.cell_contents = self.value

    def describe(self) -> str:
        now = self.current()
        if self.plain:
            return (f"{self.key!r}, which the step reads, changed from {self.value!r} to "
                    f"{now!r} (Python values are frozen into the graph)")
        return f"{self.key!r}, which the step reads, now names another {type(now).__name__}"


def _guarded(value: Any) -> bool | None:
    """True: compare by equality; False: by identity; None: not a guard."""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler,
                          torch.Tensor)):
        return False
    if isinstance(value, PLAIN) and not isinstance(value, type):
        return True
    return None


def _names_in(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_in(const)
    return names


def bindings_of(fn: Callable[..., Any]) -> list[Binding]:
    """The guarded names the step's code reads: its globals, closure cells, ``self`` attributes.

    Functions of the step's own module that it calls are followed (two levels), so a
    helper's globals count too; torch's and other libraries' functions are not.
    """
    finder = _BindingFinder(getattr(_unwrap(fn), "__module__", None))
    finder.visit(fn, 0)
    return finder.bindings


class _BindingFinder:
    """`bindings_of`'s walk over the step's functions, methods and their closures."""

    def __init__(self, home: str | None):
        self.home = home
        self.bindings: list[Binding] = []
        self.seen: set[int] = set()

    def add(self, container: Any, key: str, value: Any) -> None:
        plain = _guarded(value)
        if plain is not None:
            self.bindings.append(Binding(container, key, value, plain))

    def follows(self, value: Any) -> bool:
        """A function of the step's own module: its names count too."""
        return isinstance(value, types.FunctionType) and value.__module__ == self.home

    def visit(self, f: Any, depth: int) -> None:
        if id(f) in self.seen or depth > 2:
            return
        self.seen.add(id(f))
        if isinstance(f, functools.partial):
            self.visit(f.func, depth)
        elif isinstance(f, types.MethodType):
            self._visit_method(f, depth)
        else:
            self._visit_function(f, depth)

    def _visit_method(self, f: types.MethodType, depth: int) -> None:
        code = getattr(f.__func__, "__code__", None)
        names = _names_in(code) if code is not None else set()
        owner = f.__self__
        spaces = [getattr(owner, "__dict__", None)]
        if isinstance(owner, torch.nn.Module):  # self.model of a step that is a module's
            spaces += [owner._modules, owner._parameters, owner._buffers]
        for attrs in spaces:
            if isinstance(attrs, dict):
                for name in sorted(names & attrs.keys()):
                    self.add(attrs, name, attrs[name])
        for name in sorted(names):  # the owner's own methods it calls: self.helper()
            method = getattr(type(owner), name, None)
            if isinstance(method, types.FunctionType) and method.__module__ == self.home:
                self.visit(getattr(owner, name), depth + 1)
        self.visit(f.__func__, depth)

    def _visit_function(self, f: Any, depth: int) -> None:
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            self.visit(wrapped, depth)
        code = getattr(f, "__code__", None)
        if code is None:
            return
        for name, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            self.add(cell, name, value)
            if self.follows(value):
                self.visit(value, depth + 1)
        module_globals = getattr(f, "__globals__", {})
        for name in sorted(_names_in(code)):
            if name not in module_globals:
                continue
            value = module_globals[name]
            self.add(module_globals, name, value)
            if self.follows(value):
                self.visit(value, depth + 1)


def _unwrap(fn: Any) -> Any:
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        else:
            return fn
