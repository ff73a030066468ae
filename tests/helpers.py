"""Version-agnostic test helpers (public JAX API only)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

JAX_VERSION = tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in jax.__version__.split(".")[:3])
NEW_SHARD_MAP = hasattr(jax, "shard_map") and JAX_VERSION >= (0, 6, 0)


def make_mesh(shape=(4, 2), names=("data", "model")):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def shard_map(f, mesh, in_specs, out_specs, check=True):
    """``shard_map`` with checking on or off, on every JAX of the matrix."""
    if NEW_SHARD_MAP:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as old_shard_map

    return old_shard_map(f, mesh, in_specs, out_specs, check_rep=check)


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def randn(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.RandomState(seed).randn(*shape), dtype)


# --- collectives at the three levels ------------------------------------------
def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs (shard_map, custom_vjp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


def psum_axes(fn, *args):
    """Sorted axes of every psum (psum, psum2, psum_invariant) in ``fn``'s jaxpr,
    read from the equations (printed jaxprs split long equations over lines)."""
    found = []
    for eqn in _eqns(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name.startswith("psum"):
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, (tuple, list)) else (axes,)
            found.append(tuple(sorted(a for a in axes if isinstance(a, str))))
    return sorted(found)


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
