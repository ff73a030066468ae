"""The report's one cost model (issue 43), checked by hand against the compiled HLO.

For each collective: its buffer (the operand per device; an all-gather's result), the
devices of its replica group, and what each device sends for the ring algorithm:
all-reduce 2(n-1)/n of the buffer, all-gather, reduce-scatter and all-to-all (n-1)/n,
collective-permute the buffer. The buffers and group sizes are read here from the compiled
HLO with a parser of this file's own, independent of the report's.
"""

import math
import re

import jax
import pytest
from helpers import put, randn, shard_map
from jax.sharding import PartitionSpec as P

from reprules import testing

ITEMSIZE = {"f32": 4, "bf16": 2, "s32": 4}


def six_kinds(x):
    a = jax.lax.psum(x, "data")  # over 4 devices
    b = jax.lax.psum(x * 2.0, ("data", "model"))  # over 8
    c = jax.lax.all_gather(x, "model", tiled=True)  # over 2: an (16, 128) result
    d = jax.lax.psum_scatter(x * 3.0, "data", scatter_dimension=0, tiled=True)  # over 4: a (2, 128) result
    e = jax.lax.ppermute(x * 4.0, "data", [(i, (i + 1) % 4) for i in range(4)])
    f = jax.lax.all_to_all(x * 5.0, "model", 0, 0, tiled=True)
    return a + b + c[:8] + jax.numpy.tile(d, (4, 1)) + e + f


def _hlo_collectives(hlo, sizes):
    """(kind, buffer bytes, group size) of each collective in compiled CPU HLO text, by hand
    (CPU compiles them synchronous: no -start/-done pairs)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (\(.*?\)|\w+\[[\d,]*\]\S*) (all-reduce|all-gather|reduce-scatter|collective-permute|"
                      r"all-to-all)\(", line)
        if not m:
            continue
        kind = m[2]
        result = sum(math.prod(int(d) for d in dims.split(",") if d) * ITEMSIZE[dtype]
                     for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m[1]))
        named = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)  # JAX >= 0.10's spelling
        listed = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
        iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
        if named:
            n = math.prod(sizes[a.strip("'")] for a in named[1].split(","))
        else:
            n = len(listed[1].split(",")) if listed else int(iota[2]) if iota else 0
        found.append((kind, result * n if kind == "reduce-scatter" else result, n))
    return found


def test_bytes_sent_follow_the_ring_algorithms_on_six_collectives(mesh):
    x = put(randn(0, (32, 128)), mesh, P("data", None))
    step = shard_map(six_kinds, mesh, P("data"), P("data"), check=False)
    report = testing.collectives(step, x)
    got = {(c.kind, c.group_size): (c.bytes, c.sent_bytes) for c in report.select(level="hlo")}
    # By hand: an (8, 128) f32 block is 4096 B per device.
    want = {
        ("all-reduce", 4): (4096, 6144),  # 2 * 3/4 * 4096
        ("all-reduce", 8): (4096, 7168),  # 2 * 7/8 * 4096
        ("all-gather", 2): (8192, 4096),  # the (16, 128) result, 1/2 of it sent
        ("reduce-scatter", 4): (4096, 3072),  # 3/4 * 4096
        ("collective-permute", 4): (4096, 4096),  # the buffer
        ("all-to-all", 2): (4096, 2048),  # 1/2 * 4096
    }
    assert got == want
    hlo = jax.jit(step).lower(x).compile().as_text()
    by_hand = _hlo_collectives(hlo, dict(mesh.shape))
    # The compiled HLO's buffers agree (collective-permute has pairs, not groups: n from its axis).
    assert sorted((k, b) for k, b, _ in by_hand) == sorted((k, b) for (k, _), (b, _) in want.items())
    assert sorted((k, n) for k, _, n in by_hand if k != "collective-permute") == sorted(
        (k, n) for k, n in want if k != "collective-permute")
    assert report.sent_bytes() == sum(s for _, s in want.values())
    assert report.seconds() > 0


def test_a_defensive_all_reduce_splits_into_its_needed_and_defensive_axes(mesh):
    """Checking off, a replicated weight's gradient is one all-reduce over (data, model): its
    'data' part is needed (the activations vary there), its 'model' part defensive."""
    from reprules._demo import workloads

    case = next(c for c in workloads.DEFAULT_CASES if c.name == "layer_norm")
    built = case.build(mesh, False)
    report = testing.collectives(built.step, *built.args)
    split = [c for c in report.select() if c.split]
    assert split, report.table()
    for c in split:
        assert c.kind == "all-reduce" and set(c.axes) == {"data", "model"} and c.needed_axes == ("data",)
        assert c.replicated_axes == ("model",)
        n = c.bytes
        assert c.sent_bytes == round(2 * 7 / 8 * n)  # over 8 devices
        assert c.needed_sent_bytes == round(2 * 3 / 4 * n)  # the same all-reduce over 'data' only
        assert c.defensive_sent_bytes == c.sent_bytes - c.needed_sent_bytes
        assert c.status_text(axes=True) == "needed+defensive (model)"
    # The split's needed parts are what reprules' own program sends for the same gradients.
    for k in case.kernels():
        import reprules

        reprules.replication_rule()(k)
    try:
        on = testing.collectives(case.build(mesh, True).step, *built.args)
    finally:
        for k in case.kernels():
            reprules.unregister(k)
    assert on.defensive_sent_total == 0
    assert on.sent_bytes() == sum(c.needed_sent_bytes for c in split)
    assert report.needed_sent_total + report.defensive_sent_total == report.sent_bytes()
    # assert_no_all_reduce and friends keep their meaning: a split all-reduce is still defensive.
    assert report.count(defensive=True) == len(report.defensive) >= len(split)
    with pytest.raises(testing.CollectivesAssertionError):
        testing.assert_no_all_reduce(built.step, *built.args, axes=("data", "model"))
