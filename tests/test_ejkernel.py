"""ejkernel's Pallas TPU kernels through reprules' ejkernel pack, on CPU (TPU interpret mode).

The pack (entry point ``ejkernel``, loaded on ``import ejkernel``) registers
``rules.inferred()`` on ``reprules.kernels_in("ejkernel")`` and refuses the
backward kernel of the vocab-parallel cross-entropy and KL divergence. Every
op runs inside ``shard_map`` on the (4, 2) ("data", "model") mesh, tokens or
batch over ``data``, heads over ``model``, weights replicated, with
``check_vma=True``; results and gradients are compared with the same program
under ``check_vma=False`` and with the op run on the whole arrays without
``shard_map``.

Running ejkernel's Mosaic TPU kernels on CPU needs
``pltpu.force_tpu_interpret_mode()`` and, for ``grouped_matmulv2``, a TPU
description for the CPU device kind (as in tests/test_tokamax.py). Not run
here, and why (JAX 0.12.0.1, ejkernel 0.0.80.3): ``flash_attention`` and
``blocksparse_attention`` use ``pltpu.repeat``, which JAX 0.12 no longer has;
``grouped_matmulv3`` and the ragged paged attentions hit JAX's TPU interpreter
limit (``'ReshapeTransform' object has no attribute 'indices'``) even
unsharded; multi-token ``gated_delta_rule`` is ejkernel's XLA scan (no Pallas
kernel; with no ``initial_state`` its zero carry is typed invariant, which
JAX's scan rejects under ``check_vma=True``, with or without reprules).

Found along the way: ejkernel's vocab-parallel ops (``vocab_parallel_axis=``)
multiply the logits gradient by ``psum(1, axis)`` in their ``custom_vjp`` bwd
to undo ``check_vma=False``'s cotangent split. Under checking there is no
split: the gradient is ``axis size`` times too large. The pack refuses it
(``RuleError``) instead of returning it; the forward pass is exact.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_err, pack_state_on_import, psum_axes, put, randn, shard_map
from jax.sharding import PartitionSpec as P

import reprules
from reprules import testing

ejkernel = pytest.importorskip(
    "ejkernel", reason="ejkernel (PyPI `ejkernel`) is not installed; these tests run in an environment with it"
)
pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
if not hasattr(pltpu, "force_tpu_interpret_mode"):
    pytest.skip(f"JAX {jax.__version__} has no force_tpu_interpret_mode", allow_module_level=True)
ek = pytest.importorskip("ejkernel.kernels._pallas.tpu")

ROWS, COLS = P("data", None), P("data", "model")


@pytest.fixture(autouse=True)
def pack():
    """The pack's registration, as on ``import ejkernel`` (conftest clears rules after each test)."""
    from reprules._builtin_packs import ejkernel as ejkernel_pack

    ejkernel_pack.ejkernel(ejkernel)


@pytest.fixture
def interpret():
    """TPU interpret mode on CPU, with the CPU device described as a TPU v5e."""
    return lambda: testing.tpu_on_cpu("v5e")


def _grads(f, t, argnums):
    return jax.grad(lambda *a: (f(*a) * t).sum(), argnums=argnums)


def _check_op(mesh, interpret, op, args, in_specs, out_spec, reference, argnums):
    """``op`` under checking on equals checking off and ``reference`` (forward and grads);
    returns the psum axes of the checked gradient, which has no defensive all-reduce."""
    sharded = [put(a, mesh, s) for a, s in zip(args, in_specs)]
    on = shard_map(op, mesh, in_specs, out_spec)
    off = shard_map(op, mesh, in_specs, out_spec, check=False)
    with interpret():
        out_on, out_off = jax.jit(on)(*sharded), jax.jit(off)(*sharded)
        expected = jax.jit(reference)(*args)
        t = randn(9, out_on.shape)
        grad_on, grad_off = _grads(on, t, argnums), _grads(off, t, argnums)
        g_on, g_off = jax.jit(grad_on)(*sharded), jax.jit(grad_off)(*sharded)
        g_ref = jax.jit(_grads(reference, t, argnums))(*args)
        report = testing.collectives(grad_on, *sharded)
        psums = psum_axes(grad_on, *sharded)
    assert max_err(out_on, out_off) == 0.0
    assert max_err(out_on, expected) < 1e-5
    scale = max(float(np.abs(np.asarray(g)).max()) for g in g_ref)
    assert max_err(g_on, g_off) / scale < 1e-6
    assert max_err(g_on, g_ref) / scale < 1e-6
    assert report.count("all-reduce", defensive=True) == 0
    assert report.count("all-reduce", axes="model") == 0
    return psums


