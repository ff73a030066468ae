"""pytest plugin (loaded with `-p reprules_active`): makes reprules active while JAX's own tests run.

At load time (before collection):
  * `import reprules`; every rule pack that reprules discovered (`reprules.packs()`, the
    `reprules.rules` entry points) is loaded by importing the module it covers; every
    `jax.config` value those imports changed is put back (ejkernel sets
    `jax_compilation_cache_dir` and the persistent cache's thresholds, which broke JAX's
    `test_all_gather`: the run measures reprules, not the libraries' settings), and the
    marker lists them under `config_restored`;
  * a rule is registered for an unrelated tiny Pallas copy kernel defined here, which
    installs reprules' JAX patches (`reprules.jax_patches()` lists them).
The state (JAX support, packs, registrations, the list of patched JAX objects) is written
to $REPRULES_MARKER (JSON). At session end the plugin checks that every patch is still in
place and that the rule works (the kernel inside a checked shard_map), and adds that.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
import warnings

_MARKER = os.environ.get("REPRULES_MARKER", "/tmp/jaxtests/reprules_marker.json")
_state: dict = {"plugin_loaded": True, "argv": sys.argv}


def _import_pack_modules(packs) -> tuple[dict, dict]:
    """Imports the module each pack covers, then puts back every `jax.config` value the
    imports changed. Returns ({module: "imported" or why not}, {option: what was put back})."""
    import jax

    before = dict(jax.config.values)
    imports = {}
    for pack in packs:
        try:
            importlib.import_module(pack.module)
            imports[pack.module] = "imported"
        except Exception as err:  # a covered module that cannot be imported here
            imports[pack.module] = f"import failed: {type(err).__name__}: {err}"
    restored = {}
    for name, value in dict(jax.config.values).items():
        if name not in before or _same(value, before[name]):
            continue  # unchanged, or an option the imports defined (nothing to put back)
        try:
            jax.config.update(name, before[name])
            restored[name] = {"set_by_packs": value, "restored_to": before[name]}
        except Exception as err:  # an option JAX refuses to change back now
            restored[name] = {"set_by_packs": value, "not_restored": f"{type(err).__name__}: {err}"}
    return imports, restored


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a value without a plain truth of equality
        return a is b


with warnings.catch_warnings(record=True) as _caught:
    warnings.simplefilter("always")
    import reprules
    from reprules import rules

    _state["reprules_file"] = reprules.__file__
    _state["jax_support"] = reprules.jax_support()
    _state["pack_module_imports"], _state["config_restored"] = _import_pack_modules(reprules.packs())
    _state["packs"] = [
        {"module": p.module, "name": p.name, "state": p.state, "error": p.error} for p in reprules.packs()
    ]

    @reprules.replication_rule(rules.same())
    def _unrelated(x_ref, o_ref):
        o_ref[...] = x_ref[...]

_state["load_warnings"] = [f"{w.category.__name__}: {w.message}" for w in _caught]



def _patch_list() -> list[dict]:
    """The JAX objects reprules' live patches replaced (public API: reprules.jax_patches())."""
    return [{"patched": what, "in_place": in_place} for what, in_place in reprules.jax_patches()]


def _active() -> bool:
    return bool(reprules.jax_patches())


_state["active_after_registration"] = _active()
_state["registered"] = {k: str(v.rule) + f" ({v.source})" for k, v in reprules.registered().items()}
_state["patches_at_load"] = _patch_list()


def _dump() -> None:
    with open(_MARKER, "w") as f:
        json.dump(_state, f, indent=1, default=str)


_dump()
print(f"[reprules_active] reprules active: {_active()}, {len(_state['patches_at_load'])} patches, "
      f"packs: {[(p['module'], p['state']) for p in _state['packs']]}", file=sys.stderr)
assert _active(), "reprules patches were not installed"


def pytest_report_header(config):
    return (f"reprules_active: reprules {reprules.__version__} ({reprules.__file__}) ACTIVE, "
            f"regime {_state['jax_support']['regime']}, {len(_state['patches_at_load'])} JAX patches live")


def pytest_sessionfinish(session, exitstatus):
    _state["active_at_end"] = _active()
    _state["patches_at_end"] = _patch_list()
    _state["all_patches_in_place_at_end"] = all(p["in_place"] for p in _state["patches_at_end"])
    _state["registered_at_end"] = sorted(reprules.registered())
    # The rule still works: the registered kernel inside a checked shard_map.
    try:

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.experimental import pallas as pl
        from jax.sharding import Mesh, PartitionSpec as P

        from reprules import testing

        mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("i",))
        def body(x):
            return pl.pallas_call(_unrelated, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  interpret=True)(x)
        f = jax.jit(testing.shard_map(body, mesh, (P("i"),), P("i"), check=True))
        x = jnp.arange(32.0).reshape(8, 4)
        y = f(x)
        _state["sanity_checked_shard_map"] = bool(np.array_equal(np.asarray(y), np.asarray(x)))
        # With the rule the output varies over "i": out_specs=P() must be refused by JAX's check.
        try:
            jax.jit(testing.shard_map(body, mesh, (P("i"),), P(), check=True))(x)
            _state["out_specs_P()_refused"] = False
        except Exception as err:
            _state["out_specs_P()_refused"] = f"{type(err).__name__}: {str(err)[:200]}"
    except Exception:
        _state["sanity_checked_shard_map"] = "FAILED: " + traceback.format_exc()
    _dump()
