"""kups' custom primitives (``kups.core.utils.segment``), one :class:`measure.Case` each:
``segment_take`` of a replicated table by ids over ``data`` and ``segment_sum`` of
contributions over ``data``, as kups' message passing calls them.
"""

from __future__ import annotations

from measure import Case


def _ids(seed, n, bins):
    import numpy as np

    return np.random.RandomState(seed).randint(0, bins, (n,)).astype(np.int32)


def _rn(seed, shape):
    import numpy as np

    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def segment_take():
    import jax.numpy as jnp
    from kups.core.utils.segment import segment_take as op

    return Case(lambda table, ids: op(table, ids), (_rn(0, (5, 3)), _ids(1, 16, 5)), (_P(), _P("data")),
                _P("data", None), grad_argnums=(0,), reference=lambda table, ids: jnp.take(table, ids, axis=0),
                note="table replicated, ids over data")


def segment_sum():
    import jax
    import jax.numpy as jnp
    from kups.core.utils.segment import segment_sum as op

    def reference(d, ids):  # each data shard's sums, stacked
        return jnp.concatenate([jax.ops.segment_sum(a, i, 5) for a, i in zip(jnp.split(d, 4), jnp.split(ids, 4))])

    return Case(lambda d, ids: op(d, ids, 5), (_rn(0, (16, 3)), _ids(1, 16, 5)), (_P("data", None), _P("data")),
                _P("data", None), grad_argnums=(0,), reference=reference, note="contributions and ids over data")


CASES = {"segment_take": segment_take, "segment_sum": segment_sum}
