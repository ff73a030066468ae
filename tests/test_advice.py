"""Every fix a reprules error prints is safe to follow, exactly as printed.

For each reason an error can give, a small kernel provokes it; the test reads the
registration lines (or decorator) from the message, with the imports the message
shows and nothing else, applies them, and runs the program under
``reprules.verify()``. A single rule is an answer: the program must then run and
equal checking off and the unsharded reference (or be refused by JAX where its
out_specs drop an axis the outputs vary over, which checking off gets silently
wrong). Several rules are candidates: each must be correct, or be caught
(``ReplicationMismatchError``, or JAX's out_specs refusal), and one of them must
be correct. Nothing here hard-codes the fix: only which rules are sound.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, NEW_SHARD_MAP, make_mesh, max_err, put, randn, shard_map

# --- reading a message -------------------------------------------------------------------------


def fix_of(message: str) -> str:
    """The Fix paragraph of an error message (up to JAX's own error, if quoted)."""
    assert "\nFix: " in message, message
    return message.split("\nFix: ", 1)[1].split("\nJAX's own error:", 1)[0]


def snippets(message: str) -> tuple[list[str], list[str], list[str]]:
    """(import lines, registration lines, decorator lines) of a message's Fix, comments cut."""
    lines = [line.split("  #", 1)[0].strip() for line in fix_of(message).splitlines()]
    imports = [line for line in lines if line.startswith(("import ", "from "))]
    regs = [line for line in lines if line.startswith("reprules.replication_rule(")]
    decorators = [line for line in lines if line.startswith("@reprules.replication_rule(")]
    return imports, regs, decorators


def apply(message: str, line: str, **objects) -> None:
    """Runs one printed line with the message's imports, ``objects`` bound to the names it uses."""
    imports, _, _ = snippets(message)
    exec("\n".join([*imports, line]), dict(objects))  # noqa: S102 - the message's own snippet


def apply_decorator(message: str, kernel) -> None:
    """Applies the printed decorator to ``kernel``, checking it is shown above ``def <kernel>``."""
    imports, _, (decorator, *_) = snippets(message)
    assert f"{decorator}" in message and f"def {kernel.__name__}(...)" in fix_of(message)
    namespace: dict = {}
    exec("\n".join(imports), namespace)  # noqa: S102
    eval(decorator[1:], namespace)(kernel)  # noqa: S307


def rules_of(message: str) -> list[str]:
    """The rule each printed registration line registers."""
    return [re.match(r"reprules\.replication_rule\((.*)\)\(", line).group(1) for line in snippets(message)[1]]


# --- running a program --------------------------------------------------------------------------


def outcome(f, *args):
    """What the checked program gives under reprules.verify(): its output, "caught" (verify
    found an output differing across an axis its rule calls replicated) or "refused"
    (JAX refused out_specs that drop an axis the outputs vary over)."""
    try:
        with reprules.verify():
            return np.asarray(jax.block_until_ready(jax.jit(f)(*args)))
    except reprules.ReplicationMismatchError:
        return "caught"
    except ValueError as err:
        if isinstance(err, reprules.ReprulesError) or "out_specs" not in str(err):
            raise
        return "refused"


def refusal(f, *args, infer=True, error=reprules.MissingRuleError) -> str:
    with reprules.inference(infer), pytest.raises(error) as info:
        jax.jit(f)(*args)
    return str(info.value)


def check_follows(message, kernel, cases, *args, target=None):
    """Applies each printed rule to ``kernel`` (registered under ``target``'s name, the kernel's
    by default) and runs ``cases``: (checked program, program with checking off, reference).

    One rule printed: every case is correct or refused by JAX (never caught: the rule is
    sound). Candidates: each case of each is correct, caught or refused; the first (always
    sound) is never caught. Some rule runs a case, and is caught in none."""
    name = target or kernel.__name__
    rules = rules_of(message)
    assert rules, message
    if len(rules) > 1:
        assert "reprules.verify()" in message, message  # candidates come with the check
    correct = []
    for k, line in enumerate(snippets(message)[1]):
        assert line.endswith(f")({name})"), (line, message)
        apply(message, line, **{name: kernel})
        ran = caught = 0
        for checked, off, reference in cases:
            got = outcome(checked, *args)
            if isinstance(got, str):
                assert got == "refused" or (k > 0 and got == "caught"), (rules[k], got, message)
                caught += got == "caught"
                continue
            ran += 1
            expected = np.asarray(jax.jit(off)(*args))
            assert max_err(got, expected) < 1e-5, (rules[k], message)  # as checking off
            if reference is not None:
                assert max_err(got, reference) < 1e-5, (rules[k], message)  # as unsharded
        correct.append(ran and not caught)
        reprules.unregister(kernel)
    assert any(correct), (rules, message)
    return rules


def programs(call, mesh, in_specs, out_specs):
    """The checked program and the same with checking off."""
    return shard_map(call, mesh, in_specs, out_specs), shard_map(call, mesh, in_specs, out_specs, check=False)


# --- kernels (module level: a rule is registered on the function object) ------------------------


def index_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + jax.lax.axis_index("model").astype(jnp.float32)


def psum_kernel(x_ref, o_ref):
    o_ref[...] = jax.lax.psum(x_ref[...], "model")


def mixed_kernel(x_ref, o_ref):
    o_ref[...] = jax.lax.psum(x_ref[...], "data") + jax.lax.axis_index("model").astype(jnp.float32)


def callback_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = jax.pure_callback(lambda v: np.asarray(v) * 2.0, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def mul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def pallas(kernel):
    def call(*args):
        x = args[0]
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(*args)

    return call


@pytest.fixture
def data():
    mesh = make_mesh()
    x = randn(0, (8, 16))
    return mesh, put(x, mesh, P("data", None)), np.asarray(x)


INFER = pytest.mark.parametrize("infer", [True, False], ids=["inference", "inference-off"])


# --- MissingRuleError: pallas_call ---------------------------------------------------------------


@INFER
def test_identity_read_over_an_axis_gets_rules_varying_of_it(data, infer):
    """The issue's case: the advice used to lead with rules.same(), which out_specs=P('data')
    accepted, silently dropping the model=1 values."""
    mesh, x, xs = data
    call = pallas(index_kernel)
    narrow_on, narrow_off = programs(call, mesh, P("data", None), P("data", None))
    full_on, full_off = programs(call, mesh, P("data", None), P("data", "model"))
    message = refusal(narrow_on, x, infer=infer)
    assert "'index_kernel'" in message and "'data', 'model'" in message and f"JAX {jax.__version__}" in message
    rules = check_follows(message, index_kernel, [(narrow_on, narrow_off, None),
                                                  (full_on, full_off, np.concatenate([xs, xs + 1], 1))], x)
    assert len(rules) == 1, message  # an answer, not candidates
    apply_decorator(message, index_kernel)  # the decorator form says the same
    assert outcome(narrow_on, x) == "refused"  # where checking off returns model=0's values only
    assert max_err(outcome(full_on, x), np.concatenate([xs, xs + 1], 1)) < 1e-6


@INFER
def test_communication_gets_candidates_and_verify(data, infer):
    mesh, x, xs = data
    call = pallas(psum_kernel)
    narrow_on, narrow_off = programs(call, mesh, P("data", None), P("data", None))
    full_on, full_off = programs(call, mesh, P("data", None), P("data", "model"))
    message = refusal(narrow_on, x, infer=infer)
    assert "`psum" in message and "'psum_kernel'" in message
    rules = check_follows(message, psum_kernel, [(narrow_on, narrow_off, 2 * xs),
                                                 (full_on, full_off, np.concatenate([2 * xs] * 2, 1))], x)
    assert len(rules) > 1, message


@INFER
def test_identity_and_communication_together_get_the_sound_rule_for_both(data, infer):
    """The first refusal alone (axis_index over model) would suggest rules.varying('model'),
    which types the psum over data as replicated over data."""
    mesh, x, xs = data
    call = pallas(mixed_kernel)
    s = xs.reshape(4, 2, 16).sum(0)
    full_on, full_off = programs(call, mesh, P("data", None), P("data", "model"))
    rep_on, rep_off = programs(call, mesh, P("data", None), P(None, "model"))
    message = refusal(full_on, x, infer=infer)
    check_follows(message, mixed_kernel, [(full_on, full_off, np.tile(np.concatenate([s, s + 1], 1), (4, 1))),
                                          (rep_on, rep_off, np.concatenate([s, s + 1], 1))], x)


@INFER
def test_a_host_callback_gets_candidates(data, infer):
    mesh, x, xs = data
    call = pallas(callback_kernel)
    on, off = programs(call, mesh, P("data", None), P("data", None))
    try:
        jax.block_until_ready(jax.jit(off)(x))
    except Exception as err:  # noqa: BLE001 - JAX's own interpreter, checking off
        pytest.skip(f"JAX {jax.__version__} cannot run a pure_callback inside an interpreted kernel: {err!r:.200}")
    message = refusal(on, x, infer=infer)
    assert "`pure_callback`" in message
    check_follows(message, callback_kernel, [(on, off, 2 * xs)], x)


def test_a_local_body_with_inference_off_gets_the_default_rule(data):
    mesh, x, xs = data
    on, off = programs(pallas(copy_kernel), mesh, P("data", None), P("data", None))
    message = refusal(on, x, infer=False)
    assert "inference is off here" in message
    assert rules_of(message) == ["rules.same()"]
    check_follows(message, copy_kernel, [(on, off, xs)], x)
    apply_decorator(message, copy_kernel)
    assert max_err(outcome(on, x), xs) == 0.0


# --- MissingRuleError: pl.kernel ----------------------------------------------------------------

HAS_KERNEL = hasattr(pl, "kernel") and JAX_VERSION >= (0, 8)  # interpreted inside shard_map from 0.8


def index_body(x_ref, o_ref):
    from jax.experimental.pallas import tpu as pltpu

    def scoped(buf):
        pltpu.sync_copy(x_ref, buf)
        buf[...] = buf[...] + jax.lax.axis_index("model").astype(jnp.float32)
        pltpu.sync_copy(buf, o_ref)

    pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype))


