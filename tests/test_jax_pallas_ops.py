"""JAX's own Pallas ops inside shard_map with checking on, through reprules' built-in pack.

For every op the pack covers, on every JAX of the matrix where the op exists
and runs in interpret mode on CPU: batch (or heads) sharded over ``data`` of the
(4, 2) ("data", "model") mesh, parameters replicated; the result (and the
gradients, for ops with a VJP) compared to the op's reference implementation;
the collectives checked: nothing over ``model``, exactly the needed psums over
``data`` (weight gradients), none otherwise.

Rules are loaded by calling the pack function on the op module, as the entry
point does on import (tests/conftest.py unregisters every rule after each
test); test_packs.py proves the entry points themselves load on import.
Shapes are tiny: interpret mode is slow.

Where each op's module lives in each JAX release is written down in
:data:`OP_MODULES`: where the table says a module exists, failing to import it,
or a kernel the pack lists missing from it, fails (a rename in JAX must not
silently drop coverage); only where the table says it does not exist is a test
skipped, saying so.
"""

from __future__ import annotations

import importlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, count_all_reduce, make_mesh, max_err, psum_axes, put, randn, shard_map
from reprules._builtin_packs import jax_pallas_ops as pack

OPS = "jax.experimental.pallas.ops"
# Pack function -> [(module under OPS, first JAX release that has it, last one; None: still
# in the newest supported JAX)], read from the released jax wheels 0.4.28 - 0.12.0.1 (0.4.29
# moved the GPU ops under gpu/).
OP_MODULES = {
    "layer_norm": [("layer_norm", (0, 4, 28), (0, 4, 28)), ("gpu.layer_norm", (0, 4, 29), None)],
    "rms_norm": [("rms_norm", (0, 4, 28), (0, 4, 28)), ("gpu.rms_norm", (0, 4, 29), None)],
    "softmax": [("softmax", (0, 4, 28), (0, 4, 28)), ("gpu.softmax", (0, 4, 29), None)],
    "attention": [("attention", (0, 4, 28), (0, 4, 28)), ("gpu.attention", (0, 4, 29), None)],
    "decode_attention": [("gpu.decode_attention", (0, 4, 29), None)],
    "paged_attention_gpu": [("gpu.paged_attention", (0, 5, 1), None)],
    "splash_attention": [("tpu.splash_attention.splash_attention_kernel", (0, 4, 28), None)],
    "flash_attention_tpu": [("tpu.flash_attention", (0, 4, 28), None)],
    "matmul_tpu": [("tpu.matmul", (0, 4, 33), None)],
    "example_kernel_tpu": [("tpu.example_kernel", (0, 4, 28), None)],
}


def _claimed_path(function: str, version=JAX_VERSION):
    """The module path the table says ``function``'s op has in JAX ``version``, or None."""
    for path, first, last in OP_MODULES[function]:
        if first <= version[:len(first)] and (last is None or version[:len(last)] <= last):
            return path
    return None


def _module(function: str):
    """The op module of pack function ``function`` in this JAX; skips (saying why) where it has none."""
    path = _claimed_path(function)
    if path is None:
        spans = ", ".join(f"{p} in JAX {'.'.join(map(str, a))} - {'.'.join(map(str, b)) if b else 'now'}"
                          for p, a, b in OP_MODULES[function])
        pytest.skip(f"JAX {jax.__version__} has no module for this op ({spans})")
    return importlib.import_module(f"{OPS}.{path}")  # claimed: an ImportError fails the test


def _loaded(function: str):
    """The op module, with its rules registered by the pack (as on import)."""
    module = _module(function)
    getattr(pack, function)(module)
    return module


def _tpu_interpret():
    """Context that runs TPU kernels in interpret mode on CPU (ops with no interpret argument)."""
    try:
        from jax.experimental.pallas import tpu as pltpu
    except ImportError:
        pltpu = None
    force = getattr(pltpu, "force_tpu_interpret_mode", None)
    if force is None:
        pytest.skip(
            f"the op takes no interpret argument and JAX {jax.__version__} has no "
            "pltpu.force_tpu_interpret_mode (0.8+): it cannot run on CPU"
        )
    return force()


def _typed_varying(body, mesh, in_specs, *args):
    """The output is typed as varying: shard_map refuses to return it as replicated (out_specs=P())."""
    with pytest.raises(ValueError, match="(?i)vary|replicat"):
        jax.jit(shard_map(body, mesh, in_specs, P()))(*args)


