"""The user-target protocol of ``reprules audit module:callable``.

The audit imports ``module`` and calls ``callable``. Its result is either a
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
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from reprules._errors import ReprulesError, UnsupportedJaxError

PROTOCOL = (
    "The callable must take no arguments (or only `check`) and return (step, args), "
    "(step, args, kwargs), or a mapping with 'step' and 'args' (optional 'kwargs', 'name', "
    "'reference')."
)


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


def resolve(spec: str) -> Factory:
    """Imports ``module`` and finds ``callable`` (does not call it)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(
            f"Target {spec!r} is not of the form module:callable.\n"
            "Why: the audit imports the module and calls the callable to get the step.\n"
            "Fix: e.g. `reprules audit my_project.train:audit_step`.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise TargetError(
            f"Cannot import module {module_name!r} of target {spec!r}: {err}.\n"
            "Why: the audit imports it from the current directory or the installed packages.\n"
            "Fix: run from the directory that contains it, or install your package.") from err
    except UnsupportedJaxError:
        raise
    except Exception as err:
        raise TargetError(
            f"Importing module {module_name!r} of target {spec!r} raised {type(err).__name__}: {err}\n"
            "Why: the module's own code failed while it was imported.\n"
            f"Fix: run `python -c 'import {module_name}'` to see the full traceback.") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(
                f"Module {module_name!r} has no attribute {attr!r} (target {spec!r}).\n"
                "Why: the part after ':' names the callable that builds the step.\n"
                f"Fix: name a callable defined in {module_name}.")
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
