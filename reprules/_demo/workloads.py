"""The workloads ``reprules audit`` runs by default, on a (4, 2) CPU mesh.

Each :class:`Case` builds one training step twice: with ``shard_map``
checking off (what users do today when a Pallas kernel has no rule) and with
reprules (rules registered, checking on). Both steps return gradients, which
the audit compares with an unsharded reference. (A user's own target is read
by ``reprules._audit._target``.)
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import reprules
from reprules._demo import transformer
from reprules._demo.transformer import matmul_kernel
from reprules.testing import shard_map

MESH_SHAPE = (4, 2)
MESH_AXES = ("data", "model")


@dataclasses.dataclass(frozen=True, slots=True)
class Built:
    """One variant of a step, ready to audit."""

    step: Callable[..., Any]
    args: tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """A workload: how to build its step, its kernels, its reference.

    Attributes:
      name: Short id (``issue21855``).
      title: One line for humans.
      build: ``build(mesh, check)`` returns the :class:`Built` step.
      reference: ``reference()`` returns the unsharded gradients.
      kernels: ``kernels()`` returns the kernel functions given ``rules.same()``.
    """

    name: str
    title: str
    build: Callable[[Any, bool], Built]
    reference: Callable[[], Any]
    kernels: Callable[[], Sequence[Callable[..., Any]]]


def make_mesh() -> Any:
    import jax
    import numpy as np

    n = MESH_SHAPE[0] * MESH_SHAPE[1]
    devices = jax.devices()
    if len(devices) < n:
        raise RuntimeError(
            f"The default audit needs {n} devices for a {MESH_SHAPE} mesh, found {len(devices)}.\n"
            "Fix: run `reprules audit` in a fresh process (it provides 8 fake CPU devices), or "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts.")
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(MESH_SHAPE), MESH_AXES)


def _randn(seed: int, shape: tuple[int, ...]) -> Any:
    import jax.numpy as jnp
    import numpy as np

    return jnp.asarray(np.random.RandomState(seed).randn(*shape), jnp.float32)


def _put(x: Any, mesh: Any, spec: Any) -> Any:
    import jax

    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


# --- 1. JAX issue #21855: a Pallas copy kernel under custom_vjp ---------------------


def copy_kernel(x_ref: Any, o_ref: Any) -> None:
    """The kernel of JAX issue #21855: copies its input."""
    o_ref[...] = x_ref[...]


def _copy(x: Any) -> Any:
    import jax
    from jax.experimental import pallas as pl

    return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _make_kernel_copy() -> Callable[[Any], Any]:
    import jax

    @jax.custom_vjp
    def kernel_copy(x: Any) -> Any:
        return _copy(x)

    kernel_copy.defvjp(lambda x: (_copy(x), None), lambda _, g: (_copy(g),))
    return kernel_copy


def _issue21855(mesh: Any, check: bool) -> Built:
    import jax
    from jax.sharding import PartitionSpec as P

    x = _put(_randn(0, (8, 128)), mesh, P("data", None))
    w = _randn(1, (8, 128))  # data-dependent cotangent: XLA cannot fold the psum
    f = shard_map(_make_kernel_copy(), mesh, P("data", None), P("data", None), check)

    def loss(x: Any) -> Any:
        return (f(x) * w).sum()

    return Built(jax.grad(loss), (x,))


def _issue21855_reference() -> Any:
    return _randn(1, (8, 128))  # d/dx sum(x * w) = w


# --- 2. tensor-parallel MLP with a Pallas matmul ---------------------------------------


def _matmul(a: Any, b: Any) -> Any:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    out = jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.float32)
    return pl.pallas_call(matmul_kernel, out_shape=out, interpret=True)(a, b)


def _make_kernel_matmul() -> Callable[[Any, Any], Any]:
    import jax

    @jax.custom_vjp
    def mm(a: Any, b: Any) -> Any:
        return _matmul(a, b)

    def bwd(res: Any, g: Any) -> Any:
        a, b = res
        return _matmul(g, b.T), _matmul(a.T, g)

    mm.defvjp(lambda a, b: (_matmul(a, b), (a, b)), bwd)
    return mm


_MLP = {"batch": 16, "d": 32, "h": 64}


def _mlp_data() -> tuple[Any, ...]:
    b, d, h = _MLP["batch"], _MLP["d"], _MLP["h"]
    return _randn(10, (b, d)), 0.2 * _randn(11, (d, h)), 0.2 * _randn(12, (h, d)), _randn(13, (b, d))


def _tp_mlp(mesh: Any, check: bool) -> Built:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    x, w1, w2, t = _mlp_data()
    mm = _make_kernel_matmul()

    def body(x: Any, w1: Any, w2: Any) -> Any:
        hidden = jax.nn.relu(mm(x, w1))  # columns of w1 on `model`
        return jax.lax.psum(mm(hidden, w2), "model")  # rows of w2 on `model`: partial sums

    f = shard_map(body, mesh, (P("data", None), P(None, "model"), P("model", None)), P("data", None), check)

    def loss(w1: Any, w2: Any, x: Any) -> Any:
        return jnp.mean((f(x, w1, w2) - t) ** 2)

    args = (_put(w1, mesh, P(None, "model")), _put(w2, mesh, P("model", None)), _put(x, mesh, P("data", None)))
    return Built(jax.grad(loss, argnums=(0, 1, 2)), args)


