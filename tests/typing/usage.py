"""Every registration form the README and the docs pages show, checked by ``mypy --strict`` as user code.

    python -m nox -s typecheck     # mypy --strict reprules tests/typing/usage.py

pytest does not collect this file (its name does not start with ``test_``). It
also runs, on CPU with 8 fake devices (``python tests/typing/usage.py``), so
that every form here is code that works, not only code that type-checks; the
Triton form, which needs a GPU, is only type-checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reprules import testing

testing.fake_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.core import ShapedArray  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.extend.core import Primitive  # noqa: E402
from jax.interpreters import mlir  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402
from reprules import rules  # noqa: E402

if TYPE_CHECKING:
    from typing_extensions import assert_type

# --- a kernel function: the decorator returns it, signature kept --------------------------


@reprules.replication_rule()  # outputs vary like the union of the inputs
def copy_kernel(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


@reprules.replication_rule(rules.same())
def scale_kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] * w_ref[...]


if TYPE_CHECKING:
    kept: Callable[[Any, Any], None] = copy_kernel  # still the function, as declared
    copy_kernel(x_ref=None, o_ref=None)  # parameter names kept too


def copy(x: jax.Array) -> jax.Array:
    out: jax.Array = pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    interpret=True)(x)
    return out


@jax.custom_vjp
def kernel_copy(x: jax.Array) -> jax.Array:  # JAX #21855: the copy kernel under custom_vjp
    return copy(x)


kernel_copy.defvjp(lambda x: (copy(x), None), lambda _, g: (copy(g),))


# --- someone else's kernels, registered from outside ----------------------------------------


def register_layer_norm() -> None:
    from jax.experimental.pallas.ops.gpu import layer_norm  # JAX 0.4.29+

    for k in (layer_norm.layer_norm_forward_kernel, layer_norm.layer_norm_backward_kernel_dx,
              layer_norm.layer_norm_backward_kernel_dw_db):
        reprules.replication_rule(rules.same(), override=True)(k)


# --- a jax.extend.core.Primitive, an FFI target, a Triton kernel: each returned as given -----


my_primitive = Primitive("usage_scale")
my_primitive.def_impl(lambda x: x * 2.0)
my_primitive.def_abstract_eval(lambda a: ShapedArray(a.shape, a.dtype))
mlir.register_lowering(my_primitive, mlir.lower_fun(lambda x: x * 2.0, multiple_results=False))


def register_primitive_and_ffi_target() -> reprules.FfiTarget:
    primitive = reprules.replication_rule(rules.same())(my_primitive)
    target = reprules.replication_rule(rules.same())(reprules.ffi_target("usage_op"))
    if TYPE_CHECKING:
        assert_type(primitive, Primitive)
        assert_type(target, reprules.FfiTarget)
    return target


def register_by_name_and_inference() -> reprules.KernelName:
    """A nested kernel by its qualified name; every other kernel by inference."""
    named = reprules.replication_rule(rules.same())(reprules.kernel_named("pkg.ops:gmm.<locals>.kernel"))
    if TYPE_CHECKING:
        assert_type(named, reprules.KernelName)
    with reprules.inference():
        pass
    return named


def register_a_package_by_inference() -> reprules.KernelPackage:
    """Every kernel defined in a package: rules derived from their bodies."""
    package = reprules.replication_rule(rules.inferred())(reprules.kernels_in("tokamax"))
    if TYPE_CHECKING:
        assert_type(package, reprules.KernelPackage)
    return package


def register_triton_kernel(my_triton_kernel: reprules.TritonKernel) -> reprules.TritonKernel:
    """``jax_triton.triton_call(..., kernel=my_triton_kernel)``: a ``triton.JITFunction``."""
    return reprules.replication_rule()(my_triton_kernel)


# --- the rule vocabulary, and custom rules ---------------------------------------------------


def outputs_like_union(ctx: rules.RuleContext, in_varying: tuple[reprules.VaryingSet, ...]) -> rules.Decision:
    """Returns a Decision; ``inputs=None`` passes the inputs as they are."""
    union = frozenset().union(*in_varying)
    return rules.Decision(outputs=(union,) * ctx.num_outputs, inputs=None)


def outputs_like_first(ctx: rules.RuleContext, in_varying: tuple[reprules.VaryingSet, ...]) -> list[set[str]]:
    """Returns one set per output."""
    return [set(in_varying[0]) | set(in_varying[-1])] * ctx.num_outputs


class DeviceSeeded:
    """A rule as a class: outputs vary over ``model`` too (say, a per-device seed)."""

    def __call__(self, ctx: rules.RuleContext, in_varying: tuple[reprules.VaryingSet, ...], /) -> reprules.RuleResult:
        return [frozenset().union(*in_varying) | {"model"}] * ctx.num_outputs


RULES: list[reprules.RuleLike] = [
    rules.same(), rules.like(0), rules.varying("model"), rules.invariant("model"),
    outputs_like_union, outputs_like_first, DeviceSeeded(),
    lambda ctx, in_varying: [frozenset()] * ctx.num_outputs,
]
as_protocol: rules.Rule = rules.invariant("model")


def registry_calls() -> None:
    for rule in RULES:
        reprules.replication_rule(rule, override=True)(copy_kernel)
    reprules.replication_rule(rules.same(), override=True)(copy_kernel)
    listing: dict[str, reprules.Registration] = reprules.registered()
    for where, reg in listing.items():
        print(f"{where}: {reg.rule!r} from {reg.source}; alive: {reg.kernel() is not None}")
    statuses: list[reprules.PackStatus] = reprules.packs()
    support: dict[str, str] = reprules.jax_support()
    print(len(statuses), "packs;", support["regime"], "regime")
    try:
        reprules.replication_rule(rules.varying("model"))(copy_kernel)  # a different rule, no override
    except reprules.RegistrationError as err:
        print("refused:", str(err).splitlines()[0])
    removed: bool = reprules.unregister(scale_kernel)
    assert removed


# --- inside shard_map, verify and strict modes, reprules.testing ------------------------------


def step_and_checks() -> None:
    mesh = jax.sharding.Mesh(jax.devices()[:8], ("data",))
    x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
    w = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    f = testing.shard_map(kernel_copy, mesh, P("data", None), P("data", None))  # checking on
    grad = jax.grad(lambda x: (f(x) * w).sum())
    with reprules.verify():  # declared replication checked at run time
        jax.block_until_ready(jax.jit(grad)(x))
    with reprules.strict():  # rule-less opaque primitives refused while tracing
        jax.make_jaxpr(grad)(x)
    report: testing.Report = testing.collectives(grad, x)
    assert report.count("all-reduce") == 0 and not report.defensive
    testing.assert_no_all_reduce(grad, x)
    testing.assert_collectives(grad, x, expect={"all-reduce": 0, ("all-gather", "data"): {"count": 0}})
    print(report.table())


def main() -> None:
    register_layer_norm()
    target = register_primitive_and_ffi_target()
    reprules.unregister(register_by_name_and_inference())
    registry_calls()
    step_and_checks()
    reprules.unregister(target)
    reprules.unregister(my_primitive)
    print("OK")


if __name__ == "__main__":
    main()
