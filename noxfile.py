"""Test matrix: one virtual environment per supported JAX version.

    python -m pip install --quiet nox uv && python -m nox            # whole matrix
    python -m nox -s "tests(jax='0.12.0.1')"                          # one version
"""

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

# At least one version per regime: rep (<=0.5), vma (0.6-0.9), mat (>=0.10).
JAX_MATRIX = ["0.4.28", "0.5.3", "0.6.2", "0.8.3", "0.10.2", "0.12.0.1"]


@nox.session(python="3.12")
@nox.parametrize("jax", JAX_MATRIX)
def tests(session: nox.Session, jax: str) -> None:
    """Runs the test suite against one JAX version."""
    session.install(f"jax=={jax}", f"jaxlib=={jax}", "-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)
