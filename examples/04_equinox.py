"""An Equinox model with a Pallas layer, trained under shard_map with checking on.

An ``eqx.Module`` MLP whose linear layers compute ``x @ W`` with a Pallas kernel
(``interpret=True``, under ``custom_vjp`` with Pallas backward kernels, each
kernel with a reprules rule). On a (4, 2) mesh ``("data", "model")`` the
parameters are replicated and the batch sharded over ``data``, both placed with
``eqx.filter_shard``; the loss runs under ``shard_map`` with checking on
(``check_vma=True``; ``check_rep=True`` on JAX <= 0.5) and the model is trained
a few SGD steps with ``eqx.filter_jit``.

The script prints the all-reduces of one step with checking off (what users
do without a rule: the parameter gradients are also summed over ``model``,
where they are replicated, a defensive all-reduce) and with reprules (summed
over ``data`` only), checks the gradients and the trained parameters against
unsharded training, and exits non-zero if a check fails. Without Equinox it
says what to install, in one line, and exits 1; with an Equinox that does not
support the installed JAX it prints ``SKIPPED:`` and why, and exits 0.

Run (8 fake CPU devices are set up by the script itself; needs Equinox:
``pip install equinox``, or ``pip install '.[examples]'`` in the reprules clone):

    python examples/04_equinox.py
    reprules audit examples/04_equinox.py     # its audit_step: checking off vs reprules
"""

from reprules import testing

testing.fake_cpu_devices(8)  # first thing: 8 fake CPU devices, before JAX starts

import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402

try:
    import equinox as eqx
except Exception as err:
    if isinstance(err, ModuleNotFoundError) and err.name == "equinox":  # not installed
        sys.exit("04_equinox.py needs Equinox: pip install equinox (or pip install '.[examples]' in the "
                 "reprules clone; reprules is not on PyPI)")
    # installed, but built for another JAX (it may import what this JAX lacks)
    print(f"SKIPPED: equinox is not importable with JAX {jax.__version__} ({type(err).__name__}: {err}); "
          "pip install equinox")
    sys.exit(0)
if not hasattr(eqx, "filter_shard"):
    print(f"SKIPPED: equinox {getattr(eqx, '__version__', '?')} has no filter_shard (added in equinox 0.11)")
    sys.exit(0)

# --- a Pallas matmul with Pallas backward kernels, each with a rule --------------------


@reprules.replication_rule()
def matmul_kernel(x_ref, w_ref, o_ref):  # x @ w
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)


@reprules.replication_rule()
def matmul_nt_kernel(g_ref, w_ref, o_ref):  # g @ w.T
    dims = (((1,), (1,)), ((), ()))
    o_ref[...] = jax.lax.dot_general(g_ref[...], w_ref[...], dims, preferred_element_type=jnp.float32)


@reprules.replication_rule()
def matmul_tn_kernel(x_ref, g_ref, o_ref):  # x.T @ g
    dims = (((0,), (0,)), ((), ()))
    o_ref[...] = jax.lax.dot_general(x_ref[...], g_ref[...], dims, preferred_element_type=jnp.float32)


def _call(kernel, a, b, shape):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32), interpret=True)(a, b)


@jax.custom_vjp
def matmul(x, w):
    return _call(matmul_kernel, x, w, (x.shape[0], w.shape[1]))


def _matmul_bwd(res, g):
    x, w = res
    return _call(matmul_nt_kernel, g, w, x.shape), _call(matmul_tn_kernel, x, g, w.shape)


matmul.defvjp(lambda x, w: (matmul(x, w), (x, w)), _matmul_bwd)

# --- the Equinox model -------------------------------------------------------------------


class PallasLinear(eqx.Module):
    """``x @ weight + bias``, the matmul by the Pallas kernel."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, n_in, n_out, key):
        self.weight = jax.random.normal(key, (n_in, n_out), jnp.float32) / np.sqrt(n_in)
        self.bias = jnp.zeros((n_out,), jnp.float32)

    def __call__(self, x):
        return matmul(x, self.weight) + self.bias


class MLP(eqx.Module):
    layers: list

    def __init__(self, sizes, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [PallasLinear(a, b, k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = relu(layer(x))
        return self.layers[-1](x)


def relu(x):
    """``jax.nn.relu``, written so that its gradient also type-checks with ``jax_auto_pcast``
    off (JAX 0.12: ``jax.nn.relu``'s JVP selects between a varying tangent and replicated
    zeros, which JAX then refuses)."""
    return x * (x > 0)


def varying(tree, axis):
    """The arrays of ``tree``, replicated over ``axis``, cast to vary over it: an explicit cast
    where replicated values meet varying ones, as JAX asks with ``jax_auto_pcast`` off."""
    if hasattr(jax.lax, "pcast"):  # JAX 0.8+
        return jax.tree_util.tree_map(lambda x: jax.lax.pcast(x, axis, to="varying"), tree)
    if hasattr(jax.lax, "pvary"):  # JAX 0.6 - 0.7
        return jax.tree_util.tree_map(lambda x: jax.lax.pvary(x, axis), tree)
    return tree  # JAX <= 0.5 (check_rep): no cast needed, none to write


def make_loss(mesh, static, check):
    """The loss of the whole batch: each device's shard under shard_map, then pmean."""

    def local_loss(params, x, y):
        # the replicated parameters meet the batch's rows, which vary over `data`: cast them
        # (with checking on; off, JAX tracks nothing to cast). The loss: each device's sum of
        # squared errors, summed, over the batch's size (no float constant next to a varying
        # value, which JAX 0.12 refuses with jax_auto_pcast off, as in jnp.mean and in the
        # gradient of ** 2)
        model = eqx.combine(varying(params, "data") if check else params, static)
        d = model(x) - y
        return jax.lax.psum(jnp.sum(d * d), "data") / (y.size * mesh.shape["data"])

    sharded = testing.shard_map(local_loss, mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(), check=check)

    def loss(model, x, y):
        params, _ = eqx.partition(model, eqx.is_array)
        return sharded(params, x, y)

    return loss


