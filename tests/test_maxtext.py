"""MaxText 0.2.5's kernel paths through reprules' maxtext, qwix and tokamax packs, on CPU.

The packs load themselves (``import reprules`` is all a user writes; the last
test checks that in a fresh interpreter); conftest clears rules after each
test, so a fixture registers them again as the entry points do. Every path
runs inside ``shard_map`` on the (4, 2) ("data", "model") mesh, tokens (or
batch) over ``data``, experts or heads over ``model``, with ``check_vma=True``;
forward and gradients are compared with the same program under
``check_vma=False`` and with an unsharded reference (``jax.lax.ragged_dot``,
plain jnp attention), and the checked gradient has no defensive all-reduce.

* MoE grouped matmul, ``maxtext.kernels.megablox.gmm`` as ``MoeBlock``
  calls it, FSDP (weights replicated) and EP (experts over ``model``, local
  groups, a psum over ``model``): with ``use_tokamax_backend=True``
  (tokamax's ``ragged_dot``, Mosaic TPU kernels in TPU interpret mode) and with
  MaxText's megablox fork (``interpret=True``). The fork launches its kernels
  through ``qwix.pallas.pallas_call`` (the qwix pack) and annotates every
  out_shape by hand (``varying_axes``): the forward replicated, then
  ``pcast(out, axis, to='varying')``; the weight gradient like the weight.
  Under JAX alone the weight gradient is silently wrong (no psum over
  ``data``); with the packs both annotations are widened (a
  ``ReplicationWarning``), the fork's own cast is the identity, and the weight
  gradient gets exactly its psum over ``data``.
* Splash attention (``make_splash_mha``, causal, vmapped over the batch as
  MaxText's attention op does) and ragged GQA decode (forward only; it has no VJP).
* mHC (``mhc_kernels_fwd.pre`` / ``post``), whose kernels MaxText calls under an
  abstract mesh with no axes on CPU: forward exact, gradient refused by JAX.

Not run here: ``use_gmm_v2`` (JAX's TPU interpreter fails on it, checking off
too), and the ring-of-experts routing (on CPU a jnp fallback without kernels).
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_err, psum_axes, put, randn, shard_map
from jax.sharding import PartitionSpec as P

import reprules
from reprules import testing

maxtext = pytest.importorskip(
    "maxtext", reason="maxtext (PyPI `maxtext`, with aqtp, jinja2 and pathwaysutils) is not installed; these "
    "tests run in the newest-JAX environment"
)
pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
tokamax = pytest.importorskip("tokamax")
qpl = pytest.importorskip("qwix.pallas")
mblx = pytest.importorskip("maxtext.kernels.megablox")
from maxtext.kernels.attention import ragged_attention, splash_attention_kernel as splash  # noqa: E402

SIZES = (16, 48, 40, 24)  # four experts' groups in each data shard of 128 tokens
M, K, N = 512, 128, 128  # tokamax's TPU gmm wants every non-group dimension >= 128
TOKENS = P("data", None)


@pytest.fixture(autouse=True)
def packs():
    """The packs' registrations, as on ``import maxtext`` / ``qwix.pallas`` / ``tokamax``."""
    from reprules._builtin_packs import maxtext as maxtext_pack
    from reprules._builtin_packs import qwix as qwix_pack
    from reprules._builtin_packs import tokamax as tokamax_pack

    maxtext_pack.maxtext(maxtext)
    qwix_pack.qwix(qpl)
    tokamax_pack.tokamax(tokamax)


@pytest.fixture
def cpu_as_tpu():
    """TPU interpret mode on CPU with a TPU v5e description of the CPU device
    (``reprules.testing.tpu_on_cpu``), tokamax's TPU ops allowed there."""

    @contextlib.contextmanager
    def ctx():
        with testing.tpu_on_cpu("v5e"), tokamax.config.cross_compile(True), warnings.catch_warnings():
            warnings.simplefilter("ignore", reprules.ReplicationWarning)  # the widened annotations
            yield

    return ctx


