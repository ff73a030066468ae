"""JAX's own check_rep gaps on JAX <= 0.5, filled from ``import reprules`` (issues 10, 45).

Ordinary ``jnp`` programs with ``cond``, ``switch``, a dynamic ``while_loop`` or
``pmax`` fail under ``check_rep=True`` on these releases. With reprules imported
(the rep era's sound types, a rule registered or not) they run, with values and
gradients equal to an unsharded reference and psums over ``data`` only. On JAX
>= 0.6 the same programs run with JAX alone, and reprules changes nothing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NEW_SHARD_MAP, make_mesh, max_err, psum_axes, put, randn, shard_map
from jax.sharding import PartitionSpec as P

import reprules
from reprules import _shim

SHARDS = 4  # 'data' of the (4, 2) mesh


def unrelated_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


PROGRAMS = {  # name: (per-shard function, differentiable, JAX <= 0.5's error without reprules)
    "cond": (lambda x, w: jax.lax.cond(True, lambda: x * w, lambda: x * 3.0), True, "cond"),
    "cond_varying_predicate": (
        lambda x, w: jax.lax.cond(x.sum() > 0, lambda: x * w, lambda: jnp.broadcast_to(w, x.shape)), True, "cond"),
    "cond_replicated_predicate": (
        lambda x, w: x + jax.lax.cond(w.sum() > 0, lambda: w * 2.0, lambda: w), True, "cond"),
    "switch": (lambda x, w: jax.lax.switch(1, [lambda: x * 3.0, lambda: x * w, lambda: x]), True, "cond"),
    "while": (lambda x, w: jax.lax.while_loop(
        lambda c: c[0] < jnp.abs(w).sum(), lambda c: (c[0] + 1.0, c[1] * 1.5), (0.0, x))[1], False, "while"),
    "while_varying_predicate": (lambda x, w: jax.lax.while_loop(
        lambda c: c[0] < jnp.abs(x).sum() / 8, lambda c: (c[0] + 1.0, c[1] * w), (0.0, x))[1], False, "while"),
    "pmax": (lambda x, w: x * jax.lax.pmax(jnp.abs(x).max(), "data"), False, "pmax"),
}

JAX_ALONE = {  # JAX <= 0.5's refusal, by release
    "cond": r"No replication rule for cond|branches of cond produced mismatched replication types",
    "while": r"No replication rule for while",
    "pmax": r"No replication rule for pmax",
}


def _data():
    mesh = make_mesh()
    return mesh, put(randn(0, (16, 32)), mesh, P("data", None)), put(randn(1, (1, 32)), mesh, P()), randn(2, (16, 32))


def _reference(fn, x, w):
    """The shard_map's meaning, unsharded: ``fn`` on each row block of ``x``."""
    blocks = jnp.split(x, SHARDS)
    if fn is PROGRAMS["pmax"][0]:
        peak = jnp.abs(x).max()
        return jnp.concatenate([b * peak for b in blocks])
    return jnp.concatenate([fn(b, w) for b in blocks])


def _sharded(fn, mesh):
    return shard_map(fn, mesh, (P("data", None), P()), P("data", None))


@pytest.fixture
def jax_alone(dormant):
    """JAX's own rules: the shim disarmed and its sound types (these rules) too."""
    _shim.disarm_sound_types()
    jax.clear_caches()
    yield
    _shim.arm_sound_types()
    jax.clear_caches()


@pytest.mark.skipif(NEW_SHARD_MAP, reason="JAX >= 0.6 has these rules itself (the test below covers it)")
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_jax_alone_refuses_these_programs(name, jax_alone):
    fn, differentiable, kind = PROGRAMS[name]
    mesh, x, w, _ = _data()
    if name == "cond" and jax.__version_info__ >= (0, 4, 38):
        pytest.skip("JAX 0.4.38+ has a cond rule; only branches that disagree are refused")
    if name in ("cond_replicated_predicate", "switch") and jax.__version_info__ >= (0, 4, 38):
        pytest.skip("branches that agree: JAX 0.4.38+ runs it")
    if name == "pmax" and jax.__version_info__ >= (0, 4, 38):
        pytest.skip("JAX 0.4.38+ has a pmax rule")
    f = _sharded(fn, mesh)

    def run():  # 0.4.38 - 0.5.x check cond's branches when differentiating
        jax.jit(f)(x, w)
        if differentiable:
            jax.jit(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)))(x, w)

    with pytest.raises(Exception, match=JAX_ALONE[kind]):
        run()


@pytest.mark.parametrize("registered", [False, True], ids=["imported", "rule_registered"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_runs_exactly_with_reprules_imported(name, registered, dormant):
    fn, differentiable, _ = PROGRAMS[name]
    if name == "cond_varying_predicate" and NEW_SHARD_MAP:
        pytest.skip("JAX >= 0.6 types cond branches: one that varies and one that does not is a type "
                    "error there (the user writes jax.lax.pvary)")
    if registered:  # the shim active as well: the rules are not installed twice
        reprules.replication_rule()(unrelated_kernel)
    mesh, x, w, t = _data()
    f = _sharded(fn, mesh)
    xn, wn = jnp.asarray(np.asarray(x)), jnp.asarray(np.asarray(w))
    assert max_err(jax.jit(f)(x, w), _reference(fn, xn, wn)) < 1e-4
    if not differentiable:
        return
    grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
    expected = jax.grad(lambda x, w: (_reference(fn, x, w) * t).sum(), argnums=(0, 1))(xn, wn)
    assert max_err(jax.jit(grad)(x, w), expected) < 1e-3
    axes = psum_axes(grad, x, w)
    assert all(a == ("data",) for a in axes), axes  # nothing over 'model', where all is replicated


@pytest.mark.skipif(NEW_SHARD_MAP, reason="rep regime only")
def test_a_varying_predicate_keeps_collectives_out_of_the_branches():
    """Devices along 'data' may take different branches: a psum inside one
    branch only would deadlock, so the casts (and their psums) sit outside."""
    mesh, x, w, t = _data()
    f = _sharded(PROGRAMS["cond_varying_predicate"][0], mesh)
    grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
    jaxpr = jax.make_jaxpr(grad)(x, w).jaxpr

    def conds(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "cond":
                yield eqn
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from conds(sub)

    found = list(conds(jaxpr))
    assert found
    for eqn in found:
        for branch in eqn.params["branches"]:
            names = {e.primitive.name for e in branch.jaxpr.eqns}
            assert not names & {"psum", "psum2", "pbroadcast"}, names