def reference_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def make_step(loss, replicated=None):
    @eqx.filter_jit
    def step(model, x, y):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))
        if replicated is not None:
            model = eqx.filter_shard(model, replicated)
        return model, value

    return step


def max_err(a, b):
    leaves = lambda t: jax.tree_util.tree_leaves(eqx.filter(t, eqx.is_array))  # noqa: E731
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(leaves(a), leaves(b)))


def main():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    model = MLP([16, 32, 32, 8], jax.random.PRNGKey(0))
    rng = np.random.RandomState(0)
    x, y = rng.randn(32, 16).astype(np.float32), rng.randn(32, 8).astype(np.float32)

    ref_grads = eqx.filter_grad(reference_loss)(model, x, y)
    ref_model, ref_step, steps = model, make_step(reference_loss), 3
    for _ in range(steps):
        ref_model, _ = ref_step(ref_model, x, y)

    sharded_model = eqx.filter_shard(model, replicated)  # parameters on every device
    sx, sy = eqx.filter_shard((x, y), by_data)  # the batch split over `data`
    _, static = eqx.partition(model, eqx.is_array)

    print(f"JAX {jax.__version__}, equinox {getattr(eqx, '__version__', '?')}, mesh (4, 2) ('data', 'model'); "
          "params replicated, batch on 'data'")
    print(f"{'':24}{'all-reduce over data':>21}{'over data,model':>16}{'defensive B':>13}{'|grad - ref|':>14}")
    failed = []
    for label, check in (("checking off", False), ("reprules, checking on", True)):
        loss = make_loss(mesh, static, check)
        grad_fn = lambda m, a, b: eqx.filter_grad(loss)(m, a, b)  # noqa: E731,B023
        report = testing.collectives(grad_fn, sharded_model, sx, sy)
        error = max_err(eqx.filter_jit(grad_fn)(sharded_model, sx, sy), ref_grads)
        on_data = report.count("all-reduce", axes="data", level="jaxpr")
        on_both = report.count("all-reduce", axes=("data", "model"), level="jaxpr")
        defensive = sum(c.bytes for c in report.defensive)
        print(f"{label:24}{on_data:>21}{on_both:>16}{defensive:>13}{error:>14.1e}")
        if error > 1e-4:
            failed.append(f"{label}: gradients differ from the unsharded ones")
        if check and (defensive or on_both):
            failed.append(f"{label}: defensive all-reduce over 'model'")

    step, trained, losses = make_step(make_loss(mesh, static, True), replicated), sharded_model, []
    for _ in range(steps):
        trained, value = step(trained, sx, sy)
        losses.append(float(value))
    error = max_err(trained, ref_model)
    print(f"trained {steps} steps with checking on: loss " + " -> ".join(f"{v:.4f}" for v in losses)
          + f"; |params - unsharded training| {error:.1e}")
    if error > 1e-4 or not losses[-1] < losses[0]:
        failed.append("training differs from unsharded training")
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)
    print("OK: the Equinox model trains under shard_map with checking on, no defensive all-reduce")


def audit_step(check=True):
    """The target of ``reprules audit examples/04_equinox.py``: the model's gradient, the
    parameters replicated and the batch on ``data``, with checking off or on."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    model = MLP([16, 32, 32, 8], jax.random.PRNGKey(0))
    rng = np.random.RandomState(0)
    x, y = rng.randn(32, 16).astype(np.float32), rng.randn(32, 8).astype(np.float32)
    params, static = eqx.partition(model, eqx.is_array)
    loss = make_loss(mesh, static, check)
    sharded = eqx.filter_shard(params, NamedSharding(mesh, P()))
    sx, sy = eqx.filter_shard((x, y), NamedSharding(mesh, P("data")))
    return {"step": eqx.filter_grad(lambda p, a, b: loss(eqx.combine(p, static), a, b)),
            "args": (sharded, sx, sy), "name": "equinox_mlp",
            "reference": lambda: eqx.filter(eqx.filter_grad(reference_loss)(model, x, y), eqx.is_array)}


if __name__ == "__main__":
    main()
