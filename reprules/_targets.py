"""The static types of what a rule is registered on, and of the decorator that registers it.

``replication_rule(...)`` returns a :class:`RuleDecorator`: applied to a kernel
it returns that very object, typed as given, so ``@replication_rule()`` keeps
a kernel function's signature and ``replication_rule()(ffi_target("op"))`` is
still an ``FfiTarget``. Nothing here imports JAX or Triton at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, Union

from reprules._registry import FfiTarget, KernelName, KernelPackage

if TYPE_CHECKING:
    from jax.extend.core import Primitive


class TritonKernel(Protocol):
    """A jax-triton kernel: the ``triton.JITFunction`` that ``@triton.jit`` makes.

    Described by its shape (the wrapped function, and ``kernel[grid]``), so that
    reprules needs no Triton to be typed.
    """

    fn: Callable[..., Any]

    def __getitem__(self, grid: Any, /) -> Any: ...


KernelLike = Union[Callable[..., Any], FfiTarget, KernelName, KernelPackage, "Primitive", TritonKernel]
"""What a rule can be registered on: a Pallas kernel function, ``reprules.ffi_target(name)``,
``reprules.kernel_named("module:qualname")``, ``reprules.kernels_in("pkg")`` (with
``rules.inferred()``), a ``jax.extend.core.Primitive``, a jax-triton kernel, or the host
function of a ``jax.pure_callback`` / ``io_callback``."""

K = TypeVar("K", bound=KernelLike)


class RuleDecorator(Protocol):
    """What ``replication_rule(...)`` returns: registers the rule on a kernel and returns the kernel."""

    def __call__(self, kernel: K, /) -> K: ...
