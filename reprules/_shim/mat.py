"""The *mat* regime: JAX 0.10 - 0.12 (``jax.shard_map(..., check_vma=True)``).

Same design as the vma regime (see ``vma.py``), but 0.10.0 replaced
``ShapedArray.vma`` by ``manual_axis_type`` (read as ``.mat``, a
``core.ManualAxisType`` whose ``varying`` field is the old vma set), and
``ShapeDtypeStruct(vma=...)`` by ``ShapeDtypeStruct(manual_axis_type=...)``.
Only the type field differs, so only that is overridden here.
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src import core

from reprules._shim import vma

NAME = "mat"
VERSIONS = "0.10.x - 0.12.x"
MECHANISM = "check_vma: ShapedArray.manual_axis_type on out_shape, pvary casts, interpret lowering fix"
CHECK_FLAG = "check_vma"


class TypeField(vma.TypeField):
    sds_keyword = "manual_axis_type"

    def varying(self, aval: Any) -> frozenset[str]:
        mat = getattr(aval, "mat", None)
        if mat is None:
            return frozenset()
        varying = mat.varying  # a frozenset on 0.10 - 0.12 (JAX canonicalises it)
        return varying if type(varying) is frozenset else frozenset(varying)

    def annotated(self, sds: Any) -> bool:
        return isinstance(sds, jax.ShapeDtypeStruct) and getattr(sds, "manual_axis_type", None) is not None

    def sds_value(self, varying: frozenset[str]) -> Any:
        return core.ManualAxisType(varying=frozenset(varying))

    def strip(self, aval: Any) -> Any:
        return aval.update_manual_axis_type(core.empty_mat) if hasattr(aval, "mat") else aval

    def retype(self, aval: Any, varying: frozenset[str]) -> Any:
        extra = vma._mesh_sharding(aval, varying)
        aval = aval.update(**extra) if extra else aval
        mat = getattr(aval, "mat", None) or core.empty_mat
        return aval.update_manual_axis_type(_with_varying(mat, varying))


_other_fields: tuple[str, ...] | None = None  # ManualAxisType's, besides varying: read once


def _with_varying(mat: Any, varying: frozenset[str]) -> Any:
    global _other_fields
    if mat.varying == varying:
        return mat
    if _other_fields is None:  # 0.10: unreduced, reduced; 0.11+: unreduced_kind too
        _other_fields = tuple(f for f in ("unreduced", "reduced", "unreduced_kind") if hasattr(mat, f))
    return core.ManualAxisType(varying=frozenset(varying), **{f: getattr(mat, f) for f in _other_fields})


def detect() -> bool:
    return hasattr(core, "ManualAxisType") and hasattr(core.ShapedArray, "update_manual_axis_type")


_regime = vma.Regime(TypeField())
install = _regime.install
attach = _regime.attach
install_strict = _regime.install_strict
