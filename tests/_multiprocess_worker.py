"""One process of the multi-process run of tests/test_multiprocess.py.

The test starts two of these (4 CPU devices each) on a localhost coordinator::

    python tests/_multiprocess_worker.py --coordinator 127.0.0.1:PORT \
        --num-processes 2 --process-id I --out DIR

Each process joins JAX's multi-process runtime (``jax.distributed.initialize``,
gloo CPU collectives), registers the kernels' rules, runs every step of
:func:`workloads` on the global (4, 2) mesh of 8 devices and writes
``DIR/process-I.npz`` (loss, and the gradient shards it holds, as a full-size
array with a mask of what this process could see) and ``DIR/process-I.json``
(the collectives report of each step). The test process imports this module
too, to run the same steps on one process with 8 devices as the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

MESH_SHAPE = (4, 2)
MESH_AXES = ("data", "model")
# Needs at most this many seconds to start the distributed runtime.
INIT_TIMEOUT_S = 60


def configure_environment(num_local_devices: int) -> None:
    """CPU only, ``num_local_devices`` fake devices: before JAX is imported."""
    from reprules._environment import environ_with_cpu_devices  # imports no JAX

    os.environ.update(environ_with_cpu_devices(num_local_devices, os.environ))


def enable_cpu_collectives() -> str:
    """Turns on gloo cross-process CPU collectives; returns what was set.

    * 0.4.28 - 0.5.x: ``jax_cpu_collectives_implementation`` defaults to
      none (no cross-process collectives); "gloo" must be chosen.
    * 0.6.x - 0.12.x: gloo is already the default; setting it is harmless.
    """
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, KeyError, ValueError) as err:  # no such option
        return f"none ({err})"
    return "gloo"


# --- the kernels and steps ------------------------------------------------------------


# The kernels: JAX #21855's copy kernel (tests/helpers.py) and the audit's Pallas matmul
# (reprules/_demo/workloads.py), each under custom_vjp.


def register_rules() -> None:
    import reprules
    from helpers import copy_kernel
    from reprules._demo.transformer import matmul_kernel

    from reprules._demo import transformer

    reprules.replication_rule()(copy_kernel)
    for kernel in transformer.kernels():  # the matmul kernel among them
        reprules.replication_rule()(kernel)
    assert matmul_kernel in transformer.kernels()


def randn(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> Any:
    import numpy as np

    return (scale * np.random.RandomState(seed).randn(*shape)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Step:
    """``step(*args) -> (loss, grads)``; ``reference()`` is the unsharded one.

    ``psum_axes``: the axes of every psum the checked jaxpr must have, sorted
    (forward psums written in the body plus the backward's needed ones).
    """

    step: Callable[..., Any]
    args: tuple[Any, ...]
    reference: Callable[[], Any]
    psum_axes: tuple[tuple[str, ...], ...]


def workloads(mesh: Any, place: Callable[[Any, Any], Any]) -> dict[str, Step]:
    """The steps, built for ``mesh``; ``place(numpy_array, spec)`` makes a global array."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from helpers import kernel_copy, shard_map
    from reprules._demo.workloads import _make_kernel_matmul as kernel_matmul

    steps: dict[str, Step] = {}

    # 1. JAX #21855: x varies over data, is replicated over model.
    x0, w0 = randn(0, (8, 128)), randn(1, (8, 128))

    def make_21855(check: bool) -> Callable[..., Any]:
        f = shard_map(kernel_copy, mesh, P("data", None), P("data", None), check)
        return jax.value_and_grad(lambda x: (f(x) * w0).sum())

    steps["issue21855"] = Step(
        make_21855(True), (place(x0, P("data", None)),),
        lambda: jax.value_and_grad(lambda x: (x * w0).sum())(x0),
        psum_axes=())
    # The same step with checking off: its defensive all-reduce over model
    # shows that the report sees defensive collectives across processes too.
    steps["issue21855_check_off"] = Step(
        make_21855(False), (place(x0, P("data", None)),),
        lambda: jax.value_and_grad(lambda x: (x * w0).sum())(x0),
        psum_axes=(("model",),))

    b, d, h = 16, 32, 64
    x, w1, w2, t = randn(10, (b, d)), randn(11, (d, h), 0.2), randn(12, (h, d), 0.2), randn(13, (b, d))
    n = float(b * d)

    def ref_loss(w1: Any, w2: Any, x: Any) -> Any:
        return jnp.sum((jax.nn.relu(x @ w1) @ w2 - t) ** 2) / n

    # 2. data-parallel MLP: batch on data, weights replicated everywhere.
    def dp_body(w1: Any, w2: Any, x: Any, t: Any) -> Any:
        mm = kernel_matmul()
        y = mm(jax.nn.relu(mm(x, w1)), w2)
        return jax.lax.psum(jnp.sum((y - t) ** 2), "data") / n

    dp = shard_map(dp_body, mesh, (P(), P(), P("data", None), P("data", None)), P(), True)
    steps["dp_mlp"] = Step(
        jax.value_and_grad(dp, argnums=(0, 1)),
        (place(w1, P()), place(w2, P()), place(x, P("data", None)), place(t, P("data", None))),
        lambda: jax.value_and_grad(ref_loss, argnums=(0, 1))(w1, w2, x),
        # forward loss over data; dW1, dW2 over data; nothing over model.
        psum_axes=(("data",),) * 3)

    # 3. tensor-parallel MLP: w1 columns and w2 rows on model, batch on data.
    def tp_body(w1: Any, w2: Any, x: Any, t: Any) -> Any:
        mm = kernel_matmul()
        y = jax.lax.psum(mm(jax.nn.relu(mm(x, w1)), w2), "model")
        return jax.lax.psum(jnp.sum((y - t) ** 2), "data") / n

    tp = shard_map(tp_body, mesh, (P(None, "model"), P("model", None), P("data", None), P("data", None)), P(), True)
    steps["tp_mlp"] = Step(
        jax.value_and_grad(tp, argnums=(0, 1, 2)),
        (place(w1, P(None, "model")), place(w2, P("model", None)), place(x, P("data", None)),
         place(t, P("data", None))),
        lambda: jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(w1, w2, x),
        # forward: y over model, loss over data; backward: dW1, dW2 over data, dx over model.
        psum_axes=tuple(sorted([("data",)] * 3 + [("model",)] * 2)))

    # 4. the transformer of reprules._demo.transformer (TRANSFORMER_LAYERS layers, a shard_map
    # per sublayer): Pallas matmul, layer norm and attention kernels under custom_vjp.
    steps["transformer"] = transformer_step(mesh, place)
    return steps


TRANSFORMER_LAYERS = 2


def transformer_config() -> Any:
    from reprules._demo import transformer

    return transformer.Config(layers=TRANSFORMER_LAYERS)


def transformer_step(mesh: Any, place: Callable[[Any, Any], Any]) -> Step:
    import jax
    from jax.sharding import PartitionSpec as P

    from reprules._demo import transformer

    cfg = transformer_config()
    params, x, t = transformer.host_data(cfg)
    placed = jax.tree_util.tree_map(place, params, transformer.param_specs(cfg))
    act = P(*transformer.ACT)
    step = jax.value_and_grad(transformer.loss_fn(transformer._forward(cfg, mesh, "reprules")))
    layers = cfg.layers
    return Step(
        step, (placed, place(x, act), place(t, act)),
        lambda: jax.value_and_grad(transformer.reference_loss(cfg))(params, x, t),
        # over model: 2 forward psums and 2 backward ones (layer norm outputs) a layer; over
        # data: 4 weight and 4 layer-norm gradients a layer, the final layer norm's 2.
        psum_axes=tuple(sorted([("model",)] * (4 * layers) + [("data",)] * (8 * layers + 2))))


def make_mesh(devices: Any) -> Any:
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(devices).reshape(MESH_SHAPE), MESH_AXES)


