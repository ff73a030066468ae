"""No harm to custom_vjps that call no registered kernel.

reprules fixes the cotangents of custom_vjps that involve a registered kernel.
Every other custom_vjp must run exactly as with JAX alone while reprules is
active for other kernels (a rule registered elsewhere, the built-in pack
loaded): the same jaxpr, the same StableHLO, the same values, and JAX's own
refusals with JAX's own messages. Each program runs with ``jax_custom_vjp3``
off and on where the release has the flag.
"""

import importlib
import re
import warnings

import jax
import numpy as np
import pytest
from helpers import CUSTOM_VJP3_MODES, custom_vjp3, make_mesh, put, randn, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules


def unrelated_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def ruleless_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def _mul(bwd_w):
    """``x * w`` with a jnp bwd whose weight cotangent is ``bwd_w(g, x, w)``."""

    @jax.custom_vjp
    def mul(x, w):
        return x * w

    mul.defvjp(lambda x, w: (x * w, (x, w)), lambda r, g: (g * r[1], bwd_w(g, *r)))
    return mul


def varying_weight_cotangent():  # JAX >= 0.6 refuses; <= 0.5 psums it
    return _mul(lambda g, x, w: (g * x).sum(0, keepdims=True))


def weight_cotangent_psummed_by_the_user():
    return _mul(lambda g, x, w: jax.lax.psum((g * x).sum(0, keepdims=True), "data"))


def mixed_weight_cotangent():
    @jax.custom_vjp
    def f(x, w):
        return x * w, 2.0 * w

    def bwd(r, g):
        x, w = r
        return g[0] * w, (g[0] * x).sum(0, keepdims=True) + 2.0 * g[1]

    f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
    def summed(x, w):
        y, z = f(x, w)
        return y + z

    return summed


def replicated_cotangent_for_varying_input():
    @jax.custom_vjp
    def f(x, w):
        return x * w

    f.defvjp(lambda x, w: (x * w, (x, w)),
             lambda r, g: (jax.lax.psum(g * r[1], "data")[:4] * 0 + r[1], jax.lax.psum((g * r[0]).sum(0, keepdims=True), "data")))
    return f


def nondiff_argnums():
    def f(scale, x, w):
        return scale * x * w

    f = jax.custom_vjp(f, nondiff_argnums=(0,))
    f.defvjp(lambda s, x, w: (s * x * w, (x, w)), lambda s, r, g: (s * g * r[1], (s * g * r[0]).sum(0, keepdims=True)))
    return lambda x, w: f(3.0, x, w)


def symbolic_zeros():
    @jax.custom_vjp
    def f(x, w):
        return x * w

    def fwd(x, w):
        return x.value * w.value, (x.value, w.value)

    f.defvjp(fwd, lambda r, g: (g * r[1], (g * r[0]).sum(0, keepdims=True)), symbolic_zeros=True)
    return f


def in_scan():
    mul = varying_weight_cotangent()
    return lambda x, w: jax.lax.scan(lambda c, _: (mul(c, w), None), x, None, length=2)[0]


def in_cond():
    mul = weight_cotangent_psummed_by_the_user()
    return lambda x, w: jax.lax.cond(True, lambda: mul(x, w), lambda: x * 2.0)


def under_vmap():
    mul = varying_weight_cotangent()
    return lambda x, w: jax.vmap(mul, in_axes=(0, None))(x, w)


