"""The ``erase-fx`` command (also ``python -m erase_fx``).

Subcommands:

- ``erase-fx demo [flags]``: the showcase, `erase_fx.demo` (its flags are
  forwarded; ``erase-fx demo --help`` lists them).
- ``erase-fx explain module:factory [--json] [--options JSON] [--dump DIR]``:
  what the erase backend would do with a model, without training it.
  ``factory()`` must return ``(model, example_inputs)``, ``example_inputs`` a
  tuple, or ``(model, args, kwargs)``. Prints one table per compiled graph:
  each early block (its stream, parameter count and first names, ready point,
  node count, estimated backward FLOPs and their share of the backward's),
  the components left in the backward with the reason, the share of
  backward FLOPs that runs early, and, for a graph Dynamo ended at a graph
  break, where in the user's code and why; or with ``--json`` the list of
  ``GraphReport.to_dict()``. ``--options`` takes `EraseConfig` fields as a
  JSON object, e.g. ``'{"streams": 2}'``. ``--dump DIR`` writes the dump
  (the ``dump_dir`` option) into ``DIR/graph_<n>/``. Example::

      erase-fx explain erase_fx.demo:ff_factory --dump /tmp/erase_dump

- ``erase-fx profile module:factory [--steps N] [--warmup W] [--out PATH]
  [--options JSON] [--device DEV]``: trains factory()'s model (its forward
  returns a scalar loss) with ``backend="erase"``: ``W`` warm-up steps, then
  ``N`` steps (forward and ``loss.backward()``) under ``torch.profiler``; prints
  the settings in force (every `EraseConfig` field, ``--options`` applied),
  writes the Chrome trace to ``--out`` (default
  ``erase_fx_traces/trace.json``, the folder made if need be) and prints the
  measured overlap: side-stream kernel time, the part of it that overlapped
  main-stream kernels, and the fraction (`erase_fx.profile.kernel_overlap`).
  The backend runs with its
  defaults (CUDA graphs on a GPU), whose replay hides the per-segment labels
  (``erase_fx/<segment>``); ``--options '{"cudagraphs": false}'`` shows them.
  ``--device`` defaults to CUDA when available; on
  CPU it says that overlap needs a GPU and still writes the trace. Example::

      erase-fx profile erase_fx.demo:ff_factory --steps 20

Exit codes: 0 on success; 2 on a usage error (a spec without a colon, a
module that cannot be imported, a factory that is missing, raises or returns
the wrong shape, bad ``--options``), with a one-line message on stderr. An
error inside erase_fx or the model's forward propagates with its traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import erase_fx
from erase_fx.errors import EraseError, EraseOptionError
from erase_fx.instruments import pydot_available
from erase_fx.profile import DEFAULT_TRACE_PATH
from erase_fx.report import GraphReport
from erase_fx.report_text import first_names, format_reports

PROG = "erase-fx"
USAGE_ERROR = 2
#: How many segment labels ``profile`` prints before "...".
SEGMENT_LABELS_SHOWN = 4


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit code 2."""


# -- explain -------------------------------------------------------------------