def global_place(mesh: Any) -> Callable[[Any, Any], Any]:
    """A global array from the same host value on every process."""
    import jax

    def place(value: Any, spec: Any) -> Any:
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return place


def summarize(step: Step) -> dict[str, Any]:
    """The collectives of ``step`` (reprules.testing) and its jaxpr psum axes."""
    import jax

    from helpers import psum_axes_of
    from reprules import testing

    report = testing.collectives(step.step, *step.args)
    return {
        "collectives": [
            {"kind": c.kind, "axes": list(c.axes) if c.axes is not None else None, "levels": list(c.levels),
             "defensive": c.defensive, "origin": c.origin, "describe": c.describe()}
            for c in report.collectives],
        "psum_axes": [list(a) for a in psum_axes_of(jax.make_jaxpr(step.step)(*step.args))],
        "bytes": report.bytes(), "defensive_bytes": report.bytes(defensive=True),
        # the program's own collectives, lowered (XLA may add or combine some in compiled HLO)
        "jaxpr_bytes": sum(c.bytes for c in report.collectives if {"jaxpr", "stablehlo"} <= set(c.levels)),
        "table": report.table(),
    }


def local_values(tree: Any) -> tuple[list[Any], list[Any]]:
    """(values, masks): each leaf as a full-size array holding the shards this
    process can address (zeros elsewhere), and where they are."""
    import jax
    import numpy as np

    values, masks = [], []
    for leaf in jax.tree_util.tree_leaves(tree):
        full = np.zeros(leaf.shape, np.float32)
        mask = np.zeros(leaf.shape, bool)
        for shard in leaf.addressable_shards:
            full[shard.index] = np.asarray(shard.data)
            mask[shard.index] = True
        values.append(full)
        masks.append(mask)
    return values, masks


