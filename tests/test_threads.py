"""Registration and tracing from several threads at once.

Threads register distinct kernels (and change their rules, which drops JAX's
caches) while other threads trace, compile and run ``shard_map`` steps that
use them: every result is exact, every step has exactly its needed psums, no
thread raises, and the registry ends with exactly the expected rules.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, make_mesh, psum_axes_of, put, randn, shard_map
from reprules import _shim, rules

N_KERNELS = 8
TIMEOUT_S = 300

# Reproduced without reprules: jit of a Pallas interpret kernel (custom_vjp,
# shard_map) from 4 threads at once segfaults in jaxlib 0.4.28 and 0.5.3
# (2 of 6 runs of 30 x 8 steps); none in 60 runs on 0.6.2 - 0.12.
tracing_in_threads = pytest.mark.skipif(
    JAX_VERSION < (0, 6, 0),
    reason="JAX < 0.6 itself segfaults when Pallas kernels are traced and compiled from several threads")


def make_kernel(i):
    """A distinct kernel function per ``i``: ``out = x * w * (i + 1)``."""

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...] * float(i + 1)

    kernel.__name__ = kernel.__qualname__ = f"scale_kernel_{i}"
    return kernel


def keeper_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def make_step(kernel, i, mesh):
    """grad of sum(shard_map(custom_vjp(kernel))(x, w) * t), x on data, w replicated."""

    def call(x, w):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)

    @jax.custom_vjp
    def f(x, w):
        return call(x, w)

    def bwd(res, g):
        x, w = res
        return call(g, w), call(g, x)  # dw varies over data: psummed over exactly data

    f.defvjp(lambda x, w: (call(x, w), (x, w)), bwd)
    t = randn(100 + i, (8, 128))
    sharded = shard_map(f, mesh, (P("data", None), P()), P("data", None))
    return jax.grad(lambda x, w: (sharded(x, w) * t).sum(), argnums=(0, 1)), t


def reference(i, x, w, t):
    """Gradients of sum(x * tile(w) * (i + 1) * t): w's 2 rows repeat on each of the 4 data blocks."""
    xn, wn, tn = np.asarray(x), np.asarray(w), np.asarray(t)
    return tn * np.tile(wn, (4, 1)) * (i + 1), (tn * xn * (i + 1)).reshape(4, 2, 128).sum(0)


def run_one(i, kernel, rule, mesh, x, w):
    """Registers ``kernel`` (or re-registers it with another rule), then traces and runs its step."""
    reprules.replication_rule(rule, override=True)(kernel)
    step, t = make_step(kernel, i, mesh)
    dx, dw = jax.jit(step)(x, w)
    want_dx, want_dw = reference(i, x, w, t)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-4)
    assert psum_axes_of(jax.make_jaxpr(step)(x, w)) == [("data",)]
    return i


@pytest.fixture
def inputs():
    mesh = make_mesh()
    return mesh, put(randn(0, (8, 128)), mesh, P("data", None)), put(randn(1, (2, 128)), mesh, P())


def _rule(i, round_):
    # Every rule here is honest for x on data and w replicated: output over data.
    return (rules.same(), rules.like(0))[(i + round_) % 2]


@tracing_in_threads
def test_registration_and_tracing_from_several_threads(inputs):
    mesh, x, w = inputs
    reprules.replication_rule()(keeper_kernel)  # the registry never empties: JAX stays patched throughout
    kernels = [make_kernel(i) for i in range(N_KERNELS)]
    start = threading.Barrier(N_KERNELS)

    def task(i):
        start.wait(timeout=60)
        run_one(i, kernels[i], _rule(i, 0), mesh, x, w)
        return run_one(i, kernels[i], _rule(i, 1), mesh, x, w)  # rule changed: caches dropped

    with ThreadPoolExecutor(max_workers=N_KERNELS) as pool:
        futures = [pool.submit(task, i) for i in range(N_KERNELS)]
        done = sorted(f.result(timeout=TIMEOUT_S) for f in futures)  # re-raises a thread's exception
    assert done == list(range(N_KERNELS))

    registered = reprules.registered()
    assert len(registered) == N_KERNELS + 1
    for i, kernel in enumerate(kernels):
        reg = registered[f"{__name__}.scale_kernel_{i}"]
        assert reg.kernel() is kernel and reg.rule == _rule(i, 1)
    assert _shim.active()


