"""``reprules audit``'s communication sections: implicit collectives, cheaper equivalents, time.

The target writes both patterns: a psum of which each device keeps its own
slice (a reduce-scatter would do), then a Pallas kernel (interpret mode)
outside ``shard_map`` on a sharded operand (a TPU/GPU compile would gather it).
"""

import json
import re
import sys

import pytest

from reprules._audit import _cli, _html

TARGET = '''
import jax, numpy as np
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from reprules import testing


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def audit_step():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    x = jax.device_put(np.random.RandomState(0).randn(32, 128).astype(np.float32), NamedSharding(mesh, P("data")))

    def body(x):
        total = jax.lax.psum(x, "data")  # the psum
        return jax.lax.dynamic_slice_in_dim(total, jax.lax.axis_index("data") * 2, 2)

    summed = testing.shard_map(body, mesh, P("data"), P("data"))

    def step(x):
        y = summed(x)
        return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), interpret=True)(y)

    return step, (x,)
'''


@pytest.fixture
def comm_target(tmp_path, monkeypatch):
    (tmp_path / "comm_steps.py").write_text(TARGET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "comm_steps:audit_step"
    sys.modules.pop("comm_steps", None)


def test_the_text_report_shows_both_sections(comm_target, capsys):
    assert _cli.main(["audit", comm_target, "--quiet", "--strict"]) == 0  # --strict keeps its meaning
    out, _ = capsys.readouterr()
    assert all(len(line) <= 100 for line in out.splitlines())
    # Bytes sent (ring algorithms over the 4 'data' devices): the all-reduce of a 4096 B buffer sends
    # 6144 B, the reduce-scatter that replaces it 3072 B; the (8, 128) operand gathered: 3072 B.
    assert re.search(r"\n +could be saved +1 \(3072 B\)\n", out)
    assert re.search(r"\n +implicit \(XLA, kernels\) +1 \(3072 B\)\n", out)
    assert re.search(r"\n +est\. time \(cpu\) +\S+ us\n", out)
    assert "implicit collectives (XLA, around opaque kernels), as given:" in out
    assert re.search(r"all-gather +data +f32\[8,128\] +4096 +3072 ", out)
    assert re.search(r"all-gather .* copy_kernel +comm_steps\.py:\d+ +predicted\n", out)
    flat = " ".join(out.split())  # the fix lines wrap
    assert "(pallas_call, predicted for a TPU/GPU compile): call copy_kernel inside jax.shard_map with " \
           "in_specs=P('data') for operand 0" in flat
    assert re.search(r"all-reduce +data +6144 +3072 +3072 B, .* +reduce-scatter +comm_steps\.py:17", out)
    assert "fix: all-reduce at comm_steps.py:17: jax.lax.psum_scatter(x, 'data', scatter_dimension=0," in out
    assert "est. time: link model, cpu: 10 GB/s per device" in out


def test_strict_communication_fails_on_them(comm_target, capsys):
    assert _cli.main(["audit", comm_target, "--quiet", "--strict-communication"]) == 1
    _, err = capsys.readouterr()
    assert "reprules audit --strict-communication: 2 findings:" in err
    assert "could be reduce-scatter (6144 B sent -> 3072 B)" in err
    assert "implicit all-gather sending 3072 B into kernel" in err


def test_json_and_html(comm_target, capsys, tmp_path):
    page = tmp_path / "audit.html"
    assert _cli.main(["audit", comm_target, "--quiet", "--json", "--html", str(page), "--link", "100"]) == 0
    doc = json.loads(capsys.readouterr()[0])
    assert doc["schema_version"] == _cli.SCHEMA_VERSION == 4
    given = doc["workloads"][0]["given"]
    assert (given["cheaper_count"], given["savable_bytes"], given["implicit_count"]) == (1, 3072, 1)
    [c] = given["cheaper"]
    assert (c["pattern"], c["bytes"], c["sent"], c["sent_after"], c["saved_bytes"]) == ("own-slice", 4096, 6144,
                                                                                         3072, 3072)
    assert given["implicit_sent_bytes"] == 3072
    assert c["source"].endswith("comm_steps.py:17") and c["backend"] == "cpu"
    [i] = given["implicit"]
    assert i["predicted"] and i["kernel"].endswith("copy_kernel") and i["in_specs"] == "P('data')"
    assert given["link"]["bandwidth_bytes_per_s"] == 100e9 and given["est_seconds"] > 0
    assert all("est_seconds" in x for x in given["collectives"])
    assert len(doc["communication_findings"]) == 2
    html = page.read_text()
    assert "Implicit collectives (inserted by XLA around opaque kernels)" in html
    assert "Collectives with a cheaper equivalent (compiled cpu HLO)" in html
    assert "psum_scatter" in html and "could be saved</th>" in html and "est. time (100 GB/s)" in html
    assert html == _html.render(doc)


def test_an_unknown_link_is_a_usage_error(comm_target, capsys):
    assert _cli.main(["audit", comm_target, "--quiet", "--link", "warp-drive"]) == 2
    assert "--link: unknown link 'warp-drive'" in capsys.readouterr()[1]