def _no_collectives(fn, *args):
    assert psum_axes(fn, *args) == []
    jaxpr, stablehlo, _ = count_all_reduce(fn, *args)
    assert (jaxpr, stablehlo) == (0, 0)


# --- norms: per-row kernels, replicated weight and bias ------------------------------------


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm(op):
    norm = _loaded(op)
    fn, reference = getattr(norm, op), getattr(norm, f"{op}_reference")
    mesh = make_mesh()
    spec = P("data", None, None)
    x = put(randn(0, (8, 4, 128)), mesh, spec)
    w = put(1.0 + 0.1 * randn(1, (128,)), mesh, P())
    b = put(0.1 * randn(2, (128,)), mesh, P())
    t = randn(3, (8, 4, 128))
    sharded = shard_map(lambda x, w, b: fn(x, w, b, interpret=True), mesh, (spec, P(), P()), spec)
    args = tuple(map(np.asarray, (x, w, b)))
    assert max_err(jax.jit(sharded)(x, w, b), reference(*args)) < 1e-5

    grad = jax.grad(lambda x, w, b: (sharded(x, w, b) * t).sum(), argnums=(0, 1, 2))
    expected = jax.grad(lambda x, w, b: (reference(x, w, b) * t).sum(), argnums=(0, 1, 2))(*args)
    assert max_err(jax.jit(grad)(x, w, b), expected) < 1e-4
    # dw and db over `data` (the batch axis), nothing over `model`.
    assert psum_axes(grad, x, w, b) == [("data",), ("data",)]


# --- softmax: forward only (no VJP) ----------------------------------------------------------


def test_softmax():
    sm = _loaded("softmax")
    mesh = make_mesh()
    spec = P("data", "model", None)
    x = put(randn(0, (8, 4, 128)), mesh, spec)
    body = lambda x: sm.softmax(x, axis=-1, interpret=True)  # noqa: E731
    sharded = shard_map(body, mesh, (spec,), spec)
    assert max_err(jax.jit(sharded)(x), jax.nn.softmax(np.asarray(x), axis=-1)) < 1e-6
    _typed_varying(body, mesh, (spec,), x)
    _no_collectives(sharded, x)


# --- attention (mha): custom VJP, batch sharded, heads over model ---------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_mha(causal):
    attn = _loaded("attention")
    if hasattr(attn, "BlockSizes"):
        blocks = {"block_sizes": attn.BlockSizes(16, 16, 16, 16, 16, 16)}
    else:  # 0.4.28 - 0.4.30
        blocks = {"block_q": 16, "block_k": 16}
    mesh = make_mesh()
    spec = P("data", None, "model", None)  # (batch, seq, heads, head_dim)
    q, k, v = (put(randn(i, (4, 16, 2, 16)), mesh, spec) for i in range(3))
    t = randn(3, (4, 16, 2, 16))

    def body(q, k, v):
        return attn.mha(q, k, v, None, causal=causal, interpret=True, **blocks)

    sharded = shard_map(body, mesh, (spec,) * 3, spec)
    args = tuple(map(np.asarray, (q, k, v)))
    reference = attn.mha_reference(*args, None, causal=causal)
    assert max_err(jax.jit(sharded)(q, k, v), reference) < 1e-5

    grad = jax.grad(lambda *a: (sharded(*a) * t).sum(), argnums=(0, 1, 2))
    expected = jax.grad(lambda *a: (attn.mha_reference(*a, None, causal=causal) * t).sum(), argnums=(0, 1, 2))(*args)
    assert max_err(jax.jit(grad)(q, k, v), expected) < 1e-4
    _no_collectives(grad, q, k, v)  # every input is sharded like the output: nothing to reduce


# --- decode attention (mqa / gqa): forward only ----------------------------------------------


