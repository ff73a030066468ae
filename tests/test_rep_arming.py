"""The rep era arms at import (issue 45): ``import reprules`` alone installs its sound types.

On JAX 0.4.38 - 0.5.x, ``check_rep``'s rewrite of a ``cond`` on a device-varying
predicate casts replicated operands inside each branch, so the gradient psums
inside the branch each device took (jax#40823: a collective only some devices
run, which hangs XLA:CPU), and a dynamic ``while_loop`` has no rule at all.
reprules' rules for them (``reprules/_shim/eras/rep_gaps.py``) used to be installed
only once Pallas was imported; they are the rep era's sound types now, installed
at ``import reprules`` as the vma and mat eras' are. Every program here makes
sense on every JAX of the matrix, and is held to the same bar on each: values and
gradients equal to checking off, and no collective inside a ``case`` or ``while``
of the StableHLO (read before anything runs: such a program would hang).
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import collectives_under_branches, env_with_cpu_devices, make_mesh, max_err, put, randn, shard_map
from reprules import _shim

REP_ERA = reprules.jax_support()["regime"] == "rep"  # JAX <= 0.5: check_rep's rules
rep_only = pytest.mark.skipif(not REP_ERA, reason=f"JAX {jax.__version__}: no check_rep rules to arm (rep era only)")

# --- (1) a fresh interpreter: `import reprules`, then JAX, and no Pallas ----------------------
FRESH = textwrap.dedent('''
    import json, sys
    import reprules
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def shard_map(f, mesh, in_specs, out_specs):
        if hasattr(jax, "shard_map"):  # 0.6+
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
        from jax.experimental.shard_map import shard_map as old  # 0.4.28 - 0.5.x
        return old(f, mesh, in_specs, out_specs, check_rep=True)

    def body(x, w):  # jax#40823's cond (replicated branches) and a data-dependent one
        y = jax.lax.cond(jax.lax.axis_index("data") == 1, lambda: w * 2.0, lambda: w * 3.0)
        z = jax.lax.cond(x.sum() > 0, lambda: x * w, lambda: jnp.sin(x) * w)
        return x * y + z

    def reference(x, w):  # the same, unsharded: one row block per 'data' shard
        blocks = jnp.split(x, 4)
        return jnp.concatenate([b * (2.0 if i == 1 else 3.0) * w + jnp.where(b.sum() > 0, b * w, jnp.sin(b) * w)
                                for i, b in enumerate(blocks)])

    def collectives_in_branches(jaxpr, inside=False):  # the jaxpr-level check, so a hang is never run
        found = []
        for eqn in jaxpr.eqns:
            if inside and eqn.primitive.name in ("psum", "psum2", "psum_invariant", "all_gather", "ppermute"):
                found.append(eqn.primitive.name)
            branching = inside or eqn.primitive.name in ("cond", "while")
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        found += collectives_in_branches(sub, branching)
        return found

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rng = np.random.RandomState(0)
    x, w, t = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((16, 32), (32,), (16, 32)))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    f = shard_map(body, mesh, (P("data", None), P()), P("data", None))
    grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
    out = {"pallas": [m for m in sys.modules if m.startswith("jax.experimental.pallas")],
           "patches": [p for p, _ in reprules.jax_patches()]}
    try:
        out["stablehlo"] = jax.jit(grad).lower(xs, ws).as_text()
        out["in_branches"] = collectives_in_branches(jax.make_jaxpr(grad)(xs, ws).jaxpr)
    except Exception as err:  # JAX alone on 0.4.38 - 0.5.x: mismatched replication types
        out["refused"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    if "stablehlo" in out and not out["in_branches"]:
        want = jax.grad(lambda x, w: (reference(x, w) * t).sum(), argnums=(0, 1))(x, w)
        got = jax.jit(grad)(xs, ws)
        out["grad_err"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want))
    out["pallas"] += [m for m in sys.modules if m.startswith("jax.experimental.pallas")]
    print(json.dumps(out))
''')


def _fresh(**env):
    done = subprocess.run([sys.executable, "-c", FRESH], env=env_with_cpu_devices(8, {**os.environ, **env}),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_reprules_alone_arms_the_cond_fix_in_a_fresh_interpreter():
    """No Pallas import: the gradient of a cond on a varying predicate is exact, and its
    psums sit outside every ``case`` / ``while`` of the StableHLO."""
    out = _fresh()
    assert out["pallas"] == [], out["pallas"]
    assert "refused" not in out, out.get("refused")
    if REP_ERA:
        assert "shard_map._check_rules[cond]" in out["patches"], out["patches"]
    assert "stablehlo.case" in out["stablehlo"] and "stablehlo.all_reduce" in out["stablehlo"]
    assert out["in_branches"] == [] and collectives_under_branches(out["stablehlo"]) == []
    assert out["grad_err"] < 1e-4


@rep_only
def test_jax_alone_puts_the_psum_in_a_branch_or_refuses():
    """The control: with nothing armed (``REPRULES_DORMANT=1``), JAX 0.4.38 - 0.5.x refuses the
    program or puts an all-reduce inside a branch (not run: it hangs)."""
    out = _fresh(REPRULES_DORMANT="1")
    assert out["patches"] == []
    assert "refused" in out or collectives_under_branches(out["stablehlo"]), out.get("in_branches")


# --- (2) adversarial programs, in this process ---------------------------------------------
AXIS = lambda: jax.lax.axis_index("data")  # noqa: E731  # the predicate varies over 'data'


def _noise(shape):
    return jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(0), 3), shape)


PROGRAMS = {  # name: per-shard f(x, w) -> (16, 32) rows over 'data'; x: (4, 32) per shard, w: (32,) replicated
    "cond_axis_index": lambda x, w: jax.lax.cond(AXIS() == 1, lambda: x * w, lambda: x * w * 3.0 + 1.0),
    "cond_replicated_branches": lambda x, w: x * jax.lax.cond(AXIS() == 1, lambda: w * 2.0, lambda: w * 3.0),
    "cond_data_dependent": lambda x, w: jax.lax.cond(x.sum() > 0, lambda: x * w, lambda: jnp.sin(x) * w),
    "switch_10_way": lambda x, w: jax.lax.switch(
        (AXIS() * 3) % 10, [lambda k=k: x * w * (k + 1.0) + w * k for k in range(10)]),
    "scan_in_branch": lambda x, w: jax.lax.cond(
        AXIS() == 2, lambda: jax.lax.scan(lambda c, r: (c * 0.5 + r * w, c + r * w), jnp.zeros_like(w), x)[1],
        lambda: x * w),
    "fori_loop_in_branch": lambda x, w: jax.lax.cond(
        AXIS() == 0, lambda: jax.lax.fori_loop(0, 3, lambda i, c: c * w + 0.1, x), lambda: x + w),
    "cumsum_in_branch": lambda x, w: jax.lax.cond(AXIS() >= 2, lambda: jnp.cumsum(x * w, axis=0), lambda: x * w),
    "associative_scan_in_branch": lambda x, w: jax.lax.cond(
        AXIS() == 3, lambda: jax.lax.associative_scan(jnp.add, x * w, axis=0), lambda: x - w),
    "lax_map_in_branch": lambda x, w: jax.lax.cond(
        AXIS() == 1, lambda: jax.lax.map(lambda r: jnp.tanh(r * w), x), lambda: x * w),
    "random_in_branch": lambda x, w: jax.lax.cond(
        AXIS() == 1, lambda: x * w + _noise(x.shape) * w, lambda: x * w),
    "integer_outputs": lambda x, w: (lambda y, n: y * n.astype(y.dtype))(*jax.lax.cond(
        AXIS() == 1, lambda: (x * w, jnp.int32(2)), lambda: (x + w, jnp.int32(3)))),
    "grad_in_branch": lambda x, w: jax.lax.cond(
        AXIS() == 1, lambda: jax.grad(lambda v: (jnp.sin(v) * w).sum())(x) * w, lambda: x * w),
    "while_replicated_predicate": lambda x, w: jax.lax.while_loop(
        lambda c: c[0] < 3 * (jnp.abs(w).sum() > 0), lambda c: (c[0] + 1, c[1] * w), (0, x))[1],
    "while_varying_predicate": lambda x, w: jax.lax.while_loop(  # from the data: XLA's SPMD partitioner
        lambda c: c[0] < jnp.abs(x).sum() / 40, lambda c: (c[0] + 1.0, c[1] * w + 0.5), (0.0, x))[1],  # refuses
    # a while predicate on axis_index (PartitionId), with checking off too
}
FORWARD_ONLY = {"while_replicated_predicate", "while_varying_predicate"}  # no reverse mode: jvp instead


@pytest.fixture(scope="module")
def data():
    mesh = make_mesh()
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (32,)), mesh, P())
    return mesh, x, w, randn(2, (16, 32))


def _derivatives(name, f, t):
    """Gradients of ``sum(f(x, w) * t)`` (a jvp along (x, w) where reverse mode cannot go)."""
    if name in FORWARD_ONLY:
        return lambda x, w: jax.jvp(f, (x, w), (x * 0.5, w * 0.25))
    return jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_adversarial_program_matches_checking_off_with_no_collective_in_a_branch(name, data):
    mesh, x, w, t = data
    on = shard_map(PROGRAMS[name], mesh, (P("data", None), P()), P("data", None))
    off = shard_map(PROGRAMS[name], mesh, (P("data", None), P()), P("data", None), check=False)
    for fn in (on, _derivatives(name, on, t)):
        text = jax.jit(fn).lower(x, w).as_text()  # read before it runs: a collective in a branch hangs
        assert collectives_under_branches(text) == [], collectives_under_branches(text)
    assert max_err(jax.jit(on)(x, w), jax.jit(off)(x, w)) < 1e-4
    assert max_err(jax.jit(_derivatives(name, on, t))(x, w), jax.jit(_derivatives(name, off, t))(x, w)) < 1e-3


# --- arming, activation and the switch ---------------------------------------------------------
def _labels():
    return [p for p, _ in reprules.jax_patches()]


def unrelated_kernel(x_ref, o_ref):  # its rule activates the shim (it is never called)
    o_ref[...] = x_ref[...]


@rep_only
def test_the_rules_are_armed_once_and_outlive_deactivation(dormant):
    """Installed with the sound types, never again by activation; releasing the shim's
    patches (no rule registered, disarmed) leaves them in place."""
    assert _labels().count("shard_map._check_rules[cond]") == 1
    reprules.replication_rule()(unrelated_kernel)
    assert _shim.active() and _labels().count("shard_map._check_rules[cond]") == 1
    reprules.unregister(unrelated_kernel)
    assert not _shim.active()
    assert _labels().count("shard_map._check_rules[cond]") == 1


@rep_only
def test_without_sound_types_activation_installs_the_rules_itself(dormant):
    """``REPRULES_DORMANT=1`` arms nothing at import: a registered rule installs them, as before."""
    _shim.disarm_sound_types()
    try:
        assert "shard_map._check_rules[cond]" not in _labels()
        reprules.replication_rule()(unrelated_kernel)
        assert _labels().count("shard_map._check_rules[cond]") == 1
        reprules.unregister(unrelated_kernel)
        assert "shard_map._check_rules[cond]" not in _labels()
    finally:
        _shim.arm_sound_types()


def _cond_gradient_jaxpr(mesh, x, w, t):
    f = shard_map(PROGRAMS["cond_replicated_branches"], mesh, (P("data", None), P()), P("data", None))
    return str(jax.make_jaxpr(jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1)))(x, w))


@rep_only
def test_sound_types_off_keeps_jax_cond_rewrite(data, dormant, monkeypatch):
    """``REPRULES_SOUND_TYPES=0`` (read at trace time): JAX's own rewrite of the cond, the same
    jaxpr as with nothing armed (psums inside the branches: not run)."""
    mesh, x, w, t = data
    ours = _cond_gradient_jaxpr(mesh, x, w, t)
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")
    jax.clear_caches()
    switched_off = _cond_gradient_jaxpr(mesh, x, w, t)
    monkeypatch.delenv("REPRULES_SOUND_TYPES")
    _shim.disarm_sound_types()
    try:
        jax.clear_caches()
        jax_alone = _cond_gradient_jaxpr(mesh, x, w, t)
    except NotImplementedError as err:  # JAX 0.4.28: no cond rule of JAX's own to keep
        assert "No replication rule for cond" in str(err)
        jax_alone = None
    finally:
        _shim.arm_sound_types()
        jax.clear_caches()
    if jax_alone is None:
        assert switched_off == ours  # reprules' rule fills the gap, switched off or not
    else:
        assert switched_off == jax_alone != ours
