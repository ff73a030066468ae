"""``verify()`` and ``strict()`` never break a program that runs without them.

Where a kernel runs decides which checks JAX can lower, found on the matrix:

* under ``jax.vmap(..., spmd_axis_name="model")`` (0.6+): JAX types every batched
  value varying over ``model``, so it refused verify's cast of each output over it
  ("pvary is a invariant->variant collective"); and strict refused the types
  JAX's own batching of the kernel gives (they lack ``model``), a ``RuleError``;
* in a ``shard_map`` nested in another (0.6 - 0.9): JAX cannot lower a host
  callback there ("Cannot lower jaxpr with verifier errors", "Unhandled OpSharding
  type", or a segfault on 0.8.3);
* in a partially manual ``shard_map`` (``axis_names=`` / ``auto=``): XLA aborts the
  process on a host callback there on 0.4.x, and on an ``all_gather`` on 0.5 - 0.6;
* under a hidden abstract mesh (``use_abstract_mesh(AbstractMesh((), ()))``, 0.7+).

A check JAX cannot lower is skipped with a ``reprules.VerifyWarning`` that names
the kernel, the axes, the JAX version, why and the fix; every other check runs
(0.5 - 0.6 compare copies by ``pmax``/``pmin`` in a partially manual shard_map),
and still catches a lying rule. Outputs and gradients equal checking off and an
unsharded reference in every mode.
"""

from __future__ import annotations

import re
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, NEW_SHARD_MAP, copy_kernel, kernel_copy, make_mesh, max_err, put, randn, shard_map
from reprules import rules

# XLA:CPU never finishes compiling a partially manual shard_map on 0.4.28 (tests/test_partial_manual.py).
COMPILES_PARTIAL = JAX_VERSION >= (0, 4, 38)
JAX_TEXT = re.escape(f"JAX {jax.__version__}")


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each skip warns once per kernel, axes and reason: every test sees its own."""
    from reprules._shim.safety import _verify

    skipped = getattr(_verify, "_skipped", set())
    skipped.clear()
    yield
    skipped.clear()


@pytest.fixture
def mesh():
    return make_mesh()


def _modes():
    return {"off": _null, "verify": reprules.verify, "strict": reprules.strict,
            "both": lambda: _Both()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Both:
    def __enter__(self):
        self.strict, self.verify = reprules.strict(), reprules.verify()
        self.strict.__enter__()
        self.verify.__enter__()

    def __exit__(self, *exc):
        try:
            return self.verify.__exit__(*exc)
        finally:
            self.strict.__exit__(*exc)


def _run(mode, fn, *args):
    """``fn(*args)`` (jitted) under ``mode``; its outputs and the VerifyWarnings it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", reprules.VerifyWarning)
        with _modes()[mode]():
            out = jax.block_until_ready(jax.jit(fn)(*args))
    skipped = [str(w.message) for w in seen if issubclass(w.category, reprules.VerifyWarning)]
    others = [w for w in seen if not issubclass(w.category, reprules.VerifyWarning)]
    assert not others, [str(w.message) for w in others]  # no ReplicationWarning, nothing else
    return out, skipped


# -- the programs ------------------------------------------------------------------------


def _spmd_copy(x):
    from helpers import copy

    return jax.vmap(copy, spmd_axis_name="model")(x)


# The vmap inside the custom_vjp: JAX 0.6+ itself refuses the gradient of a custom_vjp
# batched by vmap(spmd_axis_name=...) in a checked shard_map ("Expected cotangent type"),
# with a pure-jnp custom_vjp too, reprules or not.
@jax.custom_vjp
def spmd_copy(x):
    return _spmd_copy(x)


spmd_copy.defvjp(lambda x: (_spmd_copy(x), None), lambda _, g: (_spmd_copy(g),))


def vmapped(mesh, check=True):
    """A kernel under vmap(spmd_axis_name="model"): per element x varies over data."""
    return shard_map(lambda x, w: spmd_copy(x * w), mesh, (P(None, "data"), P()), P("model", "data"), check=check)


def vmapped_args(mesh):
    x = put(randn(0, (2, 8, 128)), mesh, P(None, "data"))
    return x, randn(1, (128,)), randn(2, (4, 8, 128))


def vmapped_reference(x, w):
    return np.concatenate([np.asarray(x) * np.asarray(w)] * 2)  # each model shard holds the whole batch


def vmapped_grad_reference(x, w, t):
    x, w, t = (np.asarray(a) for a in (x, w, t))
    folded = t[:2] + t[2:]
    return folded * w, (folded * x).sum((0, 1))


def nested(mesh, check=True):
    """A kernel in a shard_map manual over model, nested in one manual over data."""
    def inner(y):
        return kernel_copy(y)

    def body(x, w):
        g = jax.shard_map(inner, mesh=jax.sharding.get_abstract_mesh(), in_specs=P(), out_specs=P(),
                          axis_names=frozenset({"model"}), check_vma=check)
        return g(x * w)

    return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"),
                         axis_names=frozenset({"data"}), check_vma=check)