def load_factory_result(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Import ``module:factory``, call the factory and return ``(model, args, kwargs)``."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"expected module:factory, e.g. erase_fx.demo:ff_factory; got {spec!r}")
    try:
        with _cwd_importable():
            module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's spec
        raise UsageError(f"cannot import module {module_name!r}: {_one_line(error)}") from error
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise UsageError(f"module {module_name!r} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(f"{spec} is not callable")
    try:
        result = factory()
    except Exception as error:  # noqa: BLE001 - reported as the factory's failure
        raise UsageError(f"{spec}() raised {_one_line(error)}") from error
    return _model_and_inputs(spec, result)


def _model_and_inputs(spec: str, result: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    expected = "(model, example_inputs) or (model, args, kwargs)"
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise UsageError(f"{spec}() returned {_kind(result)}; expected {expected}")
    model, args, kwargs = result if len(result) == 3 else (*result, {})
    if not callable(model):
        raise UsageError(f"{spec}() returned a model that is not callable: {_kind(model)}")
    if not isinstance(args, (tuple, list)):
        raise UsageError(
            f"{spec}() returned example inputs of type {_kind(args)}; expected a tuple "
            f"(write (x,) for one input)"
        )
    if not isinstance(kwargs, dict):
        raise UsageError(f"{spec}() returned kwargs of type {_kind(kwargs)}; expected a dict")
    return model, tuple(args), kwargs


def parse_options(text: str | None) -> dict[str, Any]:
    """``--options``: a JSON object of `EraseConfig` fields, checked here."""
    if text is None:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"--options is not valid JSON: {error}") from error
    if not isinstance(options, dict):
        raise UsageError(f"--options must be a JSON object, got {_kind(options)}")
    try:
        erase_fx.EraseConfig.from_options({"inner": "aot_eager", **options})
    except EraseOptionError as error:
        raise UsageError(f"--options: {error}") from error
    return options


def dump_folder(path: str, options: dict[str, Any]) -> str:
    """``--dump DIR``: a folder that exists (made here) and agrees with ``--options``."""
    other = options.get("dump_dir")
    if other is not None and os.path.abspath(other) != os.path.abspath(path):
        raise UsageError(f"--dump {path!r} and --options dump_dir {other!r} disagree; give one")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--dump {path!r} exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--dump: cannot make folder {path!r}: {_one_line(error)}") from error
    return path


def run_explain(args: argparse.Namespace) -> int:
    options = parse_options(args.options)
    if args.dump is not None:
        options["dump_dir"] = dump_folder(args.dump, options)
    model, model_args, model_kwargs = load_factory_result(args.spec)
    reports = erase_fx.explain(model, *model_args, erase_options=options, **model_kwargs)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2, sort_keys=True))
    elif not reports:
        print("no graph was compiled: the model's forward ran no torch code Dynamo captures")
    else:
        print(format_reports(reports))
    if options.get("dump_dir") is not None and reports:
        # NB: on stderr with --json, so that stdout stays one JSON document.
        print(dump_message(options["dump_dir"], reports), file=sys.stderr if args.json else None)
    return 0


# -- profile -------------------------------------------------------------------


def run_profile(args: argparse.Namespace) -> int:
    from erase_fx.profile import NotALossError, profile_training

    options = parse_options(args.options)
    if args.steps < 1 or args.warmup < 0:
        raise UsageError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, "
                         f"{args.warmup}")
    device = _device(args.device)
    out_folder = os.path.dirname(os.path.abspath(args.out))
    # NB: profile_training makes erase_fx's own folder when it writes the trace; a
    # folder the user named must exist (a typo), checked before the compilation.
    if args.out != DEFAULT_TRACE_PATH and not os.path.isdir(out_folder):
        raise UsageError(f"--out {args.out!r}: folder {out_folder!r} does not exist")
    model, model_args, model_kwargs = load_factory_result(args.spec)
    try:
        run = profile_training(model, model_args, model_kwargs, steps=args.steps,
                               warmup=args.warmup, options=options, trace_path=args.out,
                               device=device)
    except NotALossError as error:
        raise UsageError(f"{args.spec}: {error}") from error
    settings = erase_fx.EraseConfig.from_options(run.options)
    print(f"profiled {run.steps} training step(s) of {args.spec} on {run.device} after "
          f"{args.warmup} warm-up step(s)")
    print(f"erase settings: {settings_text(settings, run.options)}")
    if run.device.startswith("cuda") and settings.cudagraphs is not False:
        print("  (CUDA graph replay hides the per-segment labels; "
              "--options '{\"cudagraphs\": false}' shows them)")
    print(f"trace: {run.trace_path} (open in chrome://tracing or https://ui.perfetto.dev)")
    print(f"segment labels: {first_names(run.segment_labels, SEGMENT_LABELS_SHOWN) or 'none'}"
          f" ({len(run.segment_labels)})")
    if run.overlap is None:
        print("overlap: needs a GPU; on CPU the streams are virtual and run in order, so there "
              "are no device kernels to overlap (the trace has the CPU ops and segment labels)")
    else:
        print(f"overlap: {run.overlap.summary()}")
    return 0


def settings_text(settings: erase_fx.EraseConfig, options: Mapping[str, Any]) -> str:
    """Every `EraseConfig` field as JSON, in field order, then the ones ``--options`` gave."""
    fields = json.dumps(dataclasses.asdict(settings), default=str)
    return f"{fields} (from --options: {', '.join(options) or 'none'})"


def _device(name: str) -> str | None:
    import torch

    if name == "auto":
        return None
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise UsageError(f"--device {name!r}: {_one_line(error)}") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name!r}: CUDA is not available here")
    return name