@pytest.mark.parametrize("variant", ["mqa", "gqa"])
def test_decode_attention(variant):
    dec = _loaded("decode_attention")
    mesh = make_mesh()
    if variant == "mqa":  # q (batch, heads, dim), k/v (batch, seq, dim)
        q_spec, kv_spec = P("data", "model", None), P("data", None, None)
        q, k, v = randn(0, (4, 8, 16)), randn(1, (4, 32, 16)), randn(2, (4, 32, 16))
    else:  # gqa: k/v (batch, seq, kv_heads, dim); q heads grouped by kv head, split over model
        q_spec, kv_spec = P("data", "model", None), P("data", None, "model", None)
        q, k, v = randn(0, (4, 8, 16)), randn(1, (4, 32, 2, 16)), randn(2, (4, 32, 2, 16))
    op, ref = getattr(dec, variant), getattr(dec, f"{variant}_reference")
    start = put(jnp.array([0, 1, 2, 3], jnp.int32), mesh, P("data"))
    length = put(jnp.array([32, 20, 17, 9], jnp.int32), mesh, P("data"))

    def body(q, k, v, start, length):
        return op(q, k, v, start, length, block_h=4, block_k=16, k_splits=2, interpret=True)

    in_specs = (q_spec, kv_spec, kv_spec, P("data"), P("data"))
    sharded = shard_map(body, mesh, in_specs, q_spec)
    args = (put(q, mesh, q_spec), put(k, mesh, kv_spec), put(v, mesh, kv_spec), start, length)
    expected = ref(q, k, v, np.asarray(start), np.asarray(length))
    assert max_err(jax.jit(sharded)(*args), expected) < 1e-5
    _typed_varying(body, mesh, in_specs, *args)
    _no_collectives(sharded, *args)


# --- paged attention (GPU): forward only; the page pool is replicated ------------------------


def test_paged_attention_gpu():
    pa = _loaded("paged_attention_gpu")
    batch, heads, kv_heads, dim, page, pages_per_seq = 4, 16, 2, 16, 4, 4
    num_pages = batch * pages_per_seq
    rng = np.random.RandomState(0)
    q = randn(0, (batch, heads, dim))
    k_pages = randn(1, (kv_heads, num_pages, page, dim))
    v_pages = randn(2, (kv_heads, num_pages, page, dim))
    tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
    lengths = jnp.array([16, 11, 5, 1], jnp.int32)
    mesh = make_mesh()
    row = P("data", None, None)

    def body(q, k_pages, v_pages, tables, lengths):
        return pa.paged_attention(q, k_pages, v_pages, tables, lengths, block_h=16,
                                  pages_per_compute_block=2, k_splits=2, interpret=True)

    in_specs = (row, P(), P(), P("data", None), P("data"))
    sharded = shard_map(body, mesh, in_specs, row)
    args = (put(q, mesh, row), put(k_pages, mesh, P()), put(v_pages, mesh, P()),
            put(tables, mesh, P("data", None)), put(lengths, mesh, P("data")))
    # Reference on contiguous k/v: gather each sequence's pages.
    k = jnp.moveaxis(k_pages[:, tables].reshape(kv_heads, batch, -1, dim), 0, 2)
    v = jnp.moveaxis(v_pages[:, tables].reshape(kv_heads, batch, -1, dim), 0, 2)
    expected = pa.paged_attention_reference(q, k, v, lengths)
    assert max_err(jax.jit(sharded)(*args), expected) < 1e-5
    _typed_varying(body, mesh, in_specs, *args)  # varies like the batch, despite the replicated pool
    _no_collectives(sharded, *args)


# --- splash attention (TPU kernels, interpret=True): custom VJP -------------------------------


def _splash():
    sk = _loaded("splash_attention")
    import inspect

    if "interpret" not in inspect.signature(sk._make_splash_attention).parameters:
        pytest.skip(f"splash attention in JAX {jax.__version__} takes no interpret argument")
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    return sk, sm


