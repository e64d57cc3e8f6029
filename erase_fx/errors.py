"""Errors raised by erase_fx.

Each error names where it happened (the pass or runtime step), the graph node
when there is one, and the fix. Messages are built when printed, not when
raised, so a caught-and-handled error costs no string formatting.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class EraseError(RuntimeError):
    """Base class of every error erase_fx raises on purpose.

    Attributes:
        where: the pass or runtime step that failed, e.g. ``"find_stop_gradient_blocks"``.
        what: what went wrong.
        node: the name of the graph node involved, if any.
        fix: what the user can do about it.
    """

    def __init__(self, where: str, what: str, *, node: str | None = None, fix: str | None = None):
        super().__init__(where, what, node, fix)
        self.where = where
        self.what = what
        self.node = node
        self.fix = fix

    def __str__(self) -> str:
        text = f"[erase_fx: {self.where}] {self.what}"
        if self.node is not None:
            text += f" (node {self.node!r})"
        if self.fix is not None:
            text += f". Fix: {self.fix}"
        return text

    # NB: RuntimeError pickles through args; keep the keyword-only fields too.
    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.where, self.what, self.node, self.fix))


def _rebuild(cls: type, where: str, what: str, node: str | None, fix: str | None) -> EraseError:
    err = cls.__new__(cls)
    EraseError.__init__(err, where, what, node=node, fix=fix)
    return err


class EraseOptionError(EraseError, ValueError):
    """An option given to ``torch.compile(..., options=...)`` is unknown or has a bad value."""

    def __init__(self, name: str, value: Any, expected: str):
        super().__init__(
            "options",
            f"option {name}={value!r} is not allowed: expected {expected}",
            fix=f"pass {name} as {expected}",
        )

    @classmethod
    def unknown(cls, names: Iterable[str], allowed: Mapping[str, Any],
                what: str = "option") -> EraseOptionError:
        """``names`` are not among ``allowed`` (each name and its default), which the message
        lists; ``what``: what they are called (an option, a tuning setting)."""
        err = cls.__new__(cls)
        listing = ", ".join(f"{k} (default {v!r})" for k, v in allowed.items())
        EraseError.__init__(
            err,
            "options",
            f"unknown {what}(s) {', '.join(repr(n) for n in names)}",
            fix=f"use only the allowed {what}s: {listing}",
        )
        return err

    @classmethod
    def moved_to_tuning(cls, name: str, value: Any) -> EraseOptionError:
        """``name``, given at the top level of the options, is a tuning setting now."""
        err = cls.__new__(cls)
        EraseError.__init__(
            err,
            "options",
            f"{name} is a tuning setting now: options={{'tuning': {{{name!r}: {value!r}}}}}",
            fix="pass it under 'tuning' (erase_fx.config.Tuning lists the tuning settings; "
                "docs/performance.md, 'Tuning settings', says what each trades)",
        )
        return err


class UnsupportedBlockError(EraseError):
    """A block's backward cannot be proven safe to run early (``on_error="raise"``)."""


class GraphInvariantError(EraseError):
    """A pass produced a graph that breaks one of its stated invariants: a bug in erase_fx."""


class EraseRuntimeError(EraseError):
    """A use of a compiled graph that erase_fx cannot run exactly (e.g. double backward)."""


class EraseDistributedError(EraseError):
    """A data-parallel setup erase_fx cannot run as asked (``on_error="raise"``).

    For example a DDP module that already has a communication hook (erase_fx's
    early all-reduce needs its own), or an FSDP2 model whose early blocks
    cannot be made exact. ``fix`` says what to change; under
    ``on_error="fallback"`` the same cases log the reason and DDP (or FSDP2)
    reduces every gradient as it would without erase_fx.
    """


class StepCaptureError(EraseError):
    """`erase_fx.compile_step` cannot capture the step in a CUDA graph (``on_unsupported="raise"``).

    ``what`` names the operation that failed and where in the step; ``fix``
    says what to change (e.g. ``capturable=True`` for Adam, or moving an
    ``.item()`` out of the step).
    """