def run_steps(steps: dict[str, Step]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs each step; returns (arrays for np.savez, JSON-able summaries)."""
    import jax

    arrays: dict[str, Any] = {}
    summaries: dict[str, Any] = {}
    for name, step in steps.items():
        start = time.monotonic()
        loss, grads = jax.jit(step.step)(*step.args)
        values, masks = local_values(grads)
        arrays[f"{name}.loss"] = local_values(loss)[0][0]
        for i, (v, m) in enumerate(zip(values, masks)):
            arrays[f"{name}.grad{i}"] = v
            arrays[f"{name}.mask{i}"] = m
        ran = time.monotonic()
        summaries[name] = summarize(step)
        print(f"step {name}: run {ran - start:.1f} s, report {time.monotonic() - ran:.1f} s, "
              f"{summaries[name]['bytes']} collective bytes per step on each device of this process "
              f"({summaries[name]['defensive_bytes']} defensive)", flush=True)
    return arrays, summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--local-devices", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import faulthandler

    faulthandler.enable()  # a crash in XLA still shows where Python was

    started = time.monotonic()
    configure_environment(args.local_devices)
    import jax
    import numpy as np

    collectives = enable_cpu_collectives()
    kwargs = {}
    if "initialization_timeout" in jax.distributed.initialize.__code__.co_varnames:
        kwargs["initialization_timeout"] = INIT_TIMEOUT_S
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, **kwargs)
    info = {"jax": jax.__version__, "cpu_collectives": collectives, "process_index": jax.process_index(),
            "process_count": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count()}
    print(json.dumps(info), f"(started in {time.monotonic() - started:.1f} s)", flush=True)
    if jax.process_count() != args.num_processes or jax.device_count() != args.num_processes * args.local_devices:
        raise SystemExit(f"unexpected runtime: {info}")

    register_rules()
    mesh = make_mesh(jax.devices())
    arrays, summaries = run_steps(workloads(mesh, global_place(mesh)))
    np.savez(os.path.join(args.out, f"process-{args.process_id}.npz"), **arrays)
    with open(os.path.join(args.out, f"process-{args.process_id}.json"), "w") as f:
        json.dump({"info": info, "steps": summaries}, f)
    print(f"results written at {time.monotonic() - started:.1f} s", flush=True)
    jax.distributed.shutdown()
    print(f"shut down at {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