@pytest.mark.parametrize("variant", ["mha", "mqa"])
def test_splash_attention(variant):
    sk, sm = _splash()
    heads, seq, dim = 8, 128, 128
    blocks = sk.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                           block_kv_dkv=128, block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
    mesh = make_mesh()
    local = heads // 4
    make = sk.make_splash_mha if variant == "mha" else sk.make_splash_mqa
    kernel = make(sm.MultiHeadMask([sm.CausalMask((seq, seq))] * local), head_shards=1,
                  q_seq_shards=1, block_sizes=blocks, interpret=True)
    full_mask = sm.MultiHeadMask([sm.CausalMask((seq, seq))] * heads)
    ref_fn = (sk.make_masked_mha_reference if variant == "mha" else sk.make_masked_mqa_reference)(full_mask)
    q = randn(0, (heads, seq, dim))
    kv_shape = (heads, seq, dim) if variant == "mha" else (seq, dim)
    k, v = randn(1, kv_shape), randn(2, kv_shape)
    t = randn(3, (heads, seq, dim))
    # Heads sharded over `data`; MQA's single k/v head is replicated.
    kv_spec = P("data", None, None) if variant == "mha" else P()
    q_spec = P("data", None, None)
    sharded = shard_map(lambda q, k, v: kernel(q, k, v), mesh, (q_spec, kv_spec, kv_spec), q_spec)
    args = (put(q, mesh, q_spec), put(k, mesh, kv_spec), put(v, mesh, kv_spec))
    assert max_err(jax.jit(sharded)(*args), ref_fn(q, k, v)) < 1e-4

    grad = jax.grad(lambda *a: (sharded(*a) * t).sum(), argnums=(0, 1, 2))
    expected = jax.grad(lambda *a: (ref_fn(*a) * t).sum(), argnums=(0, 1, 2))(q, k, v)
    assert max_err(jax.jit(grad)(*args), expected) < 1e-3
    # MQA: dk and dv of the shared head summed over the sharded query heads, over `data` only.
    assert psum_axes(grad, *args) == ([] if variant == "mha" else [("data",), ("data",)])


# --- TPU ops with no interpret argument: pltpu.force_tpu_interpret_mode (0.8+) -------------------


def test_flash_attention_tpu():
    fa = _loaded("flash_attention_tpu")
    with _tpu_interpret():
        blocks = fa.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1,
                               block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128,
                               block_q_dkv=128, block_k_major_dq=128, block_k_dq=128, block_q_dq=128)
        mesh = make_mesh()
        spec = P("data", "model", None, None)  # (batch, heads, seq, dim)
        q, k, v = (randn(i, (4, 2, 128, 128)) for i in range(3))
        t = randn(3, (4, 2, 128, 128))
        sharded = shard_map(lambda *a: fa.flash_attention(*a, causal=True, block_sizes=blocks),
                            mesh, (spec,) * 3, spec)
        args = tuple(put(a, mesh, spec) for a in (q, k, v))
        assert max_err(jax.jit(sharded)(*args), fa.mha_reference(q, k, v, None, causal=True)) < 1e-4

        grad = jax.grad(lambda *a: (sharded(*a) * t).sum(), argnums=(0, 1, 2))
        expected = jax.grad(lambda *a: (fa.mha_reference(*a, None, causal=True) * t).sum(),
                            argnums=(0, 1, 2))(q, k, v)
        assert max_err(jax.jit(grad)(*args), expected) < 1e-3
        _no_collectives(grad, *args)


def test_flash_attention_tpu_after_its_rules_are_unregistered():
    """In JAX's HLO interpreter (``force_tpu_interpret_mode(True)``, as jax-flash-attn2
    runs it), run with the pack's rules, then with them unregistered: inference by
    default types all three kernels, the dq kernel too (from JAX 0.10 its out_shape is
    ``ShapeDtypeStruct.like(q)``: JAX accepts it, its interpreter refuses it). The
    second run failed in JAX's interpreter (a carry-type error, a RuleError for causal)."""
    fa = _loaded("flash_attention_tpu")
    _tpu_interpret()  # skips where JAX has no force_tpu_interpret_mode
    from jax.experimental.pallas import tpu as pltpu

    blocks = fa.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1,
                           block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128,
                           block_q_dkv=128, block_k_major_dq=128, block_k_dq=128, block_q_dq=128)
    mesh = make_mesh()
    spec = P("data", "model", None, None)
    q, k, v = (randn(i, (4, 2, 128, 128)) for i in range(3))
    t = randn(3, (4, 2, 128, 128))
    args = tuple(put(a, mesh, spec) for a in (q, k, v))

    def programs(check):  # traced anew on every call
        f = shard_map(lambda *a: fa.flash_attention(*a, causal=True, block_sizes=blocks),
                      mesh, (spec,) * 3, spec, check=check)
        grad = jax.grad(lambda *a: (f(*a) * t).sum(), argnums=(0, 1, 2))
        return jax.jit(f)(*args), jax.jit(grad)(*args)

    with pltpu.force_tpu_interpret_mode(True):
        out_off, grads_off = programs(check=False)
        ran = [programs(check=True)]
        for name in pack.KERNELS["flash_attention_tpu"]:
            reprules.unregister(getattr(fa, name))
        ran.append(programs(check=True))
    for out, grads in ran:
        assert max_err(out, out_off) == 0.0
        assert all(max_err(g, g_off) == 0.0 for g, g_off in zip(grads, grads_off))


