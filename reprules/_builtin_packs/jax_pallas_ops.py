"""Rules for the kernels of JAX's own Pallas ops (``jax.experimental.pallas.ops``).

Each function is an entry point of the ``reprules.rules`` group, named after
the op module it covers, and is called with that module right after it is
imported. It registers rules on the op's kernel functions as they are, with no
copy or edit of JAX's code. Kernels an installed JAX does not have are skipped.
"""

from __future__ import annotations

from types import ModuleType

import reprules
from reprules import rules


def _register(module: ModuleType, rule: rules.RuleLike, *names: str) -> None:
    for name in names:
        kernel = getattr(module, name, None)
        if kernel is not None:
            reprules.replication_rule(rule)(kernel)


def layer_norm(module: ModuleType) -> None:
    """``ops.gpu.layer_norm`` (0.4.31+) and ``ops.layer_norm`` (0.4.28-0.4.30).

    Every row is normalised on its own device; the dw/db kernel sums over the
    local rows, so its outputs vary like the input (the psum over the batch
    axes is then inserted by the custom_vjp cotangent handling).
    """
    _register(
        module,
        rules.same(),
        "layer_norm_forward_kernel",
        "layer_norm_backward_kernel_dx",
        "layer_norm_backward_kernel_dw_db",
    )