def partially_manual(mesh, check=True):
    """Manual over data, automatic over model: two kernels, the second's output replicated."""
    def body(x, w):
        return kernel_copy(x * w), kernel_copy(w + 1.0)

    specs = ((P("data"), P()), (P("data"), P()))
    if NEW_SHARD_MAP:
        return jax.shard_map(body, mesh=mesh, in_specs=specs[0], out_specs=specs[1],
                             axis_names=frozenset({"data"}), check_vma=check)
    from jax.experimental.shard_map import shard_map as old_shard_map  # 0.4.28 - 0.5.x

    return old_shard_map(body, mesh, *specs, check_rep=check, auto=frozenset({"model"}))


def hidden(mesh, check=True):
    """A kernel called under an abstract mesh that hides the manual axes (MaxText's mHC)."""
    @jax.custom_vjp
    def hidden_copy(y):
        return _hidden(y)

    hidden_copy.defvjp(lambda y: (_hidden(y), None), lambda _, g: (_hidden(g),))
    return shard_map(lambda x, w: hidden_copy(x * w), mesh, (P("data"), P()), P("data"), check=check)


def _hidden(y):
    from helpers import copy

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return copy(y)


def flat_args(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data"))
    return x, randn(1, (128,)), randn(2, (8, 128))


needs_new_shard_map = pytest.mark.skipif(
    not NEW_SHARD_MAP, reason=f"JAX {jax.__version__}: a checked shard_map cannot nest in another on "
    "JAX <= 0.5 (JAX's RewriteTrace has no process_shard_map, with reprules or without)")
needs_abstract_mesh = pytest.mark.skipif(
    not hasattr(jax.sharding, "use_abstract_mesh"),
    reason=f"JAX {jax.__version__} has no public jax.sharding.use_abstract_mesh (added in 0.7)")
compiles_partial = pytest.mark.skipif(
    not COMPILES_PARTIAL, reason="JAX 0.4.28: XLA:CPU hangs compiling a partially manual shard_map "
    "(without reprules too); test_partial_manual_skip_is_said_when_traced covers its warning")

MODES = ["off", "verify", "strict", "both"]


# -- every mode runs, and gives checking off's results ----------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_vmap_with_spmd_axis_name(mesh, mode):
    x, w, _ = vmapped_args(mesh)
    out, skipped = _run(mode, vmapped(mesh), x, w)  # before (0.6+): pvary refused; strict: RuleError
    assert max_err(out, vmapped_reference(x, w)) == 0.0
    if mode in ("verify", "both") and JAX_VERSION >= (0, 6):
        assert len(skipped) == 1, skipped
        assert re.search(
            r"reprules.verify\(\) skipped its check of kernel 'copy_kernel' \(rule inferred\(out0 <- \[0\]\)\) "
            r"over mesh axis \{'model'\} \(mesh axes \{'data', 'model'\}, " + JAX_TEXT + r"\).*"
            r"Why: the kernel runs under jax.vmap\(..., spmd_axis_name=...\) naming these axes.*"
            r"Fix: verify the kernel outside that vmap", skipped[0], re.S), skipped[0]
    else:  # the rep era checks it (JAX <= 0.5 lowers the gather there)
        assert skipped == []


@needs_new_shard_map
@pytest.mark.parametrize("mode", MODES)
def test_a_shard_map_nested_in_another(mesh, mode):
    x, w, _ = flat_args(mesh)
    out, skipped = _run(mode, nested(mesh), x, w)  # before (0.6 - 0.9): lowering error, or a segfault
    assert max_err(out, np.asarray(x) * np.asarray(w)) == 0.0
    if mode in ("verify", "both") and JAX_VERSION < (0, 10):
        assert len(skipped) == 1, skipped
        assert re.search(
            r"skipped its check of kernel 'copy_kernel' .* over mesh axis \{'model'\} \(mesh axes "
            r"\{'data', 'model'\}, " + JAX_TEXT + r"\).*Why: the kernel runs in a shard_map nested in "
            r"another one.*Fix: verify the kernel in a shard_map of its own", skipped[0], re.S), skipped[0]
    else:
        assert skipped == []


@compiles_partial
@pytest.mark.parametrize("mode", MODES)
def test_a_partially_manual_shard_map(mesh, mode):
    x, w, _ = flat_args(mesh)
    (out0, out1), skipped = _run(mode, partially_manual(mesh), x, w)  # before: XLA aborted (0.4.38 - 0.6.2)
    assert max_err(out0, np.asarray(x) * np.asarray(w)) == 0.0
    assert max_err(out1, np.asarray(w) + 1.0) == 0.0
    if mode in ("verify", "both") and JAX_VERSION < (0, 5):
        assert len(skipped) == 1 and re.search(
            r"over mesh axis \{'data'\} \(mesh axes \{'data'\}, " + JAX_TEXT + r"\).*the shard_map is "
            r"partially manual", skipped[0], re.S), skipped
    else:
        assert skipped == []


def test_partial_manual_skip_is_said_when_traced(mesh):
    if JAX_VERSION >= (0, 5):
        pytest.skip(f"JAX {jax.__version__} lowers the check in a partially manual shard_map")
    x, w, _ = flat_args(mesh)
    with pytest.warns(reprules.VerifyWarning, match=r"(?s)kernel 'copy_kernel'.*partially manual.*"
                      r"Fix: verify the kernel in a shard_map manual over every mesh axis"):
        with reprules.verify():
            jax.make_jaxpr(partially_manual(mesh))(x, w)


@needs_abstract_mesh
@pytest.mark.parametrize("mode", MODES)
def test_a_hidden_abstract_mesh(mesh, mode):
    x, w, _ = flat_args(mesh)
    out, skipped = _run(mode, hidden(mesh), x, w)
    assert max_err(out, np.asarray(x) * np.asarray(w)) == 0.0 and skipped == []


# -- the checks that do run still catch a lying rule -------------------------------------


def _lie(axis):
    reprules.replication_rule(rules.invariant(axis))(copy_kernel)


def test_under_spmd_vmap_the_other_axes_are_still_checked(mesh):
    _lie("data")  # a lie: the copy varies over data
    x, w, _ = vmapped_args(mesh)
    with pytest.raises(reprules.ReplicationMismatchError, match=r"kernel 'copy_kernel' is declared "
                       r"replicated over mesh axis 'data'"):
        _run("verify", vmapped(mesh), x, w)


@needs_new_shard_map
def test_in_a_nested_shard_map_a_lie_is_caught_where_jax_lowers_the_check(mesh):
    _lie("data")
    x, w, _ = flat_args(mesh)
    if JAX_VERSION < (0, 10):  # skipped, and said so: the lie goes unchecked
        _, skipped = _run("verify", nested(mesh), x, w)
        assert len(skipped) == 1 and "over mesh axes {'data', 'model'}" in skipped[0], skipped
        return
    with pytest.raises(reprules.ReplicationMismatchError, match=r"replicated over mesh axis 'data'"):
        _run("verify", nested(mesh), x, w)


@compiles_partial
def test_in_a_partially_manual_shard_map_a_lie_is_caught(mesh):
    if JAX_VERSION < (0, 5):
        pytest.skip(f"JAX {jax.__version__}: the check is skipped there (XLA aborts on a host callback)")
    _lie("data")  # out0 = copy(x * w) varies over data
    x, w, _ = flat_args(mesh)
    with pytest.raises(reprules.ReplicationMismatchError, match=r"output 0 of kernel 'copy_kernel' is "
                       r"declared replicated over mesh axis 'data'.*differs across 'data'"):
        _run("verify", partially_manual(mesh), x, w)


# -- gradients: equal to checking off and to the unsharded reference ---------------------


def _grads(step, t, argnums=(0, 1)):
    def loss(x, w):
        out = step(x, w)
        outs = out if isinstance(out, tuple) else (out,)
        ts = t if isinstance(t, tuple) else (t,)
        return sum((o * s).sum() for o, s in zip(outs, ts))

    return jax.grad(loss, argnums=argnums)


def _check_grads(mesh, build, args, t, reference, mode):
    on, _ = _run(mode, _grads(build(mesh), t), *args)
    off = jax.jit(_grads(build(mesh, check=False), t))(*args)
    for got, unchecked, want in zip(on, off, reference):
        assert max_err(got, want) < 1e-4
        assert max_err(got, unchecked) < 1e-4


@pytest.mark.parametrize("mode", ["verify", "both"])
def test_gradients_under_spmd_vmap(mesh, mode):
    x, w, t = vmapped_args(mesh)
    _check_grads(mesh, vmapped, (x, w), t, vmapped_grad_reference(x, w, t), mode)


def _flat_reference(x, w, t):
    x, w, t = (np.asarray(a) for a in (x, w, t))
    return t * w, (t * x).sum(0)


@needs_new_shard_map
@pytest.mark.parametrize("mode", ["verify", "both"])
def test_gradients_in_a_nested_shard_map(mesh, mode):
    x, w, t = flat_args(mesh)
    _check_grads(mesh, nested, (x, w), t, _flat_reference(x, w, t), mode)


@compiles_partial
@pytest.mark.parametrize("mode", ["verify", "both"])
def test_gradients_in_a_partially_manual_shard_map(mesh, mode):
    x, w, t = flat_args(mesh)
    t1 = randn(3, (128,))
    dx, dw = _flat_reference(x, w, t)
    _check_grads(mesh, partially_manual, (x, w), (t, t1), (dx, dw + np.asarray(t1)), mode)


@needs_abstract_mesh
@pytest.mark.parametrize("mode", ["verify", "both"])
def test_gradients_under_a_hidden_abstract_mesh(mesh, mode):
    x, w, t = flat_args(mesh)
    _check_grads(mesh, hidden, (x, w), t, _flat_reference(x, w, t), mode)


def test_the_warning_is_public():
    assert issubclass(reprules.VerifyWarning, UserWarning)
    assert "VerifyWarning" in reprules.__all__