def ruleless_pallas_in_custom_vjp():
    def double(x):
        return pl.pallas_call(ruleless_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    @jax.custom_vjp
    def f(x, w):
        return double(x) * w

    f.defvjp(lambda x, w: (double(x) * w, (x, w)), lambda r, g: (double(g) * r[1], (g * r[0]).sum(0, keepdims=True)))
    return f


PROGRAMS = [  # (name, factory, check)
    ("varying_weight_cotangent", varying_weight_cotangent, True),
    ("weight_cotangent_psummed_by_the_user", weight_cotangent_psummed_by_the_user, True),
    ("mixed_weight_cotangent", mixed_weight_cotangent, True),
    ("replicated_cotangent_for_varying_input", replicated_cotangent_for_varying_input, True),
    ("nondiff_argnums", nondiff_argnums, True),
    ("symbolic_zeros", symbolic_zeros, True),
    ("in_scan", in_scan, True),
    ("in_cond", in_cond, True),
    ("under_vmap", under_vmap, True),
    ("ruleless_pallas_check_off", ruleless_pallas_in_custom_vjp, False),
    ("ruleless_pallas_check_on", ruleless_pallas_in_custom_vjp, True),
]


GAP_REFERENCES = {"in_cond": lambda x, w: x * w}  # the programs JAX <= 0.5 alone refuses
REP_GAPS = r"No replication rule for (cond|while|pmax|pmin)|branches of cond produced mismatched replication types"


def _normalise(text):
    text = text.split("\n--------------------\n")[0]  # JAX's traceback-filtering note
    return re.sub(r"0x[0-9a-f]+", "0x…", text)


def _outcome(factory, check, vjp3):
    """What JAX makes of the program: its grad's jaxpr, StableHLO and values,
    or the error it raises (type and message)."""
    mesh = make_mesh()
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (1, 32)), mesh, P())
    t = randn(2, (16, 32))
    with custom_vjp3(vjp3):
        f = shard_map(factory(), mesh, (P("data", None), P()), P("data", None), check=check)
        grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
        try:
            jaxpr = str(jax.make_jaxpr(grad)(x, w))
            hlo = jax.jit(grad).lower(x, w).as_text()
            values = [np.asarray(v) for v in jax.jit(grad)(x, w)]
        except Exception as err:  # noqa: BLE001 - the refusal itself is the outcome
            return ("error", type(err), _normalise(str(err)))
    return ("ok", _normalise(jaxpr), _normalise(hlo), values)


def _activate_elsewhere():
    """reprules active for other kernels: a rule registered and the built-in pack loaded."""
    reprules.replication_rule()(unrelated_kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 0.12 deprecates pallas.ops
        try:  # 0.4.31+
            module = importlib.import_module("jax.experimental.pallas.ops.gpu.layer_norm")
        except ImportError:  # 0.4.28 - 0.4.30
            module = importlib.import_module("jax.experimental.pallas.ops.layer_norm")
    if len(reprules.registered()) < 2:  # loaded by an earlier test, whose rules were removed
        from reprules._builtin_packs import jax_pallas_ops

        jax_pallas_ops.layer_norm(module)
    assert len(reprules.registered()) >= 2, "the built-in layer_norm pack should have loaded"


@pytest.mark.parametrize("vjp3", CUSTOM_VJP3_MODES, ids=lambda on: f"vjp3={'on' if on else 'off'}")
@pytest.mark.parametrize("name,factory,check", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_custom_vjp_without_registered_kernels_is_untouched(name, factory, check, vjp3):
    assert not reprules.registered()
    alone = _outcome(factory, check, vjp3)
    _activate_elsewhere()
    active = _outcome(factory, check, vjp3)
    if alone[0] == "error" and active[0] == "ok" and re.search(REP_GAPS, alone[2]):
        # JAX <= 0.5's own missing check_rep rules, which reprules fills while
        # active (tests/test_rep_gaps.py): the gradient is the unsharded one.
        assert name in GAP_REFERENCES, f"{name}: JAX alone refused it, reprules ran it: add its reference"
        x, w, t = randn(0, (16, 32)), randn(1, (1, 32)), randn(2, (16, 32))
        ref = GAP_REFERENCES[name]
        expected = jax.grad(lambda x, w: (ref(x, w) * t).sum(), argnums=(0, 1))(x, w)
        for a, b in zip(active[3], expected):
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-4)
        return
    assert alone[0] == active[0], f"{name}: JAX alone gave {alone[:3]}, with reprules {active[:3]}"
    if alone[0] == "error" and issubclass(active[1], reprules.MissingRuleError):
        # A rule-less kernel under checking: reprules' MissingRuleError is a
        # subclass of JAX's exception type and carries JAX's message too.
        assert issubclass(active[1], alone[1])
        assert alone[2] in active[2]
    elif alone[0] == "error":
        assert active == alone
    else:
        assert active[1] == alone[1], "jaxpr differs"
        assert active[2] == alone[2], "StableHLO differs"
        for a, b in zip(active[3], alone[3]):
            np.testing.assert_array_equal(a, b)


def test_the_suite_sees_both_outcomes():
    """The programs above include refusals and successes on every version, so
    the comparison is not vacuous."""
    kinds = {_outcome(f, c, False)[0] for _, f, c in PROGRAMS[:3]}
    assert kinds == {"ok", "error"} or jax.__version_info__ < (0, 6)
