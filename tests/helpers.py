"""Version-agnostic test helpers (public JAX API only), shared by every test file.

The JAX version, ``shard_map`` with checking on or off, the fake-device
``XLA_FLAGS``, the (4, 2) mesh, and the seed workload of JAX #21855 (a Pallas
copy kernel under ``custom_vjp``) are written here once for the tests.

This module imports no reprules at module level: tests/test_no_harm_more.py
builds its programs with it in a fresh process *before* ``import reprules``.
So the version and ``shard_map`` are the tests' own copies of
``reprules._environment.version_tuple`` and ``reprules.testing.shard_map``
(the same rules; tests/test_testing.py checks that they agree).
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding

JAX_VERSION = tuple(int(re.match(r"\d*", p).group() or 0) for p in jax.__version__.split("."))
NEW_SHARD_MAP = hasattr(jax, "shard_map")  # 0.6+: jax.shard_map(check_vma=...); before: check_rep


def shard_map(f, mesh, in_specs, out_specs, check=True):
    """``shard_map`` with checking on (or off with ``check=False``), on every JAX of the matrix."""
    if NEW_SHARD_MAP:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as old_shard_map  # 0.4.28 - 0.5.x

    return old_shard_map(f, mesh, in_specs, out_specs, check_rep=check)


def make_mesh(shape=(4, 2), names=("data", "model")):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def env_with_cpu_devices(n=8, env=None):
    """A copy of ``env`` (default ``os.environ``) for a subprocess with ``n`` fake CPU devices."""
    from reprules._environment import environ_with_cpu_devices

    return environ_with_cpu_devices(n, os.environ if env is None else env)


# --- the seed workload: JAX #21855's Pallas copy kernel under custom_vjp ----------
def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def copy(x, kernel=copy_kernel):
    """``kernel`` (a copy kernel) applied to ``x`` through ``pl.pallas_call`` in interpret mode."""
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


@jax.custom_vjp
def kernel_copy(x):
    return copy(x)


kernel_copy.defvjp(lambda x: (copy(x), None), lambda _, g: (copy(g),))


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def randn(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.RandomState(seed).randn(*shape), dtype)


# --- collectives at the three levels ------------------------------------------
def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs (shard_map, custom_vjp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        hi = getattr(eqn.params.get("_prim"), "params", None)  # 0.10+ call_hi_primitive (jax_custom_vjp3,
        hi = hi if isinstance(hi, dict) else {}  # jax_remat3): the jaxprs are the hijax primitive's params
        for value in [*eqn.params.values(), *hi.values()]:
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


PSUM_PRIMITIVES = ("psum", "psum2", "psum_invariant")  # the spellings of psum across 0.4.28 - 0.12


def psum_axes_of(closed_jaxpr):
    """Sorted axes of every psum in ``closed_jaxpr`` and its sub-jaxprs, read from
    the equations (printed jaxprs split long equations over lines)."""
    found = []
    for eqn in _eqns(closed_jaxpr.jaxpr):
        if eqn.primitive.name in PSUM_PRIMITIVES:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, (tuple, list)) else (axes,)
            found.append(tuple(sorted(a for a in axes if isinstance(a, str))))
    return sorted(found)


def psum_axes(fn, *args):
    """:func:`psum_axes_of` the jaxpr of ``fn(*args)``."""
    return psum_axes_of(jax.make_jaxpr(fn)(*args))


def count_all_reduce(fn, *args):
    """(jaxpr psums, StableHLO all_reduce, compiled-HLO all-reduce) of ``jax.jit(fn)``."""
    jaxpr = len(psum_axes(fn, *args))
    lowered = jax.jit(fn).lower(*args)
    stablehlo = lowered.as_text().count("stablehlo.all_reduce")
    compiled_text = lowered.compile().as_text()
    compiled = len(re.findall(r"\ball-reduce(?:-start)?\(", compiled_text))
    return jaxpr, stablehlo, compiled


def max_err(a, b):
    """Largest absolute difference between two pytrees of arrays (computed in NumPy)."""
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(leaves_a, leaves_b)
    )


# --- custom_vjp implementations ------------------------------------------------
def _has_flag(name):
    return hasattr(jax.config, name)


CUSTOM_VJP3_MODES = [False, True] if _has_flag("jax_custom_vjp3") else [False]
"""``jax_custom_vjp3`` off and on where the release has the flag (0.9.1+)."""


class custom_vjp3:
    """Context manager: ``jax_custom_vjp3`` set to ``on`` (no-op where absent).

    From 0.9.1 to 0.11 the flag picks the implementation when a function is
    *decorated*, so define custom_vjp functions inside the block."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        if _has_flag("jax_custom_vjp3"):
            self.before = jax.config.jax_custom_vjp3
            jax.config.update("jax_custom_vjp3", self.on)
        return self

    def __exit__(self, *exc):
        if _has_flag("jax_custom_vjp3"):
            jax.config.update("jax_custom_vjp3", self.before)


