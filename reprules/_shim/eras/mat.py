"""The *mat* era: JAX 0.10 - 0.12 (``jax.shard_map(..., check_vma=True)``).

Same design as the vma era (see ``vma.py``), but 0.10.0 replaced
``ShapedArray.vma`` by ``manual_axis_type`` (read as ``.mat``, a
``core.ManualAxisType`` whose ``varying`` field is the old vma set), and
``ShapeDtypeStruct(vma=...)`` by ``ShapeDtypeStruct(manual_axis_type=...)``.
Only the type field differs (``_types.MatField``).
"""

from __future__ import annotations

from reprules._shim.plumbing import _jax
from reprules._shim.plumbing._types import MatField
from reprules._shim.eras.vma import Regime

NAME = "mat"
VERSIONS = "0.10.x - 0.12.x"
MECHANISM = "check_vma: ShapedArray.manual_axis_type on out_shape, pvary casts, interpret lowering fix"
CHECK_FLAG = "check_vma"


def detect() -> bool:
    core = _jax.core
    return hasattr(core, "ManualAxisType") and hasattr(core.ShapedArray, "update_manual_axis_type")


_regime = Regime(MatField())
install = _regime.install
attach = _regime.attach
install_strict = _regime.install_strict
install_sound_types = _regime.install_sound_types
