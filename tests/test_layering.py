"""The package's imports run one way: façade -> registry/decide -> shim -> JAX.

Read from the source (every ``import`` statement, at module level or inside a
function), so a new import that closes a cycle fails here, not in review.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "reprules"

# The layers, lowest first: a module may import only from its own layer or below.
CORE = {"reprules._errors", "reprules.rules", "reprules._registry", "reprules._decide", "reprules._mode_state",
        "reprules._version"}
SHIM_PREFIX = "reprules._shim"


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path, top_level_only=False):
    """The reprules modules ``path`` imports, as dotted names (all, or only the
    module-level statements that run on import)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in (_top_level(tree) if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("reprules"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reprules"):
            for alias in node.names:  # `from reprules import _x` names a module; `from reprules.y import z` does not
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE.parent / candidate.replace(".", "/")).is_dir() else node.module)
    return found


def _top_level(tree):
    """Statements that run on import: the module body, into if/try blocks, not into functions."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            pending.extend(ast.iter_child_nodes(node))


MODULES = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}
ON_IMPORT = {_module_name(p): _imports(p, top_level_only=True) for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_module_list_is_read():
    assert {"reprules", "reprules._modes", "reprules._shim", "reprules._shim.vma", "reprules._mode_state"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(SHIM_PREFIX)))
def test_the_shim_imports_only_itself_and_the_core(module):
    outside = {m for m in MODULES[module] if not m.startswith(SHIM_PREFIX) and m not in CORE}
    assert not outside, f"{module} imports {sorted(outside)}: the shim may use only itself and {sorted(CORE)}"


@pytest.mark.parametrize("module", sorted(CORE))
def test_the_core_imports_neither_the_shim_nor_the_facade(module):
    above = {m for m in MODULES[module] if m.startswith(SHIM_PREFIX) or m not in CORE}
    assert not above, f"{module} imports {sorted(above)}"


@pytest.mark.parametrize("module", ["reprules._mode_state", "reprules._version"])
def test_leaves(module):
    assert MODULES[module] == set()


def _package(module):
    """The shim counts as one module here."""
    return SHIM_PREFIX if module.startswith(SHIM_PREFIX) else module


PACKAGES = {}
for _name, _deps in ON_IMPORT.items():
    PACKAGES.setdefault(_package(_name), set()).update(_package(d) for d in _deps)


def test_no_import_cycles_on_import():
    """Lazy imports inside functions may point back (the layer tests above
    bound them); what runs on import has no cycle."""
    def visit(module, path):
        for dep in PACKAGES.get(module, ()):
            if dep == module:
                continue
            assert dep not in path, " -> ".join([*path, dep])
            visit(dep, [*path, dep])

    for module in PACKAGES:
        visit(module, [module])
