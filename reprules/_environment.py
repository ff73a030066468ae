"""The process JAX runs in: fake CPU devices, and the JAX version (for the CLI, the plugin, ``testing``).

Importing this module does not import JAX: the device count must be set
before a JAX backend starts.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

from reprules._version import version_tuple as version_tuple

FLAG = "--xla_force_host_platform_device_count"


def jax_version() -> tuple[int, ...]:
    """The installed JAX's version as a tuple (imports JAX)."""
    import jax

    return version_tuple(jax.__version__)


def with_device_count(flags: str, n: int) -> str:
    """``XLA_FLAGS`` text ``flags`` asking for ``n`` host (CPU) devices.

    An earlier device-count flag is replaced, not appended to, so the text
    says one count whatever it held before.
    """
    kept = re.sub(rf"{FLAG}=\S*", "", flags).split()
    return " ".join([*kept, f"{FLAG}={n}"])


def environ_with_cpu_devices(n: int, environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` for a process that starts JAX on ``n`` fake CPU devices (CPU only)."""
    env = dict(environ)
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), n)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def backend_started() -> bool:
    """Whether a JAX backend, and so its device count, is already fixed (never imports JAX)."""
    if "jax" not in sys.modules:
        return False
    from reprules._shim.plumbing._jax import backends_started  # lazy: JAX is imported already, reprules' shim may not be

    return backends_started()


def request_cpu_devices(n: int, *, cpu_only: bool = True) -> None:
    """Asks for ``n`` fake CPU devices: effective only if no JAX backend started yet.

    ``cpu_only``: also make CPU JAX's default platform, unless the user chose
    one (``JAX_PLATFORMS``). JAX reads ``JAX_PLATFORMS`` when it is imported,
    so once JAX is imported the same choice goes through ``jax.config``.
    """
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)
    if not cpu_only:
        return
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return
    import jax

    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
