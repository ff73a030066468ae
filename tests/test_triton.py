"""jax-triton's ``triton_call`` with a rule on the Triton kernel.

On CPU, Triton kernels can be traced but not lowered, so these tests check the
types in the jaxpr under shard_map and the rule dispatch; the end-to-end run
needs a GPU and is skipped elsewhere (how to run it: its skip reason).
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from reprules import testing
from helpers import make_mesh, max_err, put, randn, shard_map

jt = pytest.importorskip("jax_triton", reason="jax-triton is not installed (pip install 'reprules[triton]')")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def add(x, y):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jt.triton_call(x, y, x.size, kernel=add_kernel, out_type=out, grid=(1,), BLOCK=256)


def _triton_line(f, *args):
    text = str(jax.make_jaxpr(f)(*args))
    return next(line for line in text.splitlines() if "triton_kernel_call[" in line)


@pytest.fixture
def args():
    mesh = make_mesh()
    return mesh, put(randn(0, (8, 128)), mesh, P("data", None)), put(randn(1, (2, 128)), mesh, P())


def test_rule_types_triton_call_outputs(args):
    mesh, x, y = args
    reprules.replication_rule()(add_kernel)
    assert _triton_line(shard_map(add, mesh, (P("data", None), P()), P("data", None)), x, y).split("=")[0].strip().endswith("{V:data}")
    with pytest.raises(ValueError, match="out_specs"):
        jax.make_jaxpr(shard_map(add, mesh, (P("data", None), P()), P(None, None)))(x, y)


def test_without_rule_triton_call_is_typed_by_the_union_of_its_inputs(args, monkeypatch):
    """JAX types a rule-less triton_call's output replicated (out_specs=P() wrongly accepted);
    reprules types it by the union of its inputs' axes, warning once, naming the kernel."""
    mesh, x, y = args
    f = shard_map(add, mesh, (P("data", None), P()), P("data", None))
    with pytest.warns(reprules.ReplicationWarning, match=r"(?s)The Triton kernel 'add_kernel' \(called at .*test_triton.py.*"
                      r"inputs varying over \{'data'\}.*JAX " + jax.__version__ + r".*replication_rule\(rules.same\(\)\)\(add_kernel\)"):
        line = _triton_line(f, x, y)
    assert "{V:data}" in line.split("=")[0]
    with pytest.raises(ValueError, match="out_specs"):
        jax.make_jaxpr(shard_map(add, mesh, (P("data", None), P()), P(None, None)))(x, y)
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")  # JAX's typing: the hazard, accepted
    jax.clear_caches()  # the switch is read when a function is traced
    jax.make_jaxpr(shard_map(add, mesh, (P("data", None), P()), P(None, None)))(x, y)


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.skipif(not _has_gpu(), reason=(
    "Triton kernels run only on a CUDA GPU (jax.devices('gpu') is empty): on a GPU machine run "
    "JAX_PLATFORMS=cpu,cuda python -m pytest tests/test_triton.py (the CPU stays JAX's default platform, with "
    "conftest's 8 fake devices); tests/test_gpu_only.py has kvax's and jax-flash-attn2's Triton kernels"))
def test_triton_call_end_to_end_on_gpu():
    """On a ("data", "model") mesh of the GPUs: checking on equals checking off and the
    sum on the whole arrays, with no all-reduce (the kernel's rule: rules.same())."""
    reprules.replication_rule()(add_kernel)
    gpus = jax.devices("gpu")
    n = len(gpus)
    mesh = jax.sharding.Mesh(np.array(gpus).reshape(n, 1), ("data", "model"))
    xs, ys = randn(0, (2 * n, 128)), randn(1, (2, 128))
    x, y = put(xs, mesh, P("data", None)), put(ys, mesh, P())
    specs = ((P("data", None), P()), P("data", None))
    on, off = shard_map(add, mesh, *specs), shard_map(add, mesh, *specs, check=False)
    out = jax.jit(on)(x, y)
    assert max_err(out, jax.jit(off)(x, y)) == 0.0
    assert max_err(out, xs + jax.numpy.tile(ys, (n, 1))) < 1e-6
    testing.assert_no_all_reduce(on, x, y)