def remote_body(x_ref, o_ref):
    from jax.experimental.pallas import tpu as pltpu

    def scoped(send, recv):
        pltpu.make_async_remote_copy(x_ref, o_ref, send, recv, device_id={"model": 0}).start()

    pl.run_scoped(scoped, pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA)


def kernel_call(body):
    from test_pl_kernel import tc_mesh

    def call(x):
        return pl.kernel(body, jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=tc_mesh())(x)

    return call


@pytest.fixture
def tpu_interpret():
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode():
        yield


@pytest.mark.skipif(not HAS_KERNEL, reason=f"JAX {jax.__version__}: no pl.kernel to interpret (0.8+)")
def test_pl_kernel_identity_read_gets_rules_varying_of_it(data, tpu_interpret):
    mesh, x, xs = data
    call = kernel_call(index_body)
    narrow_on, narrow_off = programs(call, mesh, P("data", None), P("data", None))
    full_on, full_off = programs(call, mesh, P("data", None), P("data", "model"))
    message = refusal(narrow_on, x)  # 0.8 - 0.9: only under inference (JAX alone types it replicated)
    assert len(rules_of(message)) == 1, message
    try:
        check_follows(message, index_body, [(narrow_on, narrow_off, None),
                                            (full_on, full_off, np.concatenate([xs, xs + 1], 1))], x)
    except ValueError as err:  # 0.10+: JAX's TPU interpreter re-binds the body's add under
        # check_vma and refuses it (a replicated scratch read plus axis_index): check the typing
        if "varying manual axes to match" not in str(err):
            raise
        apply(message, snippets(message)[1][0], index_body=index_body)  # the typing, then
        assert outcome(narrow_on, x) == "refused"
        jax.make_jaxpr(full_on)(x)  # typed by the rule (running it is the interpreter's problem)
        assert max_err(jax.jit(full_off)(x), np.concatenate([xs, xs + 1], 1)) < 1e-6


