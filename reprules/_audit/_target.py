"""The user-target protocol of ``reprules audit module:callable`` (or ``path/to/file.py:callable``).

The audit imports ``module`` (or runs the file as a module of its own, its
folder first on ``sys.path``, so a script whose name starts with a digit is a
target too) and calls ``callable`` (:data:`DEFAULT_CALLABLE` when the
``:callable`` part is left out). Its result is either a
tuple ``(step, args)`` / ``(step, args, kwargs)`` or a mapping with keys
``"step"``, ``"args"`` and optionally ``"kwargs"``, ``"name"`` and
``"reference"`` (a zero-argument callable returning what ``step`` should
return, for the error row). ``step`` is audited as ``jax.jit(step)(*args)``.

If the callable takes a ``check`` argument, it is called twice, like the
bundled workloads: ``check=False`` builds the step with ``shard_map`` checking
off (what people run when a kernel has no rule), ``check=True`` with checking
on and the rules registered; the audit shows them side by side. A callable
without ``check`` is called once and its step audited as given.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from reprules._errors import ReprulesError, UnsupportedJaxError

PROTOCOL = (
    "The callable must take no arguments (or only `check`) and return (step, args), "
    "(step, args, kwargs), or a mapping with 'step' and 'args' (optional 'kwargs', 'name', "
    "'reference')."
)


DEFAULT_CALLABLE = "audit_step"
CONTRACT = ("TARGET is `module[:callable]` or `path/to/file.py[:callable]` (callable: `audit_step` when left "
            "out), a function taking no arguments (or only `check`) that returns (step, args)")
"""The target contract in one line (``--help`` and the README say it)."""


class TargetError(ReprulesError):
    """A ``module:callable`` target could not be loaded (a usage error: exit code 2)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Factory:
    """The resolved ``module:callable``, before it is called."""

    spec: str
    name: str
    make: Callable[..., Any]
    takes_check: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One step the factory returned, ready to audit."""

    name: str
    step: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    reference: Callable[[], Any] | None


def split(spec: str) -> tuple[str, str, bool]:
    """``(module or file path, callable, is_file)`` of a target; the callable defaults to
    :data:`DEFAULT_CALLABLE`. A ``:`` followed by something that is not a dotted name (a
    Windows drive, ``C:\\x\\f.py``) belongs to the path."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and all(part.isidentifier() for part in tail.split(".")):
        source, attr = head, tail
    else:
        source, attr = spec, DEFAULT_CALLABLE
    is_file = source.endswith(".py") or "/" in source or os.sep in source
    return source, attr, is_file


def _load_file(path: str, spec: str) -> Any:
    """Runs the file ``path`` as a module of its own (its folder first on ``sys.path``)."""
    if not os.path.isfile(path):
        raise TargetError(
            f"Target {spec!r}: no file {path!r} (from {os.getcwd()}).\n"
            "Why: a target with a path names a Python file the audit runs as a module.\n"
            "Fix: check the path, e.g. `reprules audit examples/01_issue21855.py`, or name an "
            "importable module instead (`reprules audit my_project.train:audit_step`).")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = stem if stem.isidentifier() else "reprules_audit_" + re.sub(r"\W", "_", stem)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) != os.path.abspath(path):
        name = f"reprules_audit_{name}"
    found = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    if found is None or found.loader is None:
        raise TargetError(f"Target {spec!r}: {path!r} cannot be loaded as Python.\n"
                          "Why: a target with a path must name a .py file.\nFix: name the .py file.")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its own imports of sibling files work, as when it is run
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    try:
        found.loader.exec_module(module)
    except UnsupportedJaxError:
        del sys.modules[name]
        raise
    except (Exception, SystemExit) as err:  # SystemExit: a script that says what it needs and exits
        del sys.modules[name]
        raise TargetError(
            f"Running file {path!r} of target {spec!r} raised {type(err).__name__}: {err}\n"
            "Why: the file's own code failed while the audit loaded it.\n"
            f"Fix: run `python {path}` to see the full traceback.") from err
    return module


def resolve(spec: str) -> Factory:
    """Imports ``module`` (or runs the file) and finds ``callable`` (does not call it)."""
    source, attr, is_file = split(spec)
    if not source:
        raise TargetError(
            f"Target {spec!r} names no module or file.\nWhy: {CONTRACT}.\n"
            "Fix: e.g. `reprules audit my_project.train:audit_step` or `reprules audit path/to/train.py`.")
    module_name = source
    if is_file:
        module = _load_file(source, spec)
    else:
        module = _import(source, spec)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            default = "" if spec.endswith(f":{attr}") else " (the default, as the target names none)"
            raise TargetError(
                f"{'File' if is_file else 'Module'} {module_name!r} has no attribute {attr!r}{default} "
                f"(target {spec!r}).\n"
                f"Why: the part after ':' names the callable that builds the step; {DEFAULT_CALLABLE} "
                "when there is none.\n"
                f"Fix: name a callable defined in {module_name} ({module_name}:my_step), or define "
                f"`def {DEFAULT_CALLABLE}(check=True): ...` there.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TargetError(f"{spec!r} is {type(obj).__name__}, not callable.\nWhy: {PROTOCOL}\n"
                          "Fix: name a function, e.g. `def audit_step(check=True): ...`.")
    takes_check = False
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # no signature (a builtin): call it without arguments
        params = []
    for p in params:
        if p.name == "check" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            takes_check = True
        elif p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TargetError(
                f"{spec} takes the required argument {p.name!r}.\nWhy: {PROTOCOL}\n"
                f"Fix: give {p.name!r} a default, or build it inside the callable.")
    return Factory(spec=spec, name=attr, make=obj, takes_check=takes_check)


def _import(module_name: str, spec: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise TargetError(
            f"Cannot import module {module_name!r} of target {spec!r}: {err}.\n"
            "Why: the audit imports it from the current directory or the installed packages.\n"
            "Fix: run from the directory that contains it, install your package, or name its file "
            "(`reprules audit path/to/file.py:callable`).") from err
    except UnsupportedJaxError:
        raise
    except Exception as err:
        raise TargetError(
            f"Importing module {module_name!r} of target {spec!r} raised {type(err).__name__}: {err}\n"
            "Why: the module's own code failed while it was imported.\n"
            f"Fix: run `python -c 'import {module_name}'` to see the full traceback.") from err


def build(factory: Factory, check: bool | None) -> Target:
    """Calls the factory (with ``check=`` unless ``check`` is None) and checks its result."""
    result = factory.make() if check is None else factory.make(check=check)
    step = args = None
    kwargs: Mapping[str, Any] = {}
    name, reference = factory.name, None
    if isinstance(result, Mapping):
        step, args = result.get("step"), result.get("args", ())
        kwargs = result.get("kwargs", {}) or {}
        name = result.get("name", name)
        reference = result.get("reference")
    elif isinstance(result, tuple) and len(result) in (2, 3):
        step, args = result[0], result[1]
        kwargs = result[2] if len(result) == 3 else {}
    if not callable(step) or not isinstance(args, (tuple, list)):
        raise TargetError(f"{factory.spec}() returned {type(result).__name__} {str(result)[:80]!r}.\n"
                          f"Why: {PROTOCOL}\nFix: return e.g. `(jax.grad(loss), (params, batch))`.")
    return Target(name=str(name), step=step, args=tuple(args), kwargs=dict(kwargs), reference=reference)
