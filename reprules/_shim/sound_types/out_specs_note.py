"""Why an output varies, added to JAX's out_specs error where reprules typed it.

Where reprules types a value varying that JAX alone types replicated (a
rule-less opaque call, control flow on a varying predicate), JAX may then
refuse ``out_specs`` that ask for it replicated, and its message ends by
suggesting ``check_vma=False``, which would return one device's value. Each
such typing is recorded with the code objects of the frames that made it; when
JAX builds that message for a function, the typings made inside that function
are named, with the line, the axes and the fix.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

from reprules import _errors
from reprules._shim.plumbing import _frames, _jax
from reprules._shim.plumbing._patches import Patches


class Typing(NamedTuple):
    what: str  # "lax.cond / lax.switch at file:line (...)" as messages say it
    axes: frozenset[str]
    codes: frozenset[Any]  # the user's code objects running when it was made


_recent: collections.deque[Typing] = collections.deque(maxlen=64)
_lock = threading.Lock()


def record(what: str, axes: frozenset[str]) -> None:
    """Remembers that reprules typed a value varying over ``axes`` at the user's line."""
    codes = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:  # the user's frames only: JAX's own (Primitive.bind) run for every call
        if not _frames.is_plumbing(frame):
            codes.add(frame.f_code)
        frame = frame.f_back
    with _lock:
        _recent.append(Typing(f"{what} at {_frames.annotation_site(depth=1) or 'an unknown line'}", axes,
                              frozenset(codes)))


def install(patches: Patches) -> None:
    """Appends the note to JAX's out_specs replication error (0.6+)."""
    shard_map_module = _jax.module("jax._src.shard_map")
    original = getattr(shard_map_module, "_inout_vma_error", None)
    if original is None:
        return
    patches.setattr(shard_map_module, "_inout_vma_error", _with_note(original))


def _with_note(original: Callable[..., str]) -> Callable[..., str]:
    def inout_vma_error(f: Any, *args: Any, **kwargs: Any) -> str:
        message = original(f, *args, **kwargs)
        code = getattr(getattr(f, "func", f), "__code__", None)
        with _lock:
            found = list({t.what: t for t in _recent if code is not None and code in t.codes}.values())
        if not found:
            return message
        return message + "\n\n" + _errors.out_specs_note([t.what for t in found],
                                                          sorted(frozenset().union(*(t.axes for t in found))),
                                                          _jax.JAX_VERSION)

    return inout_vma_error
