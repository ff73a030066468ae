"""Why an output varies, added to JAX's out_specs error where reprules typed it.

Where reprules types a value varying that JAX alone types replicated (a
rule-less opaque call, control flow on a varying predicate), JAX may then
refuse ``out_specs`` that ask for it replicated, and its message ends by
suggesting ``check_vma=False``, which would return one device's value. Each
such typing is recorded with the code objects of the frames that made it; when
JAX builds that message for a function, the typings made inside that function
are named, with the line, the axes and the fix.

JAX builds that message (``_inout_vma_error``) on more paths than the one it
was written for, and two of them need the user's side put back first:

* JAX 0.10+ runs an eager ``shard_map`` (called outside ``jit``, and under an
  eager ``grad`` or ``vmap``) to the end, then checks each output against its
  out_spec through a second ``shard_map`` of its own ``_rem_singleton``: the
  message names that function and the typings made in the user's are not
  found. The user's function is read from the innermost running call of a
  ``shard_map`` of a function not JAX's own (0.8's transpose passes its
  ``fun_trans`` the same way).
* Under ``grad``, a ``shard_map`` whose forward pass keeps residuals checks
  them with its outputs, and JAX then fails inside its own builder: on 0.6 -
  0.9 the checks are (residuals, outputs) against the user's tree ("Too many
  leaves for PyTreeDef"); on 0.10+ the tree packs the outputs with the
  residuals too ("Too few leaves", or a prefix error for out_specs that are a
  dict), in an order that moved between 0.10 (residuals, outputs) and 0.12
  (outputs, residuals, residuals). So the user's outputs are searched for,
  not assumed: the part of the checks that holds every refused output (a
  residual never is) and that the out_specs fit; failing that, the refusal is
  written in short, naming the function and the mesh.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any, NamedTuple

from reprules._messages import out_types
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
    """Appends the note to JAX's out_specs replication error (0.6+), on every path that builds it."""
    shard_map_module = _jax.module("jax._src.shard_map")
    original = getattr(shard_map_module, "_inout_vma_error", None)
    if original is None:
        return
    # The body of `jax.shard_map(f, ...)`, whose frame holds the user's `f`, and the marker of an
    # output JAX accepts in the list it checks (`no_fail = NoFail()`): both 0.6 - 0.12.
    calls = _nested_code(getattr(shard_map_module, "_shard_map", None), "wrapped")
    no_fail = getattr(shard_map_module, "no_fail", None)
    patches.setattr(shard_map_module, "_inout_vma_error", _with_note(original, calls, no_fail))


def _with_note(original: Callable[..., str], calls: CodeType | None, no_fail: Any) -> Callable[..., str]:
    def inout_vma_error(f: Any, mesh: Any, tree: Any, specs: Any, fails: Any, *args: Any, **kwargs: Any) -> str:
        f = _users_function(f, calls)
        fails = list(fails)
        refused = [x is not no_fail for x in fails]

        def build(outputs: Any, start: int, end: int) -> str:
            return original(f, mesh, outputs, specs, fails[start:end], *args, **kwargs)

        message = _jax_message(build, tree, refused)
        if message is None:
            message = _bare_message(f, mesh, specs, [x for x, r in zip(fails, refused) if r])
        code = _code(f)
        with _lock:
            found = list({t.what: t for t in _recent if code is not None and code in t.codes}.values())
        if not found:
            return message
        return message + "\n\n" + out_types.out_specs_note([t.what for t in found],
                                                            sorted(frozenset().union(*(t.axes for t in found))),
                                                            _jax.JAX_VERSION, tuple(getattr(mesh, "axis_names", ())))

    return inout_vma_error


def _jax_message(build: Callable[[Any, int, int], str], tree: Any, refused: list[bool]) -> str | None:
    """JAX's own message for the user's outputs (``build(tree, start, end)`` for those of the checked
    outputs ``[start:end]``), where the checks or ``tree`` also hold residuals (under ``grad``); None
    where no part of ``tree`` fits the out_specs and holds every refused output."""
    try:
        return build(tree, 0, len(refused))
    except (ValueError, TypeError, AssertionError):  # "Too few / many leaves", or out_specs that do not fit
        if not hasattr(tree, "num_leaves"):
            raise
    leaves = tree.num_leaves
    if leaves < len(refused):  # 0.6 - 0.9: the user's tree, the residuals' checks before its outputs'
        candidates: Iterator[tuple[Any, int]] = iter([(tree, len(refused) - leaves), (tree, 0)])
    else:  # 0.10+: a tree that packs the outputs with the residuals (0.10: and with leafless aux)
        candidates = (node for node in _subtrees(tree) if node[0] is not tree)
    for subtree, start in candidates:
        end = start + subtree.num_leaves
        if end > len(refused) or any(refused[:start] + refused[end:]):
            continue
        try:
            return build(subtree, start, end)
        except (ValueError, TypeError, AssertionError):  # the out_specs do not fit this subtree: not the outputs
            continue
    return None


def _subtrees(tree: Any) -> Iterator[tuple[Any, int]]:
    """Every node of ``tree`` with the index of its first leaf, outermost first."""
    level = [(tree, 0)]
    while level:
        yield from level
        deeper = []
        for node, start in level:
            for child in node.children() if node.num_nodes > 1 else ():
                deeper.append((child, start))
                start += child.num_leaves
        level = deeper


def _bare_message(f: Any, mesh: Any, specs: Any, refused: list[Any]) -> str:
    """JAX's message in short, where its tree of outputs cannot be made out. ``refused``: the
    varying axes of each refused output (a set to 0.9, a ``ManualAxisType`` from 0.10)."""
    varying = ",".join(sorted({str(a) for x in refused for a in getattr(x, "varying", x)}))
    return (f"shard_map applied to the function {getattr(f, '__name__', str(f))!r} was given out_specs {specs} "
            "which require replication which can't be statically inferred given the mesh:\n\n"
            f"The mesh given has shape {tuple(mesh.shape.values())} with corresponding axis names "
            f"{tuple(mesh.axis_names)}.\n\nSome outputs were inferred to be possibly varying over {{{varying}}}, "
            "which these out_specs leave out.")


def _users_function(f: Any, calls: CodeType | None) -> Any:
    """``f``, or where it is JAX's own (0.10+ eager: ``_rem_singleton``; 0.8 transpose: ``fun_trans``),
    the function of the innermost running ``shard_map`` call whose function is not."""
    if not _is_jax(f) or calls is None:
        return f
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is calls:
            found = _frames.frame_locals(frame).get("f")
            if found is not None and not _is_jax(found):
                return found
        frame = frame.f_back
    return f


def _is_jax(f: Any) -> bool:
    module = str(getattr(f, "__module__", None) or getattr(type(f), "__module__", ""))
    return module == "jax" or module.startswith("jax.")


def _code(f: Any) -> CodeType | None:
    """The code of ``f``, through ``functools.partial`` and wrappers (``jax.jit``)."""
    for _ in range(8):
        code = getattr(f, "__code__", None)
        if isinstance(code, CodeType):
            return code
        f = getattr(f, "func", None) or getattr(f, "__wrapped__", None)
    return None


def _nested_code(function: Any, name: str) -> CodeType | None:
    """The code object of the function ``name`` defined directly inside ``function``
    (under its decorators: 0.12 wraps ``_shard_map`` in ``traceback_util.api_boundary``)."""
    for _ in range(8):
        if getattr(function, "__wrapped__", None) is None:
            break
        function = function.__wrapped__
    for const in getattr(getattr(function, "__code__", None), "co_consts", ()):
        if isinstance(const, CodeType) and const.co_name == name:
            return const
    return None