def _compare(mesh, body, in_specs, out_spec, args, reference, argnums):
    """``body`` under checking on equals checking off and ``reference`` (forward and
    grads of ``sum(out * t)``); returns the checked gradient's psum axes and its report."""
    sharded = [put(a, mesh, s) for a, s in zip(args, in_specs)]
    t = randn(9, jax.eval_shape(reference, *args).shape)

    def step(f):
        grad = jax.grad(lambda *a: (f(*a).astype(jnp.float32) * t).sum(), argnums=argnums)
        return grad, jax.jit(lambda *a: (f(*a), grad(*a)))

    grad_on, on = step(shard_map(body, mesh, in_specs, out_spec))
    _, off = step(shard_map(body, mesh, in_specs, out_spec, check=False))
    (out_on, g_on), (out_off, g_off) = on(*sharded), off(*sharded)
    out_ref, g_ref = step(reference)[1](*args)
    report = testing.collectives(grad_on, *sharded)
    psums = psum_axes(grad_on, *sharded)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in g_ref)
    assert max_err(out_on, out_off) == 0.0
    assert max_err(out_on, out_ref) < 1e-3
    assert max_err(g_on, g_off) / scale < 1e-6
    assert max_err(g_on, g_ref) / scale < 1e-5  # another summation order
    assert report.count("all-reduce", defensive=True) == 0
    return psums, report


# --- the MoE grouped matmul ----------------------------------------------------
def _gmm(backend):
    def gmm(lhs, rhs, sizes):
        fork = backend == "megablox"
        return mblx.gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32, tiling=(128,) * 9,
                        use_tokamax_backend=not fork, interpret=True,
                        # MoeBlock's extract_vma: the operands' varying axes, for the fork's annotations
                        lhs_vma_axes=_varying(lhs) if fork else (), rhs_vma_axes=_varying(rhs) if fork else ())

    return gmm


def _varying(x):
    return tuple(sorted(jax.typeof(x).manual_axis_type.varying))


def _fsdp(gmm):
    return lambda lhs, rhs: gmm(lhs, rhs, jnp.array(SIZES, jnp.int32))


def _ep(gmm):
    """Experts over 'model': each device multiplies its tokens of its two experts (rows
    rolled to the front), zeroes the rest, and the outputs are psummed over 'model'."""

    def ep(lhs, rhs):
        sizes = jnp.array(SIZES, jnp.int32)
        m = jax.lax.axis_index("model")
        local = jax.lax.dynamic_slice(sizes, (2 * m,), (2,))
        offset = jnp.sum(jnp.where(jnp.arange(len(SIZES)) < 2 * m, sizes, 0))
        mask = (jnp.arange(lhs.shape[0]) < local.sum())[:, None]
        y = jnp.where(mask, gmm(jnp.where(mask, jnp.roll(lhs, -offset, 0), 0.0), rhs, local), 0.0)
        return jax.lax.psum(jnp.roll(y, offset, 0), "model")

    return ep


def _gmm_reference(lhs, rhs):
    """Unsharded: each data shard's 128 rows hold the four experts' groups."""
    return jax.lax.ragged_dot(lhs, jnp.tile(rhs, (4, 1, 1)), jnp.tile(jnp.array(SIZES, jnp.int32), 4),
                              preferred_element_type=jnp.float32)


@pytest.mark.parametrize("backend", ["tokamax", "megablox"])
@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_moe_gmm_forward_and_gradients(mesh, cpu_as_tpu, backend, layout):
    """The weight gradient is psummed over 'data' once; in EP the activations' gradient
    over 'model' (a sum over the experts' shards), and the forward's own psum."""
    body = (_fsdp if layout == "fsdp" else _ep)(_gmm(backend))
    experts = P() if layout == "fsdp" else P("model", None, None)
    args = (randn(0, (M, K)), randn(1, (len(SIZES), K, N)))
    with cpu_as_tpu():
        psums, report = _compare(mesh, body, (TOKENS, experts), TOKENS, args, _gmm_reference, (0, 1))
    if layout == "fsdp":
        assert psums == [("data",)]
        assert report.count("all-reduce", axes="model") == 0
    else:
        assert psums == [("data",), ("model",), ("model",)]