@pytest.mark.skipif(not HAS_KERNEL, reason=f"JAX {jax.__version__}: no pl.kernel to interpret (0.8+)")
def test_pl_kernel_remote_dma_gets_candidates_and_verify(data, tpu_interpret):
    """A DMA to another device (axes unknown to reprules): the sound rule over every axis,
    rules.invariant of each as candidates, and verify. Remote DMAs do not run on CPU: the
    applied rules are checked to type the call (it traces)."""
    mesh, x, xs = data
    on, _ = programs(kernel_call(remote_body), mesh, P("data", None), P("data", "model"))
    message = refusal(on, x)
    rules = rules_of(message)
    assert rules[0] == "rules.varying('data', 'model')" and len(rules) > 1, message
    assert "reprules.verify()" in message
    for line in snippets(message)[1]:
        apply(message, line, remote_body=remote_body)
        jax.jit(on).lower(x)  # typed by the rule: no refusal
        reprules.unregister(remote_body)


# --- StrictModeError: an opaque primitive without a rule (0.6+) ----------------------------------


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 refuses rule-less primitives itself")
def test_strict_mode_candidates_are_safe(data):
    from test_modes import silent_p  # a primitive whose abstract eval drops the varying axes

    mesh, x, xs = data
    on, off = programs(silent_p.bind, mesh, P("data", None), P("data", None))
    with reprules.strict(), pytest.raises(reprules.StrictModeError) as info:
        jax.jit(on)(x)
    message = str(info.value)
    with reprules.strict():
        check_follows(message, silent_p, [(on, off, xs)], x, target="silent_copy")


