"""NVIDIA Warp's JAX FFI targets (``wp.jax_kernel``, ``wp.jax_callable``), one
:class:`measure.Case` each: a kernel with Warp's own backward (x over ``data``,
the weight replicated), a two-output kernel and a ``jax_callable`` launching it.
Warp runs its kernels on CPU; its kernels are defined here, at module level, as
Warp reads their source.
"""

# No `from __future__ import annotations`: jax_kernel(enable_backward=True) reads the kernel's
# annotations as types.
from measure import Case


def _rn(seed, shape):
    import numpy as np

    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _warp():
    import warp as wp

    wp.config.quiet = True
    wp.init()
    return wp


wp = _warp()


@wp.kernel
def mul_kernel(x: wp.array2d(dtype=float), w: wp.array(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    y[i, j] = x[i, j] * w[j]


@wp.kernel
def affine_kernel(x: wp.array2d(dtype=float), w: wp.array(dtype=float), y: wp.array2d(dtype=float),
                  z: wp.array2d(dtype=float)):
    i, j = wp.tid()
    y[i, j] = x[i, j] * w[j]
    z[i, j] = x[i, j] + w[j]


def affine_callable(x: wp.array2d(dtype=float), w: wp.array(dtype=float), y: wp.array2d(dtype=float),
                    z: wp.array2d(dtype=float)):
    wp.launch(affine_kernel, dim=x.shape, inputs=[x, w], outputs=[y, z])


def mul_backward():
    mul = wp.jax_kernel(mul_kernel, enable_backward=True)
    return Case(lambda x, w: mul(x, w)[0], (_rn(0, (16, 32)), _rn(1, (32,))), (_P("data", None), _P()),
                _P("data", None), grad_argnums=(0, 1), reference=lambda x, w: x * w,
                note="jax_kernel(enable_backward=True): Warp's own custom_vjp; weight replicated")


def _two_outputs(kind):
    def case():
        call = (wp.jax_kernel(affine_kernel, num_outputs=2) if kind == "jax_kernel"
                else wp.jax_callable(affine_callable, num_outputs=2))
        rows = _P("data", None)
        return Case(lambda x, w: tuple(call(x, w)), (_rn(0, (16, 32)), _rn(1, (32,))), (rows, _P()), (rows, rows),
                    reference=lambda x, w: (x * w, x + w), note=f"{kind}, two outputs, no VJP")
    return case


CASES = {
    "jax_kernel mul (enable_backward=True)": mul_backward,
    "jax_kernel affine (two outputs)": _two_outputs("jax_kernel"),
    "jax_callable affine (two outputs)": _two_outputs("jax_callable"),
}
