"""Version-agnostic test helpers (public JAX API only), shared by every test file.

The JAX version, ``shard_map`` with checking on or off, the fake-device
``XLA_FLAGS``, the (4, 2) mesh, and the seed workload of JAX #21855 (a Pallas
copy kernel under ``custom_vjp``) are written here once for the tests.

This module imports no reprules at module level: tests/test_no_harm_more.py
builds its programs with it in a fresh process *before* ``import reprules``.
So the version and ``shard_map`` are the tests' own copies of
``reprules._environment.version_tuple`` and ``reprules.testing.shard_map``
(the same rules; tests/test_testing.py checks that they agree).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding

JAX_VERSION = tuple(int(re.match(r"\d*", p).group() or 0) for p in jax.__version__.split("."))
NEW_SHARD_MAP = hasattr(jax, "shard_map")  # 0.6+: jax.shard_map(check_vma=...); before: check_rep


def shard_map(f, mesh, in_specs, out_specs, check=True):
    """``shard_map`` with checking on (or off with ``check=False``), on every JAX of the matrix."""
    if NEW_SHARD_MAP:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as old_shard_map  # 0.4.28 - 0.5.x

    return old_shard_map(f, mesh, in_specs, out_specs, check_rep=check)


def make_mesh(shape=(4, 2), names=("data", "model")):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def env_with_cpu_devices(n=8, env=None):
    """A copy of ``env`` (default ``os.environ``) for a subprocess with ``n`` fake CPU devices."""
    from reprules._environment import environ_with_cpu_devices

    return environ_with_cpu_devices(n, os.environ if env is None else env)


# --- the seed workload: JAX #21855's Pallas copy kernel under custom_vjp ----------
def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def copy(x, kernel=copy_kernel):
    """``kernel`` (a copy kernel) applied to ``x`` through ``pl.pallas_call`` in interpret mode."""
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


@jax.custom_vjp
def kernel_copy(x):
    return copy(x)


kernel_copy.defvjp(lambda x: (copy(x), None), lambda _, g: (copy(g),))


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def randn(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.RandomState(seed).randn(*shape), dtype)


# --- collectives at the three levels ------------------------------------------
def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs (shard_map, custom_vjp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        hi = getattr(eqn.params.get("_prim"), "params", None)  # 0.10+ call_hi_primitive (jax_custom_vjp3,
        hi = hi if isinstance(hi, dict) else {}  # jax_remat3): the jaxprs are the hijax primitive's params
        for value in [*eqn.params.values(), *hi.values()]:
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


PSUM_PRIMITIVES = ("psum", "psum2", "psum_invariant")  # the spellings of psum across 0.4.28 - 0.12


def psum_axes_of(closed_jaxpr):
    """Sorted axes of every psum in ``closed_jaxpr`` and its sub-jaxprs, read from
    the equations (printed jaxprs split long equations over lines)."""
    found = []
    for eqn in _eqns(closed_jaxpr.jaxpr):
        if eqn.primitive.name in PSUM_PRIMITIVES:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, (tuple, list)) else (axes,)
            found.append(tuple(sorted(a for a in axes if isinstance(a, str))))
    return sorted(found)


def psum_axes(fn, *args):
    """:func:`psum_axes_of` the jaxpr of ``fn(*args)``."""
    return psum_axes_of(jax.make_jaxpr(fn)(*args))


def count_all_reduce(fn, *args):
    """(jaxpr psums, StableHLO all_reduce, compiled-HLO all-reduce) of ``jax.jit(fn)``."""
    jaxpr = len(psum_axes(fn, *args))
    lowered = jax.jit(fn).lower(*args)
    stablehlo = lowered.as_text().count("stablehlo.all_reduce")
    compiled_text = lowered.compile().as_text()
    compiled = len(re.findall(r"\ball-reduce(?:-start)?\(", compiled_text))
    return jaxpr, stablehlo, compiled


def max_err(a, b):
    """Largest absolute difference between two pytrees of arrays (computed in NumPy)."""
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(leaves_a, leaves_b)
    )


# --- custom_vjp implementations ------------------------------------------------
def _has_flag(name):
    return hasattr(jax.config, name)


CUSTOM_VJP3_MODES = [False, True] if _has_flag("jax_custom_vjp3") else [False]
"""``jax_custom_vjp3`` off and on where the release has the flag (0.9.1+)."""


class custom_vjp3:
    """Context manager: ``jax_custom_vjp3`` set to ``on`` (no-op where absent).

    From 0.9.1 to 0.11 the flag picks the implementation when a function is
    *decorated*, so define custom_vjp functions inside the block."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        if _has_flag("jax_custom_vjp3"):
            self.before = jax.config.jax_custom_vjp3
            jax.config.update("jax_custom_vjp3", self.on)
        return self

    def __exit__(self, *exc):
        if _has_flag("jax_custom_vjp3"):
            jax.config.update("jax_custom_vjp3", self.before)


