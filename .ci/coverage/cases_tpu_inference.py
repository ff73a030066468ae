"""vLLM's TPU kernels (PyPI ``tpu-inference``, which pins JAX 0.11.2), one :class:`measure.Case` each.

``tpu_inference.kernels``: the quantized matmul (int8 weights, f32 or int8 activations),
flash attention, megablox ``gmm``, the KV-cache update (DMAs into a paged cache), the
ragged causal conv1d and ragged paged attention v3. Tokens or batch over ``data``;
heads, output features or channels over ``model`` (the cache's heads, as the library's
own ``shard_map`` splits it); weights and metadata replicated. Forward only: none of
these has a VJP. TPU interpret mode at the test site (the library exposes no
``interpret``, except ``gmm``'s, which the case sets too), with uninitialized reads
out of bounds where a kernel reads past its input's end (the conv1d's padded tiles).
Reference: ``jnp`` on the whole arrays (the cache update's: ``.at[].set`` per slice).

Installed without dependencies (vLLM, torch, libtpu): where vLLM is absent,
:func:`stand_ins` gives ``vllm.logger`` (the library's logger wraps it) and
``tpu_inference.utils`` (torch, torchax and vLLM at import) with only what the kernels
take from it, the library's own definitions read from its file.
"""

from __future__ import annotations

import contextlib
import functools

from measure import Case

UTILS = ("align_to", "get_dtype_packing", "get_device_name", "TPU_HEAD_SIZE_ALIGNMENT", "TPU_SECOND_LAST_MINOR")


def stand_ins() -> None:
    """``vllm.logger`` and ``tpu_inference.utils`` where vLLM (and so torch) is not installed."""
    import ast
    import importlib.util
    import logging
    import pathlib
    import sys
    import types

    if ("tpu_inference.utils" in sys.modules or importlib.util.find_spec("tpu_inference") is None
            or importlib.util.find_spec("vllm") is not None):
        return  # stood in (or imported) already, not installed (the tests skip), or installed with vLLM

    class Logger(logging.Logger):  # vLLM's: logging's, plus its *_once methods
        def warning_once(self, *a, **k):
            self.warning(*a, **k)

        info_once = debug_once = warning_once

    vllm, log = types.ModuleType("vllm"), types.ModuleType("vllm.logger")
    vllm.__path__ = []  # no submodules: the library's `import vllm.sampling_params` fails as without vLLM
    log._VllmLogger, log.init_logger = Logger, Logger
    vllm.logger = log
    sys.modules.update({"vllm": vllm, "vllm.logger": log})
    import tpu_inference

    # The library's own definitions, with the imports they need (not torch's, torchax's, vLLM's).
    path = pathlib.Path(tpu_inference.__file__).parent / "utils.py"
    skip = ("torch", "torchax", "vllm", "tpu_inference")

    def keep(node):
        if isinstance(node, ast.Import):
            return not any(a.name.startswith(skip) for a in node.names)
        if isinstance(node, ast.ImportFrom):
            return not (node.module or "").startswith(skip)
        if isinstance(node, ast.FunctionDef):
            return node.name in UTILS
        return isinstance(node, ast.Assign) and any(getattr(t, "id", "") in UTILS for t in node.targets)

    tree = ast.parse(path.read_text())
    tree.body = [n for n in tree.body if keep(n)]
    utils = types.ModuleType("tpu_inference.utils")
    utils.__file__ = str(path)
    exec(compile(tree, str(path), "exec"), utils.__dict__)
    sys.modules["tpu_inference.utils"] = tpu_inference.utils = utils


@contextlib.contextmanager
def _interpret(**params):
    """TPU interpret mode, the CPU device described as a TPU v6e (the kernels' block sizes ask
    ``pltpu.get_tpu_info()``), with ``params`` for the interpreter."""
    from jax.experimental.pallas import tpu as pltpu

    from reprules import testing

    with testing.tpu_on_cpu("v6e"), pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(**params)):
        yield


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _quantized_matmul(int8_x):
    def case():
        import jax.numpy as jnp
        import numpy as np

        stand_ins()
        from tpu_inference.kernels.quantized_matmul import kernel

        rng = np.random.RandomState(0)
        x = rng.randn(64, 256).astype(np.float32)  # (tokens, in)
        w_q = rng.randint(-127, 128, (256, 256)).astype(np.int8)  # (out, in)
        w_scale = (0.01 + 0.01 * rng.rand(256)).astype(np.float32)
        x_q_dtype = jnp.int8 if int8_x else None

        def body(x, w_q, w_scale):
            return kernel.quantized_matmul_kernel(x, w_q, w_scale, x_q_dtype=x_q_dtype)

        def ref(x, w_q, w_scale):
            w = w_q.astype(jnp.float32) * w_scale[:, None]
            if not int8_x:
                return jnp.dot(x, w.T, precision="highest")
            scale = jnp.max(jnp.abs(x), -1, keepdims=True) / 127.0  # per token, truncated, as the kernel quantizes
            x_q = (x * (1 / scale)).astype(jnp.int8)
            return jnp.dot(x_q, w_q.T.astype(jnp.float32), precision="highest") * scale * w_scale

        return Case(body, (x, w_q, w_scale), (_P("data", None), _P("model", None), _P("model")),
                    _P("data", "model"), reference=ref, context=_interpret, tol=1e-5 if int8_x else 1e-4,
                    note="tokens over data, output features over model"
                    + ("; activations quantized per token to int8" if int8_x else "; f32 activations"))

    return case


