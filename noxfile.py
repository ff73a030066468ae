"""Test matrix and main job, each in its own virtual environment.

    python -m pip install --quiet nox uv && python -m nox            # tests, whole JAX matrix, and typecheck
    python -m nox -s "tests(jax='0.12.0.1')"                          # tests, one JAX version
    python -m nox -s tests_python                                     # tests, the other Pythons
    python -m nox -s typecheck                                        # mypy --strict, newest JAX
    python -m nox -s docs                                             # the documentation site, warnings as errors
    python -m pip install --quiet nox uv && python -m nox -s main    # the main job
"""

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests", "tests_python", "typecheck", "docs"]

# Every minor release in the supported range (its newest patch), plus the oldest
# supported one; regimes: rep (<=0.5), vma (0.6-0.9), mat (>=0.10).
JAX_MATRIX = [
    "0.4.28", "0.4.38", "0.5.3", "0.6.2", "0.7.2", "0.8.3", "0.9.2", "0.10.2", "0.11.2", "0.12.0.1",
]


# Every other Python that pyproject's requires-python claims, with one JAX each: the newest
# JAX that supports it (JAX 0.7 dropped 3.10, JAX 0.12 needs 3.12+), one regime each.
PYTHON_MATRIX = [("3.10", "0.6.2"), ("3.11", "0.10.2"), ("3.13", "0.12.0.1")]


def _run_tests(session: nox.Session, jax: str, tokamax: bool = False) -> None:
    # jax-triton (optional) needs JAX >= 0.11 and imports on CPU from there; tokamax's
    # kernels are tested under inference on the newest JAX only (it pulls ~70 packages).
    extras = "test,triton" if tuple(map(int, jax.split(".")[:2])) >= (0, 11) else "test"
    if tokamax and jax == JAX_MATRIX[-1]:
        extras += ",tokamax"
    session.install(f"jax=={jax}", f"jaxlib=={jax}", "-e", f".[{extras}]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python="3.12")
@nox.parametrize("jax", JAX_MATRIX)
def tests(session: nox.Session, jax: str) -> None:
    """Runs the test suite against one JAX version."""
    _run_tests(session, jax, tokamax=True)


@nox.session
@nox.parametrize(("python", "jax"), PYTHON_MATRIX)
def tests_python(session: nox.Session, jax: str) -> None:
    """Runs the test suite on another supported Python, with one JAX version."""
    _run_tests(session, jax)


@nox.session(python="3.12")
def typecheck(session: nox.Session) -> None:
    """``mypy --strict`` on the package and on a user's view of it, against the newest JAX."""
    session.install(f"jax=={JAX_MATRIX[-1]}", f"jaxlib=={JAX_MATRIX[-1]}", "mypy>=1.10", "-e", ".[test]")
    session.run("mypy", "--strict", "reprules", "tests/typing/usage.py", *session.posargs)


# The site's tools, pinned (mkdocstrings[python] brings mkdocstrings-python and griffe).
DOCS_TOOLS = ["mkdocs==1.6.1", "mkdocstrings[python]==1.0.8", "mkdocstrings-python==2.0.11", "mkdocs-material==9.8.1"]


@nox.session(python="3.12")
def docs(session: nox.Session) -> None:
    """The documentation site (``.docs/``), built with warnings as errors into ``.docs/site/``.

    Its code examples are run by ``tests/test_docs.py`` in the ``tests`` sessions.
    """
    session.install(f"jax=={JAX_MATRIX[-1]}", f"jaxlib=={JAX_MATRIX[-1]}", *DOCS_TOOLS, "-e", ".")
    session.run("mkdocs", "build", "--strict", "--config-file", ".docs/mkdocs.yml", *session.posargs,
                env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python="3.12")
def main(session: nox.Session) -> None:
    """The main job, on the newest supported JAX: ``reprules audit`` of its default workload."""
    session.install(f"jax=={JAX_MATRIX[-1]}", f"jaxlib=={JAX_MATRIX[-1]}", "-e", ".")
    session.run("reprules", "audit", *session.posargs)
