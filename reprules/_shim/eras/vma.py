"""The *vma* era: JAX 0.6.x - 0.9.x (``jax.shard_map(..., check_vma=True)``).

Each value's type carries the set of manual mesh axes it varies over
(``ShapedArray.vma``), and a primitive's abstract eval *is* its rule. This
module chooses the adapters and installs them, given how this era's types hold
varying axes (``_types.TypeField``):

* ``pallas_call``: types the outputs of a call by its kernel's rule at the bind,
  fixes the interpret-mode lowering (and, on 0.7 - 0.8, the kernel's JVP);
* ``core_map``: the same for ``pl.kernel`` and ``pl.core_map``;
* ``primitives``: user primitives, ``ffi_call``, ``triton_call`` and JAX's
  callbacks (a rule on the host function), typed by their abstract eval;
* ``custom_vjp``: psums a ``custom_vjp`` cotangent over the axes it varies over
  and its primal does not (JAX <= 0.5 did this itself; from 0.6.2 JAX refuses it);
* ``opaque_types``: a rule-less opaque call (user primitive, ``ffi_call``,
  ``pure_callback``, ``triton_call``) that JAX types with fewer varying axes
  than its inputs have is typed by their union, inputs cast up;
* ``control_flow``: a ``cond``/``switch``/``while_loop`` whose predicate varies
  over axes its outputs are not typed with gets its operands cast up (jax#40823);
* ``pcast``: ``pcast(..., to='varying')`` of an output reprules widened
  (the annotation union) over the axes it added is the identity;
* ``strict``: strict mode's check after each staged primitive.

The *mat* era (0.10+) is the same with another type field (``mat.py``).
"""

from __future__ import annotations

from reprules._shim.plumbing import _jax
from reprules._shim.rules import _resolve, callbacks, pcast
from reprules._shim.safety import strict
from reprules._shim.cotangents import custom_vjp
from reprules._shim.sound_types import control_flow, opaque_types, out_specs_note
from reprules._shim.entry_points import core_map, primitives
from reprules._shim.plumbing._patches import Patches
from reprules._shim.plumbing._types import TypeField
from reprules._shim.entry_points.pallas_call import TypedPallasCall

NAME = "vma"
VERSIONS = "0.6.x - 0.9.x"
MECHANISM = "check_vma: ShapedArray.vma on out_shape, pvary casts, interpret lowering fix"
CHECK_FLAG = "check_vma"


def detect() -> bool:
    shaped = _jax.core.ShapedArray
    return "vma" in getattr(shaped, "__slots__", ()) or hasattr(shaped, "vma")


class Regime:
    """What an era with varying axes in its types installs, given its type field."""

    def __init__(self, field: TypeField):
        self.field = field

    def install(self, patches: Patches) -> None:
        TypedPallasCall(self.field).install(patches)
        custom_vjp.install(patches, self.field)
        ffi = _resolve.ffi_opaque()
        if ffi is not None and not opaque_types.hooked(ffi.prim):
            self.attach(ffi, patches)
        for callback in sorted(callbacks.callbacks(), key=lambda p: p.name):  # a rule on the host function
            if not opaque_types.hooked(callback):  # (sound types hook them at their first checked bind)
                opaque_types.attach_callback(self.field, _resolve.callback_opaque(callback), patches,
                                             primitives.attach)
        core_map.install(patches, self.field)  # after pallas_call's: it wraps that conversion hook
        pcast.install(patches)

    def install_sound_types(self, patches: Patches) -> None:
        """Rule-less opaque calls and control flow on a varying predicate, typed soundly
        (installed at ``import reprules``, Pallas imported or not)."""
        opaque_types.install(self.field, patches, primitives.attach)
        control_flow.install(self.field, patches)
        out_specs_note.install(patches)

    def attach(self, op: _resolve.Opaque, patches: Patches) -> None:
        """Types the outputs of a user primitive, ``ffi_call`` or ``triton_call`` by its rule."""
        primitives.attach(self.field, op, patches)

    def install_strict(self, patches: Patches) -> None:
        strict.install(self.field, patches)


_regime = Regime(TypeField())
install = _regime.install
attach = _regime.attach
install_strict = _regime.install_strict
install_sound_types = _regime.install_sound_types
