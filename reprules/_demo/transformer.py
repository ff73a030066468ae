"""A small decoder-only transformer built from Pallas kernels: the model-scale workload.

Used by ``reprules audit`` (cases ``transformer`` and ``transformer_scan`` in
:mod:`reprules._demo.workloads`), by ``examples/benchmarks/bench.py`` and by the
multi-process test. Every layer is pre-norm attention + MLP, Megatron-style
tensor parallel on ``model`` (heads and FFN columns), batch on ``data``:

* **Kernels** (Pallas, ``interpret=True``, each under ``custom_vjp`` with a
  Pallas fwd and a Pallas bwd): :func:`matmul_kernel` (every projection, from
  :mod:`reprules._demo.workloads`), :func:`ln_fwd_kernel` / :func:`ln_bwd_kernel`
  (layer norm; the bwd computes the weight and bias gradients over the local
  rows) and :func:`attn_fwd_kernel` / :func:`attn_bwd_kernel` (causal
  attention over the local heads, softmax recomputed in the bwd).
* **Where the ``shard_map``\\ s are** (``Config.shard_map``):

  - ``"sublayer"`` (default): the program is a jitted GSPMD model and each
    sublayer is its own ``shard_map`` -- every layer norm, the attention block
    (QKV projection, attention, output projection, ``psum`` over ``model``)
    and the MLP block (up projection, GELU, down projection, ``psum``). This
    is how Pallas kernels usually reach a model (JAX #21855, MaxText's
    attention), and where checking off costs defensive all-reduces: each
    ``shard_map`` input replicated over ``model`` gets its cotangent
    all-reduced over ``model`` at the boundary, although it is already
    identical there.
  - ``"model"``: one ``shard_map`` around every layer (Megatron written by
    hand).

* **Layers**: ``Config.layers`` of them, unrolled or under ``jax.lax.scan``
  (``Config.scan``; parameters then stacked on a leading layer axis).

Variants (:func:`build`): ``"off"`` (checking off, what users do when a
kernel has no rule), ``"reprules"`` (checking on; the caller registers
:func:`kernels` with ``rules.same()``), ``"inference"`` (checking on, nothing
registered; the caller traces under ``reprules.inference()``), ``"hand"``
(checking on, no reprules: every ``out_shape`` annotated by hand with
``vma=`` / ``manual_axis_type=``, inputs cast by hand, ``custom_vjp``
cotangents psummed by hand; JAX >= 0.6 only). With ``interpret=True`` JAX
itself refuses the hand-annotated calls on every JAX >= 0.6 (its HLO
interpreter's while loop starts the output buffers unvarying: a carry-type
error; reprules fixes that lowering for registered kernels), so on CPU the
benchmark records that refusal; the variant is kept for compiled kernels.

Public JAX API only. Sizes are CPU-small: one step of the default config
traces, lowers and compiles in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from reprules._demo import scale
from reprules.testing import shard_map

EPS = 1e-5
VARIANTS = ("off", "reprules", "hand", "inference")
LAYER_KEYS = ("ln1_g", "ln1_b", "w_qkv", "w_o", "ln2_g", "ln2_b", "w1", "w2")


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and placement.

    Attributes:
      layers: Decoder layers.
      d_model: Width.
      heads: Attention heads (a multiple of the ``model`` axis size).
      ffn: MLP hidden width (a multiple of the ``model`` axis size).
      seq: Sequence length.
      batch: Global batch (a multiple of the ``data`` axis size).
      scan: Layers under ``jax.lax.scan`` (parameters stacked) instead of unrolled.
      shard_map: ``"sublayer"`` or ``"model"`` (see the module docstring).
    """

    layers: int = 24
    d_model: int = 64
    heads: int = 4
    ffn: int = 128
    seq: int = 16
    batch: int = 8
    scan: bool = False
    shard_map: str = "sublayer"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def describe(self) -> str:
        return (f"{self.layers} layers{' (scan)' if self.scan else ''}, d {self.d_model}, {self.heads} heads, "
                f"ffn {self.ffn}, seq {self.seq}, batch {self.batch}, shard_map per {self.shard_map}")