@tracing_in_threads
def test_one_kernel_traced_from_several_threads(inputs):
    """The same registered kernel, traced concurrently into distinct programs."""
    mesh, x, w = inputs
    kernel = make_kernel(0)
    reprules.replication_rule()(kernel)

    def task(i):
        step, t = make_step(kernel, i, mesh)
        dx, dw = jax.jit(step)(x, w)
        want_dx, want_dw = reference(0, x, w, t)
        np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-4)
        assert psum_axes_of(jax.make_jaxpr(step)(x, w)) == [("data",)]
        return i

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert sorted(pool.map(task, range(8), timeout=TIMEOUT_S)) == list(range(8))
    assert list(reprules.registered()) == [f"{__name__}.scale_kernel_0"]


def test_concurrent_register_and_unregister_keep_the_registry_consistent():
    """Many threads register and unregister distinct kernels; the registry
    ends with exactly the kernels that were last registered."""
    reprules.replication_rule()(keeper_kernel)
    kernels = [make_kernel(i) for i in range(32)]

    def churn(i):
        for round_ in range(5):
            reprules.replication_rule(_rule(i, round_), override=True)(kernels[i])
            if i % 2:
                assert reprules.unregister(kernels[i])
        return i

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert sorted(pool.map(churn, range(32), timeout=TIMEOUT_S)) == list(range(32))
    expected = {f"{__name__}.keeper_kernel"} | {f"{__name__}.scale_kernel_{i}" for i in range(0, 32, 2)}
    assert set(reprules.registered()) == expected
    assert all(reprules.registered()[f"{__name__}.scale_kernel_{i}"].rule == _rule(i, 4) for i in range(0, 32, 2))
    assert _shim.active()


class _WatchedLock:
    """``_shim.lock`` as the façade takes it, announcing each thread that asks for it."""

    def __init__(self, lock, on_acquire):
        self._lock, self._on_acquire = lock, on_acquire

    def __enter__(self):
        self._on_acquire(threading.current_thread())
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def test_unregistering_the_last_kernel_while_another_thread_registers(monkeypatch, dormant):
    """The interleaving made deterministic: thread A unregisters the last kernel
    and, inside ``deactivate``, waits until thread B asks for the lock to
    register another kernel. B must then wait for A's deactivation and activate
    JAX's patches again, so b ends registered with JAX patched."""
    a, b = make_kernel(0), make_kernel(1)
    reprules.replication_rule()(a)
    in_deactivate, b_asks_for_lock = threading.Event(), threading.Event()
    deactivate, errors = _shim.deactivate, []

    def held_deactivate():
        in_deactivate.set()
        if not b_asks_for_lock.wait(TIMEOUT_S):
            errors.append("thread B never asked for the registry lock")
        deactivate()

    def on_acquire(thread):
        if thread.name == "register-b":
            b_asks_for_lock.set()

    monkeypatch.setattr(_shim, "deactivate", held_deactivate)
    monkeypatch.setattr(_shim, "lock", _WatchedLock(_shim.lock, on_acquire))
    thread_a = threading.Thread(target=reprules.unregister, args=(a,), name="unregister-a")
    thread_b = threading.Thread(target=reprules.replication_rule(), args=(b,), name="register-b")
    thread_a.start()
    assert in_deactivate.wait(TIMEOUT_S), "unregistering the last kernel did not deactivate"
    thread_b.start()  # A holds the lock inside deactivate until B asks for it
    for thread in (thread_a, thread_b):
        thread.join(timeout=TIMEOUT_S)
        assert not thread.is_alive(), f"{thread.name} did not finish"
    monkeypatch.undo()
    assert not errors, errors
    assert list(reprules.registered()) == [f"{__name__}.scale_kernel_1"]
    assert _shim.active(), "b is registered but every JAX patch was undone"
