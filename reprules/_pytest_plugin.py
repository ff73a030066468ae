"""The reprules pytest plugin (registered through the ``pytest11`` entry point).

* ``--reprules-cpu-devices N``: N fake CPU devices, set before JAX starts.
* ``@pytest.mark.reprules_devices(n)``: skip unless at least n devices exist.
* fixtures ``no_all_reduce`` and ``collectives``.
* a report-header line: reprules and JAX versions, device count.

Loading this plugin imports neither JAX nor ``reprules.testing``: they are
imported when a fixture or marker needs them.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("reprules", "reprules: replication rules for shard_map")
    group.addoption(
        "--reprules-cpu-devices", dest="reprules_cpu_devices", type=int, default=None, metavar="N",
        help="provide N fake CPU devices (sets XLA_FLAGS before JAX starts)")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    n = getattr(early_config.known_args_namespace, "reprules_cpu_devices", None)
    if n is not None:
        _provide_devices(n)


def _provide_devices(n: int) -> None:
    if n < 1:
        raise pytest.UsageError(f"--reprules-cpu-devices must be at least 1, got {n}.")
    from reprules import _environment

    if _environment.backend_started():
        import jax

        have = jax.device_count()
        if have != n:
            raise pytest.UsageError(
                f"--reprules-cpu-devices {n}: a JAX backend already started with {have} devices.\n"
                "Why: the number of fake CPU devices is fixed when JAX's backend starts, and "
                "something (a plugin or an imported module) started it before reprules could "
                "set XLA_FLAGS.\n"
                "Fix: do not call JAX (jax.devices(), array creation) at import time in plugins "
                f"or conftest.py, or set XLA_FLAGS={_environment.FLAG}={n} in the environment.")
        return
    _environment.request_cpu_devices(n)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "reprules_devices(n): the test needs at least n JAX devices; skipped when fewer exist "
        "(provide fake CPU devices with --reprules-cpu-devices n)")


def pytest_report_header(config: pytest.Config) -> str:
    text = f"reprules {_version('reprules')}; JAX {_version('jax')}"
    n = config.getoption("reprules_cpu_devices", None)
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
        pytest.skip(f"needs {need} JAX devices, found {have}; run pytest with "
                    f"--reprules-cpu-devices {need} to provide fake CPU devices")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """With ``REPRULES_VERIFY=1``, fails a test whose kernels broke their rules."""
    yield
    if "reprules._shim._verify" not in sys.modules:  # nothing was verified: JAX untouched
        return
    from reprules import _modes
    from reprules._shim import _verify

    if _modes.verifying():
        found = _verify.take_mismatches()
        if found:
            pytest.fail("\n\n".join(found), pytrace=False)


@pytest.fixture
def collectives() -> Callable[..., Any]:
    """``reprules.testing.collectives``: the report of a function's collectives."""
    from reprules import testing

    return testing.collectives


@pytest.fixture
def no_all_reduce() -> Callable[..., Any]:
    """Call it as ``no_all_reduce(fn, *args, **kwargs)``; fails the test on any all-reduce.

    Looks at the jaxpr, the lowered StableHLO and the compiled HLO, and fails
    with the offending lines, their source, and the decorator to add when an
    opaque kernel without a rule is the cause. Returns the report otherwise.
    """
    from reprules import testing

    def check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return testing.assert_no_all_reduce(fn, *args, **kwargs)
        except testing.CollectivesAssertionError as err:
            pytest.fail(str(err), pytrace=False)

    return check