@pytest.mark.parametrize("name", ["grouped_matmul", "grouped_matmulv2"])
def test_grouped_matmul_forward_and_gradients(mesh, interpret, name):
    """Tokens over ``data`` (two ragged groups per shard), expert weights replicated: the
    weight gradient is psummed over ``data`` once, nothing over ``model``."""
    gmm = getattr(ek, name)
    sizes = jnp.array([48, 80], jnp.int32)  # each data shard's groups

    def op(lhs, rhs):
        return gmm(lhs, rhs, sizes, interpret=True)

    def reference(lhs, rhs):  # the op on the whole arrays, each 128-row block with its groups
        return jnp.concatenate([op(block, rhs) for block in jnp.split(lhs, 4)])

    args = (randn(0, (512, 128)), 0.1 * randn(1, (2, 128, 128)))
    psums = _check_op(mesh, interpret, op, args, (ROWS, P()), ROWS, reference, (0, 1))
    assert psums == [("data",)]


@pytest.mark.parametrize("name", ["fused_cross_entropy", "fused_kl_divergence"])
def test_fused_losses_forward_and_gradients(mesh, interpret, name):
    """Tokens over ``data``, vocab whole on each device (replicated over ``model``): exact,
    and no all-reduce at all (checking off psums the replicated logits' gradient over ``model``)."""
    logits = randn(0, (64, 256))
    if name == "fused_cross_entropy":
        second = jnp.asarray(np.random.RandomState(1).randint(0, 256, (64,)), jnp.int32)
        op = lambda x, y: ek.fused_cross_entropy(x, y, reduction="none")[0]
        spec = P("data")
    else:
        second = randn(1, (64, 256))
        op = lambda x, y: ek.fused_kl_divergence(x, y, reduction="none")
        spec = ROWS
    psums = _check_op(mesh, interpret, op, (logits, second), (ROWS, spec), P("data"), op, (0,))
    assert psums == []


@pytest.mark.parametrize("name", ["fused_cross_entropy", "fused_kl_divergence"])
def test_vocab_parallel_gradient_is_refused_not_wrong(mesh, interpret, name):
    """Vocab over ``model``: the forward (ejkernel's own pmax/psum) is exact; the bwd's
    ``* psum(1, 'model')`` would double the gradient under checking, so it is refused."""
    logits = randn(0, (64, 256))
    if name == "fused_cross_entropy":
        second = jnp.asarray(np.random.RandomState(1).randint(0, 256, (64,)), jnp.int32)
        op = lambda x, y, **kw: ek.fused_cross_entropy(x, y, reduction="none", **kw)[0]
        spec, kernel = P("data"), "_ce_bwd_kernel"
    else:
        second = randn(1, (64, 256))
        op = lambda x, y, **kw: ek.fused_kl_divergence(x, y, reduction="none", **kw)
        spec, kernel = COLS, "_kl_bwd_kernel"
    f = shard_map(lambda x, y: op(x, y, vocab_parallel_axis="model"), mesh, (COLS, spec), P("data"))
    args = (put(logits, mesh, COLS), put(second, mesh, spec))
    with interpret():
        out = jax.jit(f)(*args)
        expected = jax.jit(op)(logits, second)
        with pytest.raises(reprules.RuleError, match=rf"(?s){kernel}.*psum\(1, \{{'model'\}}\).*check_vma=False"):
            jax.jit(jax.grad(lambda x: f(x, args[1]).sum()))(args[0])
    assert max_err(out, expected) < 1e-5


