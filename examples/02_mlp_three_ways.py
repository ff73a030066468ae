"""The shard_map tutorial's MLP, trained three ways, with a Pallas matmul and checking on.

The MLP of JAX's shard_map tutorial ("Neural networks" section), its matmuls
done by Pallas kernels (``interpret=True``) under ``custom_vjp`` with Pallas
backward kernels, trained on 8 devices:

* **data parallel**: parameters replicated, batch sharded over ``batch``;
* **FSDP**: parameters sharded over ``batch`` too, each layer's weights
  all-gathered in the forward pass and, through ``jax.remat``, all-gathered
  again in the backward pass instead of being kept;
* **tensor parallel**: features sharded over ``feats``, a local matmul and
  then ``psum_scatter``.

The three kernels get a rule (``@reprules.replication_rule()``), so
``shard_map`` runs with checking on (``check_vma=True``; ``check_rep=True`` on
JAX <= 0.5). For each way the script checks that the gradients equal the
unsharded loss's, that a few SGD steps track unsharded training, and that no
collective is defensive; it prints one line per way and exits non-zero if a
check fails.

Run (8 fake CPU devices are set up by the script itself):

    python examples/02_mlp_three_ways.py
    reprules audit examples/02_mlp_three_ways.py    # its audit_step (way="fsdp", "dp" or "tp")
"""

from reprules import testing

testing.fake_cpu_devices(8)  # first thing: 8 fake CPU devices, before JAX starts

import sys  # noqa: E402
from collections import Counter  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402

# --- the Pallas matmul: forward and backward kernels, each with a rule --------------


@reprules.replication_rule()  # outputs vary like the union of the inputs
def matmul_kernel(x_ref, w_ref, o_ref):  # x @ w
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)


@reprules.replication_rule()
def matmul_nt_kernel(g_ref, w_ref, o_ref):  # g @ w.T: the input's cotangent
    dims = (((1,), (1,)), ((), ()))
    o_ref[...] = jax.lax.dot_general(g_ref[...], w_ref[...], dims, preferred_element_type=jnp.float32)


@reprules.replication_rule()
def matmul_tn_kernel(x_ref, g_ref, o_ref):  # x.T @ g: the weight's cotangent
    dims = (((0,), (0,)), ((), ()))
    o_ref[...] = jax.lax.dot_general(x_ref[...], g_ref[...], dims, preferred_element_type=jnp.float32)


def _call(kernel, a, b, shape):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32), interpret=True)(a, b)


@jax.custom_vjp
def matmul(x, w):
    return _call(matmul_kernel, x, w, (x.shape[0], w.shape[1]))


def _matmul_fwd(x, w):
    return matmul(x, w), (x, w)


def _matmul_bwd(res, g):
    x, w = res
    return _call(matmul_nt_kernel, g, w, x.shape), _call(matmul_tn_kernel, x, g, w.shape)


matmul.defvjp(_matmul_fwd, _matmul_bwd)

# --- the tutorial's model --------------------------------------------------------------

LAYER_SIZES = [32, 64, 64, 16]
BATCH = 32
LEARNING_RATE = 0.05
STEPS = 3


def init(seed):
    rng = np.random.RandomState(seed)
    params = [(rng.randn(n_in, n_out).astype(np.float32) / np.sqrt(n_in), 0.1 * rng.randn(n_out).astype(np.float32))
              for n_in, n_out in zip(LAYER_SIZES[:-1], LAYER_SIZES[1:])]
    batch = (rng.randn(BATCH, LAYER_SIZES[0]).astype(np.float32), rng.randn(BATCH, LAYER_SIZES[-1]).astype(np.float32))
    return params, batch


def mse(predictions, targets):
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def sse(predictions, targets):
    """The sum of squared errors: ``BATCH * mse`` over a device's rows, inside ``shard_map``
    (``d * d`` and ``jnp.sum``, no float constant: with ``jax_auto_pcast`` off, JAX 0.12
    refuses one next to a varying value, as in ``jnp.mean`` and the gradient of ``** 2``)."""
    d = predictions - targets
    return jnp.sum(d * d)


def loss_reference(params, batch):
    """The unsharded loss, plain ``jnp.dot``: what every way must reproduce."""
    inputs, targets = batch
    for i, (w, b) in enumerate(params):
        outputs = jnp.dot(inputs, w) + b
        inputs = jax.nn.relu(outputs) if i < len(params) - 1 else outputs
    return mse(outputs, targets)


def varying(x, axis):
    """``x``, replicated over ``axis``, cast to vary over it: an explicit cast where a
    replicated value meets a varying one, as JAX asks with ``jax_auto_pcast`` off."""
    if hasattr(jax.lax, "pcast"):  # JAX 0.8+
        return jax.lax.pcast(x, axis, to="varying")
    if hasattr(jax.lax, "pvary"):  # JAX 0.6 - 0.7
        return jax.lax.pvary(x, axis)
    return x  # JAX <= 0.5 (check_rep): no cast needed, none to write


def relu(x):
    """``jax.nn.relu``, written so that its gradient also type-checks with ``jax_auto_pcast``
    off (JAX 0.12: ``jax.nn.relu``'s JVP selects between a varying tangent and replicated
    zeros, which JAX then refuses)."""
    return x * (x > 0)


def predict(params, inputs):  # data parallel: b replicated, the rows of `inputs` vary over `batch`
    for i, (w, b) in enumerate(params):
        outputs = matmul(inputs, w) + varying(b, "batch")
        inputs = relu(outputs) if i < len(params) - 1 else outputs
    return outputs


