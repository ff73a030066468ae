"""The package's imports run one way, and the shim stands in layers.

Read from the source (every ``import`` statement, at module level or inside a
function), so a new import that closes a cycle fails here, not in review.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PACKAGE = ROOT / "reprules"

# The core: no JAX, no shim, no façade.
CORE = {"reprules._errors", "reprules.rules", "reprules._registry", "reprules._decide", "reprules._mode_state",
        "reprules._version"}

# The shim's layers, lowest first (the shim's __init__ says what each is for). A
# shim module imports only from its own layer or lower ones (and the core); the
# cycle test below keeps imports within a layer one way.
SHIM_LAYERS = [
    {"_jax", "_patches", "_frames"},  # JAX's internals, patch bookkeeping
    {"_types", "_kernels", "_bodies"},  # varying axes per era; which kernel an equation is
    {"_equations", "_effects", "_analysis", "infer"},  # inference: a jaxpr in, a rule or a refusal out
    {"_rules", "_taint", "_union"},  # the rule behind an equation; a bwd's cotangent taints; annotation unions
    {"_pallas_hooks", "pallas_call", "_kernel_inference", "core_map", "primitives", "strict", "_bwd_trace", "custom_vjp",
     "_verify", "_source", "pcast", "opaque_types", "control_flow", "out_specs_note"},  # adapters
    {"rep", "rep_gaps", "custom_vjp_rep", "vma", "mat"},  # eras: choose and install
    {"__init__"},
]
LAYER = {f"reprules._shim.{m}" if m != "__init__" else "reprules._shim": i
         for i, layer in enumerate(SHIM_LAYERS) for m in layer}
MAX_LINES = 600


def _module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted):
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def _imports(tree):
    """(reprules module imported, the import node) for every import statement."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("reprules"):
                    yield alias.name, node
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reprules"):
            for alias in node.names:  # `from reprules import _x` names a module; `from reprules.y import z` does not
                candidate = f"{node.module}.{alias.name}"
                yield (candidate if _is_module(candidate) else node.module), node


def _top_level(tree):
    """Statements that run on import: the module body, into if/try blocks, not into functions."""
    found, pending = set(), list(tree.body)
    while pending:
        node = pending.pop()
        found.add(node)
        if isinstance(node, (ast.If, ast.Try)):
            pending.extend(ast.iter_child_nodes(node))
    return found


SOURCES = {_module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(text) for name, text in SOURCES.items()}
MODULES = {name: {m for m, _ in _imports(tree)} - {name} for name, tree in TREES.items()}


def test_the_module_list_is_read():
    assert {"reprules", "reprules._modes", "reprules._shim", "reprules._shim._jax", "reprules._shim.vma",
            "reprules._mode_state"} <= set(MODULES)
    assert MODULES["reprules._shim.vma"] >= {"reprules._shim.pallas_call", "reprules._shim.core_map"}


def test_no_import_cycle_anywhere_in_the_package():
    """Every import statement, at module level or in a function, counts."""
    state = {}  # module -> "visiting" / "done"

    def visit(module, path):
        state[module] = "visiting"
        for dep in sorted(MODULES.get(module, ())):
            if state.get(dep) == "visiting":
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])


def test_every_shim_module_has_a_layer():
    shim = {m for m in MODULES if m.startswith("reprules._shim")}
    assert shim == set(LAYER), f"unplaced: {sorted(shim - set(LAYER))}; gone: {sorted(set(LAYER) - shim)}"


@pytest.mark.parametrize("module", sorted(LAYER))
def test_a_shim_module_imports_only_its_layer_lower_layers_and_the_core(module):
    for dep in MODULES[module]:
        if dep.startswith("reprules._shim"):
            assert LAYER[dep] <= LAYER[module], f"{module} (layer {LAYER[module]}) imports {dep} (layer {LAYER[dep]})"
        else:
            assert dep in CORE, f"{module} imports {dep}: the shim may use only itself and {sorted(CORE)}"


@pytest.mark.parametrize("module", sorted(CORE))
def test_the_core_imports_neither_the_shim_nor_the_facade(module):
    above = {m for m in MODULES[module] if m not in CORE}
    assert not above, f"{module} imports {sorted(above)}"


@pytest.mark.parametrize("module", ["reprules._mode_state", "reprules._version"])
def test_leaves(module):
    assert MODULES[module] == set()


def test_only_the_bottom_of_the_shim_imports_jax_internals():
    """``jax._src`` is imported in one module (``_shim/_jax.py``); the rest reach it through that."""
    offenders = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m.startswith("jax._src") for m in modules) and name != "reprules._shim._jax":
                offenders.append(f"{name}:{node.lineno}")
            if any(m == "importlib" for m in modules) and name.startswith("reprules._shim") \
                    and name != "reprules._shim._jax":
                offenders.append(f"{name}:{node.lineno} (importlib)")
    assert not offenders, offenders


def test_a_function_level_import_of_reprules_says_why_it_is_lazy():
    """A module-level import unless a ``# lazy: <why>`` comment says otherwise (on
    its line or the line above): an import hidden in a function must not be a way
    around a cycle."""
    unexplained = []
    for name, tree in TREES.items():
        lines = SOURCES[name].splitlines()
        top = _top_level(tree)
        for _, node in _imports(tree):
            if node in top:
                continue
            here = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
            if not re.search(r"# lazy: \S", here):
                unexplained.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not unexplained, "\n".join(unexplained)


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_no_module_is_over_600_lines(module):
    assert len(SOURCES[module].splitlines()) <= MAX_LINES, f"{module}: one concern per module"


def test_ci_code_uses_only_public_api():
    """``.ci/`` runs reprules as a user would: no private module, no private attribute."""
    private = []
    for path in sorted((ROOT / ".ci").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\breprules\._[a-z]|from reprules(\.\w+)* import _[a-z]|from reprules\._", line):
                private.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not private, "\n".join(private)


def test_the_workloads_import_the_transformer_not_the_reverse():
    assert "reprules._transformer" in MODULES["reprules._workloads"]
    assert "reprules._workloads" not in MODULES["reprules._transformer"]