VARYING_OVER_DATA = r"\{(V:)?data\}"
"""How a jaxpr prints a type varying over ``data``: ``{V:data}``, ``{data}`` on JAX 0.7."""


# A `reprules audit` target (module text): a Pallas kernel in a custom_vjp whose bwd's cotangent for
# the replicated w varies over `data` (reprules psums it, JAX <= 0.5 does); `only_x` leaves w's
# gradient unused, so that all-reduce is dead code.
# What reprules' errors tell a user to cast up with: jax.lax.pcast from JAX 0.8, pvary before.
CAST_UP = r"jax\.lax\.pcast\(" if hasattr(jax.lax, "pcast") else r"jax\.lax\.pvary\("


BWD_STEPS = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import pallas as pl
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import reprules
    from reprules.testing import shard_map

    def scale_kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    def _scale(x, w):
        return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)

    @jax.custom_vjp
    def scaled(x, w):
        return _scale(x, w)

    def scaled_bwd(res, g):
        x, w = res
        return _scale(g, w), _scale(g, x).sum(0, keepdims=True)

    scaled.defvjp(lambda x, w: (_scale(x, w), (x, w)), scaled_bwd)

    def _step(check, argnums):
        if check:
            reprules.replication_rule()(scale_kernel)
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
        w = jax.device_put(jnp.ones((1, 128)), NamedSharding(mesh, P()))
        f = shard_map(scaled, mesh, (P("data", None), P()), P("data", None), check=check)
        return jax.grad(lambda x, w: (f(x, w) * jnp.arange(128.0)).sum(), argnums=argnums), (x, w)

    def both(check=True):
        return _step(check, (0, 1))

    def only_x(check=True):  # w's gradient is not used: its all-reduce is dead code
        return _step(check, 0)
