"""Rule packs: discovered through entry points, loaded when their module is imported.

Each scenario runs in a fresh interpreter, since discovery happens at
``import reprules`` and a module is imported only once per process.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

FAKE_DIST = {
    "fakepack-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakepack\nVersion: 1.0\n",
    "fakepack-1.0.dist-info/entry_points.txt": textwrap.dedent(
        """\
        [reprules.rules]
        fake_kernels = fake_pack:register
        broken_kernels = fake_pack:broken
        """
    ),
    "fake_kernels.py": "def scale_kernel(x_ref, o_ref):\n    o_ref[...] = 2.0 * x_ref[...]\n",
    "broken_kernels.py": "def k(x_ref, o_ref):\n    o_ref[...] = x_ref[...]\n",
    "fake_pack.py": textwrap.dedent(
        """\
        import reprules
        from reprules import rules

        def register(module):
            reprules.replication_rule(rules.same())(module.scale_kernel)

        def broken(module):
            raise RuntimeError("this pack is broken")
        """
    ),
}


def run(code, tmp_path):
    for name, text in FAKE_DIST.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_pack_loads_when_its_module_is_imported(tmp_path):
    out = run(
        """
        import reprules
        print([ (p.module, p.state, p.distribution) for p in reprules.packs() if p.distribution == "fakepack"])
        print(reprules.registered() == {})
        import fake_kernels
        reg = reprules.registered()["fake_kernels.scale_kernel"]
        print(reg.rule, reg.source)
        """,
        tmp_path,
    )
    lines = out.splitlines()
    assert "('fake_kernels', 'waiting', 'fakepack')" in lines[0]
    assert lines[1] == "True"  # nothing imported, nothing registered
    assert lines[2] == "rules.same() pack fake_pack:register"


def test_pack_for_an_already_imported_module_loads_at_import_reprules(tmp_path):
    out = run(
        """
        import fake_kernels
        import reprules
        print(reprules.registered()["fake_kernels.scale_kernel"].source)
        """,
        tmp_path,
    )
    assert out.strip() == "pack fake_pack:register"


def test_broken_pack_is_reported_and_never_breaks_imports(tmp_path):
    out = run(
        """
        import warnings
        import reprules
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import broken_kernels
        print(caught[0].category.__name__)
        print(caught[0].message)
        status = [p for p in reprules.packs() if p.module == "broken_kernels"][0]
        print(status.state, status.error)
        """,
        tmp_path,
    )
    category, message, status = out.splitlines()[:3]
    assert category == "PackWarning"
    assert "'fake_pack:broken' (from fakepack, for broken_kernels) failed to load: RuntimeError: this pack is broken" in message
    assert status == "failed RuntimeError: this pack is broken"


def test_builtin_pack_makes_jax_layer_norm_work_with_only_reprules_installed(tmp_path):
    out = run(
        """
        from reprules import testing
        testing.fake_cpu_devices(8)
        import warnings; warnings.simplefilter("ignore", DeprecationWarning)
        import numpy as np, jax
        from jax.sharding import PartitionSpec as P
        import reprules  # nothing else: no rule is written here
        try:
            from jax.experimental.pallas.ops.gpu import layer_norm as ln
        except ImportError:
            from jax.experimental.pallas.ops import layer_norm as ln
        import sys; sys.path.insert(0, %r)
        from helpers import make_mesh, put, randn, shard_map, psum_axes, max_err
        mesh = make_mesh()
        x = put(randn(0, (8, 4, 128)), mesh, P("data", None, None))
        w, b = put(randn(1, (128,)), mesh, P()), put(randn(2, (128,)), mesh, P())
        f = shard_map(lambda x, w, b: ln.layer_norm(x, w, b, interpret=True), mesh, (P("data", None, None), P(), P()), P("data", None, None))
        grad = jax.grad(lambda x, w, b: f(x, w, b).sum(), argnums=(0, 1, 2))
        ref = jax.grad(lambda x, w, b: ln.layer_norm_reference(x, w, b).sum(), argnums=(0, 1, 2))(*map(np.asarray, (x, w, b)))
        print(psum_axes(grad, x, w, b), max_err(jax.jit(grad)(x, w, b), ref) < 1e-4)
        print(reprules.registered()[ln.__name__ + ".layer_norm_forward_kernel"].source)
        """ % str(pathlib.Path(__file__).parent),
        tmp_path,
    )
    axes, source = out.splitlines()[:2]
    assert axes == "[('data',), ('data',)] True"
    assert source == "pack reprules._builtin_packs.jax_pallas_ops:layer_norm"


def test_qwix_pack_says_where_to_look_when_qwix_moves_pallas_call():
    """The qwix pack registers the module that defines ``qwix.pallas.pallas_call``; a
    qwix that no longer defines it there gets a LookupError (reported as a PackWarning
    by the loader) saying what happened, why, and how to register the kernels meanwhile."""
    import types

    import pytest

    from reprules._builtin_packs import qwix

    moved = types.ModuleType("qwix.pallas")
    moved.pallas_call = len  # a callable defined outside qwix
    with pytest.raises(LookupError, match=r"(?s)qwix\.pallas has no pallas_call defined in qwix \(found "
                       r"<built-in function len>\): qwix moved it.*\nWhy: qwix hands JAX its own lambda.*"
                       r"\nFix: upgrade reprules; until then register them yourself with "
                       r"reprules\.replication_rule\(reprules\.rules\.inferred\(\)\)\(reprules\.kernels_in\("):
        qwix.qwix(moved)
    with pytest.raises(LookupError, match=r"found None"):
        qwix.qwix(types.ModuleType("qwix.pallas"))
