"""The annotation union: a hand-written out_shape annotation that says an output
is replicated over an axis the kernel body (analysed by inference) makes it
depend on is widened to the union of annotation and body, with one
``reprules.ReplicationWarning`` per kernel; ``reprules.strict()`` refuses it.

The kernels mimic tokamax's ragged_dot VJP: the weight gradient's out_shape is
annotated with the weight's own (replicated) type although it is a per-shard
partial sum over the tokens' axis. JAX alone would believe it and skip the psum
over 'data' (a silently wrong weight gradient); with the union, reprules'
custom_vjp fix adds exactly that psum.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CAST_UP, NEW_SHARD_MAP, max_err, psum_axes, put, randn, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules

pytestmark = pytest.mark.skipif(not NEW_SHARD_MAP, reason="out_shape carries varying axes from JAX 0.6 (check_vma)")

M, K, N = 32, 16, 8
FIELD = "manual_axis_type" if hasattr(jax.ShapeDtypeStruct((1,), jnp.float32), "manual_axis_type") else "vma"


def _annotated_like(shape, dtype, like):
    """An out_shape annotated with ``like``'s own type, as tokamax annotates a cotangent."""
    t = jax.typeof(like)
    return jax.ShapeDtypeStruct(shape, dtype, **{FIELD: getattr(t, FIELD)})


def matmul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] @ w_ref[...]


def wgrad_kernel(x_ref, g_ref, o_ref):
    o_ref[...] = x_ref[...].T @ g_ref[...]


@jax.custom_vjp
def linear(x, w):
    return pl.pallas_call(matmul_kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype),
                          interpret=True)(x, w)


def _fwd(x, w):
    return linear(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    dw = pl.pallas_call(wgrad_kernel, out_shape=_annotated_like(w.shape, w.dtype, w), interpret=True)(x, g)
    return g @ w.T, dw


linear.defvjp(_fwd, _bwd)


@pytest.fixture(autouse=True)
def inferred():
    """Rules derived from the bodies, as a pack's rules.inferred() gives them."""
    from reprules._shim.rules import _union

    _union._warned.clear()  # one warning per kernel and process: each test starts afresh
    with reprules.inference():
        yield


def _inputs(mesh, m=M):
    x = put(randn(0, (m, K)), mesh, P("data", None))
    w = put(randn(1, (K, N)), mesh, P())
    t = randn(2, (m, N))
    return x, w, t


def _grad(mesh, t, check=True, cast=False):
    def body(x, w):
        if cast:  # the workaround of today: the weight made varying first, so the annotation is right
            cast_up = getattr(jax.lax, "pcast", None)  # 0.6 - 0.7: jax.lax.pvary
            w = cast_up(w, "data", to="varying") if cast_up else jax.lax.pvary(w, "data")
        return linear(x, w)

    f = shard_map(body, mesh, (P("data", None), P()), P("data", None), check=check)
    return jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))


def _expected(x, w, t):
    xn, wn, tn = (np.asarray(a, np.float64) for a in (x, w, t))
    return tn @ wn.T, xn.T @ tn


def test_the_union_makes_the_weight_gradient_exact_with_one_psum_over_the_tokens(mesh):
    x, w, t = _inputs(mesh)
    grad = _grad(mesh, t)
    with pytest.warns(reprules.ReplicationWarning) as caught:
        psums = psum_axes(grad, x, w)
        gx, gw = jax.jit(grad)(x, w)
    ex, ew = _expected(x, w, t)
    assert max_err(gx, ex) < 1e-4 and max_err(gw, ew) < 1e-4
    assert psums == [("data",)]  # the weight gradient's psum: no defensive one over 'model'
    message = str(caught[0].message)
    assert "'wgrad_kernel'" in message and "replicated over {'data'}" in message
    assert "silently wrong" in message and "test_annotation_union.py" in message  # where it was passed


