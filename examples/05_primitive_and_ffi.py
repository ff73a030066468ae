"""A user primitive and an FFI kernel, each with a replication rule.

The same layer, ``y = x * w`` (``w`` a row vector broadcast over the rows of
``x``) with a ``custom_vjp`` whose backward pass computes ``g * w`` and
``sum_rows(g * x)``, built two ways:

* **user primitives**: two ``jax.extend.core.Primitive``\\ s lowered with
  ``mlir.lower_fun``; the rule is registered on the primitive object;
* **FFI kernels**: reprules' opaque C++ CPU kernels ``reprules_mul`` and
  ``reprules_mul_rowsum`` called through ``ffi_call``; the rule is registered
  on ``reprules.ffi_target(name)``. Needs JAX >= 0.4.31 (``ffi_call``) and a
  C++ compiler; otherwise this part is skipped with the reason printed.

On a (4, 2) mesh ``("data", "model")`` with ``x`` on ``data`` and ``w``
replicated, ``w``'s gradient must be summed over ``data`` only. The script
prints the all-reduces of the gradient with checking off (also over
``model``: defensive) and with the rules and checking on, checks the
gradients against plain ``jnp``, and exits non-zero if a check fails.

Run (8 fake CPU devices are set up by the script itself):

    python examples/05_primitive_and_ffi.py
    reprules audit examples/05_primitive_and_ffi.py   # its audit_step (the user primitives)
"""

from reprules import testing

testing.fake_cpu_devices(8)  # first thing: 8 fake CPU devices, before JAX starts

import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.core import ShapedArray  # noqa: E402
from jax.extend.core import Primitive  # noqa: E402
from jax.interpreters import mlir  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402
from reprules import rules  # noqa: E402
from reprules.testing import cpu_kernels  # noqa: E402  (opaque C++ FFI kernels for CPU)

# --- 1. user primitives ------------------------------------------------------------------


def _mul(x, w):
    return x * w


def _mul_rowsum(a, b):
    return (a * b).sum(axis=0)


mul_p = Primitive("my_mul")  # x * w
mul_p.def_impl(_mul)
mul_p.def_abstract_eval(lambda x, w: ShapedArray(x.shape, x.dtype))
mlir.register_lowering(mul_p, mlir.lower_fun(_mul, multiple_results=False))

mul_rowsum_p = Primitive("my_mul_rowsum")  # sum over rows of a * b
mul_rowsum_p.def_impl(_mul_rowsum)
mul_rowsum_p.def_abstract_eval(lambda a, b: ShapedArray(a.shape[1:], a.dtype))
mlir.register_lowering(mul_rowsum_p, mlir.lower_fun(_mul_rowsum, multiple_results=False))

# The rules: outputs vary like the union of the inputs (w is cast up to x's axes).
reprules.replication_rule(rules.same())(mul_p)
reprules.replication_rule(rules.same())(mul_rowsum_p)


def make_layer(mul, mul_rowsum):
    """``x * w`` with a custom_vjp built from the two kernels."""

    @jax.custom_vjp
    def layer(x, w):
        return mul(x, w)

    def bwd(res, g):
        x, w = res
        return mul(g, w), mul_rowsum(g, x)

    layer.defvjp(lambda x, w: (mul(x, w), (x, w)), bwd)
    return layer


primitive_layer = make_layer(mul_p.bind, mul_rowsum_p.bind)

# --- 2. FFI kernels ------------------------------------------------------------------------

FFI_SKIPPED = cpu_kernels.unavailable_reason()
if FFI_SKIPPED is None:
    reprules.replication_rule(rules.same())(reprules.ffi_target("reprules_mul"))
    reprules.replication_rule(rules.same())(reprules.ffi_target("reprules_mul_rowsum"))
    ffi_layer = make_layer(cpu_kernels.mul, lambda g, x: cpu_kernels.mul_rowsum(g, x, x.shape[1:]))

# --- the check -------------------------------------------------------------------------------


def setup():
    """The (4, 2) mesh, ``x`` sharded over ``data``, ``w`` replicated, the target ``t``, and the
    unsharded reference gradients of ``sum(x * w * t)``."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rng = np.random.RandomState(0)
    x_host, w_host, t = (rng.randn(16, 128).astype(np.float32), rng.randn(128).astype(np.float32),
                         rng.randn(16, 128).astype(np.float32))
    x = jax.device_put(x_host, NamedSharding(mesh, P("data", None)))
    w = jax.device_put(w_host, NamedSharding(mesh, P()))

    def reference():
        return jax.grad(lambda x, w: (x * w * t).sum(), argnums=(0, 1))(x_host, w_host)

    return mesh, x, w, t, reference


def main():
    mesh, x, w, t, reference_grads = setup()
    reference = reference_grads()

    print(f"JAX {jax.__version__}, mesh (4, 2) ('data', 'model'); x: P('data', None), w: P(); "
          "loss: sum(layer(x, w) * t)")
    print(f"{'':38}{'all-reduces of the gradient (over)':>36}{'defensive':>11}{'|grad - ref|':>14}")
    layers = [("user primitive", primitive_layer)]
    if FFI_SKIPPED is None:
        layers.append(("FFI kernel", ffi_layer))
    failed = []
    for name, layer in layers:
        for label, check in (("checking off", False), ("rule, checking on", True)):
            f = testing.shard_map(layer, mesh, (P("data", None), P()), P("data", None), check)
            grad_fn = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))  # noqa: B023
            report = testing.collectives(grad_fn, x, w)
            error = max(float(np.max(np.abs(np.asarray(g) - r))) for g, r in zip(jax.jit(grad_fn)(x, w), reference))
            over = sorted(c.axes_text() for c in report.select("all-reduce"))
            defensive = len(report.defensive)
            print(f"{name + ', ' + label:38}{'; '.join(over) or '-':>36}{defensive:>11}{error:>14.1e}")
            if error > 1e-3:
                failed.append(f"{name}, {label}: wrong gradients")
            if check and (defensive or over != ["data"]):
                failed.append(f"{name}, {label}: expected one all-reduce, over 'data'")
    if FFI_SKIPPED is not None:
        print(f"FFI kernel: SKIPPED ({FFI_SKIPPED})")
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)
    print("OK: with the rules, w's gradient is summed over 'data' only")


def audit_step(check=True, ffi=False):
    """The target of ``reprules audit examples/05_primitive_and_ffi.py``: the gradients of
    ``sum(layer(x, w) * t)``, with checking off or on (``ffi=True``: the FFI kernels)."""
    mesh, x, w, t, reference = setup()
    if ffi and FFI_SKIPPED is not None:
        raise RuntimeError(f"the FFI kernels are unavailable: {FFI_SKIPPED}")
    f = testing.shard_map(ffi_layer if ffi else primitive_layer, mesh, (P("data", None), P()), P("data", None),
                          check)
    return {"step": jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1)), "args": (x, w),
            "name": "ffi_layer" if ffi else "primitive_layer",
            "reference": reference}


if __name__ == "__main__":
    main()