def _tp_mlp_reference() -> Any:
    import jax
    import jax.numpy as jnp

    x, w1, w2, t = _mlp_data()
    return jax.grad(lambda w1, w2, x: jnp.mean((jax.nn.relu(x @ w1) @ w2 - t) ** 2), argnums=(0, 1, 2))(w1, w2, x)


# --- 3. JAX's own Pallas layer_norm ------------------------------------------------


def layer_norm_module() -> Any:
    """JAX's Pallas layer_norm op module (its location moved in 0.4.31)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 0.12: "use tokamax.layer_norm"
        for path in ("jax.experimental.pallas.ops.gpu.layer_norm", "jax.experimental.pallas.ops.layer_norm"):
            try:
                return importlib.import_module(path)
            except ImportError:
                continue
    raise RuntimeError("this JAX has no Pallas layer_norm op")


def _ln_data() -> tuple[Any, ...]:
    return _randn(20, (8, 4, 128)), 1.0 + 0.1 * _randn(21, (128,)), 0.1 * _randn(22, (128,)), _randn(23, (8, 4, 128))


def _layer_norm(mesh: Any, check: bool) -> Built:
    import jax
    from jax.sharding import PartitionSpec as P

    ln = layer_norm_module()
    x, w, b, t = _ln_data()

    def body(x: Any, w: Any, b: Any) -> Any:
        return ln.layer_norm(x, w, b, interpret=True)

    f = shard_map(body, mesh, (P("data", None, None), P(), P()), P("data", None, None), check)

    def loss(x: Any, w: Any, b: Any) -> Any:
        return (f(x, w, b) * t).sum()

    args = (_put(x, mesh, P("data", None, None)), _put(w, mesh, P()), _put(b, mesh, P()))
    return Built(jax.grad(loss, argnums=(0, 1, 2)), args)


def _layer_norm_reference() -> Any:
    import jax

    ln = layer_norm_module()
    x, w, b, t = _ln_data()
    return jax.grad(lambda x, w, b: (ln.layer_norm_reference(x, w, b) * t).sum(), argnums=(0, 1, 2))(x, w, b)


def _layer_norm_kernels() -> Sequence[Callable[..., Any]]:
    ln = layer_norm_module()
    return (ln.layer_norm_forward_kernel, ln.layer_norm_backward_kernel_dx, ln.layer_norm_backward_kernel_dw_db)


DEFAULT_CASES: tuple[Case, ...] = (
    Case("issue21855", "JAX #21855: Pallas copy kernel under custom_vjp, x P('data', None)",
         _issue21855, _issue21855_reference, lambda: (copy_kernel,)),
    Case("tp_mlp", "tensor-parallel MLP step, Pallas matmul kernel, weights on 'model'",
         _tp_mlp, _tp_mlp_reference, lambda: (matmul_kernel,)),
    Case("layer_norm", "JAX's Pallas layer_norm (interpret=True), x on 'data', weight/bias replicated",
         _layer_norm, _layer_norm_reference, _layer_norm_kernels),
)


# --- 4. a decoder-only transformer: Pallas matmul, layer norm and attention kernels -------
#
# Not in DEFAULT_CASES (24 layers: about a minute to trace and compile on two CPU
# cores); selected by name (CASES), or audited as a target, checking off and on:
# `reprules audit reprules._demo.workloads:transformer_target` (`:transformer_scan_target`).


def _transformer_config(scan: bool) -> Any:
    return transformer.Config(scan=scan)


def _transformer_build(scan: bool) -> Callable[[Any, bool], Built]:
    def build(mesh: Any, check: bool) -> Built:
        step, args = transformer.build(mesh, "reprules" if check else "off", _transformer_config(scan))
        return Built(step, args)

    return build


def _transformer_reference(scan: bool) -> Callable[[], Any]:
    def reference() -> Any:
        return transformer.reference_grads(_transformer_config(scan))

    return reference


def _transformer_kernels() -> Sequence[Callable[..., Any]]:
    return transformer.kernels()


_TRANSFORMER_TITLE = ("decoder, {} layers{}, Pallas matmul/layer norm/attention kernels (interpret=True) under "
                      "custom_vjp; heads and MLP on 'model', batch on 'data', a shard_map per sublayer")

EXTRA_CASES: tuple[Case, ...] = (
    Case("transformer", _TRANSFORMER_TITLE.format(24, ""),
         _transformer_build(False), _transformer_reference(False), _transformer_kernels),
    Case("transformer_scan", _TRANSFORMER_TITLE.format(24, " under jax.lax.scan"),
         _transformer_build(True), _transformer_reference(True), _transformer_kernels),
)

CASES: dict[str, Case] = {c.name: c for c in DEFAULT_CASES + EXTRA_CASES}
"""Every workload by name: the default ones and the transformer ones."""


def transformer_target(check: bool = True, scan: bool = False) -> Mapping[str, Any]:
    """The transformer step in the ``module:callable`` protocol, checking on (rules
    registered) or off: ``reprules audit reprules._demo.workloads:transformer_target``
    audits both side by side."""
    if check:
        for kernel in _transformer_kernels():
            reprules.replication_rule()(kernel)
    case = CASES["transformer_scan" if scan else "transformer"]
    built = case.build(make_mesh(), check)
    return {"step": built.step, "args": built.args, "name": case.name, "reference": case.reference}


def transformer_scan_target(check: bool = True) -> Mapping[str, Any]:
    """:func:`transformer_target` with the layers under ``jax.lax.scan``."""
    return transformer_target(check, scan=True)
