"""Kernels that communicate: a rule such as ``rules.invariant("model")``.

The primitive's lowering really all-reduces over ``model``; its abstract eval
knows nothing of that. With the rule its output is typed replicated over
``model``, so an ``out_specs`` that needs replication is accepted, and no
collective is added beyond the kernel's own.
"""

import jax
import numpy as np
import pytest
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import reprules
from helpers import count_all_reduce, make_mesh, max_err, put, randn, shard_map
from reprules import rules

allreduce_p = Primitive("model_allreduce")
allreduce_p.def_abstract_eval(lambda a: ShapedArray(a.shape, a.dtype))
mlir.register_lowering(
    allreduce_p,
    lambda ctx, x: mlir.lower_fun(lambda x: jax.lax.psum(x, "model"), multiple_results=False)(ctx, x),
)


@jax.custom_vjp
def model_allreduce(x):
    return allreduce_p.bind(x)


# d/dx of a sum over `model` shards: every shard receives the (replicated) cotangent.
model_allreduce.defvjp(lambda x: (allreduce_p.bind(x), None), lambda _, g: (g,))


@pytest.fixture
def x():
    return put(randn(0, (8, 16)), make_mesh(), P("data", "model"))


def test_invariant_rule_accepts_replicated_out_specs_and_adds_nothing(x):
    reprules.replication_rule(rules.invariant("model"))(allreduce_p)
    mesh = make_mesh()
    f = shard_map(model_allreduce, mesh, P("data", "model"), P("data", None))
    xn = np.asarray(x)
    assert max_err(jax.jit(f)(x), xn[:, :8] + xn[:, 8:]) == 0.0
    t = randn(1, (8, 8))
    step = jax.value_and_grad(lambda x: (f(x) * t).sum())
    # No psum in the jaxpr: StableHLO holds only the kernel's own all-reduce; the
    # compiled HLO adds the partitioner's one for the global loss sum.
    assert count_all_reduce(step, x) == (0, 1, 2)
    loss, grad = jax.jit(step)(x)
    assert abs(float(loss) - float(((xn[:, :8] + xn[:, 8:]) * t).sum())) < 1e-3
    assert max_err(grad, np.concatenate([t, t], axis=1)) < 1e-6


def test_without_invariant_the_replicated_out_specs_is_refused(x):
    reprules.replication_rule(rules.same())(allreduce_p)  # an honest-but-weaker rule
    mesh = make_mesh()
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(allreduce_p.bind, mesh, P("data", "model"), P("data", None)))(x)
