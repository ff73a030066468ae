"""reprules' note on JAX's out_specs refusal, on every path that reaches it.

Where sound types make a value varying that JAX alone types replicated (a
``lax.cond`` on a varying predicate with replicated branches, jax#40823; a
rule-less ``jax.pure_callback``), ``out_specs=P()`` for it is refused, and
reprules adds why and the fix. JAX builds that refusal differently per path:
under ``jit`` for the user's function; eagerly (0.10+) for its own
``_rem_singleton``; under ``grad`` (0.10+) with a tree that also holds the
residuals, so the builder itself failed with "Too few leaves for PyTreeDef".
The note, the mesh axes and the JAX version must come out the same on each.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import NEW_SHARD_MAP, make_mesh, put, randn, shard_map

pytestmark = [
    pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 refuses rule-less primitives and rewrites cond "
                       "itself (check_rep); sound types are for JAX 0.6+"),
    pytest.mark.filterwarnings("ignore::reprules.ReplicationWarning"),  # the callback's own warning: not tested here
]
VERSION = re.escape(jax.__version__)


def cond_body(x, w):
    """Replicated branches on a data-varying predicate: varying over 'data' (jax#40823)."""
    return jax.lax.cond(x.sum() > 70.0, lambda: 1.0, lambda: 0.0) * w


def callback_body(x, w):
    """A rule-less host callback on a data-sharded operand: varying over 'data'."""
    return jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x).sum() * w


CAUSES = {
    "cond": (cond_body, r"a lax\.cond\b[^\n]* whose predicate varies over \['data'\] \(jax#40823\)"),
    "pure_callback": (callback_body, r"the JAX callback 'pure_callback', which"),
}


def _eager(sm, x, w):
    return sm(x, w)


def _user_function(sm, x, w):
    def step(x, w):  # the user's own function around the shard_map, called eagerly
        return sm(x, w) + 1.0

    return step(x, w)


def _jit(sm, x, w):
    return jax.jit(sm)(x, w)


def _grad(sm, x, w):  # by w: the callback's operand x is not differentiated (callbacks have no JVP)
    return jax.grad(sm, argnums=1)(x, w)


def _jit_grad(sm, x, w):
    return jax.jit(jax.grad(sm, argnums=1))(x, w)


def _vmap(sm, x, w):
    return jax.vmap(sm, in_axes=(None, 0))(x, jnp.stack([w, w + 1.0]))


def _nested_jit(sm, x, w):
    return jax.jit(lambda x, w: jax.jit(sm)(x, w) * 2.0)(x, w)


PATHS = {"eager": _eager, "user_function": _user_function, "jit": _jit, "grad": _grad, "jit_grad": _jit_grad,
         "vmap": _vmap, "nested_jit": _nested_jit}


@pytest.fixture(scope="module")
def data():
    mesh = make_mesh()
    x = put(randn(0, (8, 16)) + 2.0, mesh, P("data", None))  # data-dependent: no constant folding
    return mesh, x, jnp.float32(1.5)


def _note(function, construct):
    """JAX's refusal for ``function`` (mesh axes named), then reprules' note naming ``construct``."""
    return (rf"(?s)^shard_map applied to the function '{function}' was given out_specs which require replication"
            r".*axis names \('data', 'model'\).*out_specs.*inferred to be possibly varying over \{data\}"
            rf".*reprules \(mesh axes \{{'data', 'model'\}}, JAX {VERSION}\): these values vary over \{{'data'\}}.*{construct}[^\n]* at "
            r"[^\n]*test_out_specs_note_paths\.py:\d+.*Fix: keep \{'data'\} in the out_specs.*rather than turn "
            r"checking off\.")


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_the_refusal_carries_the_note_on_every_path(data, cause, path):
    mesh, x, w = data
    body, construct = CAUSES[cause]
    sm = shard_map(body, mesh, (P("data", None), P()), P())
    with pytest.raises(ValueError, match=_note(body.__name__, construct)) as refused:
        PATHS[path](sm, x, w)
    message = str(refused.value)
    assert "_rem_singleton" not in message and "Too few leaves" not in message, message


