"""JAX issue #21855, before and after reprules.

A Pallas copy kernel under ``custom_vjp`` inside ``shard_map`` on a (4, 2) mesh
``("data", "model")``, input sharded over ``data``. With checking off, the
backward pass all-reduces over ``model`` although ``x`` is replicated over it.
With checking on, reprules derives the kernel's rule from its body (inference,
on by default where JAX would refuse the kernel), and the all-reduce goes; one
decorator on the kernel declares the rule instead.

Run (8 fake CPU devices are set up by the script itself):

    python examples/01_issue21855.py
    reprules audit examples/01_issue21855.py     # its audit_step: checking off vs reprules
"""

from reprules import testing

testing.fake_cpu_devices(8)  # first thing: 8 fake CPU devices, before JAX starts

import functools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def copy(x):
    return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


@jax.custom_vjp
def kernel_copy(x):
    return copy(x)


kernel_copy.defvjp(lambda x: (copy(x), None), lambda _, g: (copy(g),))


def all_reduces(grad_fn, x):
    """psums in the jaxpr, all_reduce ops in StableHLO, all-reduces in compiled HLO."""
    jaxpr = len(re.findall(r"\bpsum\w*\[", str(jax.make_jaxpr(grad_fn)(x))))
    lowered = jax.jit(grad_fn).lower(x)
    stablehlo = lowered.as_text().count("stablehlo.all_reduce")
    compiled = len(re.findall(r"\ball-reduce(?:-start)?\(", lowered.compile().as_text()))
    return jaxpr, stablehlo, compiled


def main():
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    rng = np.random.RandomState(0)
    x = jax.device_put(rng.randn(8, 128).astype(np.float32), NamedSharding(mesh, P("data", None)))
    weights = rng.randn(8, 128).astype(np.float32)  # data-dependent cotangent: nothing to fold
    reference = weights  # d/dx sum(x * weights), unsharded

    support = reprules.jax_support()
    print(f"JAX {support['jax']} ({support['regime']} regime: {support['mechanism']})")
    print("mesh (4, 2) ('data', 'model'); x: P('data', None); loss: sum(copy(x) * w)\n")
    print(f"{'':32}{'psum (jaxpr)':>10}{'all_reduce (StableHLO)':>24}{'all-reduce (compiled)':>23}{'max |grad - ref|':>18}")
    rows = (("checking off", False), ("reprules inferred, checking on", True), ("reprules, checking on", True))
    for label, check in rows:
        if label == "reprules, checking on":
            reprules.replication_rule()(copy_kernel)  # the rule declared: the whole fix
        sharded = testing.shard_map(kernel_copy, mesh, P("data", None), P("data", None), check=check)
        grad_fn = jax.grad(lambda x: (sharded(x) * weights).sum())
        counts = all_reduces(grad_fn, x)
        error = float(np.max(np.abs(np.asarray(jax.jit(grad_fn)(x)) - reference)))
        print(f"{label:32}{counts[0]:>10}{counts[1]:>24}{counts[2]:>23}{error:>18.1e}")


def audit_step(check=True):
    """The target of ``reprules audit examples/01_issue21855.py``: the gradients of
    ``sum(copy(x) * w)`` for ``x`` and for ``w``, a weight replicated over the mesh (a
    row per device block of ``x``), with checking off (``check=False``) or on (the
    kernel has no rule here: inference covers it, as the audit's row says).

    Checking off, ``w``'s gradient is one all-reduce over ``('data', 'model')``: its
    ``data`` part is needed (``x`` varies there), its ``model`` part defensive, and the
    audit shows the two parts; with reprules it is the all-reduce over ``data`` alone."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rng = np.random.RandomState(0)
    x = jax.device_put(rng.randn(8, 128).astype(np.float32), NamedSharding(mesh, P("data", None)))
    w = rng.randn(2, 128).astype(np.float32)  # replicated: every device's block of x times it
    weights = rng.randn(8, 128).astype(np.float32)
    def body(x, w):  # w meets x's blocks: cast to vary over 'data' (to_varying, below) where checked
        return kernel_copy(x) * (to_varying(w, "data") if check else w)

    sharded = testing.shard_map(body, mesh, (P("data", None), P()), P("data", None), check=check)
    x_host = np.asarray(x)
    reference = (weights * np.tile(w, (4, 1)), (x_host * weights).reshape(4, 2, 128).sum(0))  # d/dx, d/dw
    return {"step": jax.grad(lambda x, w: (sharded(x, w) * weights).sum(), argnums=(0, 1)), "args": (x, w),
            "reference": lambda: reference, "name": "issue21855"}


# audit_step's cast of the replicated w to vary over 'data' where it meets x's blocks, with checking
# on: the cast JAX inserts itself by default, written out as it asks with jax_auto_pcast off.
if hasattr(jax.lax, "pcast"):  # JAX 0.8+
    to_varying = functools.partial(jax.lax.pcast, to="varying")
elif hasattr(jax.lax, "pvary"):  # JAX 0.6 - 0.7
    to_varying = jax.lax.pvary
else:  # JAX <= 0.5 (check_rep): no cast to write
    def to_varying(w, axis):
        return w


if __name__ == "__main__":
    main()
