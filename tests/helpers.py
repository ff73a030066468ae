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
_JAXPR_COLLECTIVE = re.compile(r"\b(psum\w*|all_gather\w*|reduce_scatter|psum_scatter|ppermute|all_to_all)\[")
_JAXPR_AXES = re.compile(r"axes=\(([^)]*)\)|axis_name=\(?([^),\s]+)")


def jaxpr_collectives(fn, *args):
    """[(primitive name, axes tuple)] of every collective in the jaxpr, sub-jaxprs included."""
    text = str(jax.make_jaxpr(fn)(*args))
    found = []
    for line in text.splitlines():
        m = _JAXPR_COLLECTIVE.search(line)
        if not m:
            continue
        axes = re.search(r"axes=\(([^)]*)\)", line) or re.search(r"axis_name=\(([^)]*)\)", line)
        names = tuple(a.strip().strip("'\"") for a in axes.group(1).split(",") if a.strip()) if axes else ()
        found.append((m.group(1), names))
    return found


def count_all_reduce(fn, *args):
    """(jaxpr psums, StableHLO all_reduce, compiled-HLO all-reduce) of ``jax.jit(fn)``."""
    jaxpr = sum(1 for name, _ in jaxpr_collectives(fn, *args) if name.startswith("psum"))
    lowered = jax.jit(fn).lower(*args)
    stablehlo = lowered.as_text().count("stablehlo.all_reduce")
    compiled_text = lowered.compile().as_text()
    compiled = len(re.findall(r"\ball-reduce(?:-start)?\(", compiled_text))
    return jaxpr, stablehlo, compiled


def psum_axes(fn, *args):
    """Sorted list of the axes tuples of every psum in the jaxpr."""
    return sorted(tuple(sorted(axes)) for name, axes in jaxpr_collectives(fn, *args) if name.startswith("psum"))


def max_err(a, b):
    """Largest absolute difference between two pytrees of arrays (computed in NumPy)."""
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(leaves_a, leaves_b)
    )
