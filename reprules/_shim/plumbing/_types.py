"""The varying axes of a value, read and written per era.

* rep (0.4.28 - 0.5): no types; JAX's rules see the mesh, and
  :func:`rep_manual_axes` finds which of its axes are manual.
* vma (0.6 - 0.9): ``ShapedArray.vma``, a set, and ``ShapeDtypeStruct(vma=...)``.
* mat (0.10+): ``ShapedArray.mat``, a ``core.ManualAxisType`` whose ``varying``
  field is the old set, and ``ShapeDtypeStruct(manual_axis_type=...)``.

A :class:`TypeField` (vma) or :class:`MatField` (mat) is what the adapters
above are given; the rest of this module casts and reduces over manual axes in
a checked ``shard_map``.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import weakref
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any, NamedTuple

import jax

from reprules._shim.plumbing._jax import config, core, mesh_lib


class TypeField:
    """Reads and writes the varying-axes part of a type (0.6 - 0.9: ``vma``)."""

    sds_keyword = "vma"

    def varying(self, aval: Any) -> frozenset[str]:
        return frozenset(getattr(aval, "vma", frozenset()))

    def annotated(self, sds: Any) -> bool:
        # Only a ShapeDtypeStruct carries a user's annotation: an array given as
        # out_shape forwards .vma to its own type, which pallas_call ignores.
        return isinstance(sds, jax.ShapeDtypeStruct) and getattr(sds, "vma", None) is not None

    def sds_value(self, varying: frozenset[str]) -> Any:
        return frozenset(varying)

    def strip(self, aval: Any) -> Any:
        return aval.update(vma=frozenset()) if hasattr(aval, "vma") else aval

    def retype(self, aval: Any, varying: frozenset[str]) -> Any:
        return aval.update(vma=frozenset(varying), **_mesh_sharding(aval, varying))

    def sds(self, leaf: Any, varying: frozenset[str]) -> jax.ShapeDtypeStruct:
        """An out_shape leaf typed ``varying``. Any leaf with .shape and .dtype (a
        ShapeDtypeStruct, or an array as JAX's own ops pass) becomes a ShapeDtypeStruct."""
        is_sds = isinstance(leaf, jax.ShapeDtypeStruct)
        return jax.ShapeDtypeStruct(
            leaf.shape,
            leaf.dtype,
            sharding=leaf.sharding if is_sds else None,
            weak_type=leaf.weak_type if is_sds else False,
            **{self.sds_keyword: self.sds_value(varying)},
        )


def _mesh_sharding(aval: Any, varying: frozenset[str]) -> dict[str, Any]:
    """From 0.8, a type that varies needs a sharding on a (manual) mesh: an
    abstract eval that built ``ShapedArray(shape, dtype)`` has none."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if not varying or (mesh is not None and not getattr(mesh, "empty", False)):
        return {}
    get_cur_mesh_sharding = getattr(core, "get_cur_mesh_sharding", None)
    if get_cur_mesh_sharding is None:
        return {}
    with shard_map_mesh():  # the shard_map's mesh, not one that hides it
        return {"sharding": get_cur_mesh_sharding()}


def checking() -> bool:
    """Whether the innermost ``shard_map`` being traced has checking on."""
    return bool(config._check_vma.value)


# Where code around a call hid the shard_map's manual axes (see hidden_axes):
# those axes, and the shard_map's abstract mesh as the inputs' types carry it.
_hidden_call: contextvars.ContextVar[tuple[tuple[str, ...], Any] | None] = contextvars.ContextVar(
    "reprules_hidden_call", default=None)


def manual_axes() -> tuple[str, ...]:
    """The manual axes of the innermost ``shard_map`` being traced (vma and mat eras)."""
    hidden = _hidden_call.get()
    return hidden[0] if hidden is not None else tuple(mesh_lib.get_abstract_mesh().manual_axes)


def in_checked_shard_map() -> bool:
    """Whether a checked ``shard_map`` is being traced here: its abstract mesh
    names manual axes, or code inside it hid them (:func:`hidden_axes`)."""
    return checking() and bool(mesh_lib.get_abstract_mesh().manual_axes or core.get_axis_env().axis_sizes)


class HiddenAxes(NamedTuple):
    """The manual axes of a call whose abstract mesh does not name them."""

    known: tuple[str, ...]  # manual for sure: the abstract mesh's, and every axis an input varies over
    in_scope: tuple[str, ...]  # possibly manual: every named axis in scope (vmap's included)


def hidden_axes(in_vary: Sequence[frozenset[str]]) -> HiddenAxes | None:
    """Where code inside a checked ``shard_map`` replaced the abstract mesh
    (MaxText's kernels run under ``jax.sharding.use_abstract_mesh(AbstractMesh((), ()))``
    on CPU), the mesh no longer names the manual axes the values still vary
    over: a rule decided over it would type every output replicated. Returns
    what can still be known of them, or None where the mesh names every axis
    an input varies over (the rule then sees exactly the shard_map's axes)."""
    mesh = tuple(mesh_lib.get_abstract_mesh().manual_axes)
    seen = frozenset().union(*in_vary)
    if mesh and seen <= frozenset(mesh):
        return None
    in_scope = tuple(dict.fromkeys((*mesh, *core.get_axis_env().axis_sizes)))
    if not in_scope:  # no named axis at all: not inside a shard_map
        return None
    known = tuple(a for a in in_scope if a in seen or a in mesh) + tuple(sorted(seen - frozenset(in_scope)))
    return HiddenAxes(known, tuple(dict.fromkeys((*known, *in_scope))))


def mesh_hides(axes: tuple[str, ...]) -> bool:
    """Whether the current abstract mesh does not name ``axes`` (a call's manual
    axes, from :func:`hidden_axes`) as its manual axes: code around the call hid them."""
    return axes != tuple(mesh_lib.get_abstract_mesh().manual_axes)


@contextlib.contextmanager
def call_axes(axes: tuple[str, ...], in_avals: Sequence[Any]) -> Iterator[None]:
    """:func:`manual_axes` is ``axes`` inside, and a varying output is typed on
    the inputs' mesh: a call whose abstract mesh hides its manual axes
    (:func:`hidden_axes`). Elsewhere (``axes`` are the mesh's) nothing changes."""
    if not mesh_hides(axes):
        yield
        return
    meshes = (getattr(getattr(a, "sharding", None), "mesh", None) for a in in_avals)
    mesh = next((m for m in meshes if m is not None and not getattr(m, "empty", True)), None)
    token = _hidden_call.set((axes, mesh))
    try:
        yield
    finally:
        _hidden_call.reset(token)


def cast_up(x: Any, axes: frozenset[str]) -> Any:
    # core.pvary is what jax.lax.pvary (0.6 - 0.9) and pcast(to="varying") use.
    with shard_map_mesh():
        return core.pvary(x, tuple(a for a in manual_axes() if a in axes))


def cast_up_tuple(x: Any, axes: tuple[str, ...]) -> Any:
    return cast_up(x, frozenset(axes))


def cast_inputs(args: Sequence[Any], now: Sequence[frozenset[str]],
                 targets: Sequence[frozenset[str]] | None) -> list[Any]:
    """Casts each input up to its target set (None: inputs pass as they are)."""
    if targets is None:
        return list(args)
    return [cast_up(a, t - n) if t - n else a for a, n, t in zip(args, now, targets)]


def psum(x: Any, axes: frozenset[str]) -> Any:
    with shard_map_mesh():
        return jax.lax.psum(x, tuple(a for a in manual_axes() if a in axes))


@contextlib.contextmanager
def shard_map_mesh() -> Iterator[None]:
    """Inside :func:`call_axes` of a hidden mesh, the shard_map's: JAX types a
    collective's result on the current abstract mesh (0.8 - 0.9 ``pvary`` fails
    on one that names no manual axes)."""
    hidden = _hidden_call.get()
    if hidden is None or hidden[1] is None:
        yield
        return
    with mesh_lib.use_abstract_mesh(hidden[1]):
        yield


class MatField(TypeField):
    """The same, 0.10+: ``ShapedArray.mat`` (a ``core.ManualAxisType``)."""

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
        extra = _mesh_sharding(aval, varying)
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


def rep_manual_axes(mesh: Any) -> tuple[str, ...]:
    """The manual axes of the ``shard_map`` over ``mesh`` whose rules are running.

    JAX gives its rules only the mesh; the automatic axes (``auto=``) are a
    local of the shard_map function that runs them (staging, eager, type
    check), read here from the innermost such frame. The rep regime ends with
    0.5.x, so these names cannot change under us.
    """
    from jax.experimental import shard_map as sm  # the module exists on the rep era only

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is vars(sm):
            local = frame.f_locals
            if "auto" in local and (local.get("mesh") is mesh or local.get("mesh") == mesh):
                auto = frozenset(local["auto"] or ())
                return tuple(a for a in mesh.axis_names if a not in auto)
        frame = frame.f_back
    return tuple(mesh.axis_names)


# The traces in which sound types cast a value up (a cond's operands, a loop's carries): a
# custom_vjp called there may get inputs typed more varying than JAX alone would type them,
# so its bwd may return a cotangent JAX refuses though checking off sums it (cotangents.custom_vjp).
_widened: weakref.WeakSet[Any] = weakref.WeakSet()


def note_widened() -> None:
    """Sound types cast a value up in the trace being built."""
    try:
        _widened.add(core.trace_ctx.trace)
    except TypeError:  # (a trace that takes no weak reference)
        pass


def widened_here() -> bool:
    """Whether sound types cast a value up in the current trace or one around it."""
    trace = core.trace_ctx.trace
    for _ in range(64):  # (the chain of traces is short; a bound against a cycle)
        if trace is None:
            return False
        try:
            if trace in _widened:
                return True
        except TypeError:
            pass
        trace = getattr(trace, "parent_trace", None)
    return False
