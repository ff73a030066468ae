"""augax's samplers (XLA FFI custom calls on CPU), one :class:`measure.Case` each.

``augax.pg_sample`` (Pólya-Gamma draws, FFI target ``augax_pg_sample_f64``) and
``augax.ks_sample`` (Kolmogorov scales, ``augax_ks_sample_f64``), each with one key
replicated and its operands over ``data``, and under ``jax.vmap`` with one key per
row (the library's batched targets, ``..._batched_f64``), rows over ``data``; the
operands replicated over ``model``. augax gives them no replication rule: reprules
types each output by the union of its inputs' axes (a ``ReplicationWarning``).
float64 (the library refuses without ``jax_enable_x64``); no VJP (draws).

A draw depends on the seed and on the whole call (each shard's block is a call of
its own, and the batched targets seed rows by their place in the batch): the
reference is the library on each ``data`` block of the whole arrays, with the same
keys, concatenated.

And the pg draws returned with ``out_specs=P()``: they vary over ``data``; JAX alone
types the FFI call's output replicated and returns one device's block; reprules
refuses (``refused``: the right answer, the ``ValueError`` says why).
"""

from __future__ import annotations

from measure import Case

N, ROWS, COLS = 32, 8, 4
SHARDS = 4  # the size of 'data'


def _augax():
    import jax

    jax.config.update("jax_enable_x64", True)  # before any array: augax draws in float64 only
    import augax

    return augax


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _per_block(op, nargs):
    """The op on each data block of its first ``nargs`` arguments (the rest whole), concatenated."""
    def reference(*args):
        import jax.numpy as jnp

        blocks = [jnp.split(a, SHARDS) for a in args[:nargs]]
        return jnp.concatenate([op(*(b[i] for b in blocks), *args[nargs:]) for i in range(SHARDS)])

    return reference


def _operands(sampler, shape):
    import numpy as np

    rng = np.random.RandomState(0)
    if sampler == "pg":  # h = 1 (the logit augmentation), z the linear predictor
        return np.ones(shape), rng.randn(*shape)
    return (rng.logistic(size=shape),)  # ks: logistic disturbances


def _sampler(sampler, batched=False, replicated_out=False):
    def case():
        import jax

        augax = _augax()
        op = augax.pg_sample if sampler == "pg" else augax.ks_sample
        key = jax.random.key(0)
        if batched:  # one key per row: the batched FFI target
            operands = _operands(sampler, (ROWS, COLS))
            fn = jax.vmap(op)
            args = (*operands, jax.random.split(key, ROWS))
            specs = (_P("data", None),) * len(operands) + (_P("data"),)
            reference = _per_block(fn, len(args))
            note = "vmapped, one key per row; rows and keys over data"
        else:
            operands = _operands(sampler, (N,))
            fn = op
            args = (*operands, key)
            specs = (_P("data"),) * len(operands) + (_P(),)
            reference = _per_block(fn, len(operands))
            note = "operands over data, one key replicated"
        out = _P("data", None) if batched else _P("data")
        if replicated_out:
            out = _P()
            note += "; the draws (varying over data) returned with out_specs=P(): checking off returns one block (inf)"
        return Case(fn, args, specs, out, reference=reference, tol=1e-12, note=note)

    return case


CASES = {
    "pg_sample": _sampler("pg"),
    "pg_sample (vmapped, batched target)": _sampler("pg", batched=True),
    "ks_sample": _sampler("ks"),
    "ks_sample (vmapped, batched target)": _sampler("ks", batched=True),
    "pg_sample, out_specs=P() (varying draws)": _sampler("pg", replicated_out=True),
}