# --- kernels ------------------------------------------------------------------------


def ln_fwd_kernel(x_ref: Any, g_ref: Any, b_ref: Any, y_ref: Any, mean_ref: Any, rstd_ref: Any) -> None:
    """Layer norm over the last axis of a (rows, d) block; also writes mean and 1/std."""
    import jax
    import jax.numpy as jnp

    x = x_ref[...]
    mean = jnp.mean(x, axis=-1)
    xc = x - mean[:, None]
    rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1) + EPS)
    y_ref[...] = xc * rstd[:, None] * g_ref[...][None, :] + b_ref[...][None, :]
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def ln_bwd_kernel(x_ref: Any, g_ref: Any, mean_ref: Any, rstd_ref: Any, dy_ref: Any,
                  dx_ref: Any, dg_ref: Any, db_ref: Any) -> None:
    """Layer norm backward: dx, and the weight and bias gradients summed over the local rows."""
    import jax.numpy as jnp

    rstd = rstd_ref[...][:, None]
    xhat = (x_ref[...] - mean_ref[...][:, None]) * rstd
    dy = dy_ref[...]
    dxhat = dy * g_ref[...][None, :]
    dx_ref[...] = rstd * (dxhat - jnp.mean(dxhat, axis=-1, keepdims=True)
                          - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    dg_ref[...] = jnp.sum(dy * xhat, axis=0)
    db_ref[...] = jnp.sum(dy, axis=0)


def _causal_scores(q: Any, k: Any) -> Any:
    import jax
    import jax.numpy as jnp

    s = jnp.einsum("nqd,nkd->nqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    rows = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, s.shape, 2)
    return jnp.where(cols <= rows, s, -1e30)


def attn_fwd_kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any, lse_ref: Any) -> None:
    """Causal attention over (batch x heads, seq, head_dim) blocks; also writes the log-sum-exp."""
    import jax.numpy as jnp

    s = _causal_scores(q_ref[...], k_ref[...])
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    denom = jnp.sum(p, axis=-1)
    o_ref[...] = jnp.einsum("nqk,nkd->nqd", p, v_ref[...], preferred_element_type=jnp.float32) / denom[..., None]
    lse_ref[...] = m + jnp.log(denom)


def attn_bwd_kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any, lse_ref: Any, do_ref: Any,
                    dq_ref: Any, dk_ref: Any, dv_ref: Any) -> None:
    """Causal attention backward, the softmax recomputed from the log-sum-exp."""
    import jax.numpy as jnp

    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = jnp.exp(_causal_scores(q, k) - lse_ref[...][..., None])
    dv_ref[...] = jnp.einsum("nqk,nqd->nkd", p, do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("nqd,nkd->nqk", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - jnp.sum(do * o_ref[...], axis=-1)[..., None])
    dq_ref[...] = scale * jnp.einsum("nqk,nkd->nqd", ds, k, preferred_element_type=jnp.float32)
    dk_ref[...] = scale * jnp.einsum("nqk,nqd->nkd", ds, q, preferred_element_type=jnp.float32)


def matmul_kernel(a_ref: Any, b_ref: Any, o_ref: Any) -> None:
    """A whole-block matmul."""
    import jax.numpy as jnp

    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def kernels() -> tuple[Callable[..., Any], ...]:
    """The kernel functions the model calls (each takes ``rules.same()``)."""
    return (matmul_kernel, ln_fwd_kernel, ln_bwd_kernel, attn_fwd_kernel, attn_bwd_kernel)


# --- hand annotation (JAX >= 0.6, public API) ------------------------------------------


def hand_unavailable() -> str | None:
    """Why this JAX cannot annotate an out_shape by hand, or None."""
    import jax

    if sds_keyword() is not None:
        return None
    return f"JAX {jax.__version__} has no vma=/manual_axis_type= on jax.ShapeDtypeStruct (added in JAX 0.6)"


@functools.cache
def sds_keyword() -> str | None:
    """How ShapeDtypeStruct takes varying axes here: ``manual_axis_type`` (0.10+),
    ``vma`` (0.6 - 0.9) or None (<= 0.5). Read once: the hand variant's trace time
    is compared with reprules'."""
    import jax

    params = inspect.signature(jax.ShapeDtypeStruct.__init__).parameters
    return next((k for k in ("manual_axis_type", "vma") if k in params), None)


def _varying(x: Any) -> frozenset[str]:
    import jax

    t = jax.typeof(x)
    mat = getattr(t, "mat", None)  # 0.10+: manual_axis_type
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(t, "vma", ()))


