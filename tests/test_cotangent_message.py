"""A CotangentError explains the user's own bwd (issue 36, item 5).

The natural bwd of a kernel that reads its device index, ``return (dev(g),)``,
got a message about "a part that was replicated over 'model'" that explained
nothing in the user's code. Now it names the bwd and its line, quotes the
returned element, names the kernel and the primitive that made reprules unsure,
and gives the fix in the user's terms: following it gives the gradient of
checking off.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import make_mesh, max_err, put, randn, shard_map
from reprules import rules


def dev_kernel(x_ref, o_ref):  # each device scales by its index along `model`, plus one
    o_ref[...] = x_ref[...] * (jax.lax.axis_index("model") + 1).astype(jnp.float32)


def dev(x):
    return pl.pallas_call(dev_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _layer(bwd_text):
    """``custom_vjp(dev)`` whose bwd returns ``(eval(bwd_text),)``, ``g`` the incoming cotangent."""
    f = jax.custom_vjp(dev)
    if bwd_text == "dev(g)":
        f.defvjp(lambda x: (dev(x), None), lambda _, g: (dev(g),))  # the natural bwd, as written
    else:
        f.defvjp(lambda x: (dev(x), None), lambda _, g: (eval(bwd_text, {"jax": jax, "dev": dev, "g": g}),))  # noqa: S307
    return f


def _grad(bwd_text, check):
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    t = randn(1, (8, 256))
    step = shard_map(_layer(bwd_text), mesh, P("data", None), P("data", "model"), check)
    return jax.jit(jax.grad(lambda x: (step(x) * t).sum()))(x), x, t


def test_the_natural_bwd_is_explained_and_its_fix_is_exact():
    reprules.replication_rule(rules.varying("model"))(dev_kernel)
    with pytest.raises(reprules.CotangentError) as info:
        _grad("dev(g)", check=True)
    message = str(info.value)
    one_line = " ".join(message.split())
    assert re.search(r"custom_vjp function 'dev' \(`<lambda>` at \S+test_cotangent_message\.py:\d+\) returned, "
                     r"for input 0 \('x'\) of type float32\[2,128\]\S* \(element 0 of what it returns, `dev\(g\)`\), "
                     r"a cotangent that varies over \{'model'\}", one_line), message
    assert f"(mesh axes {{'data', 'model'}}, JAX {jax.__version__})" in one_line, message
    assert re.search(r"Here it goes through the Pallas kernel 'dev_kernel' \(pallas_call.*?\), whose body "
                     r"names \{'model'\} \(`axis_index`", one_line), message
    (fix,) = re.findall(r"return `(jax\.lax\.psum\(dev\(g\), \('model',\)\))` in its place", one_line)

    got, x, t = _grad(fix, check=True)  # the printed fix, followed
    off, _, _ = _grad("dev(g)", check=False)
    scale = np.tile(np.repeat([1.0, 2.0], 128), (8, 1))  # device m along `model` scales by m + 1
    reference = (np.asarray(t) * scale).reshape(8, 2, 128).sum(1)  # d/dx sum(dev(x) * t), unsharded
    assert max_err(got, off) < 1e-5 and max_err(got, reference) < 1e-4


def test_a_mixed_cotangent_quotes_the_element_and_the_cast():
    """The replicated ``2.0 * g_z`` made varying by the addition: the Fix quotes the user's element."""
    reprules.replication_rule()(mul_kernel)

    @jax.custom_vjp
    def f(x, w):
        return mul(x, w), 2.0 * w

    def bwd(res, g):
        (x, w), (g_y, g_z) = res, g
        dw = (g_y * x).sum(0, keepdims=True)
        return g_y * w, dw + 2.0 * g_z

    f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
    mesh = make_mesh()
    x, w = put(randn(0, (16, 32)), mesh, P("data", None)), put(randn(1, (1, 32)), mesh, P())
    g = shard_map(f, mesh, (P("data", None), P()), (P("data", None), P()))
    with pytest.raises(reprules.CotangentError) as info:
        jax.jit(jax.grad(lambda x, w: g(x, w)[0].sum() + g(x, w)[1].sum(), argnums=1))(x, w)
    one_line = " ".join(str(info.value).split())
    assert re.search(r"\(`bwd` at \S+test_cotangent_message\.py:\d+\) returned, for input 1 \('w'\) of type "
                     r"\S+ \(element 1 of what it returns, `dw \+ 2\.0 \* g_z`\), a cotangent that varies over "
                     r"\{'data'\} and mixes in a part that was replicated over 'data'", one_line), one_line
    assert "Here, split `dw + 2.0 * g_z` into the part each device computes from its own shard" in one_line
    assert "`jax.lax.psum(dw_varying, ('data',)) + dw_replicated`" in one_line


def mul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def mul(x, w):
    return pl.pallas_call(mul_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)
