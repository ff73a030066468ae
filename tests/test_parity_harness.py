"""The shard_map parity harness (``.ci/shard_map_parity/reprules_active.py``), loaded as pytest loads it.

Its pack imports must leave JAX's configuration as they found it: ejkernel sets
``jax_compilation_cache_dir`` (and the persistent cache's thresholds) on import,
which broke JAX's own ``test_all_gather`` in the reprules run. Here the only pack
is a fake whose module changes two options.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import types

import jax

import reprules

HARNESS = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "shard_map_parity" / "reprules_active.py"

FAKE_PACK_MODULE = """
import jax

jax.config.update("jax_compilation_cache_dir", {cache!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
"""


def test_the_pack_imports_leave_jax_config_as_they_found_it(tmp_path, monkeypatch):
    (tmp_path / "fake_pack_module.py").write_text(FAKE_PACK_MODULE.format(cache=str(tmp_path / "cache")))
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = types.SimpleNamespace(module="fake_pack_module", name="fake", state="loaded", error=None)
    monkeypatch.setattr(reprules, "packs", lambda: [fake])
    marker = tmp_path / "marker.json"
    monkeypatch.setenv("REPRULES_MARKER", str(marker))
    before = dict(jax.config.values)

    spec = importlib.util.spec_from_file_location("reprules_active_under_test", HARNESS)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)  # registers its kernel's rule: conftest unregisters it

    after = dict(jax.config.values)
    assert {k: after[k] for k in before if after[k] != before[k]} == {}
    state = json.loads(marker.read_text())
    assert state["pack_module_imports"] == {"fake_pack_module": "imported"}
    assert state["config_restored"] == {
        "jax_compilation_cache_dir": {"set_by_packs": str(tmp_path / "cache"),
                                      "restored_to": before["jax_compilation_cache_dir"]},
        "jax_persistent_cache_min_compile_time_secs": {
            "set_by_packs": 0.0, "restored_to": before["jax_persistent_cache_min_compile_time_secs"]},
    }
