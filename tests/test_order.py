"""What a program computes does not depend on the order of events (issue 14, finding 2).

The #21855 model (a Pallas copy kernel under ``custom_vjp`` inside a checked
``shard_map``, rows on ``data`` of a (4, 2) mesh) must give, with a rule, the
input back, the gradient of the unsharded NumPy reference, and no psum or
all-reduce at all, whether its ``pallas_call`` object was built

* before ``import reprules`` (in a fresh process: this module imports no
  reprules at module level, and builds ``EARLY_CALL`` when imported);
* before any rule was registered, or while another kernel's rule was active;
* before its step was jitted and run without the rule;
* before its rule was removed and registered again, or overridden.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from helpers import count_all_reduce, make_mesh, max_err, put, randn, shard_map

HERE = os.path.dirname(os.path.abspath(__file__))
SHARD = (2, 128)  # one device's block of the (8, 128) input, rows on `data`


def early_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def other_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def build(kernel):
    """A ``pallas_call`` object, built once and called many times (as libraries do)."""
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(SHARD, jnp.float32), interpret=True)


EARLY_CALL = build(early_kernel)  # at import: before any rule (and, run as a script, before reprules)


@pytest.fixture
def reprules():
    import reprules

    return reprules


def fresh_kernel():
    def copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return copy_kernel


class Model:
    """The #21855 model around one ``pallas_call`` object, with its jitted steps
    built once (so a test can call the very same steps before and after an event)."""

    def __init__(self, call):
        self.mesh = make_mesh()
        self.x = put(randn(0, (8, 128)), self.mesh, P("data", None))
        self.w = randn(1, (8, 128))

        @jax.custom_vjp
        def f(x):
            return call(x)

        f.defvjp(lambda x: (call(x), None), lambda _, g: (call(g),))
        self.forward = shard_map(f, self.mesh, P("data", None), P("data", None))
        self.grad = jax.grad(lambda x: (self.forward(x) * self.w).sum())
        self.forward_step = jax.jit(self.forward)
        self.grad_step = jax.jit(self.grad)
        self.unsharded_step = jax.jit(call)

    def check(self):
        """Values and gradients against NumPy, and no collective at any level."""
        x, w = np.asarray(self.x), np.asarray(self.w)
        assert max_err(self.forward_step(self.x), x) == 0.0  # a copy
        assert max_err(self.grad_step(self.x), w) < 1e-6  # d/dx sum(x * w) = w
        assert max_err(self.unsharded_step(x[:2]), x[:2]) == 0.0
        assert count_all_reduce(self.grad, self.x) == (0, 0, 0)  # jaxpr psum, StableHLO, HLO

    def refused(self):
        """The error the checked steps raise (both must raise the same kind)."""
        with pytest.raises((NotImplementedError, ValueError)) as forward_info:
            self.forward_step(self.x)
        with pytest.raises(type(forward_info.value)):
            self.grad_step(self.x)
        return forward_info.value


def test_call_built_before_reprules_was_imported():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=HERE, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"reprules_imported_before_the_call": False, "ran_before_import": True, "checked": True}


def test_call_built_before_any_rule(reprules):
    model = Model(EARLY_CALL)
    reprules.replication_rule(reprules.rules.same())(early_kernel)
    model.check()


@pytest.mark.parametrize("other_rule", ["kept", "removed"])
def test_call_built_while_another_kernels_rule_is_active(reprules, other_rule):
    kernel = fresh_kernel()
    reprules.replication_rule()(other_kernel)
    call = build(kernel)
    if other_rule == "removed":
        reprules.unregister(other_kernel)  # every patch undone, then installed again below
    reprules.replication_rule()(kernel)
    Model(call).check()


@pytest.mark.parametrize("reprules_before", ["dormant", "armed", "active for another kernel"])
def test_step_jitted_and_run_before_registration(reprules, reprules_before, request, no_inference):
    if reprules_before == "dormant":
        request.getfixturevalue("dormant")
    kernel = fresh_kernel()
    model = Model(build(kernel))
    if reprules_before == "active for another kernel":
        reprules.replication_rule()(other_kernel)
    x = np.asarray(model.x)
    assert max_err(model.unsharded_step(x[:2]), x[:2]) == 0.0  # runs (no shard_map)
    error = model.refused()  # no rule yet
    assert isinstance(error, reprules.MissingRuleError) == (reprules_before != "dormant")
    # JAX's own words either way (JAX <= 0.5, then 0.6+).
    assert "No replication rule for pallas_call" in str(error) or "must not be `None`" in str(error)
    reprules.replication_rule()(kernel)
    model.check()  # the same jitted steps


@pytest.mark.parametrize("mode", ["dormant", "armed"])
def test_unregister_then_register_again(reprules, mode, request, no_inference):
    if mode == "dormant":
        request.getfixturevalue("dormant")
    kernel = fresh_kernel()
    model = Model(build(kernel))
    reprules.replication_rule()(kernel)
    model.check()
    reprules.unregister(kernel)  # the last rule: dormant, JAX alone again; armed, reprules' refusal
    assert isinstance(model.refused(), reprules.MissingRuleError) == (mode == "armed")
    reprules.replication_rule()(kernel)
    model.check()


def test_override_after_the_call_was_built(reprules):
    rules = reprules.rules
    kernel = fresh_kernel()
    model = Model(build(kernel))
    reprules.replication_rule(rules.varying("model"))(kernel)  # varies over `model` too
    with pytest.raises(ValueError, match="out_specs"):  # so out_specs P("data", None) is refused
        model.forward_step(model.x)
    reprules.replication_rule(rules.same(), override=True)(kernel)
    model.check()
    reprules.replication_rule(rules.varying("model"), override=True)(kernel)
    with pytest.raises(ValueError, match="out_specs"):
        model.forward_step(model.x)


if __name__ == "__main__":  # the fresh process of test_call_built_before_reprules_was_imported
    imported = "reprules" in sys.modules
    model = Model(EARLY_CALL)
    x = np.asarray(model.x)
    ran = max_err(model.unsharded_step(x[:2]), x[:2]) == 0.0
    import reprules as _reprules

    _reprules.replication_rule(_reprules.rules.same())(early_kernel)
    model.check()
    print(json.dumps({"reprules_imported_before_the_call": imported, "ran_before_import": ran, "checked": True}))