# data parallel: replicated parameters, sharded batch, the local losses summed
def make_dp(mesh, check=True):
    def local_loss(params, batch):
        inputs, targets = batch
        return jax.lax.psum(sse(predict(params, inputs), targets), "batch") / BATCH

    loss = testing.shard_map(local_loss, mesh, in_specs=(P(), P("batch")), out_specs=P(), check=check)
    return loss, (P(), P("batch"))


# FSDP: parameters sharded over `batch`, gathered per layer, re-gathered in the backward pass
def make_fsdp(mesh, check=True):
    @partial(jax.remat, policy=lambda op, *_, **__: str(op) != "all_gather")  # do not keep gathered weights
    def predict_fsdp(params_frag, inputs):
        for i, (w_frag, b_frag) in enumerate(params_frag):
            w = jax.lax.all_gather(w_frag, "batch", tiled=True)
            b = jax.lax.all_gather(b_frag, "batch", tiled=True)
            outputs = matmul(inputs, w) + b
            inputs = relu(outputs) if i < len(params_frag) - 1 else outputs
        return outputs

    def local_loss(params_frag, batch):
        inputs, targets = batch
        return jax.lax.psum(sse(predict_fsdp(params_frag, inputs), targets), "batch") / BATCH

    loss = testing.shard_map(local_loss, mesh, in_specs=(P("batch"), P("batch")), out_specs=P(), check=check)
    return loss, (P("batch"), P("batch"))


# tensor parallel: features sharded over `feats`, local matmul then psum_scatter
def make_tp(mesh, check=True):
    def gemm_tp(inputs, w, b):
        block_result = matmul(inputs, w)
        return jax.lax.psum_scatter(block_result, "feats", scatter_dimension=1, tiled=True) + b

    gemm = testing.shard_map(gemm_tp, mesh, in_specs=(P(None, "feats"), P("feats", None), P("feats")),
                             out_specs=P(None, "feats"), check=check)

    def loss(params, batch):
        inputs, targets = batch
        for i, (w, b) in enumerate(params):
            outputs = gemm(inputs, w, b)
            inputs = relu(outputs) if i < len(params) - 1 else outputs
        return mse(outputs, targets)

    return loss, (P("feats"), P(None, "feats"))  # W: rows on `feats`; b on `feats`


def max_err(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def sgd(loss):
    @jax.jit
    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads), value

    return step


def main():
    devices = np.array(jax.devices()[:8])
    params, batch = init(0)

    ref_grads = jax.grad(loss_reference)(params, batch)
    ref_step, ref_params, ref_losses = sgd(loss_reference), params, []
    for _ in range(STEPS):
        ref_params, value = ref_step(ref_params, batch)
        ref_losses.append(float(value))

    print(f"JAX {jax.__version__}, 8 devices, MLP {LAYER_SIZES}, batch {BATCH}, Pallas matmul, checking on")
    print(f"{'way':18}{'collectives per step (jaxpr)':50}{'defensive':>10}{'|grad - ref|':>14}"
          f"{'|params - ref| after ' + str(STEPS):>26}")
    failed = []
    for name, axis, make in (("data parallel", "batch", make_dp), ("FSDP", "batch", make_fsdp),
                             ("tensor parallel", "feats", make_tp)):
        mesh = jax.sharding.Mesh(devices, (axis,))
        loss, (param_spec, batch_spec) = make(mesh)
        put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
        sharded_params, sharded_batch = put(params, param_spec), put(batch, batch_spec)

        grads = jax.jit(jax.grad(loss))(sharded_params, sharded_batch)
        report = testing.collectives(jax.grad(loss), sharded_params, sharded_batch)
        kinds = ", ".join(f"{report.count(k, level='jaxpr')} {k}" for k in testing.KINDS
                          if report.count(k, level="jaxpr"))

        step, trained, losses = sgd(loss), sharded_params, []
        for _ in range(STEPS):
            trained, value = step(trained, sharded_batch)
            losses.append(float(value))

        grad_err, param_err = max_err(grads, ref_grads), max_err(trained, ref_params)
        defensive = len(report.defensive)
        print(f"{name:18}{kinds:50}{defensive:>10}{grad_err:>14.1e}{param_err:>26.1e}")
        if grad_err > 1e-4 or param_err > 1e-4 or defensive or not losses[-1] < losses[0]:
            failed.append(name)
        # FSDP: each W whose backward needs it (g @ W.T: every layer but the first) is gathered
        # in the forward pass and again in the backward pass, in the program JAX lowers (its
        # StableHLO; XLA may merge the two gathers when it compiles, as on CPU with JAX 0.7 - 0.10)
        gathers = Counter(c.shapes[0] for c in report.select("all-gather", level="stablehlo"))
        if name == "FSDP" and any(gathers[w.shape] != 2 for w, _ in params[1:]):
            failed.append("FSDP (weights not re-gathered in the backward pass)")
    print(f"loss over {STEPS} steps (unsharded): " + " -> ".join(f"{v:.4f}" for v in ref_losses))
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)
    print("OK: every way matches the unsharded gradients, with no defensive collective")


def audit_step(check=True, way="fsdp"):
    """The target of ``reprules audit examples/02_mlp_three_ways.py``: the gradient of one way's
    loss (``way``: ``"dp"``, ``"fsdp"`` or ``"tp"``), with checking off or on."""
    axis, make = {"dp": ("batch", make_dp), "fsdp": ("batch", make_fsdp), "tp": ("feats", make_tp)}[way]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), (axis,))
    params, batch = init(0)
    loss, (param_spec, batch_spec) = make(mesh, check)
    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    return {"step": jax.grad(loss), "args": (put(params, param_spec), put(batch, batch_spec)),
            "reference": lambda: jax.grad(loss_reference)(params, batch), "name": f"mlp_{way}"}


if __name__ == "__main__":
    main()