VARYING_OVER_DATA = r"\{(V:)?data\}"
"""How a jaxpr prints a type varying over ``data``: ``{V:data}``, ``{data}`` on JAX 0.7."""


# A `reprules audit` target (module text): a Pallas kernel in a custom_vjp whose bwd's cotangent for
# the replicated w varies over `data` (reprules psums it, JAX <= 0.5 does); `only_x` leaves w's
# gradient unused, so that all-reduce is dead code.
# What reprules' errors tell a user to cast up with: jax.lax.pcast from JAX 0.8, pvary before.
CAST_UP = r"jax\.lax\.pcast\(" if hasattr(jax.lax, "pcast") else r"jax\.lax\.pvary\("


BWD_STEPS = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import pallas as pl
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import reprules
    from reprules.testing import shard_map

    def scale_kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    def _scale(x, w):
        return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)

    @jax.custom_vjp
    def scaled(x, w):
        return _scale(x, w)

    def scaled_bwd(res, g):
        x, w = res
        return _scale(g, w), _scale(g, x).sum(0, keepdims=True)

    scaled.defvjp(lambda x, w: (_scale(x, w), (x, w)), scaled_bwd)

    def _step(check, argnums):
        if check:
            reprules.replication_rule()(scale_kernel)
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
        w = jax.device_put(jnp.ones((1, 128)), NamedSharding(mesh, P()))
        f = shard_map(scaled, mesh, (P("data", None), P()), P("data", None), check=check)
        return jax.grad(lambda x, w: (f(x, w) * jnp.arange(128.0)).sum(), argnums=argnums), (x, w)

    def both(check=True):
        return _step(check, (0, 1))

    def only_x(check=True):  # w's gradient is not used: its all-reduce is dead code
        return _step(check, 0)
''')


def pack_state_on_import(module: str) -> list[str]:
    """In a fresh interpreter: whether nothing is registered after ``import reprules``, the
    pack's (name, state) once ``module`` is imported, and ``kernels_in(module)``'s rule and source."""
    import subprocess
    import sys

    code = ("import reprules\n"
            "print(reprules.registered() == {})\n"
            f"import {module}\n"
            f"print([(p.name, p.state) for p in reprules.packs() if p.module == {module!r}])\n"
            f"reg = reprules.registered()['kernels_in:{module}']\n"
            "print(reg.rule, reg.source)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()


def megablox_in_own_process(test_file: str, test: str, env: dict[str, str], hang_s: int = 120) -> None:
    """Runs ``test_file::test`` (megablox ``gmm`` in JAX's TPU interpreter) in its own pytest
    process, with ``env`` added, given ``hang_s`` seconds. JAX's TPU interpreter can deadlock
    in its callbacks (JAX alone too: always on 0.6 - 0.10, now and then on 0.11+ on a loaded
    2-core machine) or abort: a hung process must not hang the suite, and the test is then
    skipped saying so; a wrong result still fails."""
    import pytest

    path = pathlib.Path(test_file)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"{path.name}::{test}"],
            cwd=path.parent, env={**os.environ, **env}, capture_output=True, text=True, timeout=hang_s)
    except subprocess.TimeoutExpired:
        pytest.skip(f"JAX {jax.__version__}'s TPU interpreter hung running megablox gmm for {hang_s} s "
                    "(a deadlock of its callbacks, seen with JAX alone): no result to check")
    if done.returncode < 0:  # killed by a signal: JAX's interpreter aborted (seen on 0.11.2 under load)
        pytest.skip(f"JAX {jax.__version__}'s TPU interpreter aborted running megablox gmm (signal "
                    f"{-done.returncode}): no result to check. {done.stderr.strip().splitlines()[:1]}")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def fuzz_seed() -> int:
    """The fuzzers' seed: ``REPRULES_FUZZ_SEED`` if set (the noxfile sets and prints it), else
    one shared by every pytest-xdist worker of this run."""
    given = os.environ.get("REPRULES_FUZZ_SEED")
    if given:
        return int(given)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    return int(run[:8], 16) if run else int(time.time())
