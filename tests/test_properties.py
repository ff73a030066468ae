"""Property-based tests (hypothesis): random meshes, specs, rules and small kernels.

Each example draws a mesh (1 - 3 axes, sizes dividing 8), a small Pallas kernel
under ``custom_vjp`` (elementwise, two inputs with mixed varying axes, or two
outputs; its backward is a Pallas kernel too), an ``in_spec`` per input, a
built-in rule that is honest for those inputs (``same``, ``like``,
``varying``, ``invariant``) and ``out_specs`` that name at least the axes the
rule says each output varies over (more axes tile the output). Then:

* the loss ``sum_k sum(out_k * t_k)`` and its gradients equal those computed
  in NumPy from shard_map's definition, device by device on the global arrays
  (the unsharded reference);
* the psums of the step's jaxpr are exactly the analytically needed ones (see
  :func:`needed_psums`);
* ``reprules.testing`` finds no defensive collective.

And ``out_specs`` that omit an axis the rule says an output varies over are
refused by JAX itself, not silently accepted.

Example counts are CI-sized and derandomized (the same examples on every run);
``REPRULES_HYPOTHESIS_PROFILE=dev`` runs 200 random examples per test. A
failure prints the example and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import reprules  # noqa: E402
from helpers import NEW_SHARD_MAP, psum_axes, shard_map  # noqa: E402
from reprules import rules, testing  # noqa: E402

_COMMON = dict(deadline=None, print_blob=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("reprules-ci", max_examples=12, derandomize=True, **_COMMON)
settings.register_profile("reprules-dev", max_examples=200, **_COMMON)
PROFILE = settings.get_profile("reprules-" + os.environ.get("REPRULES_HYPOTHESIS_PROFILE", "ci"))

LOCAL = (2, 8)  # every kernel sees per-device blocks of this shape
AXIS_POOL = ("a", "b", "c")


# --- kernels: forward and backward, each registered ---------------------------------


def square_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * x_ref[...]


def square_bwd_kernel(x_ref, g_ref, dx_ref):
    dx_ref[...] = 2.0 * x_ref[...] * g_ref[...]


def mul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def mul_bwd_kernel(x_ref, w_ref, g_ref, dx_ref, dw_ref):
    dx_ref[...] = g_ref[...] * w_ref[...]
    dw_ref[...] = g_ref[...] * x_ref[...]


def sum_prod_kernel(x_ref, w_ref, s_ref, p_ref):
    s_ref[...] = x_ref[...] + w_ref[...]
    p_ref[...] = x_ref[...] * w_ref[...]


def sum_prod_bwd_kernel(x_ref, w_ref, gs_ref, gp_ref, dx_ref, dw_ref):
    dx_ref[...] = gs_ref[...] + gp_ref[...] * w_ref[...]
    dw_ref[...] = gs_ref[...] + gp_ref[...] * x_ref[...]


def _call(kernel, n_out, *args):
    sds = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
    out_shape = sds if n_out == 1 else (sds,) * n_out
    return pl.pallas_call(kernel, out_shape=out_shape, interpret=True)(*args)


def _with_vjp(fwd_kernel, bwd_kernel, n_in, n_out):
    @jax.custom_vjp
    def f(*args):
        return _call(fwd_kernel, n_out, *args)

    def fwd(*args):
        return f(*args), args

    def bwd(res, g):
        gs = (g,) if n_out == 1 else tuple(g)
        out = _call(bwd_kernel, n_in, *res, *gs)
        return (out,) if n_in == 1 else tuple(out)

    f.defvjp(fwd, bwd)
    return f


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    fwd: object
    bwd: object
    n_in: int
    n_out: int
    reference: object  # the per-device math, in NumPy
    vjp: object  # (local inputs, local output cotangents) -> local input cotangents, in NumPy

    def function(self):
        return _with_vjp(self.fwd, self.bwd, self.n_in, self.n_out)


KERNELS = {
    "elementwise": Kernel("elementwise", square_kernel, square_bwd_kernel, 1, 1,
                          lambda x: (x * x,), lambda x, g: (2 * x * g[0],)),
    "mixed_inputs": Kernel("mixed_inputs", mul_kernel, mul_bwd_kernel, 2, 1,
                           lambda x, w: (x * w,), lambda x, w, g: (g[0] * w, g[0] * x)),
    "two_outputs": Kernel("two_outputs", sum_prod_kernel, sum_prod_bwd_kernel, 2, 2,
                          lambda x, w: (x + w, x * w), lambda x, w, g: (g[0] + g[1] * w, g[0] + g[1] * x)),
}


# --- the example -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Example:
    mesh: tuple[tuple[str, int], ...]
    kernel: str
    in_specs: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]  # per input: (row axes, column axes)
    rule: object
    out_varying: tuple[frozenset, ...]  # what the rule says, per output
    out_specs: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]
    seed: int

    @property
    def axes(self):
        return tuple(n for n, _ in self.mesh)

    def in_varying(self):
        return tuple(frozenset(r + c) for r, c in self.in_specs)


def _spec(entry):
    return P(*(axes if axes else None for axes in entry))


def _split(draw, axes):
    """Places each of ``axes`` on the row or the column dimension, in a random order."""
    axes = draw(st.permutations(list(axes))) if axes else []
    rows = tuple(a for a in axes if draw(st.booleans()))
    return rows, tuple(a for a in axes if a not in rows)


@st.composite
def meshes(draw):
    n = draw(st.integers(1, 3))
    names = draw(st.permutations(list(AXIS_POOL)))[:n]
    sizes = []
    for _ in range(n):
        budget = 8 // math.prod(sizes or [1])
        sizes.append(draw(st.sampled_from([s for s in (1, 2, 4, 8) if s <= budget])))
    return tuple(zip(names, sizes))


class Current:
    """The rule of the example being run.

    Registered once per test: registering a *different* rule drops all of
    JAX's caches (so that nothing traced before runs stale), which would make
    every example compile from scratch. Each example builds new functions,
    so none can be stale.
    """

    rule: object = rules.same()

    def __call__(self, ctx, in_varying):
        return self.rule(ctx, in_varying)

    def __repr__(self):
        return f"Current({self.rule!r})"


CURRENT = Current()


RULE_KINDS = ("same", "like", "varying", "invariant")


@st.composite
def examples(draw, kernel=None, rule=None, varying_input=False):
    """An example whose rule is honest for its inputs.

    The rule kind is drawn first and the inputs built to make it true:
    ``like(i)``: every other input varies over a subset of input ``i``'s axes;
    ``invariant(*gone)``: no input varies over ``gone`` (a kernel that
    communicates over ``gone`` would be replicated there too).
    """
    mesh = draw(meshes())
    axes = tuple(n for n, _ in mesh)
    kernel = KERNELS[kernel or draw(st.sampled_from(sorted(KERNELS)))]
    kind = rule or draw(st.sampled_from(RULE_KINDS))
    if kind == "invariant" and varying_input and len(axes) == 1:
        kind = "same"

    def subset(pool, min_size=0):
        return tuple(draw(st.lists(st.sampled_from(sorted(pool)), unique=True, min_size=min_size,
                                   max_size=len(pool)))) if pool else ()

    gone = subset(axes, min_size=1)[: len(axes) - int(varying_input)] if kind == "invariant" else ()
    pool = sorted(set(axes) - set(gone))
    index = draw(st.integers(0, kernel.n_in - 1)) if kind == "like" else None
    first = subset(pool, min_size=int(varying_input))
    varying = [first]
    for _ in range(1, kernel.n_in):
        varying.append(subset(first) if kind == "like" else subset(pool))
    if index is not None:  # input `index` is the one the others are subsets of
        varying[0], varying[index] = varying[index], varying[0]
    in_specs = tuple(_split(draw, v) for v in varying)
    union = frozenset().union(*(frozenset(v) for v in varying))

    if kind == "same":
        rule_obj, out = rules.same(), union
    elif kind == "like":
        rule_obj, out = rules.like(index), union
    elif kind == "varying":
        extra = subset(axes)
        rule_obj, out = rules.varying(*extra), union | frozenset(extra)
    else:
        rule_obj, out = rules.invariant(*gone), union
    out_varying = (out,) * kernel.n_out
    out_specs = []
    for v in out_varying:  # the varying axes, and maybe more (then the output is tiled)
        out_specs.append(_split(draw, sorted(v) + list(subset(set(axes) - v))))
    return Example(mesh, kernel.name, in_specs, rule_obj, out_varying, tuple(out_specs),
                   draw(st.integers(0, 2**16)))


# --- the unsharded reference: shard_map's definition, simulated in NumPy ---------------


def _blocks(entry, coords, sizes):
    """The slices of the block of the device at ``coords``, for a spec entry."""
    out = []
    for n, axes in zip(LOCAL, entry):
        index = 0
        for a in axes:  # the first axis is the major one
            index = index * sizes[a] + coords[a]
        out.append(slice(index * n, (index + 1) * n))
    return tuple(out)


def _global_shape(entry, sizes):
    return tuple(n * math.prod(sizes[a] for a in axes) for n, axes in zip(LOCAL, entry))


def reference(ex: Example, inputs, targets):
    """The loss ``sum_k sum(out_k * t_k)`` of ``shard_map(kernel, in_specs,
    out_specs)`` and its gradients, from shard_map's definition: every device
    runs the kernel on its blocks; an output block comes from the device at
    index 0 of each axis its out_spec does not name (the copies are equal).
    """
    kernel = KERNELS[ex.kernel]
    sizes = dict(ex.mesh)
    loss = 0.0
    grads = [np.zeros(x.shape, np.float64) for x in inputs]
    for coord in itertools.product(*(range(s) for _, s in ex.mesh)):
        coords = dict(zip(ex.axes, coord))
        local = [x[_blocks(e, coords, sizes)].astype(np.float64) for x, e in zip(inputs, ex.in_specs)]
        outs = kernel.reference(*local)
        cts = []
        for y, t, (rows, cols) in zip(outs, targets, ex.out_specs):
            if any(coords[a] for a in ex.axes if a not in rows + cols):
                cts.append(np.zeros(LOCAL))  # a copy that is not part of the global output
                continue
            ct = t[_blocks((rows, cols), coords, sizes)].astype(np.float64)
            loss += float(np.sum(y * ct))
            cts.append(ct)
        for acc, g, e in zip(grads, kernel.vjp(*local, cts), ex.in_specs):
            acc[_blocks(e, coords, sizes)] += g
    return loss, grads


def needed_psums(ex: Example):
    """The psums the gradient needs, one per set of axes:

    * an output whose ``out_spec`` names axes the rule says it does not vary
      over is cast up to them (its global value holds copies): the cotangent
      is summed over those axes, as every copy counts in the loss;
    * the backward kernel (``rules.same()``) varies over the union of its
      inputs (residuals and cotangents): each input's cotangent is summed
      over the axes of that union its ``in_spec`` does not name.
    """
    in_varying = ex.in_varying()
    union = frozenset().union(*in_varying, *ex.out_varying)
    outputs = [frozenset(r + c) - v for (r, c), v in zip(ex.out_specs, ex.out_varying)]
    inputs = [union - v for v in in_varying]
    return sorted(tuple(sorted(s)) for s in outputs + inputs if s)


# --- building and running an example ---------------------------------------------------


def _setup(ex: Example, out_specs=None):
    kernel = KERNELS[ex.kernel]
    CURRENT.rule = ex.rule
    reprules.replication_rule(CURRENT)(kernel.fwd)
    reprules.replication_rule(rules.same())(kernel.bwd)
    names, sizes = zip(*ex.mesh)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes), names)
    sizes = dict(ex.mesh)
    rng = np.random.RandomState(ex.seed)
    inputs = [rng.randn(*_global_shape(e, sizes)).astype(np.float32) for e in ex.in_specs]
    targets = [rng.randn(*_global_shape(e, sizes)).astype(np.float32) for e in ex.out_specs]
    in_specs = tuple(_spec(e) for e in ex.in_specs)
    specs = tuple(_spec(e) for e in (out_specs or ex.out_specs))
    f = shard_map(kernel.function(), mesh, in_specs, specs[0] if kernel.n_out == 1 else specs)
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(inputs, in_specs)]
    return kernel, f, inputs, targets, placed


def _loss(f, targets):
    def loss(*args):
        out = f(*args)
        out = (out,) if not isinstance(out, (tuple, list)) else out
        return sum(jnp.sum(y * t) for y, t in zip(out, targets))

    return loss


@pytest.mark.parametrize("rule", RULE_KINDS)
@PROFILE
@given(data=st.data())
def test_gradients_exact_and_only_the_needed_psums(rule, data):
    ex = data.draw(examples(rule=rule), label="example")
    event(f"kernel {ex.kernel}")
    event(f"{len(ex.mesh)} mesh axes")
    kernel, f, inputs, targets, placed = _setup(ex)
    step = jax.value_and_grad(_loss(f, targets), argnums=tuple(range(kernel.n_in)))

    loss, grads = jax.jit(step)(*placed)
    want_loss, want_grads = reference(ex, inputs, targets)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-4)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    assert psum_axes(step, *placed) == needed_psums(ex), ex
    report = testing.collectives(step, *placed)
    assert not report.defensive, f"{ex}\n{report}"


@st.composite
def lying_out_specs(draw, kernel):
    """An example whose out_specs omit one axis the rule says an output varies over."""
    ex = draw(examples(kernel=kernel, varying_input=True))
    k = draw(st.sampled_from([i for i, v in enumerate(ex.out_varying) if v]))
    dropped = draw(st.sampled_from(sorted(ex.out_varying[k])))
    specs = list(ex.out_specs)
    specs[k] = tuple(tuple(a for a in axes if a != dropped) for axes in specs[k])
    return ex, tuple(specs), dropped


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@PROFILE
@given(data=st.data())
def test_out_specs_claiming_absent_replication_are_refused_by_jax(kernel, data):
    ex, specs, dropped = data.draw(lying_out_specs(kernel), label="example")
    kernel, f, inputs, targets, placed = _setup(ex, out_specs=specs)
    with pytest.raises(ValueError, match="out_specs") as info:
        jax.jit(f)(*placed)
    assert not isinstance(info.value, reprules.ReprulesError)
    assert dropped in str(info.value)


def test_bwd_mixing_replicated_and_varying_cotangents():
    """Two outputs, the second varying over ``a`` (a per-output rule), the
    bwd adds their cotangents: the gradient is ``t0 + t1[:, :4] + t1[:, 4:]``."""
    reprules.replication_rule(lambda ctx, v: [frozenset(), frozenset({"a"})])(sum_prod_kernel)
    reprules.replication_rule()(sum_prod_bwd_kernel)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("a",))
    f = shard_map(KERNELS["two_outputs"].function(), mesh, (P(), P()), (P(), P(None, "a")))
    x, w = np.ones((2, 4), np.float32), np.full((2, 4), 2.0, np.float32)
    t0, t1 = np.ones((2, 4), np.float32), np.full((2, 8), 10.0, np.float32)

    def loss(x, w):
        s, p = f(x, w)
        return jnp.sum(s * t0) + jnp.sum(p * t1)

    # Refused on every version, never over-counted (JAX <= 0.5 alone gives 42, not 41).
    with pytest.raises(reprules.CotangentError, match=r"(?s)mixes in a part that was replicated over 'a'.*Fix:"):
        jax.jit(jax.grad(loss))(x, w)
