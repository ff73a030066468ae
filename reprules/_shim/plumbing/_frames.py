"""Frames: which JAX function reached a hook, and whether a call is still running.

State a hook leaves for a later hook of the same JAX call is keyed by that
call's frame (see :func:`running`). Pure Python: no JAX, no reprules.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any


def caller_module() -> str | None:
    """The module of the innermost frame outside reprules (who called the hook)."""
    frame: FrameType | None = sys._getframe(2)  # the hook's caller (the hook is reprules')
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if not (isinstance(name, str) and name.startswith("reprules.")):
            return name
        frame = frame.f_back
    return None


def jax_frame() -> FrameType | None:
    """The innermost running frame of JAX's own code outside generator
    expressions: the JAX function whose call reached a hook (``pallas_call``'s
    ``wrapped`` converts its out_shape leaves in a generator expression, and
    binds ``pallas_call_p`` itself). Frames of reprules and of anything else
    between JAX and the hook (a profiler that wrapped ``pallas_call_p.bind``
    after reprules) are skipped: both hooks of one call must find the same frame."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if (isinstance(name, str) and (name == "jax" or name.startswith("jax."))
                and frame.f_code.co_name != "<genexpr>"):
            return frame
        frame = frame.f_back
    return None


def running(frames: Sequence[FrameType | None]) -> list[bool]:
    """Whether each frame is still running on this thread's stack.

    State a hook leaves for a later hook of the same JAX call (the out_shape
    conversion for the bind, a ``new_ref`` for the ``core_map``) is kept with
    that call's frame, held strongly (so no later frame can take its address):
    a call that raised between the two hooks leaves it behind, and it is
    dropped as soon as its frame is seen finished."""
    live: set[int] = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        live.add(id(frame))
        frame = frame.f_back
    return [f is not None and id(f) in live for f in frames]


def outside_reprules(depth: int = 2) -> FrameType | None:
    """The innermost frame outside reprules, starting ``depth`` frames up."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("reprules."):
        frame = frame.f_back
    return frame


def frame_locals(frame: FrameType) -> dict[str, Any]:
    # A running function frame's f_locals is a snapshot that includes its free
    # variables (the closure's `body`, `out_shape`, `meshes_and_fns`).
    return dict(frame.f_locals)


# Modules whose frames are plumbing between the user's call and a kernel's bind.
_SKIP = ("jax.", "jaxlib.", "jax_triton.", "reprules.", "contextlib", "functools")


def is_plumbing(frame: FrameType) -> bool:
    """Whether ``frame`` runs JAX's, reprules' or their plumbing's code (not the user's)."""
    module = str(frame.f_globals.get("__name__", ""))
    return module.startswith(_SKIP) or module == "jax"


def user_frame() -> FrameType | None:
    """The innermost frame outside JAX, reprules and their plumbing."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and is_plumbing(frame):
        frame = frame.f_back
    return frame


def annotation_site(depth: int = 5) -> str:
    """Where the kernel was called from, outside JAX and reprules: the innermost
    frames, where its out_shape (and so the annotation) was built or passed."""
    frame: FrameType | None = sys._getframe(1)
    found: list[str] = []
    while frame is not None and len(found) < depth:
        module = str(frame.f_globals.get("__name__", ""))
        if not module.startswith(_SKIP) and module != "jax":
            found.append(f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return " <- ".join(found)
