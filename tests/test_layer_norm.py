"""JAX's own Pallas ``layer_norm`` inside shard_map with checking on.

Made to work only by registering rules for its kernel functions from here: no
copy or edit of JAX's code. The backward pass must hold exactly the needed
all-reduces (weight and bias gradients over ``data``), nothing over ``model``.
"""

import importlib

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, count_all_reduce, make_mesh, max_err, psum_axes, put, randn, shard_map


def _layer_norm_module():
    """Every supported JAX has the op: ``ops.layer_norm`` in 0.4.28, ``ops.gpu.layer_norm`` from 0.4.29."""
    path = "layer_norm" if JAX_VERSION < (0, 4, 29) else "gpu.layer_norm"
    return importlib.import_module(f"jax.experimental.pallas.ops.{path}")


@pytest.fixture
def ln():
    module = _layer_norm_module()
    for kernel in (
        module.layer_norm_forward_kernel,
        module.layer_norm_backward_kernel_dx,
        module.layer_norm_backward_kernel_dw_db,
    ):
        reprules.replication_rule()(kernel)
    return module


def test_layer_norm_gradients_and_collectives(ln):
    mesh = make_mesh()
    x = put(randn(0, (8, 4, 128)), mesh, P("data", None, None))
    weight = put(1.0 + 0.1 * randn(1, (128,)), mesh, P())
    bias = put(0.1 * randn(2, (128,)), mesh, P())
    t = randn(3, (8, 4, 128))

    def body(x, w, b):
        return ln.layer_norm(x, w, b, interpret=True)

    sharded = shard_map(body, mesh, (P("data", None, None), P(), P()), P("data", None, None))

    def loss(x, w, b):
        return (sharded(x, w, b) * t).sum()

    def reference_loss(x, w, b):
        return (ln.layer_norm_reference(x, w, b) * t).sum()

    out = jax.jit(sharded)(x, weight, bias)
    assert max_err(out, ln.layer_norm_reference(*map(np.asarray, (x, weight, bias)))) < 1e-5

    grad = jax.grad(loss, argnums=(0, 1, 2))
    expected = jax.grad(reference_loss, argnums=(0, 1, 2))(*map(np.asarray, (x, weight, bias)))
    assert max_err(jax.jit(grad)(x, weight, bias), expected) < 1e-4
    # Exactly the needed all-reduces: dw and db over `data`; nothing over `model`.
    assert psum_axes(grad, x, weight, bias) == [("data",), ("data",)]
    jaxpr, stablehlo, compiled = count_all_reduce(grad, x, weight, bias)
    assert (jaxpr, stablehlo) == (2, 2)
    assert compiled in (1, 2)  # XLA's all-reduce combiner merges the two from 0.8 on


def test_layer_norm_checking_off_has_defensive_all_reduces():
    ln = _layer_norm_module()
    mesh = make_mesh()
    x = put(randn(0, (8, 4, 128)), mesh, P("data", None, None))
    weight, bias = put(randn(1, (128,)), mesh, P()), put(randn(2, (128,)), mesh, P())
    t = randn(3, (8, 4, 128))
    sharded = shard_map(
        lambda x, w, b: ln.layer_norm(x, w, b, interpret=True),
        mesh, (P("data", None, None), P(), P()), P("data", None, None), check=False,
    )
    grad = jax.grad(lambda x, w, b: (sharded(x, w, b) * t).sum(), argnums=(0, 1, 2))
    assert psum_axes(grad, x, weight, bias) == [("data", "model"), ("data", "model"), ("model",)]