def _decode_attention():
    q, k, v = randn(0, (4, 2, 128)), randn(1, (4, 256, 2, 128)), randn(2, (4, 256, 2, 128))
    start, end = jnp.zeros(4, jnp.int32), jnp.array([100, 256, 17, 200], jnp.int32)
    heads = P("data", None, "model", None)
    op = lambda *a: ek.ragged_decode_attention(*a)

    # Unsharded, JAX's TPU interpreter fails on the op's vmapped grid (safe_zip of a 3-d grid with
    # 2 dimension semantics), so the reference is ejkernel's own XLA implementation.
    from ejkernel.kernels._xla import ragged_decode_attention as reference

    return op, (q, k, v, start, end), (P("data", "model", None), heads, heads, P("data"), P("data")), \
        P("data", "model", None), reference


def _page_attention():
    lens = jnp.array([10, 64, 33, 50], jnp.int32)
    tables = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)
    args = (randn(0, (4, 2, 128)), randn(1, (2, 16, 16, 128)), randn(2, (2, 16, 16, 128)), lens, tables)
    op = lambda *a: ek.page_attention(*a)
    return op, args, (P("data", "model", None), P("model"), P("model"), P("data"), ROWS), \
        P("data", "model", None), op


def _gated_delta_rule_decode():
    heads = P("data", None, "model", None)
    beta = jax.nn.sigmoid(randn(3, (4, 1, 2)))
    args = (randn(0, (4, 1, 2, 128)), randn(1, (4, 1, 2, 128)), randn(2, (4, 1, 2, 128)), beta,
            -jnp.abs(0.1 * randn(4, (4, 1, 2))), 0.1 * randn(5, (4, 2, 128, 128)))
    op = lambda *a: ek.gated_delta_rule(*a[:5], initial_state=a[5])[0]  # seq_len 1: the Pallas kernel
    return op, args, (heads, heads, heads, P("data", None, "model"), P("data", None, "model"),
                      P("data", "model", None, None)), heads, op


@pytest.mark.parametrize("case", [_decode_attention, _page_attention, _gated_delta_rule_decode],
                         ids=["ragged_decode_attention", "page_attention", "gated_delta_rule_decode"])
def test_inference_kernels_forward(mesh, interpret, case):
    """Batch over ``data``, heads (and the page pool's kv heads) over ``model``: forward only."""
    op, args, in_specs, out_spec, reference = case()
    sharded = [put(a, mesh, s) for a, s in zip(args, in_specs)]
    with interpret():
        out = jax.jit(shard_map(op, mesh, in_specs, out_spec))(*sharded)
        off = jax.jit(shard_map(op, mesh, in_specs, out_spec, check=False))(*sharded)
        expected = jax.jit(reference)(*args)
        testing.assert_no_all_reduce(shard_map(op, mesh, in_specs, out_spec), *sharded)
    assert max_err(out, off) == 0.0
    assert max_err(out, expected) < 1e-4


def test_the_pack_loads_on_import_ejkernel():
    assert pack_state_on_import("ejkernel") == [
        "True",
        "[('reprules._builtin_packs.ejkernel:ejkernel', 'loaded')]",
        "rules.inferred() pack reprules._builtin_packs.ejkernel:ejkernel",
    ]


def test_without_the_pack_jax_refuses_the_kernel(mesh, interpret, no_inference):
    for reg in list(reprules.registered().values()):
        reprules.unregister(reg.kernel())
    sizes = jnp.array([48, 80], jnp.int32)
    f = shard_map(lambda l, r: ek.grouped_matmul(l, r, sizes, interpret=True), mesh, (ROWS, P()), ROWS)
    with interpret(), pytest.raises(ValueError, match="manual_axis_type"):
        jax.jit(f)(put(randn(0, (512, 128)), mesh, ROWS), put(randn(1, (2, 128, 128)), mesh, P()))