# --- verify's ReplicationMismatchError, like()'s RuleError, CotangentError -----------------------


def test_a_verify_mismatch_fix_makes_the_rule_true(data):
    mesh, x, xs = data
    reprules.replication_rule(reprules.rules.invariant("data"))(copy_kernel)
    on, off = programs(pallas(copy_kernel), mesh, P("data", None), P("data", None))
    rep_on, rep_off = programs(pallas(copy_kernel), mesh, P("data", None), P(None, None))
    with pytest.raises(reprules.ReplicationMismatchError) as info, reprules.verify():
        jax.block_until_ready(jax.jit(rep_on)(x))
    message = str(info.value).split("\n(", 1)[0]
    (line,) = snippets(message)[1]
    apply(message, line, copy_kernel=copy_kernel)  # override=True: a rule is registered
    assert max_err(outcome(on, x), xs) == 0.0 and max_err(jax.jit(off)(x), xs) == 0.0
    assert outcome(rep_on, x) == "refused"


def test_like_rule_error_fix_is_safe(data):
    mesh, x, xs = data
    w = randn(1, (2, 16))
    reprules.replication_rule(reprules.rules.like(1))(mul_kernel)
    on, off = programs(pallas(mul_kernel), mesh, (P("data", None), P()), P("data", None))
    with pytest.raises(reprules.RuleError) as info:
        jax.jit(on)(x, w)
    message = str(info.value)
    (line,) = snippets(message)[1]
    apply(message, line, mul_kernel=mul_kernel)
    assert max_err(outcome(on, x, w), xs * np.tile(np.asarray(w), (4, 1))) < 1e-6
    assert max_err(outcome(on, x, w), jax.jit(off)(x, w)) < 1e-6


def test_cotangent_error_fix_gives_the_exact_gradient(data):
    """The bwd returns the printed expression, evaluated on its varying and replicated parts."""
    mesh = data[0]
    x, w, t = put(randn(0, (16, 32)), mesh, P("data", None)), put(randn(1, (1, 32)), mesh, P()), randn(2, (16, 32))
    reprules.replication_rule()(mul_kernel)

    def loss_with(expression):
        @jax.custom_vjp
        def f(x, w):
            return pallas(mul_kernel)(x, w), 2.0 * w

        def bwd(res, g):
            (x, w), (g_y, g_z) = res, g
            parts = {"dw_varying": (g_y * x).sum(0, keepdims=True), "dw_replicated": 2.0 * g_z, "jax": jax}
            return g_y * w, eval(expression, parts)  # noqa: S307 - the message's own expression

        f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
        g = shard_map(f, mesh, (P("data", None), P()), (P("data", None), P()))
        return lambda x, w: (g(x, w)[0] * t).sum() + (g(x, w)[1] * 3.0).sum()

    with pytest.raises(reprules.CotangentError) as info:
        jax.jit(jax.grad(loss_with("dw_varying + dw_replicated"), argnums=1))(x, w)
    (expression,) = re.findall(r"`(jax\.lax\.psum\(dw_varying, .*?\) \+ dw_replicated)`", str(info.value))
    got = jax.jit(jax.grad(loss_with(expression), argnums=1))(x, w)
    reference = (np.asarray(t) * np.asarray(x)).sum(0, keepdims=True) + 6.0  # unsharded
    assert max_err(got, reference) < 1e-4