def test_the_megablox_fork_is_silently_wrong_without_the_qwix_pack(mesh, cpu_as_tpu):
    """Why the qwix pack: without it the fork's kernels have no rule, JAX believes their
    hand annotations, and the weight gradient misses its psum over 'data'."""
    reprules.unregister(reprules.kernels_in(qpl.pallas_call.__module__))
    f = shard_map(_fsdp(_gmm("megablox")), mesh, (TOKENS, P()), TOKENS)
    lhs, rhs, t = randn(0, (M, K)), randn(1, (len(SIZES), K, N)), randn(9, (M, N))
    grad = jax.grad(lambda *a: (f(*a) * t).sum(), argnums=1)
    with cpu_as_tpu():
        psums = psum_axes(grad, put(lhs, mesh, TOKENS), put(rhs, mesh, P()))
    assert psums == []  # no psum over 'data': each shard's partial sum taken for the whole


# --- attention -----------------------------------------------------------------
B, H, S, D = 4, 2, 128, 128
HEADS = P("data", "model", None, None)


def _splash(q, k, v):
    sizes = dict(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
                 block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
    mask = splash.mask_lib.MultiHeadMask([splash.mask_lib.CausalMask((S, S))] * q.shape[1])
    kernel = splash.make_splash_mha(mask, block_sizes=splash.BlockSizes(**sizes), head_shards=1, q_seq_shards=1)
    return jax.vmap(kernel)(q, k, v)


def _causal_attention(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)


def test_splash_attention_forward_and_gradients(mesh, cpu_as_tpu):
    """Batch over 'data', heads over 'model': no all-reduce at all (checking off: none either)."""
    args = [randn(i, (B, H, S, D)) for i in range(3)]
    with cpu_as_tpu():
        psums, _ = _compare(mesh, _splash, (HEADS,) * 3, HEADS, args, _causal_attention, (0, 1, 2))
    assert psums == []


HQ, HKV, SK = 8, 2, 256
KV = P("data", None, "model", None)


def test_ragged_gqa_decode_forward(mesh, cpu_as_tpu):
    """Batch over 'data', kv heads (and their query groups) over 'model', per-sequence lengths."""
    q, k, v = randn(0, (B, 1, HQ, D)), randn(1, (B, SK, HKV, D)), randn(2, (B, SK, HKV, D))
    lengths = jnp.array([256, 100, 200, 7], jnp.int32)

    def body(q, k, v, lengths):
        o, _, l = ragged_attention.ragged_gqa(q, k, v, lengths, block_size=128)
        return o / l

    def reference(q, k, v, lengths):
        qg = q.reshape(B, HKV, HQ // HKV, D)
        s = jnp.einsum("bgqd,bsgd->bgqs", qg, k)
        s = jnp.where(jnp.arange(SK) < lengths[:, None, None, None], s, -jnp.inf)
        return jnp.einsum("bgqs,bsgd->bgqd", jax.nn.softmax(s, -1), v).reshape(B, 1, HQ, D)

    specs = (KV, KV, KV, P("data"))
    sharded = [put(a, mesh, s) for a, s in zip((q, k, v, lengths), specs)]
    with cpu_as_tpu():
        on = jax.jit(shard_map(body, mesh, specs, KV))(*sharded)
        off = jax.jit(shard_map(body, mesh, specs, KV, check=False))(*sharded)
    assert max_err(on, off) == 0.0
    assert max_err(on, reference(q, k, v, lengths)) < 1e-5


# --- mHC: kernels called under a hidden abstract mesh ----------------------------
def test_mhc_forward_is_exact_and_its_gradient_refused_by_jax_not_silently_wrong(mesh, cpu_as_tpu):
    """MaxText calls each mHC kernel inside ``use_abstract_mesh(AbstractMesh((), ()))`` on
    CPU, where the mesh names no manual axes. Before, reprules typed the kernels' outputs
    replicated there and every checked gradient leaf was silently wrong (0.7 - 7.5
    relative). Now the forward is exact, and the backward reaches MaxText's own
    ``jax.vjp`` of the (replicated) folded weights with the kernel's per-shard partial
    gradient, typed varying over ``data`` as it is: JAX refuses it (MaxText's bwd
    assumes checking off, where the shard_map transpose adds the psum)."""
    import itertools

    from maxtext.kernels import mhc
    from maxtext.kernels.mhc import mhc_kernels_fwd

    b, s, k, d = 8, 32, 4, 128
    shapes = dict(norm_scale=(k * d,), pre_alpha=(k * d, k), pre_bias=(k,), pre_scale=(1,), post_alpha=(k * d, k),
                  post_bias=(k,), post_scale=(1,), res_alpha=(k * d, 24), res_bias=(24,), res_scale=(1,))
    weights = [randn(10 + i, shape) * (0.05 if len(shape) == 2 else 0.5) + (name == "norm_scale")
               for i, (name, shape) in enumerate(shapes.items())]
    perms = jnp.asarray(np.eye(k)[np.array(list(itertools.permutations(range(k))))], jnp.bfloat16)
    config = mhc.MhcKernelConfig(block_size=32, bwd_block_size=32, bwd_feature_block_size=128)

    def body(x, *w):
        layer_input, ctx = mhc_kernels_fwd.pre(x, mhc.MhcWeights(*w), perms, config=config)
        return mhc_kernels_fwd.post((layer_input * 1.5).astype(jnp.bfloat16), ctx, config=config).astype(jnp.float32)

    x = randn(0, (b, s, k, d)).astype(jnp.bfloat16)
    specs = (P("data"),) + (P(),) * len(weights)
    sharded = [put(a, mesh, spec) for a, spec in zip((x, *weights), specs)]
    t = randn(9, (b, s, k, d))
    with cpu_as_tpu():
        on = shard_map(body, mesh, specs, P("data"))
        off = shard_map(body, mesh, specs, P("data"), check=False)
        assert max_err(jax.jit(on)(*sharded), jax.jit(off)(*sharded)) == 0.0
        assert max_err(jax.jit(on)(*sharded), jax.jit(body)(x, *weights)) == 0.0
        grad = jax.grad(lambda *a: (on(*a) * t).sum(), argnums=tuple(range(len(specs))))
        with pytest.raises(ValueError, match=r"unexpected JAX type .* got float32\[\d+,\d+\]\{V:data\}"):
            jax.jit(grad)(*sharded)


# --- the packs load themselves ---------------------------------------------------
def test_the_packs_load_on_import():
    """In a fresh interpreter: nothing registered after ``import reprules``; ``import maxtext``
    loads the maxtext pack, ``import qwix.pallas`` (which MaxText's megablox imports) the qwix
    pack, each with its rules.inferred() registrations."""
    import subprocess
    import sys

    code = ("import reprules\n"
            "print(reprules.registered() == {})\n"
            "import maxtext, qwix.pallas\n"
            "print(sorted((p.module, p.name, p.state) for p in reprules.packs() if p.state != 'waiting'))\n"
            "for key, reg in sorted(reprules.registered().items()):\n"
            "    print(key, '|', reg.rule, '|', reg.source)")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[0] == "True"
    assert lines[1] == str([("maxtext", "reprules._builtin_packs.maxtext:maxtext", "loaded"),
                            ("qwix.pallas", "reprules._builtin_packs.qwix:qwix", "loaded")])
    assert lines[2:] == [
        "kernels_in:maxtext.kernels.attention | rules.inferred() | pack reprules._builtin_packs.maxtext:maxtext",
        "kernels_in:maxtext.kernels.megablox | rules.inferred() | pack reprules._builtin_packs.maxtext:maxtext",
        f"kernels_in:{qpl.pallas_call.__module__} | rules.inferred() | pack reprules._builtin_packs.qwix:qwix",
    ]
