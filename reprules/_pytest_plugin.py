"""The reprules pytest plugin (registered through the ``pytest11`` entry point).

* ``--reprules-cpu-devices N``, or the ini setting ``reprules_cpu_devices = N``
  (the option wins): N fake CPU devices, set before JAX starts.
* ``--reprules-infer``, or the ini setting ``reprules_infer = true``: the whole
  session runs under ``reprules.inference()`` (rules derived from kernel bodies).
* ``@pytest.mark.reprules_devices(n)``: skip unless at least n devices exist.
* fixtures ``no_all_reduce``, ``collectives``, ``no_implicit_collectives`` and
  ``no_cheaper_collectives`` (each skips a test whose function runs on a mesh of
  one device, saying how to get more).
* a report-header line: reprules and JAX versions, device count.

Loading this plugin imports neither JAX nor ``reprules.testing``: they are
imported when a fixture or marker needs them.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Generator
from typing import Any

import pytest

INI = "reprules_cpu_devices"
INFER_INI = "reprules_infer"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("reprules", "reprules: replication rules for shard_map")
    group.addoption(
        "--reprules-cpu-devices", dest="reprules_cpu_devices", type=int, default=None, metavar="N",
        help="provide N fake CPU devices (sets XLA_FLAGS before JAX starts); overrides the "
        f"{INI} ini setting")
    parser.addini(
        INI, "fake CPU devices to provide, as --reprules-cpu-devices N does (the option wins)",
        default="")
    group.addoption(
        "--reprules-infer", dest="reprules_infer", action="store_true", default=False,
        help="run the session under reprules.inference(): a Pallas kernel without a registered "
        f"rule gets one derived from its body (or a clear refusal); also the {INFER_INI} ini setting")
    parser.addini(
        INFER_INI, "run the session under reprules.inference(), as --reprules-infer does",
        type="bool", default=False)


def _inference_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("reprules_infer", False) or config.getini(INFER_INI))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    n, source = _requested_devices(early_config)
    if n is not None:
        _provide_devices(n, source)


def _requested_devices(config: pytest.Config) -> tuple[int | None, str]:
    """The device count asked for, and where: the command-line option, else the ini setting."""
    n = getattr(config.known_args_namespace, "reprules_cpu_devices", None)
    if n is not None:
        return n, f"--reprules-cpu-devices {n}"
    raw = str(config.getini(INI) or "").strip()
    if not raw:
        return None, ""
    source = f"{INI} = {raw}"
    try:
        return int(raw), source
    except ValueError:
        raise pytest.UsageError(
            f"{source} (in {config.inipath or 'the pytest configuration'}) is not a whole number.\n"
            "Why: it is the number of fake CPU devices JAX starts with.\n"
            f"Fix: write e.g. `{INI} = 8` under [pytest] (pytest.ini) or "
            "[tool.pytest.ini_options] (pyproject.toml).") from None


def _provide_devices(n: int, source: str) -> None:
    if n < 1:
        raise pytest.UsageError(
            f"{source}: the number of fake CPU devices must be at least 1, got {n}.\n"
            "Why: JAX needs at least one device.\nFix: ask for 1 or more devices, e.g. 8.")
    from reprules import _environment  # lazy: the plugin loads in every pytest run; reprules only for a test that uses it

    if _environment.backend_started():
        import jax

        have = jax.device_count()
        if have != n:
            raise pytest.UsageError(
                f"{source}: a JAX backend already started with {have} devices.\n"
                "Why: the number of fake CPU devices is fixed when JAX's backend starts, and "
                "something (a plugin or an imported module) started it before reprules could "
                "set XLA_FLAGS.\n"
                "Fix: do not call JAX (jax.devices(), array creation) at import time in plugins "
                f"or conftest.py, or set XLA_FLAGS={_environment.FLAG}={n} in the environment.")
        return
    _environment.request_cpu_devices(n)


def pytest_configure(config: pytest.Config) -> None:
    if _inference_requested(config):  # after pytest_load_initial_conftests provided the devices
        import reprules  # lazy: the plugin loads in every pytest run; reprules only for a test that uses it

        context = reprules.inference()
        context.__enter__()

        def leave() -> None:
            context.__exit__(None, None, None)

        config.add_cleanup(leave)
    config.addinivalue_line(
        "markers",
        "reprules_devices(n): the test needs at least n JAX devices; skipped when fewer exist "
        f"(provide fake CPU devices with --reprules-cpu-devices n or the {INI} ini setting)")


def pytest_report_header(config: pytest.Config) -> str:
    from reprules import _mode_state  # lazy: the plugin loads in every pytest run (a leaf: no JAX)

    mode = "all" if _inference_requested(config) else _mode_state.inference_mode()
    text = f"reprules {_version('reprules')}; JAX {_version('jax')}; {_mode_state.INFERENCE_TEXT[mode]}"
    n, _ = _requested_devices(config)
    if "jax" in sys.modules or n is not None:
        import jax

        return f"{text}; {jax.device_count()} {jax.default_backend()} devices"
    return f"{text}; devices: JAX not started"


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("reprules_devices")
    if marker is None:
        return
    if len(marker.args) != 1 or marker.kwargs or isinstance(marker.args[0], bool) or not isinstance(
            marker.args[0], int) or marker.args[0] < 1:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.reprules_devices takes one positive int (the number of "
            f"devices the test needs), got args={marker.args!r} kwargs={marker.kwargs!r}.\n"
            "Fix: write e.g. @pytest.mark.reprules_devices(8).")
    import jax

    need, have = marker.args[0], jax.device_count()
    if have < need:
        # Reported (`pytest -rs`) at the test, not here: what pytest's own skip marker does
        # (_pytest/skipping.py, pytest 7 - 9).
        raise pytest.skip.Exception(
            f"needs {need} JAX devices, found {have}; run pytest with --reprules-cpu-devices {need} "
            f"(or set {INI} = {need}) to provide fake CPU devices", _use_item_location=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """With ``REPRULES_VERIFY=1``, fails a test whose kernels broke their rules (whatever the
    test's own outcome, as the mismatch may be why it failed).

    A new-style wrapper (pluggy 1.1, pytest 8): its ``pytest.fail`` is the test's outcome,
    reported once; an old-style ``hookwrapper`` raising after its ``yield`` also printed the
    message again in a ``PluggyTeardownRaisedWarning``."""
    try:
        return (yield)
    finally:
        found = _mismatches()
        if found:
            pytest.fail("\n\n".join(found), pytrace=False)


def _mismatches() -> list[str]:
    """What verify mode found since the last call (nothing when it is off, or JAX untouched)."""
    if "reprules._shim" not in sys.modules:  # nothing was verified: JAX untouched
        return []
    from reprules import _modes, _shim  # lazy: the plugin loads in every pytest run; reprules only for a test that uses it

    return _shim.take_mismatches() if _modes.verifying() else []


def _skip_one_device_mesh(report: Any, fixture: str) -> None:
    """Skips the test, saying how to get devices, when ``report``'s function runs inside a
    ``shard_map`` on a mesh of one device: it has no all-reduce to find, so the fixture's
    verdict would say nothing (issue 36: the README's test passed on one device).

    Hidden from the traceback, as the fixtures' callables are, so ``pytest -rs`` reports the
    skip at the user's line that called the fixture, not here."""
    __tracebackhide__ = True
    sizes = [size for _, size in report.mesh]
    if not sizes or any(size != 1 for size in sizes):
        return
    import jax

    axes = ", ".join(f"{name}={size}" for name, size in report.mesh)
    pytest.skip(
        f"{fixture}: {report.function} runs on a mesh of 1 device ({axes}; JAX {jax.__version__} has "
        f"{jax.device_count()} {jax.default_backend()} device{'s' if jax.device_count() > 1 else ''}), "
        "where no all-reduce can occur, so the check would pass whatever the kernels' rules; run pytest with "
        f"--reprules-cpu-devices 8 (or set {INI} = 8) to provide fake CPU devices")


@pytest.fixture
def collectives() -> Callable[..., Any]:
    """``reprules.testing.collectives``: the report of a function's collectives.

    Skips the test, saying how to get devices, when the function runs on a mesh of
    one device (a report with nothing to find)."""
    from reprules import testing  # lazy: the plugin loads in every pytest run; reprules only for a test that uses it

    def report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        found = testing.collectives(fn, *args, **kwargs)
        _skip_one_device_mesh(found, "collectives")
        return found

    return report


@pytest.fixture
def no_all_reduce() -> Callable[..., Any]:
    """Call it as ``no_all_reduce(fn, *args, **kwargs)``; fails the test on any all-reduce.

    Looks at the jaxpr, the lowered StableHLO and the compiled HLO (a dead
    all-reduce, only in the jaxpr, never runs and is ignored, as by
    ``testing.assert_no_all_reduce``), and fails with the offending lines, their source, and the decorator to add when an
    opaque kernel without a rule is the cause. Returns the report otherwise. Skips the
    test, saying how to get devices, when the function runs on a mesh of one device
    (where no all-reduce can occur, so passing would prove nothing).
    """
    from reprules import testing  # lazy: the plugin loads in every pytest run; reprules only for a test that uses it

    def check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            report = testing.assert_no_all_reduce(fn, *args, **kwargs)
        except testing.CollectivesAssertionError as err:
            message = str(err)
        else:
            _skip_one_device_mesh(report, "no_all_reduce")
            return report
        # Outside the except block: pytest prints the message once, with no
        # "During handling of the above exception" chain.
        pytest.fail(message, pytrace=False)

    return check


def _failing(check: Callable[..., Any], fixture: str) -> Callable[..., Any]:
    """``check`` as a fixture's callable: a ``CollectivesAssertionError`` fails the test with its
    message; a pass on a one-device mesh skips it (nothing could have been found)."""
    from reprules import testing  # lazy: the plugin loads in every pytest run; reprules only for a test that uses it

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            report = check(fn, *args, **kwargs)
        except testing.CollectivesAssertionError as err:
            message = str(err)
        else:
            _skip_one_device_mesh(report, fixture)
            return report
        pytest.fail(message, pytrace=False)

    return run


@pytest.fixture
def no_implicit_collectives() -> Callable[..., Any]:
    """Call it as ``no_implicit_collectives(fn, *args, **kwargs)``; fails the test on any
    collective XLA inserted around an opaque kernel (``testing.assert_no_implicit_collectives``)."""
    from reprules import testing  # lazy: the plugin loads in every pytest run; reprules only for a test that uses it

    return _failing(testing.assert_no_implicit_collectives, "no_implicit_collectives")


@pytest.fixture
def no_cheaper_collectives() -> Callable[..., Any]:
    """Call it as ``no_cheaper_collectives(fn, *args, **kwargs)``; fails the test on any
    collective with a cheaper equivalent (``testing.assert_no_cheaper_collectives``)."""
    from reprules import testing  # lazy: the plugin loads in every pytest run; reprules only for a test that uses it

    return _failing(testing.assert_no_cheaper_collectives, "no_cheaper_collectives")
