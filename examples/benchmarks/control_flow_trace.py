"""What sound types for control flow cost at trace and lower time (JAX 0.6+).

Two programs inside a checked ``shard_map`` on 8 fake CPU devices: 200 ``lax.cond``s
on data-varying predicates one after another, and ``lax.cond``s nested 6 deep,
each closing over a replicated weight. Each is traced and lowered (``jit(grad(...))``,
fresh caches each time) with reprules' sound types on, then with
``REPRULES_SOUND_TYPES=0`` (JAX's own typing), alternating, and the median ratio is
printed, with the all-reduces each lowering holds (sound types may move a psum out of
a branch, never add one)::

    python examples/benchmarks/control_flow_trace.py [--repeats 5]
"""

import argparse
import os
import re
import statistics
import time

from reprules import testing

testing.fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402,F401  (sound types are armed at import)


def chain(x, w):
    for i in range(200):
        x = jax.lax.cond(x.sum() > i, lambda v: v * w + 1.0, lambda v: v - w, x)
    return x


def nested(x, w, depth=6):
    if depth == 0:
        return x * w
    return jax.lax.cond(x.sum() > depth, lambda v: nested(v, w, depth - 1) + w, lambda v: v - w, x)


def trace_and_lower(body, sound, check=True):
    os.environ["REPRULES_SOUND_TYPES"] = "1" if sound else "0"
    jax.clear_caches()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    f = testing.shard_map(body, mesh, (P("data"), P()), P("data"), check=check)
    step = jax.jit(jax.grad(lambda x, w: f(x, w).sum(), argnums=1))
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
    w = jax.device_put(jnp.ones((16,)), NamedSharding(mesh, P()))
    start = time.perf_counter()
    text = step.lower(x, w).as_text()
    return time.perf_counter() - start, len(re.findall(r"all_reduce", text))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"JAX {jax.__version__}, trace + lower of jit(grad(...)), median of {args.repeats}")
    for name, body in (("200 conds in a row", chain), ("conds nested 6 deep", nested)):
        times = {True: [], False: []}
        reduces = {}
        for _ in range(args.repeats):
            for sound in (False, True):
                seconds, reduces[sound] = trace_and_lower(body, sound)
                times[sound].append(seconds)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        unchecked = trace_and_lower(body, True, check=False)[1]
        print(f"  {name:22s} sound types {on * 1e3:7.1f} ms, JAX's typing {off * 1e3:7.1f} ms, "
              f"ratio {on / off:4.2f}; all-reduces {reduces[True]} (JAX's typing {reduces[False]}, "
              f"checking off {unchecked})")


if __name__ == "__main__":
    main()
