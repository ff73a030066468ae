"""``reprules audit``: the default workloads, a user target, --json, --strict."""

import json
import textwrap

import pytest

from reprules import _cli

TARGET = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import pallas as pl
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from reprules.testing import shard_map

    def user_copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def _copy(x):
        return pl.pallas_call(user_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    @jax.custom_vjp
    def kernel_copy(x):
        return _copy(x)

    kernel_copy.defvjp(lambda x: (_copy(x), None), lambda _, g: (_copy(g),))
    W = jnp.asarray(np.random.RandomState(0).randn(8, 128), jnp.float32)

    def audit_step():
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
        f = shard_map(kernel_copy, mesh, P("data", None), P("data", None), check=False)
        return {"step": jax.grad(lambda x: (f(x) * W).sum()), "args": (x,), "reference": lambda: W}

    def data_parallel():
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
        f = shard_map(lambda x, w: x @ w, mesh, (P("data", None), P()), P("data", None), check=True)
        return jax.grad(lambda w, x: (f(x, w) * 2.0).sum()), (jnp.ones((128, 4)), x)

    def not_a_step():
        return 42
''')


@pytest.fixture
def target(tmp_path, monkeypatch):
    (tmp_path / "user_steps.py").write_text(TARGET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_steps"


def test_default_audit_side_by_side(capsys):
    assert _cli.main(["audit", "--strict"]) == 0  # the reprules side is clean
    out, err = capsys.readouterr()
    assert "[1/3] issue21855: checking off ... reprules ... done" in err
    assert "[3/3] layer_norm:" in err
    blocks = out.split("\n== ")
    assert len(blocks) == 4
    issue = blocks[1]
    assert "checking off" in issue and "reprules (checking on)" in issue
    assert "defensive         1 all-reduce over model (1024 B)  0" in issue
    assert "kernels with rules  0/1 (no rule: copy_kernel)        1/1" in issue
    ln = blocks[3]
    assert "2 all-reduce over data (1024 B)" in ln


def test_default_audit_json(capsys):
    assert _cli.main(["audit", "--json", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    doc = json.loads(out)
    assert doc["devices"] == 8 and doc["mesh"] == {"data": 4, "model": 2}
    by = {w["name"]: w for w in doc["workloads"]}
    assert set(by) == {"issue21855", "tp_mlp", "layer_norm"}
    assert all(w["error"] is None for w in by.values())
    issue = by["issue21855"]
    assert (issue["off"]["defensive_count"], issue["off"]["defensive_bytes"]) == (1, 1024)
    assert (issue["on"]["count"], issue["on"]["kernels_with_rules"]) == (0, 1)
    for w in by.values():
        assert w["on"]["defensive_count"] == 0
        assert w["off"]["defensive_count"] >= 1
        assert w["on"]["max_error"] < 1e-4 and w["off"]["max_error"] < 1e-4
    mlp = by["tp_mlp"]["on"]
    assert sorted(tuple(c["axes"]) for c in mlp["collectives"]) == [("data",), ("data",), ("model",), ("model",)]
    assert doc["strict_findings"] == []


def test_user_target_strict_reports_kernel_and_decorator(target, capsys):
    assert _cli.main(["audit", f"{target}:audit_step", "--strict", "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert "user_copy_kernel (pallas_call x2) at " in out and "NO RULE" in out
    assert "defensive collectives: 1 (1024 B per step)" in out
    assert "@reprules.replication_rule()   # above `def user_copy_kernel(...)`" in out
    assert "max error against the reference: 0.00e+00" in out
    assert "reprules audit --strict: 1 defensive collectives, 1 kernels without a rule" in err


def test_user_target_json_and_needed_all_reduce(target, capsys):
    assert _cli.main(["audit", f"{target}:data_parallel", "--json", "--strict", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (c,) = doc["report"]["collectives"]
    assert (c["kind"], c["axes"], c["status"], c["bytes"]) == ("all-reduce", ["data"], "needed", 128 * 4 * 4)
    assert doc["strict_findings"] == []


@pytest.mark.parametrize(
    "spec, message",
    [
        ("user_steps", "is not of the form module:callable"),
        ("no_such_module_xyz:f", "Cannot import module 'no_such_module_xyz'"),
        ("user_steps:missing", "has no attribute 'missing'"),
        ("user_steps:W", "not callable"),
        ("user_steps:not_a_step", r"returned int"),
    ],
)
def test_bad_targets_are_usage_errors(target, capsys, spec, message):
    assert _cli.main(["audit", spec, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "reprules audit: error:" in err
    import re

    assert re.search(message, err)


def test_no_command_prints_help(capsys):
    assert _cli.main([]) == 2
    assert "audit" in capsys.readouterr().err


def test_bad_device_count_is_a_usage_error(capsys):
    assert _cli.main(["audit", "--devices", "0", "--quiet"]) == 2
    assert "--devices must be at least 1" in capsys.readouterr().err


def test_too_few_started_devices_is_a_usage_error(capsys):
    assert _cli.main(["audit", "--devices", "64", "--quiet"]) == 2
    assert "JAX already started with 8 devices; the audit needs 64" in capsys.readouterr().err
