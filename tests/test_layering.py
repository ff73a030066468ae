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

# The core: no JAX, no shim, no façade. The errors' messages are core too (_messages/).
MESSAGES = {"reprules._messages", "reprules._messages.advice", "reprules._messages.out_types",
            "reprules._messages.gradients", "reprules._messages.calls"}
CORE = {"reprules._errors", "reprules.rules", "reprules._registry", "reprules._decide", "reprules._mode_state",
        "reprules._version"} | MESSAGES

# The shim's folders, one concern each, lowest first (the shim's __init__ has the
# same table, saying what each owns). A module imports only from its own folder,
# lower folders and the core; the cycle test below keeps imports within a folder
# one way. The façade (reprules._shim itself) stands on top of them all.
SHIM_FOLDERS = ["plumbing", "kernels", "inference", "rules", "safety", "cotangents", "sound_types", "entry_points",
                "eras"]
FACADE = "reprules._shim"


def _folder_rank(module):
    """The rank of ``module``'s folder in SHIM_FOLDERS (the façade ranks above them all)."""
    if module == FACADE:
        return len(SHIM_FOLDERS)
    return SHIM_FOLDERS.index(module.split(".")[2])


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
    assert {"reprules", "reprules._modes", "reprules._shim", "reprules._shim.plumbing._jax", "reprules._shim.eras.vma",
            "reprules._mode_state"} <= set(MODULES)
    assert MODULES["reprules._shim.eras.vma"] >= {"reprules._shim.entry_points.pallas_call", "reprules._shim.entry_points.core_map"}


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


SHIM = sorted(m for m in MODULES if m.startswith(FACADE))


def test_the_shim_is_its_folders():
    """No module beside the façade: each sits in the folder of its concern."""
    loose = [m for m in SHIM if m != FACADE and (len(m.split(".")) not in (3, 4) or m.split(".")[2] not in SHIM_FOLDERS)]
    assert not loose, f"modules outside the shim's folders {SHIM_FOLDERS}: {loose}"
    assert {f"{FACADE}.{f}" for f in SHIM_FOLDERS} <= set(SHIM), "a folder of SHIM_FOLDERS is missing"
    assert all(any(m.startswith(f"{FACADE}.{f}.") for m in SHIM) for f in SHIM_FOLDERS), "an empty folder"


@pytest.mark.parametrize("folder", SHIM_FOLDERS)
def test_a_folder_says_what_it_owns_and_imports_nothing(folder):
    """Its ``__init__`` is one docstring: importing one module of a folder loads no other."""
    tree = TREES[f"{FACADE}.{folder}"]
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 30, f"{folder}/__init__.py: say what the folder owns"
    assert len(tree.body) == 1, f"{folder}/__init__.py holds code besides its docstring"


def test_the_facade_table_lists_the_folders_in_their_order():
    table = ast.get_docstring(TREES[FACADE]).split("Lowest first:")[1]
    rows = re.findall(r"^``(\w+)``\s{2,}", table, re.M)
    assert rows == SHIM_FOLDERS


@pytest.mark.parametrize("module", SHIM)
def test_a_shim_module_imports_only_its_folder_lower_folders_and_the_core(module):
    for dep in MODULES[module]:
        if dep.startswith(FACADE):
            assert _folder_rank(dep) <= _folder_rank(module), f"{module} imports {dep}, a folder above its own"
        else:
            assert dep in CORE, f"{module} imports {dep}: the shim may use only itself and {sorted(CORE)}"


def test_the_rest_of_reprules_reaches_the_shim_through_its_facade():
    """Beside the façade, only the version facts of ``plumbing._jax`` (read before the shim is armed)."""
    allowed = {FACADE, f"{FACADE}.plumbing._jax"}
    reaching_in = [f"{m} imports {dep}" for m in MODULES if not m.startswith(FACADE)
                   for dep in MODULES[m] if dep.startswith(FACADE) and dep not in allowed]
    assert not reaching_in, reaching_in


def test_one_lookup_of_a_pallas_calls_kernel_per_bind():
    """The bind hook looks the kernel up (``PallasCall.of``) and hands the call down: the
    era's bind and the rules it asks take the call, never the params to look up again."""
    hooks = SOURCES[f"{FACADE}.entry_points._pallas_hooks"]
    bind = hooks[hooks.index("    def bind("):hooks.index("    patches.setattr(prim, \"bind\", bind)")]
    assert bind.count("PallasCall.of(") == 1 and "kernel_of(" not in bind
    adapter = SOURCES[f"{FACADE}.entry_points.pallas_call"]
    for body in (adapter[adapter.index("    def _bind("):adapter.index("    def _check_annotations(")],):
        assert "kernel_of(" not in body and "PallasCall.of(" not in body and "kernel_name_from_params" not in body
        assert "site_text(params" not in body and "(params)" not in body.replace("pallas_registration(params)", "")


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
            if any(m.startswith("jax._src") for m in modules) and name != "reprules._shim.plumbing._jax":
                offenders.append(f"{name}:{node.lineno}")
            if any(m == "importlib" for m in modules) and name.startswith("reprules._shim") \
                    and name != "reprules._shim.plumbing._jax":
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
    assert "reprules._demo.transformer" in MODULES["reprules._demo.workloads"]
    assert "reprules._demo.workloads" not in MODULES["reprules._demo.transformer"]


def test_the_compatibility_page_shows_the_folders_in_their_order():
    """The docs' table of the shim's folders is the one this test enforces."""
    page = (ROOT / ".docs/pages/jax-compatibility.md").read_text()
    section = page.split("## How reprules is laid out")[1].split("\n## ")[0]
    shim_table, top_table = section.split("\n\n| folder |")[1:3]
    assert re.findall(r"^\| `(\w+)` \|", shim_table, re.M) == SHIM_FOLDERS
    assert set(re.findall(r"^\| `(\w+)` \|", top_table, re.M)) <= set(TOP_FOLDERS)


TOP_FOLDERS = ["_shim", "_report", "_audit", "_demo", "_builtin_packs", "_cpu_kernels", "_messages"]


def test_each_folder_of_the_package_says_what_it_owns():
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(TOP_FOLDERS)
    for folder in TOP_FOLDERS:
        assert ast.get_docstring(TREES[f"reprules.{folder}"]), f"reprules/{folder}/__init__.py: say what it owns"


def test_the_messages_are_their_folder():
    """Every module of ``_messages/`` is core (listed in MESSAGES), and ``_errors`` builds no message
    it could import from there: the messages import the errors, never the reverse."""
    assert {m for m in MODULES if m.startswith("reprules._messages")} == MESSAGES
    assert not any(m.startswith("reprules._messages") for m in MODULES["reprules._errors"])


def test_the_report_and_the_audit_stand_in_that_order():
    """The audit renders reports; the report never imports the audit, and the shim neither."""
    for module in MODULES:
        deps = MODULES[module]
        if module.startswith(("reprules._report", FACADE)):
            assert not any(d.startswith("reprules._audit") for d in deps), f"{module} imports the audit"
        if module.startswith(FACADE):
            assert not any(d.startswith("reprules._report") for d in deps), f"{module} imports the report"
