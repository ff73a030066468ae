"""tpu-inference 0.32.0's Pallas kernels (vLLM's TPU backend) under checking, on CPU, on JAX 0.11.2.

The ops of ``.ci/coverage/cases_tpu_inference.py`` (the same inputs, specs and references):
the quantized matmul (int8 weights; f32 or int8 activations), flash attention, megablox
``gmm``, the KV-cache update (DMAs into a paged cache) and the ragged causal conv1d, inside
``shard_map`` on the (4, 2) ("data", "model") mesh, tokens or batch over ``data``, heads,
output features or channels over ``model``, in TPU interpret mode (the CPU device described
as a TPU v6e; the conv1d's padded tiles read past its input's end, uninitialized). No pack:
reprules derives each kernel's rule from its body.

* each forward equals checking off and an unsharded reference; none has a VJP, and the
  checked forward has no defensive all-reduce;
* ragged paged attention v3 fails in TPU interpret mode with checking off too (JAX's
  interpreter: ``'ReshapeTransform' object has no attribute 'indices'``): the same error.

vLLM (and torch, which it imports) is not installed: ``cases_tpu_inference.stand_ins``
gives vLLM's logger and ``tpu_inference.utils``' few kernel helpers (the library's own).
"""

import jax
import pytest
from helpers import coverage_cases, max_err, put, shard_map

from reprules import testing

cases = coverage_cases("cases_tpu_inference")
cases.stand_ins()  # before the library's first import: vLLM's logger, where vLLM is absent
pytest.importorskip(
    "tpu_inference.kernels.quantized_matmul.kernel",
    reason="tpu-inference is not installed. To run these tests (JAX 0.11.2, Python 3.12): pip install "
    "jax==0.11.2 jaxlib==0.11.2 requests, then pip install --no-deps tpu-inference==0.32.0 (noxfile.py's "
    "TPU_INFERENCE and TPU_INFERENCE_IMPORTS, as the coverage_pinned session installs them)",
)

EXACT = [op for op in cases.CASES if "ragged_paged_attention" not in op]


def _run(case, mesh, check):
    sharded = [put(a, mesh, s) for a, s in zip(case.args, case.in_specs)]
    f = shard_map(case.fn, mesh, case.in_specs, case.out_specs, check=check)
    return f, sharded


@pytest.mark.parametrize("op", EXACT)
def test_forward_is_exact(mesh, op):
    case = cases.CASES[op]()
    with case.context():
        on, sharded = _run(case, mesh, check=True)
        off, _ = _run(case, mesh, check=False)
        out_on, out_off = jax.jit(on)(*sharded), jax.jit(off)(*sharded)
        out_ref = jax.jit(case.reference)(*case.args)
        report = testing.collectives(on, *sharded)
    assert max_err(out_on, out_off) == 0.0
    scale = max(float(abs(x).max()) for x in jax.tree.leaves(out_ref))
    assert max_err(out_on, out_ref) <= case.tol * scale
    assert report.count("all-reduce", defensive=True) == 0


def test_ragged_paged_attention_fails_as_with_checking_off(mesh):
    """JAX's TPU interpreter cannot run the kernel (a reshaped ref it indexes); checking changes nothing."""
    case = cases.CASES["ragged_paged_attention (v3)"]()
    errors = []
    with case.context():
        for check in (False, True):
            f, sharded = _run(case, mesh, check)
            with pytest.raises(Exception, match="'ReshapeTransform' object has no attribute 'indices'") as err:
                jax.block_until_ready(jax.jit(f)(*sharded))
            errors.append(type(err.value))
    assert errors[0] is errors[1]