def _cast(x: Any, axes: frozenset[str]) -> Any:
    import jax

    missing = tuple(sorted(axes - _varying(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):  # 0.8+
        return jax.lax.pcast(x, missing, to="varying")
    pvary: Callable[[Any, tuple[str, ...]], Any] = getattr(jax.lax, "pvary")  # 0.6 - 0.7
    return pvary(x, missing)


def _sds(shape: tuple[int, ...], dtype: Any, axes: frozenset[str] | None) -> Any:
    import jax

    if axes is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    if sds_keyword() == "manual_axis_type":  # 0.10+
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    return jax.ShapeDtypeStruct(shape, dtype, **{"vma": axes})  # 0.6 - 0.9


def _psum_extra(ct: Any, primal_axes: frozenset[str]) -> Any:
    import jax

    extra = tuple(sorted(_varying(ct) - primal_axes))
    return jax.lax.psum(ct, extra) if extra else ct


# --- the ops: each kernel pair under custom_vjp ----------------------------------------


class Ops:
    """Matmul, layer norm and attention; fresh ``custom_vjp``\\ s per instance.

    With ``hand``, every call is annotated by hand instead of relying on rules.
    """

    def __init__(self, hand: bool = False):
        import jax

        self.hand = hand
        self.matmul = jax.custom_vjp(self._matmul)
        self.matmul.defvjp(self._matmul_fwd, self._matmul_bwd)
        self.layer_norm = jax.custom_vjp(self._layer_norm)
        self.layer_norm.defvjp(self._layer_norm_fwd, self._layer_norm_bwd)
        self.attention = jax.custom_vjp(self._attention)
        self.attention.defvjp(self._attention_fwd, self._attention_bwd)

    def _call(self, kernel: Callable[..., Any], outs: Sequence[tuple[tuple[int, ...], Any]], *args: Any) -> Any:
        from jax.experimental import pallas as pl

        axes = None
        if self.hand:  # the union of the inputs' axes, every input cast up to it
            axes = frozenset().union(*(_varying(a) for a in args))
            args = tuple(_cast(a, axes) for a in args)
        out_shape = tuple(_sds(shape, dtype, axes) for shape, dtype in outs)
        result = pl.pallas_call(kernel, out_shape=out_shape, interpret=True)(*args)
        return tuple(result)

    def _fix(self, cts: Sequence[Any], primals: Sequence[Any]) -> tuple[Any, ...]:
        if not self.hand:  # reprules (or JAX <= 0.5) psums what varies more than its primal
            return tuple(cts)
        return tuple(_psum_extra(c, _varying(p)) for c, p in zip(cts, primals))

    # matmul
    def _mm(self, a: Any, b: Any) -> Any:
        import jax.numpy as jnp

        return self._call(matmul_kernel, [((a.shape[0], b.shape[1]), jnp.float32)], a, b)[0]

    def _matmul(self, a: Any, b: Any) -> Any:
        return self._mm(a, b)

    def _matmul_fwd(self, a: Any, b: Any) -> Any:
        return self._mm(a, b), (a, b)

    def _matmul_bwd(self, res: Any, g: Any) -> Any:
        a, b = res
        return self._fix((self._mm(g, b.T), self._mm(a.T, g)), (a, b))

    # layer norm over rows of a 2-D block
    def _ln(self, x: Any, g: Any, b: Any) -> tuple[Any, Any, Any]:
        import jax.numpy as jnp

        n, d = x.shape
        y, mean, rstd = self._call(ln_fwd_kernel, [((n, d), jnp.float32), ((n,), jnp.float32), ((n,), jnp.float32)],
                                   x, g, b)
        return y, mean, rstd

    def _layer_norm(self, x: Any, g: Any, b: Any) -> Any:
        return self._ln(x, g, b)[0]

    def _layer_norm_fwd(self, x: Any, g: Any, b: Any) -> Any:
        y, mean, rstd = self._ln(x, g, b)
        return y, (x, g, b, mean, rstd)

    def _layer_norm_bwd(self, res: Any, dy: Any) -> Any:
        import jax.numpy as jnp

        x, g, b, mean, rstd = res
        n, d = x.shape
        dx, dg, db = self._call(ln_bwd_kernel, [((n, d), jnp.float32), ((d,), jnp.float32), ((d,), jnp.float32)],
                                x, g, mean, rstd, dy)
        return self._fix((dx, dg, db), (x, g, b))

    # causal attention over (batch x heads, seq, head_dim)
    def _attn(self, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        import jax.numpy as jnp

        n, s, _ = q.shape
        o, lse = self._call(attn_fwd_kernel, [(q.shape, jnp.float32), ((n, s), jnp.float32)], q, k, v)
        return o, lse

    def _attention(self, q: Any, k: Any, v: Any) -> Any:
        return self._attn(q, k, v)[0]

    def _attention_fwd(self, q: Any, k: Any, v: Any) -> Any:
        o, lse = self._attn(q, k, v)
        return o, (q, k, v, o, lse)

    def _attention_bwd(self, res: Any, do: Any) -> Any:
        import jax.numpy as jnp

        q, k, v, o, lse = res
        dq, dk, dv = self._call(attn_bwd_kernel, [(q.shape, jnp.float32)] * 3, q, k, v, o, lse, do)
        return self._fix((dq, dk, dv), (q, k, v))


# --- the model ------------------------------------------------------------------------


def _gelu(x: Any) -> Any:
    import jax

    return jax.nn.gelu(x, approximate=True)


def _attention_block(ops: Ops, cfg: Config, h: Any, w_qkv: Any, w_o: Any) -> Any:
    """Local: h (batch, seq, d) -> the attention sublayer's output, psummed over ``model``."""
    import jax

    b, s, d = h.shape
    dh = cfg.head_dim
    hl = w_qkv.shape[1] // (3 * dh)  # local heads
    qkv = ops.matmul(h.reshape(b * s, d), w_qkv).reshape(b, s, hl, 3, dh)
    q, k, v = (qkv[:, :, :, i].transpose(0, 2, 1, 3).reshape(b * hl, s, dh) for i in range(3))
    o = ops.attention(q, k, v).reshape(b, hl, s, dh).transpose(0, 2, 1, 3).reshape(b * s, hl * dh)
    return jax.lax.psum(ops.matmul(o, w_o), "model").reshape(b, s, d)


def _mlp_block(ops: Ops, h: Any, w1: Any, w2: Any) -> Any:
    import jax

    b, s, d = h.shape
    up = _gelu(ops.matmul(h.reshape(b * s, d), w1))
    return jax.lax.psum(ops.matmul(up, w2), "model").reshape(b, s, d)


def _ln_block(ops: Ops, x: Any, g: Any, bias: Any) -> Any:
    b, s, d = x.shape
    return ops.layer_norm(x.reshape(b * s, d), g, bias).reshape(b, s, d)


def layer_specs(stacked: bool) -> dict[str, Any]:
    """PartitionSpecs of one layer's parameters (``stacked``: with a leading layer axis)."""
    from jax.sharding import PartitionSpec as P

    lead = (None,) if stacked else ()
    rep = P(*lead, None)
    col, row = P(*lead, None, "model"), P(*lead, "model", None)
    return {"ln1_g": rep, "ln1_b": rep, "w_qkv": col, "w_o": row, "ln2_g": rep, "ln2_b": rep, "w1": col, "w2": row}


def param_specs(cfg: Config) -> dict[str, Any]:
    from jax.sharding import PartitionSpec as P

    one = layer_specs(cfg.scan)
    layers = one if cfg.scan else [dict(one) for _ in range(cfg.layers)]
    return {"layers": layers, "lnf_g": P(None), "lnf_b": P(None)}


ACT = ("data", None, None)


def _forward(cfg: Config, mesh: Any, variant: str) -> Callable[[Any, Any], Any]:
    """``forward(params, x) -> y`` for the variant (fresh ``custom_vjp``\\ s and ``shard_map``\\ s)."""
    import jax
    from jax.sharding import PartitionSpec as P

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    ops = Ops(hand=variant == "hand")
    check = variant != "off"
    act, rep = P(*ACT), P(None)
    specs = layer_specs(False)

    def apply_layers(layers: Any, x: Any, ln: Callable[..., Any], attn: Callable[..., Any],
                     mlp: Callable[..., Any]) -> Any:
        def layer(x: Any, p: Any) -> Any:
            x = x + attn(ln(x, p["ln1_g"], p["ln1_b"]), p["w_qkv"], p["w_o"])
            return x + mlp(ln(x, p["ln2_g"], p["ln2_b"]), p["w1"], p["w2"])

        if cfg.scan:
            return jax.lax.scan(lambda c, p: (layer(c, p), None), x, layers)[0]
        for p in layers:
            x = layer(x, p)
        return x

    ln_local = functools.partial(_ln_block, ops)
    attn_local = functools.partial(_attention_block, ops, cfg)
    mlp_local = functools.partial(_mlp_block, ops)

    if cfg.shard_map == "sublayer":
        ln = shard_map(ln_local, mesh, (act, rep, rep), act, check)
        attn = shard_map(attn_local, mesh, (act, specs["w_qkv"], specs["w_o"]), act, check)
        mlp = shard_map(mlp_local, mesh, (act, specs["w1"], specs["w2"]), act, check)

        def forward(params: Any, x: Any) -> Any:
            x = apply_layers(params["layers"], x, ln, attn, mlp)
            return ln(x, params["lnf_g"], params["lnf_b"])

        return forward
    if cfg.shard_map == "model":
        def body(params: Any, x: Any) -> Any:
            x = apply_layers(params["layers"], x, ln_local, attn_local, mlp_local)
            return ln_local(x, params["lnf_g"], params["lnf_b"])

        return shard_map(body, mesh, (param_specs(cfg), act), act, check)
    raise ValueError(f"Config.shard_map must be 'sublayer' or 'model', not {cfg.shard_map!r}")


def loss_fn(forward: Callable[[Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    import jax.numpy as jnp

    def loss(params: Any, x: Any, t: Any) -> Any:
        return jnp.mean((forward(params, x) - t) ** 2)

    return loss


def make_step(mesh: Any, variant: str, cfg: Config = Config()) -> Callable[..., Any]:
    """A fresh ``step(params, x, t)`` returning the parameter gradients (fresh
    ``custom_vjp``\\ s and ``shard_map``\\ s: no JAX cache hit from an earlier build).

    The caller registers :func:`kernels` for ``"reprules"`` and enters
    ``reprules.inference()`` for ``"inference"``.
    """
    import jax

    return jax.grad(loss_fn(_forward(cfg, mesh, variant)))


def build(mesh: Any, variant: str, cfg: Config = Config()) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(step, args)``: :func:`make_step` and its arguments (:func:`place`)."""
    return make_step(mesh, variant, cfg), place(mesh, cfg)


# --- data, reference --------------------------------------------------------------------


def _randn(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> Any:
    import numpy as np

    return (scale * np.random.RandomState(seed).randn(*shape)).astype(np.float32)


def host_data(cfg: Config) -> tuple[dict[str, Any], Any, Any]:
    """(unrolled params, x, t) as NumPy arrays, the same for every variant and placement."""
    import numpy as np

    d, f, s = cfg.d_model, cfg.ffn, 0.5
    layers = []
    for i in range(cfg.layers):
        base = 100 + 10 * i
        # w_qkv columns laid out (heads, 3, head_dim): a `model` shard holds whole heads.
        layers.append({
            "ln1_g": 1.0 + _randn(base, (d,), 0.1), "ln1_b": _randn(base + 1, (d,), 0.1),
            "w_qkv": _randn(base + 2, (d, 3 * d), s / math.sqrt(d)),
            "w_o": _randn(base + 3, (d, d), s / math.sqrt(d)),
            "ln2_g": 1.0 + _randn(base + 4, (d,), 0.1), "ln2_b": _randn(base + 5, (d,), 0.1),
            "w1": _randn(base + 6, (d, f), s / math.sqrt(d)), "w2": _randn(base + 7, (f, d), s / math.sqrt(f)),
        })
    params = {"layers": layers, "lnf_g": 1.0 + _randn(1, (d,), 0.1), "lnf_b": _randn(2, (d,), 0.1)}
    x = _randn(3, (cfg.batch, cfg.seq, d))
    t = _randn(4, (cfg.batch, cfg.seq, d))
    return params, x, np.asarray(t)


def stack(params: dict[str, Any]) -> dict[str, Any]:
    """Unrolled params (a list of layers) -> stacked (one array per key, leading layer axis)."""
    import numpy as np

    layers = params["layers"]
    return {**params, "layers": {k: np.stack([np.asarray(p[k]) for p in layers]) for k in LAYER_KEYS}}


def place(mesh: Any, cfg: Config) -> tuple[Any, Any, Any]:
    """(params, x, t) on ``mesh``, sharded as the step expects."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params, x, t = host_data(cfg)
    if cfg.scan:
        params = stack(params)

    def put(value: Any, spec: Any) -> Any:
        return jax.device_put(value, NamedSharding(mesh, spec))

    placed = jax.tree_util.tree_map(put, params, param_specs(cfg))
    return placed, put(x, P(*ACT)), put(t, P(*ACT))


def reference_forward(params: dict[str, Any], x: Any, cfg: Config) -> Any:
    """The unsharded model in plain jnp (unrolled params)."""
    import jax
    import jax.numpy as jnp

    def ln(x: Any, g: Any, b: Any) -> Any:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        xc = x - mean
        return xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + EPS) * g + b

    bsz, s, d = x.shape
    heads, dh = cfg.heads, cfg.head_dim
    mask = jnp.tril(jnp.ones((s, s), bool))
    for p in params["layers"]:
        h = ln(x, p["ln1_g"], p["ln1_b"])
        qkv = (h @ p["w_qkv"]).reshape(bsz, s, heads, 3, dh)
        q, k, v = (qkv[:, :, :, i] for i in range(3))  # (b, s, heads, dh)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
        attn = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(bsz, s, d)
        x = x + o @ p["w_o"]
        h = ln(x, p["ln2_g"], p["ln2_b"])
        x = x + _gelu(h @ p["w1"]) @ p["w2"]
    return ln(x, params["lnf_g"], params["lnf_b"])


def reference_loss(cfg: Config) -> Callable[[Any, Any, Any], Any]:
    import jax.numpy as jnp

    def loss(params: Any, x: Any, t: Any) -> Any:
        return jnp.mean((reference_forward(params, x, cfg) - t) ** 2)

    return loss


def reference_grads(cfg: Config = Config()) -> Any:
    """The unsharded gradients, laid out like the step's (stacked under ``scan``)."""
    import jax
    import numpy as np

    params, x, t = host_data(cfg)
    grads = jax.jit(jax.grad(reference_loss(cfg)))(params, x, t)
    grads = jax.tree_util.tree_map(np.asarray, grads)
    return stack(grads) if cfg.scan else grads


# --- collectives, on paper --------------------------------------------------------------


def expected_bytes(cfg: Config, mesh_shape: dict[str, int], itemsize: int = 4) -> Any:
    """:func:`reprules._demo.scale.step_bytes` for this config on a ``{"data": n, "model": m}`` mesh."""
    mesh = scale.Mesh(data=mesh_shape["data"], model=mesh_shape["model"])
    tokens = cfg.batch // mesh.data * cfg.seq
    return scale.step_bytes(scale.Model.from_config(cfg, itemsize), mesh, tokens, cfg.shard_map, cfg.scan)
