"""Where the equations reprules makes say they come from: the user's code.

JAX records with every equation the Python stack it was made on
(``source_info``); the innermost frame outside JAX is what XLA's op metadata,
JAX's error messages and reprules' reports (``reprules audit``,
:mod:`reprules.testing`) name as its source. Two things would make that frame
reprules' own:

* **reprules' wrappers.** The ``custom_vjp`` ``__call__`` and the kernel hooks
  sit between the user's call and JAX, and every equation a bwd makes is
  attributed to the stack of the ``custom_vjp`` call. While reprules is active
  the shim's directory is excluded from the user's frames
  (:func:`exclude_shim_frames`), as JAX excludes its own, so the innermost
  frame outside both is the user's call, as with JAX alone.
* **What reprules adds to a bwd.** The psum of a ``custom_vjp`` bwd's cotangent
  (and the cast of a replicated one, whose transpose is a psum) is made by
  reprules after the user's bwd returned. :func:`added_in` gives such an
  equation the two frames the user wrote, the call of the ``custom_vjp``
  function and then the bwd's ``def`` line, so its source is the bwd (where
  library frames are skipped and the bwd is a library's, such as one of JAX's
  own ops, the user's call of it is next), and puts
  :data:`ADDED_SCOPE` in its name stack, which reports read to mark it as added
  by reprules.

JAX's ``Traceback`` cannot be built from frames, so the two frames are real:
functions whose code objects carry the user's file, line and name, called on
a fresh thread (whose stack has nothing else outside the standard library and
this module) to take the traceback; it is made once per (call site, bwd) and
cached.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from reprules._shim.plumbing._jax import source_info_util
from reprules._shim.plumbing._patches import Patches

ADDED_SCOPE = "reprules_added"
"""The name-stack scope of every equation :func:`added_in` makes (it shows in
jaxpr name stacks and in XLA's ``op_name`` metadata)."""

SHIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the whole shim, not this folder


class _Site(NamedTuple):
    file: str
    line: int
    name: str


def exclude_shim_frames(patches: Patches) -> None:
    """Makes JAX skip the shim's frames when it looks for the user's code, until
    ``patches`` are undone (JAX >= 0.4.28: ``register_exclusion`` clears its caches)."""
    paths: list[str] = source_info_util._exclude_paths
    if SHIM_DIR in paths:
        return
    source_info_util.register_exclusion(SHIM_DIR)

    def undo() -> None:
        if SHIM_DIR in paths:
            paths.remove(SHIM_DIR)
        for cached in (source_info_util._exclude_path_regex, source_info_util.is_user_filename,
                       source_info_util.user_frame):
            clear = getattr(cached, "cache_clear", None)
            if clear is not None:
                clear()

    patches.on_undo(undo)


def is_user_file(filename: str) -> bool:
    """Whether JAX would take a frame of ``filename`` for the user's code (the shim's never)."""
    return source_info_util.is_user_filename(filename) and not filename.startswith(SHIM_DIR)


@contextlib.contextmanager
def added_in(bwd: Any) -> Iterator[None]:
    """Equations made inside are attributed to ``bwd`` (a custom_vjp bwd, or any
    function with code), called from where JAX's current stack says the user
    called, and are named :data:`ADDED_SCOPE`."""
    traceback = _traceback_for(_site_of(bwd), _call_site())
    with source_info_util.extend_name_stack(ADDED_SCOPE):
        if traceback is None:
            yield
            return
        with source_info_util.user_context(traceback):
            yield


def _site_of(fn: Any) -> _Site | None:
    """File, ``def`` line and qualified name of ``fn`` (unwrapped), or None."""
    try:
        fn = inspect.unwrap(fn)
    except ValueError:  # a __wrapped__ cycle
        pass
    fn = getattr(fn, "func", fn)  # functools.partial
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    name = getattr(code, "co_qualname", None) or getattr(fn, "__qualname__", None) or code.co_name
    return _Site(code.co_filename, code.co_firstlineno, str(name))


def _call_site() -> _Site | None:
    """The innermost user frame of JAX's current source info: where the user
    called the ``custom_vjp`` function whose bwd runs (JAX runs a bwd under the
    stack of that call), or the live stack's."""
    traceback = source_info_util.current().traceback
    for frame in getattr(traceback, "frames", None) or ():
        if is_user_file(frame.file_name):
            return _Site(frame.file_name, int(frame.line_num), str(frame.function_name))
    return None


_cache: dict[tuple[_Site | None, _Site | None], Any] = {}
_cache_lock = threading.Lock()
_CACHE_SIZE = 256


def _traceback_for(bwd: _Site | None, call: _Site | None) -> Any:
    """A JAX traceback whose frames are ``bwd`` (innermost), then ``call``; None
    without a ``bwd`` or where this JAX takes no tracebacks."""
    if bwd is None:
        return None
    key = (bwd, call)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    sites = [bwd] if call is None or call == bwd else [bwd, call]
    found = _capture(sites)
    with _cache_lock:
        if len(_cache) >= _CACHE_SIZE:
            _cache.clear()
        _cache[key] = found
    return found


_TEMPLATE = eval(compile("lambda: _next()", "<reprules>", "eval"), {"_next": None}).__code__  # noqa: S307 - a constant


def _at(site: _Site, next_call: Callable[[], Any]) -> Callable[[], Any]:
    """A function that calls ``next_call`` from a frame at ``site`` (file, line, name)."""
    short = site.name.rsplit(".", 1)[-1]
    changes: dict[str, Any] = {"co_filename": site.file, "co_firstlineno": max(site.line, 1), "co_name": short}
    if hasattr(_TEMPLATE, "co_qualname"):  # Python 3.11+
        changes["co_qualname"] = site.name
    return types.FunctionType(_TEMPLATE.replace(**changes), {"_next": next_call}, short)


def _capture(sites: list[_Site]) -> Any:
    """JAX's traceback taken from frames at ``sites`` (innermost first), on a fresh thread."""
    fn: Callable[[], Any] = source_info_util.Traceback.get_traceback  # a builtin: no frame of its own
    for site in sites:
        fn = _at(site, fn)
    taken: list[Any] = []

    def run() -> None:
        try:
            taken.append(fn())
        except Exception:  # noqa: BLE001 - no traceback: the equation keeps JAX's own source
            pass

    thread = threading.Thread(target=run, name="reprules-source-info", daemon=True)
    thread.start()
    thread.join()
    return taken[0] if taken else None