def test_the_union_agrees_with_jax_alone_unchecked(mesh):
    x, w, t = _inputs(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        on = jax.jit(_grad(mesh, t))(x, w)
    off = jax.jit(_grad(mesh, t, check=False))(x, w)
    assert max_err(on, off) < 1e-5


def test_strict_keeps_the_refusal(mesh):
    x, w, t = _inputs(mesh)
    with reprules.strict(), pytest.raises(
        reprules.RuleError, match=r"(?s)'wgrad_kernel' annotates output 0 as replicated over \{'data'\}.*" + CAST_UP
    ):
        jax.jit(_grad(mesh, t))(x, w)


def test_one_warning_per_kernel(mesh):
    with pytest.warns(reprules.ReplicationWarning) as caught:
        for m in (M, 2 * M):  # two shapes: two traces of the same kernel
            x, w, t = _inputs(mesh, m)
            jax.jit(_grad(mesh, t))(x, w)
    assert len([c for c in caught if issubclass(c.category, reprules.ReplicationWarning)]) == 1


def test_an_annotation_that_is_right_gets_no_warning(mesh):
    x, w, t = _inputs(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        gx, gw = jax.jit(_grad(mesh, t, cast=True))(x, w)
    ex, ew = _expected(x, w, t)
    assert max_err(gx, ex) < 1e-4 and max_err(gw, ew) < 1e-4


def test_an_aliased_output_is_still_refused(mesh):
    """JAX types an aliased output like its input: widening it would need the input cast up."""
    x = put(randn(0, (M, K)), mesh, P("data", None))
    acc = put(jnp.zeros((K, K)), mesh, P())

    def accumulate_kernel(x_ref, acc_ref, o_ref):
        o_ref[...] = acc_ref[...] + x_ref[...].T @ x_ref[...]

    def body(x, acc):
        return pl.pallas_call(accumulate_kernel, out_shape=_annotated_like(acc.shape, acc.dtype, acc),
                              input_output_aliases={1: 0}, interpret=True)(x, acc)

    f = shard_map(body, mesh, (P("data", None), P()), P())
    with pytest.raises(reprules.RuleError, match=r"(?s)is the buffer of its input 1"):
        jax.jit(f)(x, acc)


# --- a library's own pcast of a widened output (MaxText's megablox fork) -----------------
@jax.jit  # as megablox's backend.gmm: the kernel is bound inside a jit, the cast is outside
def _replicated_matmul(x, w):
    return pl.pallas_call(matmul_kernel, out_shape=_annotated_like((x.shape[0], w.shape[1]), x.dtype, w),
                          interpret=True)(x, w)


def _cast_fwd(x, w):
    out = _replicated_matmul(x, w)  # annotated replicated, then cast to the activations' axes
    return jax.lax.pcast(out, "data", to="varying"), (x, w)


@jax.custom_vjp
def cast_linear(x, w):
    return _cast_fwd(x, w)[0]


cast_linear.defvjp(_cast_fwd, _bwd)
needs_pcast = pytest.mark.skipif(not hasattr(jax.lax, "pcast"), reason=f"JAX {jax.__version__} has no jax.lax.pcast")


@needs_pcast
def test_a_library_cast_of_a_widened_output_to_varying_is_the_identity(mesh):
    """The forward's annotation (replicated) is widened to {'data'}; the library's own
    ``pcast(out, 'data', to='varying')`` (JAX: "Unsupported pcast from=varying") is then
    the identity: forward and gradients exact, one psum over 'data'."""
    x, w, t = _inputs(mesh)
    f = shard_map(cast_linear, mesh, (P("data", None), P()), P("data", None))
    grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
    with pytest.warns(reprules.ReplicationWarning) as caught:
        out = jax.jit(f)(x, w)
        psums = psum_axes(grad, x, w)
        gx, gw = jax.jit(grad)(x, w)
        out_again = jax.jit(f)(x, w)  # the kernel's jit cached: its output is found all the same
    ex, ew = _expected(x, w, t)
    assert max_err(out, np.asarray(x, np.float64) @ np.asarray(w, np.float64)) < 1e-4
    assert max_err(out_again, out) == 0.0
    assert max_err(gx, ex) < 1e-4 and max_err(gw, ew) < 1e-4
    assert psums == [("data",)]
    assert {"'matmul_kernel'", "'wgrad_kernel'"} <= {m for c in caught for m in ("'matmul_kernel'", "'wgrad_kernel'")
                                                     if m in str(c.message)}


@needs_pcast
def test_a_cast_of_any_other_varying_value_is_refused_as_jax_refuses_it(mesh):
    """Only the widened output's cast is the identity: the same cast of the (data-varying)
    activations next to it gets JAX's own error, word for word."""
    x, w, _ = _inputs(mesh)

    def body(x, w):
        return cast_linear(x, w) + jax.lax.pcast(x, "data", to="varying")[:, :N]

    f = shard_map(body, mesh, (P("data", None), P()), P("data", None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        with pytest.raises(ValueError) as refused:
            jax.jit(f)(x, w)
    assert refused.value.args == ("Unsupported pcast from=varying, to='varying'",)