def dump_message(dump_dir: str, reports: Sequence[GraphReport]) -> str:
    folders = ", ".join(
        os.path.join(dump_dir, f"graph_{r.graph_id}") + os.sep for r in reports
    )
    picture = ", schedule.dot" if pydot_available() else ""
    return f"\ndump written to {folders} (per-pass files, report.json, timings.json{picture})"


# -- command line --------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="erase_fx: run the backward of detached blocks early, on side CUDA streams.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {erase_fx.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo", add_help=False,
        help="train local-loss models eagerly and with backend='erase' side by side "
        "(flags: erase-fx demo --help)",
    )
    explain = commands.add_parser(
        "explain",
        help="print the early blocks erase_fx finds in a model",
        description="Compile one forward of factory()'s model with backend='erase' (inner "
        "aot_eager, nothing trained) and print what erase_fx decided per graph.",
    )
    explain.add_argument(
        "spec", metavar="module:factory",
        help="a function returning (model, example_inputs) or (model, args, kwargs), "
        "e.g. erase_fx.demo:ff_factory",
    )
    explain.add_argument("--json", action="store_true",
                         help="print the reports as a JSON list of GraphReport.to_dict()")
    explain.add_argument("--options", metavar="JSON",
                         help='erase backend options as a JSON object, e.g. \'{"streams": 2}\'')
    explain.add_argument("--dump", metavar="DIR",
                         help="also write each graph's dump (numbered per-pass files, report.json, "
                         "timings.json, schedule.dot) into DIR/graph_<n>/, as the dump_dir "
                         "option does")
    add_profile_parser(commands)
    return parser


def add_profile_parser(commands: Any) -> None:
    profile = commands.add_parser(
        "profile",
        help="train a model with backend='erase' under torch.profiler; print the stream overlap",
        description="Compile factory()'s model with backend='erase', run warm-up steps, then "
        "--steps training steps (forward + loss.backward(); the model returns a scalar loss) "
        "under torch.profiler (CPU, and CUDA on a GPU). Writes a Chrome trace and prints the "
        "side-stream kernel time, how much of it overlapped main-stream kernels, and the "
        "fraction. The backend runs with its defaults (CUDA graphs on a GPU), whose replay "
        "hides the per-segment labels (erase_fx/<segment>) in the trace; --options "
        "'{\"cudagraphs\": false}' shows them. On CPU there is no overlap to measure (the "
        "streams are virtual); the trace is still written.",
    )
    profile.add_argument(
        "spec", metavar="module:factory",
        help="a function returning (model, example_inputs) or (model, args, kwargs); the "
        "model's forward returns a scalar loss, e.g. erase_fx.demo:ff_factory",
    )
    profile.add_argument("--steps", type=int, default=10, metavar="N",
                         help="training steps to profile (default 10)")
    profile.add_argument("--warmup", type=int, default=3, metavar="W",
                         help="steps to run before profiling; compilation happens here "
                         "(default 3)")
    profile.add_argument("--out", default=DEFAULT_TRACE_PATH, metavar="PATH",
                         help=f"where to write the Chrome trace (default {DEFAULT_TRACE_PATH}, "
                         f"its folder made if need be; git ignores it in a checkout)")
    profile.add_argument("--options", metavar="JSON",
                         help='erase backend options as a JSON object, e.g. \'{"streams": 2}\' '
                         '(default: the backend\'s defaults)')
    profile.add_argument("--device", default="auto",
                         help="where to run: auto (CUDA when available, else CPU), cpu, cuda, "
                         "cuda:1, ... (default auto)")


def main(argv: Sequence[str] | None = None) -> int:
    """The ``erase-fx`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except BrokenPipeError:
        # NB: the reader (``| head``) left; as Python's docs advise, silence
        # the flush at exit instead of printing a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _dispatch(argv: list[str]) -> int:
    # NB: the demo parses its own flags (``--help`` included): forward them untouched.
    if argv[:1] == ["demo"]:
        from erase_fx import demo

        return demo.main(argv[1:], prog=f"{PROG} demo")
    args = build_parser().parse_args(argv)
    run = {"explain": run_explain, "profile": run_profile}[args.command]
    try:
        return run(args)
    except UsageError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except EraseError as error:
        print(f"{PROG} {args.command}: {error}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """Let the spec name a module of the current folder, as ``python -m`` does."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _kind(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of length {len(value)}"
    return f"a {type(value).__name__}"