def test_matmul_tpu():
    mm = _loaded("matmul_tpu")
    interpret = _tpu_interpret()  # skips first where TPU kernels cannot run on CPU at all (< 0.8)
    if JAX_VERSION < (0, 12, 0):
        pytest.skip(f"JAX {jax.__version__}'s TPU interpret mode hangs on this op inside shard_map "
                    "(without reprules too)")
    with interpret:
        mesh = make_mesh()
        x, y = randn(0, (32, 256)), randn(1, (256, 256))
        # Rows of x over `data`, columns of y over `model`: each output tile varies over both.
        body = lambda x, y: mm.matmul(x, y, block_shape=(8, 128), block_k=128)  # noqa: E731
        in_specs = (P("data", None), P(None, "model"))
        sharded = shard_map(body, mesh, in_specs, P("data", "model"))
        args = (put(x, mesh, P("data", None)), put(y, mesh, P(None, "model")))
        assert max_err(jax.jit(sharded)(*args), np.asarray(x) @ np.asarray(y)) < 1e-3
        _typed_varying(body, mesh, in_specs, *args)
        # x replicated, y over `model`: the output varies over `model` only.
        only_model = shard_map(body, mesh, (P(), P(None, "model")), P(None, "model"))
        assert max_err(jax.jit(only_model)(x, args[1]), np.asarray(x) @ np.asarray(y)) < 1e-3
        _no_collectives(sharded, *args)


def test_example_kernel_tpu():
    ex = _loaded("example_kernel_tpu")
    with _tpu_interpret():
        mesh = make_mesh()
        x = randn(0, (32, 128))
        sharded = shard_map(ex.double, mesh, (P("data", None),), P("data", None))
        arg = put(x, mesh, P("data", None))
        assert max_err(jax.jit(sharded)(arg), 2 * np.asarray(x)) == 0
        _typed_varying(ex.double, mesh, (P("data", None),), arg)
        _no_collectives(sharded, arg)


# --- the pack itself: its kernel names, its entry points (loading on import: test_packs.py) ----


def test_the_table_covers_every_pack_function():
    assert set(OP_MODULES) == set(pack.KERNELS)
    assert all(callable(getattr(pack, function)) for function in pack.KERNELS)


@pytest.mark.parametrize("function", sorted(OP_MODULES))
def test_every_listed_kernel_exists_where_the_op_is_claimed(function):
    """Where the table says the op exists in this JAX, its module imports and has
    every kernel the pack lists, and the pack registers each of them."""
    module = _module(function)
    missing = [name for name in pack.KERNELS[function] if not callable(getattr(module, name, None))]
    assert not missing, (f"JAX {jax.__version__}'s {module.__name__} lacks {missing}, which "
                         f"reprules._builtin_packs.jax_pallas_ops lists for {function}: renamed in JAX?")
    getattr(pack, function)(module)
    registered = {reg.kernel() for reg in reprules.registered().values()}
    assert all(getattr(module, name) in registered for name in pack.KERNELS[function])


def test_a_kernel_missing_from_the_module_is_reported_not_skipped():
    """The pack registers what it finds, then raises naming what it did not find
    (the import hook turns that into a PackWarning and a failed pack status)."""
    module = types.ModuleType("fake_ops.softmax_renamed")
    with pytest.raises(LookupError, match=r"(?s)fake_ops\.softmax_renamed in JAX .* has no _vmappable_softmax_kernel.*Fix:"):
        pack.softmax(module)

    def layer_norm_forward_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    module.layer_norm_forward_kernel = layer_norm_forward_kernel
    with pytest.raises(LookupError, match="has no layer_norm_backward_kernel_dx, layer_norm_backward_kernel_dw_db"):
        pack.layer_norm(module)
    assert [reg.kernel() for reg in reprules.registered().values()] == [layer_norm_forward_kernel]


@pytest.mark.parametrize("function", sorted(OP_MODULES))
def test_pack_entry_points(function):
    """Each pack function is declared (installed metadata) for every module path it covers."""
    from importlib.metadata import entry_points

    declared = {ep.name: ep.value for ep in entry_points(group="reprules.rules")}
    for path, _, _ in OP_MODULES[function]:
        assert declared.get(f"{OPS}.{path}") == f"reprules._builtin_packs.jax_pallas_ops:{function}"