''')


def pack_state_on_import(module: str) -> list[str]:
    """In a fresh interpreter: whether nothing is registered after ``import reprules``, the
    pack's (name, state) once ``module`` is imported, and ``kernels_in(module)``'s rule and source."""
    import subprocess
    import sys

    code = ("import reprules\n"
            "print(reprules.registered() == {})\n"
            f"import {module}\n"
            f"print([(p.name, p.state) for p in reprules.packs() if p.module == {module!r}])\n"
            f"reg = reprules.registered()['kernels_in:{module}']\n"
            "print(reg.rule, reg.source)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()


def megablox_in_own_process(test_file: str, test: str, env: dict[str, str], hang_s: int = 120) -> None:
    """Runs ``test_file::test`` (megablox ``gmm`` in JAX's TPU interpreter) in its own pytest
    process, with ``env`` added, given ``hang_s`` seconds. JAX's TPU interpreter can deadlock
    in its callbacks (JAX alone too: always on 0.6 - 0.10, now and then on 0.11+ on a loaded
    2-core machine) or abort: a hung process must not hang the suite, and the test is then
    skipped saying so; a wrong result still fails."""
    import pytest

    path = pathlib.Path(test_file)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"{path.name}::{test}"],
            cwd=path.parent, env={**os.environ, **env}, capture_output=True, text=True, timeout=hang_s)
    except subprocess.TimeoutExpired:
        pytest.skip(f"JAX {jax.__version__}'s TPU interpreter hung running megablox gmm for {hang_s} s "
                    "(a deadlock of its callbacks, seen with JAX alone): no result to check")
    if done.returncode < 0:  # killed by a signal: JAX's interpreter aborted (seen on 0.11.2 under load)
        pytest.skip(f"JAX {jax.__version__}'s TPU interpreter aborted running megablox gmm (signal "
                    f"{-done.returncode}): no result to check. {done.stderr.strip().splitlines()[:1]}")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def fuzz_seed() -> int:
    """The fuzzers' seed: ``REPRULES_FUZZ_SEED`` if set (the noxfile sets and prints it), else
    one shared by every pytest-xdist worker of this run."""
    given = os.environ.get("REPRULES_FUZZ_SEED")
    if given:
        return int(given)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    return int(run[:8], 16) if run else int(time.time())


# --- the hang invariant: no collective inside a branch or loop that devices take apart ----------
_COLLECTIVE = re.compile(r"\b(?:stablehlo|mhlo)\.(?:all_reduce|all_gather|all_to_all|collective_permute|"
                         r"reduce_scatter|collective_broadcast)\b")
_BRANCHING = re.compile(r"\b(?:stablehlo|mhlo)\.(?:case|if|while)\b")
# A symbol is bare (@solve) or quoted (@"<lambda>_0", as JAX names a lambda's function).
_CALL = re.compile(r'\bcall @(?:"([^"]+)"|([\w.$-]+))')
_FUNC = re.compile(r'^\s*func\.func\s+(?:\w+\s+)?@(?:"([^"]+)"|([\w.$-]+))')
MESH_AXES = (("data", 4), ("model", 2))  # make_mesh()'s axes and sizes, device ids row-major


def _collective_axes(line, mesh_axes=MESH_AXES):
    """The mesh axes a collective's groups span: named (JAX 0.10+) or as device groups."""
    named = re.findall(r'axis_ref<name = "(\w+)"', line)
    if named:
        return frozenset(named)
    groups = re.search(r"replica_groups = dense<\[\[([\d, ]+)\]", line)
    if not groups:
        return frozenset(name for name, _ in mesh_axes)  # unknown: every axis
    spanned = set()
    for i in (int(i) for i in groups[1].split(",")):
        coords = []
        for _, size in reversed(mesh_axes):
            coords.append(i % size)
            i //= size
        spanned.add(tuple(reversed(coords)))
    return frozenset(name for k, (name, _) in enumerate(mesh_axes) if len({c[k] for c in spanned}) > 1)


def collectives_under_branches(stablehlo, mesh_axes=MESH_AXES):
    """The collectives a program runs inside a ``case`` (cond, switch), ``if`` or ``while``,
    directly or through calls, as (line or ``call @f``, the mesh axes it spans). Where the
    branch taken (or the trip count) differs across those axes, devices wait on each other
    forever (the CPU runtime aborts the process after 40 s) or pair with another branch's."""
    funcs = {}
    name, stack = "", []
    for line in stablehlo.splitlines():
        found = _FUNC.match(line)
        if found:
            name, stack = found[1] or found[2], []
            funcs[name] = ([], [], [])
            continue
        if name:
            direct, callees, under = funcs[name]
            branching = any(k == "branch" for k in stack)
            if _COLLECTIVE.search(line):
                direct.append(_collective_axes(line, mesh_axes))
                if branching:
                    under.append((line.strip()[:160], direct[-1]))
            for quoted, bare in _CALL.findall(line):
                callee = quoted or bare
                callees.append(callee)
                if branching:
                    under.append((f"call @{callee}", callee))
            net = line.count("{") - line.count("}")
            kind = "branch" if _BRANCHING.search(line) else "other"
            for _ in range(max(net, 0)):
                stack.append(kind)
            for _ in range(max(-net, 0)):
                if stack:
                    stack.pop()
    spans = {}

    def span(f, seen=frozenset()):
        if f not in spans:
            direct, callees, _ = funcs.get(f, ([], [], []))
            spans[f] = frozenset().union(*direct, *(span(c, seen | {f}) for c in callees if c not in seen))
        return spans[f]

    bad = []
    for _, _, under in funcs.values():
        for what, axes in under:
            axes = span(axes) if isinstance(axes, str) else axes
            if axes:
                bad.append((what, axes))
    return bad


def assert_no_collective_under_varying_branch(stablehlo, steered_axes, mesh_axes=MESH_AXES):
    """The invariant of issue 45: with checking on, no collective of a forward or backward pass
    sits inside a ``cond`` / ``switch`` / ``while`` whose predicate may vary over that
    collective's axes (``steered_axes``: the axes the program's predicates and trip counts
    vary over). Such a program deadlocks on hardware; it is read from its StableHLO
    (``jax.jit(f).lower(...).as_text()``), never run.

    Raises:
        AssertionError: naming each such collective (its line, or ``call @f`` for a function
            holding one) and the axes it spans.
    """
    found = collectives_under_varying_branches(stablehlo, steered_axes, mesh_axes)
    assert not found, (
        f"a collective inside a cond/switch/while whose predicate varies over {sorted(steered_axes)} "
        "(devices that take another branch never join it): "
        + "; ".join(f"{what} over {sorted(axes)}" for what, axes in found))



# --- which axes each cond / switch / while predicate varies over, read from the StableHLO -------
_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*(.*)$")
_NAME = re.compile(r"%[\w.$-]+(?:#\d+)?")
_CONST = re.compile(r"stablehlo\.constant dense<(-?\d+)> : tensor<[a-z]*\d+>")
_OP = re.compile(r'"?(?:stablehlo|mhlo)\.(\w+)')
_TABLE_OPS = {"divide": lambda a, b: a // b if b else 0, "remainder": lambda a, b: a % b if b else 0,
              "add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b}


def _table_axes(table, mesh_axes):
    """The axes along which a per-device table (device ids row-major over ``mesh_axes``) differs."""
    axes, stride = set(), 1
    for name, size in reversed(mesh_axes):
        if any(table[d] != table[d - ((d // stride) % size) * stride] for d in range(len(table))):
            axes.add(name)
        stride *= size
    return frozenset(axes)


class _Varying:
    """One pass over a module's StableHLO: the mesh axes each value may vary over (a sound
    over-approximation: the sources are ``partition_id`` -- followed exactly through
    ``axis_index``'s divide and remainder -- and each manual computation's inputs, by their
    ``in_shardings``, or by the forward pass's values where a backward pass reads its residuals;
    a collective removes the axes it reduces over), and for each ``case`` / ``if`` / ``while``
    the axes its index, predicate or trip count may vary over."""

    def __init__(self, mesh_axes, func_args, func_inside, func_returns, loops):
        self.mesh_axes, self.every = mesh_axes, frozenset(name for name, _ in mesh_axes)
        self.devices = 1
        for _, size in mesh_axes:
            self.devices *= size
        self.func_args, self.func_inside = func_args, func_inside  # from the pass before
        self.func_returns, self.new_returns = func_returns, {}
        self.loops, self.new_loops = loops, {}  # a while's carries as its body returns them, by op id
        self.region, self.carries, self.returns = {}, {}, {}
        self.new_args, self.new_inside = {}, {}
        self.taint, self.tables, self.consts, self.mc_results = {}, {}, {}, {}
        self.preds, self.inside, self.results, self.kinds = [], [], [], []
        self.collectives, self.calls = [], []  # (what, axes or callee, enclosing op ids)
        self.frames, self.pending, self.func, self.public_args = [], None, "", set()

    def of(self, token):
        base, _, k = token.partition("#")
        if (base, k) in self.mc_results:
            return self.mc_results[base, k]
        if base in self.tables:
            return _table_axes(self.tables[base], self.mesh_axes)
        return self.taint.get(base, frozenset())

    def define(self, base, value, table=None):
        self.tables.pop(base, None)
        for key in [key for key in self.mc_results if key[0] == base]:
            del self.mc_results[key]
        if table is not None:
            self.tables[base] = table
            value = _table_axes(table, self.mesh_axes)
        self.taint[base] = value
        self.new_inside.setdefault(self.func, set()).update(value)
        for kind, payload in self.frames:
            if kind == "op":
                self.inside[payload] |= value

    def sharded_axes(self, line):
        """The axes a GSPMD sharding annotation splits a value over (every axis if unread)."""
        if 'mhlo.sharding = "{replicated}"' in line:
            return frozenset()
        found = re.search(r"devices=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?( last_tile_dim_replicate)?", line)
        if not found:
            return self.every
        dims = [int(d) for d in found[1].split(",")]
        order = np.arange(self.devices).reshape([int(d) for d in found[2].split(",")])
        if found[3]:
            order = order.transpose([int(d) for d in found[3].split(",")])
        tiles = order.reshape(dims)
        axes = set()
        for k in range(len(dims) - (1 if found[4] else 0)):
            table = [0] * self.devices
            for index in np.ndindex(*dims):
                table[int(tiles[index])] = index[k]
            axes |= _table_axes(table, self.mesh_axes)
        return frozenset(axes)

    def enclosing(self):
        return [payload for kind, payload in self.frames if kind == "op"]

    def run(self, stablehlo):
        for line in stablehlo.splitlines():
            found = _FUNC.match(line)
            if found:
                self.func, self.frames, self.pending = found[1] or found[2], [], None
                self.taint, self.tables, self.consts, self.mc_results = {}, {}, {}, {}  # names are per function
                public = "public" in line.split("@")[0]
                known = self.func_args.get(self.func, {})
                self.public_args = set()
                for i, arg in enumerate(re.findall(r"(%[\w.$-]+):", line.split(")")[0])):
                    self.define(arg, self.every if public else known.get(i, frozenset()))
                    if public:
                        self.public_args.add(arg)
                continue
            if self.func:
                self.line(line)
        return self

    def line(self, line):
        got = _DEF.match(line)
        opened = ("other", None)
        if got:
            base, rest = got[1], got[2]
            head = rest.split(" : ")[0]
            operands = _NAME.findall(head)
            op = _OP.match(rest)
            op = op[1] if op else ""
            const = _CONST.search(rest)
            args = [t.partition("#")[0] for t in operands]
            if const:
                self.consts[base] = int(const[1])
                self.define(base, frozenset())
            elif op in ("partition_id", "replica_id"):
                self.define(base, frozenset(), table=tuple(range(self.devices)))
            elif op == "convert" and args and args[0] in self.tables:
                self.define(base, frozenset(), table=self.tables[args[0]])
            elif op in _TABLE_OPS and len(args) == 2 and args[0] in self.tables and args[1] in self.consts:
                b = self.consts[args[1]]
                self.define(base, frozenset(), table=tuple(_TABLE_OPS[op](v, b) for v in self.tables[args[0]]))
            elif "custom_call @Sharding(" in rest and args and args[0] in self.public_args:
                self.define(base, self.sharded_axes(rest))  # GSPMD (JAX <= 0.6): an input's sharding
            elif _COLLECTIVE.search(rest):
                axes = _collective_axes(rest, self.mesh_axes)
                self.collectives.append((line.strip()[:160], axes, self.enclosing()))
                self.define(base, frozenset().union(*map(self.of, operands)) - axes)
            elif "manual_computation" in rest:
                shardings = re.findall(r"<@[\w.$-]+, \[(.*?)\]>", rest.split("out_shardings")[0])
                inputs = _NAME.findall(rest.split(")")[0])
                for k, arg in enumerate(re.findall(r"(%arg\d+):", rest.split("manual_axes")[-1])):
                    source = inputs[k].partition("#") if k < len(inputs) else ("", "", "")
                    if (source[0], source[2]) in self.mc_results:  # a residual of the forward pass
                        self.define(arg, self.mc_results[source[0], source[2]])
                    elif k < len(shardings):
                        self.define(arg, frozenset(re.findall(r'"(\w+)"', shardings[k])))
                    else:
                        self.define(arg, self.every)
                opened = ("mc", base)
            elif op in ("case", "if"):
                self.preds.append(frozenset().union(*map(self.of, operands)))
                self.inside.append(set())
                self.results.append(base)
                self.kinds.append(op)
                opened = ("op", len(self.preds) - 1)
            elif op == "while":
                pairs = re.findall(r"(%[\w.$-]+) = (%[\w.$-]+(?:#\d+)?)", head)
                i = len(self.preds)
                looped = self.loops.get(i, [frozenset()] * len(pairs))
                carries = [self.of(v) | looped[k] for k, (_, v) in enumerate(pairs)]
                for (carry, _), value in zip(pairs, carries):  # each as the body returns it (a fixed point)
                    self.define(carry, value)
                self.preds.append(frozenset())  # its `cond` region's result, when read
                self.inside.append(set())
                self.results.append(base)
                self.kinds.append(op)
                self.carries[i], self.region[i] = carries, "cond"
                self.pending = i
            else:
                value = frozenset().union(*map(self.of, operands))
                callee = _CALL.search(rest)
                if callee:
                    callee = callee[1] or callee[2]
                    slots = self.new_args.setdefault(callee, {})
                    for i, t in enumerate(o for o in operands if not o.startswith("%@")):
                        slots[i] = slots.get(i, frozenset()) | self.of(t)
                    value |= frozenset(self.func_inside.get(callee, ()))
                    if callee not in self.func_returns:
                        # Its results from the bottom up, like every other value of the fixed point:
                        # its operands' axes would stick in the loop carries that read them.
                        value = frozenset()
                    self.calls.append((f"call @{callee}", callee, self.enclosing()))
                self.define(base, value)
                for k, returned in enumerate(self.func_returns.get(callee, ()) if callee else ()):
                    self.mc_results[base, str(k)] = returned  # each result as its function returns it
                    if k == 0:
                        self.mc_results[base, ""] = returned
        elif re.match(r"\s*\}\s*do\s*\{", line) and self.frames and self.frames[-1][0] == "op":
            self.region[self.frames[-1][1]] = "do"
        elif re.match(r"\s*\"?stablehlo\.return\b", line) and self.frames and self.frames[-1][0] == "op":
            i = self.frames[-1][1]
            returned = [self.of(t) for t in _NAME.findall(line.split(" : ")[0])]
            if self.kinds[i] == "while" and self.region[i] == "cond":
                self.preds[i] |= frozenset().union(*returned)
            else:
                before = self.returns.get(i, [frozenset()] * len(returned))
                self.returns[i] = [a | b for a, b in zip(before, returned)]
        elif re.match(r"\s*(?:func\.)?return\b", line):
            returned = [self.of(t) for t in _NAME.findall(line.split(" : ")[0])]
            before = self.new_returns.get(self.func, [frozenset()] * len(returned))
            self.new_returns[self.func] = [a | b for a, b in zip(before, returned)]
        elif "sdy.return" in line:
            mc = next((payload for kind, payload in reversed(self.frames) if kind == "mc"), None)
            if mc is not None:
                for k, t in enumerate(_NAME.findall(line.split(" : ")[0])):
                    self.mc_results[mc, str(k)] = self.of(t)
        net = line.count("{") - line.count("}")
        for _ in range(max(net, 0)):
            if opened[0] == "other" and self.pending is not None:  # a while's `cond {`
                opened, self.pending = ("op", self.pending), None
            self.frames.append(opened)
            opened = ("other", None)
        for _ in range(max(-net, 0)):
            if not self.frames:
                break
            kind, i = self.frames.pop()
            if kind == "op" and ("op", i) not in self.frames:
                returned = self.returns.get(i, [])
                if self.kinds[i] == "while":
                    self.new_loops[i] = returned
                    results = [c | r for c, r in zip(self.carries[i], returned)] or self.carries[i]
                else:
                    results = [self.preds[i] | r for r in returned]
                self.define(self.results[i], frozenset().union(self.preds[i], *results))
                for k, value in enumerate(results):
                    self.mc_results[self.results[i], str(k)] = value
                if results:
                    self.mc_results[self.results[i], ""] = results[0]


def collectives_under_varying_branches(stablehlo, steered_axes=None, mesh_axes=MESH_AXES):
    """The collectives a program runs inside a ``case`` (cond, switch), ``if`` or ``while``
    (directly or through calls) whose index, predicate or trip count may vary over the
    collective's axes, as (line or ``call @f``, the axes): devices that take apart there never
    join it (a deadlock; the CPU runtime aborts after 40 s) or pair with another branch's.

    The predicates' axes are read from the StableHLO itself (:class:`_Varying`), so a psum over
    'data' inside a cond on ``axis_index("model")`` is fine. ``steered_axes``, where given, caps
    them (the axes the program's predicates vary over, as its author knows them)."""
    func_args, func_inside, func_returns, loops = {}, {}, {}, {}
    for _ in range(64):  # functions' arguments and results, loops' carries: to a fixed point (from the bottom)
        found = _Varying(mesh_axes, func_args, func_inside, func_returns, loops).run(stablehlo)
        new_args = {f: dict(v) for f, v in found.new_args.items()}
        new_inside = {f: frozenset(v) for f, v in found.new_inside.items()}
        new_loops = {i: [a | b for a, b in zip(found.new_loops[i], loops.get(i, found.new_loops[i]))]
                     for i in found.new_loops}
        if (new_args, new_inside, found.new_returns, new_loops) == (func_args, func_inside, func_returns, loops):
            break
        func_args, func_inside, func_returns, loops = new_args, new_inside, found.new_returns, new_loops
    else:
        raise AssertionError("collectives_under_varying_branches: no fixed point after 64 passes")
    cap = frozenset(steered_axes) if steered_axes is not None else frozenset(name for name, _ in mesh_axes)
    spans = {}
    # The axes each function's collectives span, through its calls.
    funcs = {}
    name = ""
    for line in stablehlo.splitlines():
        got = _FUNC.match(line)
        if got:
            name = got[1] or got[2]
            funcs[name] = ([], [])
            continue
        if name:
            if _COLLECTIVE.search(line):
                funcs[name][0].append(_collective_axes(line, mesh_axes))
            funcs[name][1].extend(q or b for q, b in _CALL.findall(line))

    def span(f, seen=frozenset()):
        if f not in spans:
            own, calls = funcs.get(f, ([], []))
            spans[f] = frozenset().union(*own, *(span(c, seen | {f}) for c in calls if c not in seen))
        return spans[f]

    bad = []
    for what, axes, ops in found.collectives + found.calls:
        axes = span(axes) if isinstance(axes, str) else axes
        steering = frozenset().union(*(found.preds[i] for i in ops)) & cap
        if axes & steering:
            bad.append((what, axes))
    return bad



def coverage_cases(name):
    """``.ci/coverage/<name>.py``, the coverage script's cases, for a library's tests to reuse
    (its inputs, references, and what the library needs to import)."""
    coverage = str(pathlib.Path(__file__).resolve().parent.parent / ".ci" / "coverage")
    if coverage not in sys.path:
        sys.path.insert(0, coverage)
    return importlib.import_module(name)