def _flash_attention():
    def case():
        import jax
        import jax.numpy as jnp
        import numpy as np

        stand_ins()
        from tpu_inference.kernels.flash_attention import kernel

        b, h, t, d = 4, 4, 256, 128
        rng = np.random.RandomState(0)
        q, k, v = (rng.randn(b, h, t, d).astype(np.float32) for _ in range(3))
        scale = d**-0.5

        def body(q, k, v):
            return kernel.flash_attention(q, k, v, causal=True, sm_scale=scale)

        def ref(q, k, v):
            s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * scale
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
            return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v, precision="highest")

        spec = _P("data", "model", None, None)
        return Case(body, (q, k, v), (spec,) * 3, spec, reference=ref, context=_interpret, tol=1e-4,
                    note="batch over data, heads over model; causal")

    return case


def _gmm():
    def case():
        import jax.numpy as jnp
        import numpy as np

        stand_ins()
        from tpu_inference.kernels.megablox import gmm

        rng = np.random.RandomState(0)
        m, k, n, groups = 256, 128, 256, 4
        lhs = rng.randn(m, k).astype(np.float32)
        rhs = (rng.randn(groups, k, n) * 0.1).astype(np.float32)
        sizes = np.array([16, 24, 8, 16], np.int32)  # per device's 64 tokens: ragged, one group per block edge

        def body(lhs, rhs, sizes):
            return gmm.gmm(lhs, rhs, sizes, tiling=(16, 128, 128), interpret=True)

        def ref(lhs, rhs, _):  # each data shard's tokens, grouped by the same sizes (constants: under jit)
            group = np.repeat(np.arange(groups), sizes)
            out = [jnp.einsum("mk,mkn->mn", part, rhs[group], precision="highest") for part in jnp.split(lhs, 4)]
            return jnp.concatenate(out)

        return Case(body, (lhs, rhs, sizes), (_P("data", None), _P(None, None, "model"), _P()),
                    _P("data", "model"), reference=ref, context=_interpret, tol=1e-5,
                    note="tokens over data, output features over model; ragged groups; interpret=True too")

    return case


def _kv_cache_update():
    def case():
        import numpy as np

        stand_ins()
        from tpu_inference.kernels.ragged_paged_attention.v2.ragged_kv_cache_update import kv_cache_update

        page, pages, heads, d = 32, 8, 4, 128
        rng = np.random.RandomState(0)
        new_kv = rng.randn(64, heads, d).astype(np.float32)
        cache = rng.randn(pages * page, heads, d).astype(np.float32)
        lens = np.array([7, page, 1, 9], np.int32)
        slots = np.stack([np.array([page - 7, page, 4 * page + 6, 6 * page + 3], np.int32),
                          np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.int32), lens])
        slots = np.pad(slots, ((0, 0), (0, 8 - len(lens))))  # a whole block of 8 slices; num says 4 are real
        num = np.array([len(lens)], np.int32)

        def body(new_kv, slots, cache, num):
            return kv_cache_update(new_kv, slots, cache, num, page_size=page, num_slices_per_block=8)

        def ref(new_kv, _, cache, num):  # the metadata as constants (the reference runs under jit)
            for start, src, n in slots.T[:len(lens)]:
                cache = cache.at[start:start + n].set(new_kv[src:src + n])
            return cache

        heads_spec = _P(None, "model", None)
        return Case(body, (new_kv, slots, cache, num), (heads_spec, _P(), heads_spec, _P()), heads_spec,
                    reference=ref, context=_interpret, tol=0.0,
                    note="heads over model (as the library's own shard_map), replicated over data")

    return case


