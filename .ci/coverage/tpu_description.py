"""A TPU v5e description for the CPU device kind, for kernels that ask for one on CPU.

``pltpu.emit_pipeline`` (tokamax's and ejkernel's v2 grouped matmuls, MaxText's
tokamax backend) and some kernels' block-size logic call JAX's ``get_tpu_info()``,
which raises "Unsupported TPU device kind: cpu" on CPU. JAX has no public way to
describe a TPU for the CPU device (an ``AbstractMesh``'s device is replaced by the
concrete mesh's inside ``shard_map``), so this registers one in JAX's private
registry, as tests/test_tokamax.py does: the one private JAX name in this directory,
and only for the cases that say they need it.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def v5e_for_cpu():
    from jax._src import tpu_info  # private: see the module docstring
    from jax.experimental.pallas import tpu as pltpu

    old = tpu_info.registry.get("cpu")
    tpu_info.registry["cpu"] = lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5E, 1)
    try:
        yield
    finally:
        if old is None:
            tpu_info.registry.pop("cpu", None)
        else:
            tpu_info.registry["cpu"] = old
        getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)()


@contextlib.contextmanager
def tpu_interpret(v5e: bool = False, tokamax: bool = False):
    """TPU interpret mode; with ``v5e`` the CPU device described as a v5e; with ``tokamax``
    ``tokamax.config.cross_compile(True)`` (tokamax refuses TPU ops on a CPU device otherwise)."""
    from jax.experimental.pallas import tpu as pltpu

    with contextlib.ExitStack() as stack:
        stack.enter_context(pltpu.force_tpu_interpret_mode())
        if v5e:
            stack.enter_context(v5e_for_cpu())
        if tokamax:
            import tokamax as tk

            stack.enter_context(tk.config.cross_compile(True))
        yield
