"""TPU interpret mode for the cases, with the CPU device described as a TPU v5e where a
kernel asks which TPU it runs on (``pltpu.emit_pipeline``: tokamax's and ejkernel's v2
grouped matmuls, MaxText's tokamax backend): ``reprules.testing.tpu_on_cpu``.
"""

from __future__ import annotations

import contextlib

from reprules import testing


@contextlib.contextmanager
def tpu_interpret(v5e: bool = False, tokamax: bool = False):
    """TPU interpret mode; with ``v5e`` the CPU device described as a v5e; with ``tokamax``
    ``tokamax.config.cross_compile(True)`` (tokamax refuses TPU ops on a CPU device otherwise)."""
    from jax.experimental.pallas import tpu as pltpu

    with contextlib.ExitStack() as stack:
        stack.enter_context(testing.tpu_on_cpu("v5e") if v5e else pltpu.force_tpu_interpret_mode())
        if tokamax:
            import tokamax as tk

            stack.enter_context(tk.config.cross_compile(True))
        yield