def _causal_conv1d():
    def case():
        import jax.numpy as jnp
        import numpy as np

        stand_ins()
        from tpu_inference.kernels.causal_conv1d import causal_conv1d

        dim, ksize = 256, 4
        q_loc = np.array([0, 40, 45, 80, 96], np.int32)  # 4 sequences, 96 tokens
        lengths = np.array([50, 5, 35, 20], np.int32)
        rng = np.random.RandomState(0)
        x = rng.randn(96, dim).astype(np.float32)
        state = rng.randn(5, ksize - 1, dim).astype(np.float32)
        weight, bias = rng.randn(dim, 1, ksize).astype(np.float32), rng.randn(dim).astype(np.float32)
        meta = (q_loc, np.arange(1, 5, dtype=np.int32), np.array([0, 0, 4], np.int32), lengths > np.diff(q_loc))

        def body(x, state, weight, bias, q_loc, indices, distribution, has_init):
            return causal_conv1d.ragged_causal_conv1d(x, state, weight, bias, q_loc, indices, distribution,
                                                      has_init, kernel_size=ksize)

        def ref(x, state, weight, bias, *_):  # the metadata as constants (the reference runs under jit)
            indices, has_init = meta[1], meta[3]
            out, new_state = [], state
            for s in range(4):
                lo, hi = int(q_loc[s]), int(q_loc[s + 1])
                prior = state[indices[s]] if has_init[s] else jnp.zeros_like(state[0])
                seq = jnp.concatenate([prior, x[lo:hi]])
                out.append(sum(seq[j:j + hi - lo] * weight[:, 0, j] for j in range(ksize)) + bias)
                new_state = new_state.at[indices[s]].set(seq[-(ksize - 1):])
            return jnp.concatenate(out), new_state

        ch = _P(None, "model")
        return Case(body, (x, state, weight, bias, *meta),
                    (ch, _P(None, None, "model"), _P("model", None, None), _P("model"), _P(), _P(), _P(), _P()),
                    (ch, _P(None, None, "model")), reference=ref,
                    context=functools.partial(_interpret, out_of_bounds_reads="uninitialized"), tol=1e-5,
                    note="channels over model, replicated over data; 4 ragged sequences, mixed")

    return case


def _ragged_paged_attention():
    def case():
        import numpy as np

        stand_ins()
        from tpu_inference.kernels.ragged_paged_attention.v3 import kernel

        heads, kv_heads, d, page, pages_per_seq = 4, 2, 128, 16, 4
        q_lens = np.array([8, 17], np.int32)  # 2 sequences, both with earlier tokens in the cache
        rng = np.random.RandomState(0)
        t = int(q_lens.sum())
        q = rng.randn(t, heads, d).astype(np.float32)
        k, v = (rng.randn(t, kv_heads, d).astype(np.float32) for _ in range(2))
        # (pages, page size, k and v of each kv head interleaved, f32 packing 1, head dim)
        cache = rng.randn(2 * pages_per_seq, page, 2 * kv_heads, 1, d).astype(np.float32)
        meta = (np.array([40, 30], np.int32), np.arange(2 * pages_per_seq, dtype=np.int32),
                np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32), np.array([0, 0, 2], np.int32))

        def body(q, k, v, cache, *meta):
            # block sizes given (their heuristic asks the device kind, which names no TPU: "cpu")
            return kernel.ragged_paged_attention(q, k, v, cache, *meta, sm_scale=d**-0.5, d_block_sizes=(1, 64, 1, 64),
                                                 p_block_sizes=(16, 64, 16, 32), m_block_sizes=(16, 64, 16, 32))[0]

        def ref(q, k, v, cache, *_):  # the library's reference; the metadata as constants (it loops over them)
            return kernel.ref_ragged_paged_attention(q, k, v, cache, *meta, sm_scale=d**-0.5)[0]

        heads_spec = _P(None, "model", None)
        return Case(body, (q, k, v, cache, *meta),
                    (heads_spec, heads_spec, heads_spec, _P(None, None, "model", None, None), _P(), _P(), _P(), _P()),
                    heads_spec, reference=ref, context=_interpret, tol=1e-4,
                    note="heads over model (k and v of a kv head on one device), replicated over data; 2 sequences")

    return case


CASES = {
    "quantized_matmul_kernel (int8 weights, f32 activations)": _quantized_matmul(False),
    "quantized_matmul_kernel (int8 weights, int8 activations)": _quantized_matmul(True),
    "flash_attention (causal)": _flash_attention(),
    "megablox.gmm": _gmm(),
    "kv_cache_update (ragged, paged)": _kv_cache_update(),
    "ragged_causal_conv1d": _causal_conv1d(),
    "ragged_paged_attention (v3)": _ragged_paged_attention(),
}