def test_under_grad_each_refused_output_is_named_by_its_path_in_the_out_specs(data):
    """0.10+ linearizes with the residuals packed beside the outputs: the refusal is for the
    user's outputs alone, each by its path in the out_specs; those kept varying pass."""
    mesh, x, w = data

    def body(x, w):
        c = jax.lax.cond(x.sum() > 70.0, lambda: 1.0, lambda: 0.0)
        y = jnp.sin(x) * c * w
        return {"a": c * jnp.sum(jnp.cos(x)) * w, "b": y, "c": (y.sum(), c[None])}

    specs = {"a": P(), "b": P("data"), "c": (P(), P("data"))}

    def loss(x, w):
        out = shard_map(body, mesh, (P("data", None), P()), specs)(x, w)
        return out["a"] + out["b"].sum() + out["c"][0] + out["c"][1].sum()

    for run in (jax.jit(jax.grad(loss, argnums=1)), jax.jit(loss)):
        with pytest.raises(ValueError, match=(
                r"(?s)function 'body'.*\* out_specs\['a'\] is (P|PartitionSpec)\(\).*\* out_specs\['c'\]\[0\] is "
                r"(P|PartitionSpec)\(\)"
                rf".*reprules \(mesh axes \{{'data', 'model'\}}, JAX {VERSION}\).*a lax\.cond\b")) as refused:
            run(x, w)
        assert "out_specs['b']" not in str(refused.value) and "out_specs['c'][1]" not in str(refused.value)


@pytest.mark.parametrize("path", ["eager", "jit_grad"])
def test_a_value_jax_itself_types_varying_gets_its_refusal_without_a_note(data, path):
    """No typing of reprules' made it vary: JAX's own refusal, for the user's function,
    with nothing added (not "Too few leaves" under grad, not '_rem_singleton' eagerly)."""
    mesh, x, w = data

    def plain(x, w):
        return x.sum() * w

    with pytest.raises(ValueError, match=r"(?s)^shard_map applied to the function 'plain'.*check_vma=False") as refused:
        PATHS[path](shard_map(plain, mesh, (P("data", None), P()), P()), x, w)
    assert "reprules" not in str(refused.value)


def test_out_specs_that_keep_the_axis_are_accepted_on_every_path(data):
    """The fix the note gives (keep 'data' in the out_specs) runs on each path."""
    mesh, x, w = data
    for body, _ in CAUSES.values():
        sm = shard_map(lambda x, w, body=body: body(x, w)[None], mesh, (P("data", None), P()), P("data"))
        expected = np.asarray(sm(x, w))
        assert expected.shape == (4,)
        assert np.allclose(np.asarray(_jit(sm, x, w)), expected)
        assert np.allclose(np.asarray(_nested_jit(sm, x, w)), 2.0 * expected)


def test_a_refusal_whose_outputs_cannot_be_made_out_still_names_the_function_and_the_mesh():
    """Should a later JAX pass a tree that no part of fits the out_specs, the refusal is
    written in short rather than JAX's builder failing on it."""
    from jax.tree_util import tree_structure

    from reprules._shim.sound_types import out_specs_note

    def lone(x):
        return x

    def builder_that_fails(*args):
        raise ValueError("Too few leaves for PyTreeDef; expected 3, got 2")

    build = out_specs_note._with_note(builder_that_fails, None, no_fail=None)
    message = build(lone, make_mesh(), tree_structure((0, 0, 0)), P(), [frozenset({"data"}), None])
    assert re.fullmatch(r"(?s)shard_map applied to the function 'lone' was given out_specs .*axis names "
                        r"\('data', 'model'\).*varying over \{data\}, which these out_specs leave out\.", message)
