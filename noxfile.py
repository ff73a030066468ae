"""Test matrix and main job, each in its own virtual environment.

    python -m pip install --quiet nox uv && python -m nox            # the default: tests (whole JAX matrix), tests_upgrade_flags, tests_python, typecheck, docs
    python -m nox -s "tests(jax='0.12.0.1')"                          # tests, one JAX version
    python -m nox -s tests_upgrade_flags                              # tests, newest JAX with its announced defaults
    python -m nox -s tests_python                                     # tests, the other Pythons
    python -m nox -s typecheck                                        # mypy --strict, newest JAX
    python -m nox -s docs                                             # the documentation site, warnings as errors
    python -m nox -s coverage                                         # every op of the kernel libraries: the coverage table
    python -m nox -s coverage_pinned                                  # the same for the libraries that pin JAX 0.11.2
    python -m pip install --quiet nox uv && python -m nox -s main    # the main job
"""

import os
import time
from collections.abc import Sequence

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests", "tests_upgrade_flags", "tests_python", "typecheck", "docs"]

# Every minor release in the supported range (its newest patch), plus the oldest
# supported one; regimes: rep (<=0.5), vma (0.6-0.9), mat (>=0.10).
JAX_MATRIX = [
    "0.4.28", "0.4.38", "0.5.3", "0.6.2", "0.7.2", "0.8.3", "0.9.2", "0.10.2", "0.11.2", "0.12.0.1",
]


# Every other Python that pyproject's requires-python claims, with one JAX each: the newest
# JAX that supports it (JAX 0.7 dropped 3.10, JAX 0.12 needs 3.12+), one regime each.
PYTHON_MATRIX = [("3.10", "0.6.2"), ("3.11", "0.10.2"), ("3.13", "0.12.0.1")]

# What can differ by Python, not by JAX (the tests sessions run everything on 3.12 with each
# JAX): the syntax of every module (test_layering parses them all), the CLI and its HTML page,
# the pytest plugin and the modes, plus the core: registration, #21855 and the compositions.
PYTHON_SUITE = [
    "tests/test_layering.py", "tests/test_registration.py", "tests/test_issue21855.py",
    "tests/test_custom_vjp.py", "tests/test_compositions.py", "tests/test_no_harm.py",
    "tests/test_cli.py", "tests/test_audit_html.py", "tests/test_plugin.py", "tests/test_modes.py",
    "tests/test_testing.py",
]


EJKERNEL = "ejkernel==0.0.80.3"
EJKERNEL_IMPORTS = ["beartype", "chex", "einops", "pydantic", "tqdm"]
# MaxText declares no dependencies; its kernel modules (megablox through its quantization layer)
# import these, which bring only pure-Python packages (no transformers, grain or tensorflow).
MAXTEXT = "maxtext==0.2.5"
MAXTEXT_IMPORTS = ["aqtp", "jinja2", "pathwaysutils"]
# NVIDIA Warp runs its kernels on CPU (its wheel brings only numpy). kups pins dependencies that
# conflict with the newest JAX (and brings ase, h5py, matplotlib...): installed without them.
WARP = "warp-lang==1.19.0"
KUPS = "kups==1.0.8"
KUPS_IMPORTS = ["slub"]
# recurrentgemma pins numpy < 2.4 (and pulls torch with its extras): installed without its pins;
# importing recurrentgemma.jax.pallas imports the whole recurrentgemma.jax package (flax, orbax).
RECURRENTGEMMA = "recurrentgemma==1.0.1"
RECURRENTGEMMA_IMPORTS = ["absl-py", "einops", "flax", "jaxtyping", "orbax-checkpoint", "sentencepiece", "typeguard<3"]
# Levanter (PyPI marin-levanter) pins jax < 0.12 and brings transformers, wandb, datasets...:
# it and its marin-* siblings at the same version without dependencies, then what its fused
# cross-entropy's modules import (finestore/rigging reach for cloud storage at import).
MARIN = "0.2.227.dev40316220070"
LEVANTER = [f"marin-levanter=={MARIN}", f"marin-haliax=={MARIN}", f"marin-rigging=={MARIN}",
            f"marin-finestore=={MARIN}"]
LEVANTER_IMPORTS = ["aqtp", "braceexpand", "draccus", "equinox", "google-cloud-storage", "msgspec", "pyarrow",
                    "pydantic", "requests", "s3fs", "safetensors", "zstandard"]
# Libraries that pin JAX 0.11.2 (session coverage_pinned). tpu-inference (vLLM's TPU backend) brings
# vLLM, torch, libtpu and transformers: installed without dependencies; its package imports requests
# (its TPU-info probe). vLLM's logger and tpu_inference.utils (torch at import) are stood in at the
# test site (.ci/coverage/cases_tpu_inference.py): no CPU torch wheel exists for Python 3.12 here.
TPU_INFERENCE = "tpu-inference==0.32.0"
TPU_INFERENCE_IMPORTS = ["requests"]
# deltanet-tpu asks only for jax >= 0.11.2, < 0.12: installed as users would.
DELTANET = "deltanet-tpu==0.3.0"
PINNED = ["tpu_inference", "deltanet"]  # .ci/coverage/run.py's names
# jax-flash-attn2 pins triton < 3.3 (whose autotuner asks torch for a GPU driver at import) and
# eformer, which pins ray[serve] (a web stack): both without dependencies, the triton that
# jax-triton brings (the triton extra), and what its modules import (eformer's reach ray at import).
FLASH_ATTN2 = ["jax-flash-attn2==0.0.3", "eformer==0.0.15"]
FLASH_ATTN2_IMPORTS = ["chex", "einops<0.9", "mergedeep<1.4", "ray==2.42.1", "tblib<3.1"]
# augax asks only for jax and numpy: installed with them (in the tests sessions too: one small wheel).
AUGAX = "augax==0.3.0"


def _install(session: nox.Session, *args: str) -> None:
    # Bytecode at install time (pip's default; uv's only when asked): a machine that sets
    # PYTHONDONTWRITEBYTECODE would otherwise compile JAX from source in every process the
    # suite starts (~3 s each: every subprocess test, every pytest-xdist worker).
    session.install(*args, env={"UV_COMPILE_BYTECODE": "1"})


# Tests that run on a sample of the matrix (node id prefix -> JAX versions), each the slowest of
# what it checks and its JAX-facing parts tested in every session by other tests: the benchmark's
# smoke test (a minute of CPU: the script), once per regime; the front end, on the oldest JAX and
# each regime's newest (the Python sessions add 0.6.2 and 0.10.2): the pytest plugin (pytester's
# inner sessions), the CLI and its HTML page (the audit's figures: test_communication and
# test_cost_model everywhere), the coverage script, and each example run as a script (each
# example's step is audited in every session: test_examples' test_reprules_audit_of_the_example);
# likewise the two-process run (its models are checked in one process everywhere). Megablox with
# per-shard group sizes runs on 0.11+, one way into the TPU interpreter on 0.11 (a minute a way
# there, four times 0.12's; the other way's entry is tested everywhere by the dynamic-grid test).
BENCH_SMOKE = "tests/test_examples.py::test_benchmark_smoke"
FRONT_END = ["tests/test_plugin.py", "tests/test_cli.py", "tests/test_audit_html.py", "tests/test_coverage_script.py",
             "tests/test_examples.py::test_example_runs", "tests/test_multiprocess.py"]
SAMPLED = {
    BENCH_SMOKE: ["0.5.3", "0.9.2", JAX_MATRIX[-1]],
    **dict.fromkeys(FRONT_END, ["0.4.28", "0.5.3", "0.9.2", JAX_MATRIX[-1]]),
    "tests/test_megablox_per_shard.py::test_gmm_with_group_sizes_sharded_over_data_equals_ragged_dot_per_shard"
    "[InterpretParams]": [JAX_MATRIX[-1]],
}


def _run_tests(session: nox.Session, jax: str, tokamax: bool = False, files: Sequence[str] = (),
               env: dict[str, str] | None = None, deselect: Sequence[str] = (),
               counts: tuple[str, str] | None = None) -> None:
    # jax-triton (optional) needs JAX >= 0.11 and imports on CPU from there; tokamax's
    # kernels are tested under inference on the newest JAX only (it pulls ~70 packages).
    extras = "test,triton" if tuple(map(int, jax.split(".")[:2])) >= (0, 11) else "test"
    if tokamax and jax == JAX_MATRIX[-1]:
        extras += ",tokamax"
    _install(session, f"jax=={jax}", f"jaxlib=={jax}", "-e", f".[{extras}]")
    if tokamax and jax == JAX_MATRIX[-1]:
        # ejkernel pins jax~=0.10 but imports and runs on the newest JAX: installed without its
        # pins (its pack's test, tests/test_ejkernel.py), with the pure-Python packages it imports.
        _install(session, "--no-deps", EJKERNEL)
        _install(session, *EJKERNEL_IMPORTS)
        # MaxText's kernels (tests/test_maxtext.py: its maxtext and qwix packs); maxtext itself
        # without dependencies, then what its kernel modules import, with the JAX above kept.
        _install(session, "--no-deps", MAXTEXT)
        _install(session, *MAXTEXT_IMPORTS, f"jax=={jax}", f"jaxlib=={jax}")
        # Warp (tests/test_warp.py), augax (tests/test_augax.py) and kups (tests/test_kups.py): kups
        # without its pins, with the one package its primitives' modules import (slub, which asks only for jax).
        _install(session, WARP, AUGAX, *KUPS_IMPORTS, f"jax=={jax}", f"jaxlib=={jax}")
        _install(session, "--no-deps", KUPS)
    # The soundness fuzzer (tests/test_fuzz_inference.py): a seed that changes between runs (CI pins
    # one: .ci/run), printed here so that a failure can be replayed; 150 kernels on the newest JAX, 40
    # elsewhere (its kernels' jaxprs differ little between versions; the share elsewhere checks each
    # version's forms). New seeds are run by hand, long, as the program fuzzer's.
    seed = os.environ.get("REPRULES_FUZZ_SEED") or str(int(time.time()) % 2**31)
    newest = jax == JAX_MATRIX[-1] and counts is None
    count = os.environ.get("REPRULES_FUZZ_COUNT") or (counts[0] if counts else "150" if newest else "40")
    session.log(f"soundness fuzzer: REPRULES_FUZZ_SEED={seed}, {count} kernels on JAX {jax}")
    # The program fuzzer (tests/test_fuzz_programs.py): the same seed; 200 programs on the
    # newest JAX, 50 elsewhere.
    programs = os.environ.get("REPRULES_PROGRAM_FUZZ_COUNT") or (counts[1] if counts else "200" if newest else "50")
    deselect = [*deselect, *(test for test, versions in SAMPLED.items() if jax not in versions and not files)]
    session.log(f"program fuzzer: REPRULES_FUZZ_SEED={seed}, {programs} programs on JAX {jax}")
    # One pytest-xdist worker per core (the tests are single-threaded Python, mostly tracing);
    # reprules' own modules and the tests may cache their bytecode too.
    session.run("python", "-m", "pytest", "-n", "auto", *(session.posargs or files),
                *(arg for test in deselect for arg in ("--deselect", test)),
                env={"PYTHONDONTWRITEBYTECODE": None, "REPRULES_FUZZ_SEED": seed, "REPRULES_FUZZ_COUNT": count,
                     "REPRULES_PROGRAM_FUZZ_COUNT": programs, **(env or {})})


@nox.session(python="3.12")
@nox.parametrize("jax", JAX_MATRIX)
def tests(session: nox.Session, jax: str) -> None:
    """Runs the test suite against one JAX version."""
    _run_tests(session, jax, tokamax=True)


# JAX's announced defaults: the flags JAX 0.12 marks `upgrade=True` (the incoming behaviour,
# off by default for now) and `jax_auto_pcast`, whose default its code marks to become False (no
# automatic pvary where a replicated value meets a varying one). Set through their environment
# variables, which JAX reads when it defines each flag, so every process the suite starts (the
# pytest-xdist workers, the examples, the CLI's) runs under them.
UPGRADE_FLAGS = {"JAX_REMAT3": "1", "JAX_CUSTOM_VJP3": "1", "JAX_CUSTOM_JVP3": "1"}
NO_AUTO_PCAST = {"JAX_AUTO_PCAST": "0"}


@nox.session(python="3.12")
def tests_upgrade_flags(session: nox.Session) -> None:
    """Runs the test suite against the newest JAX with its announced defaults on.

    The whole suite with ``jax_remat3``, ``jax_custom_vjp3`` and ``jax_custom_jvp3`` on; the
    examples (``tests/test_examples.py``) with ``jax_auto_pcast`` off too. Not the whole suite
    with it off: on JAX 0.12.0.1 JAX itself refuses, inside ``shard_map``, a float constant next
    to a varying value (``2.0 * x``, ``jnp.mean``, the gradients of ``x ** 2`` and
    ``jax.nn.relu``), which the tests, like users, write everywhere. Checks first that each flag
    takes effect (a renamed or removed flag would make its environment variable a silent no-op).
    """
    jax = JAX_MATRIX[-1]
    flags = {**UPGRADE_FLAGS, **NO_AUTO_PCAST}
    check = ("import jax; want = {'jax_remat3': True, 'jax_custom_vjp3': True, 'jax_custom_jvp3': True, "
             "'jax_auto_pcast': False}; got = {k: getattr(jax.config, k) for k in want}; "
             "print('JAX', jax.__version__, got); assert got == want, got")
    _install(session, f"jax=={jax}", f"jaxlib=={jax}")
    session.run("python", "-c", check, env=flags)
    # Known open under jax_custom_vjp3 (JAX refuses, never silently wrong): MaxText's megablox bwd
    # returns the weight gradient typed varying over 'data' for a weight replicated there, and
    # reprules' custom_vjp cotangent fix (which psums it with vjp3 off) does not reach it.
    # The flags change how JAX differentiates (custom_vjp, custom_jvp, remat), so the suite runs
    # without what the flags cannot change: the CLI, the HTML page, the docs' claims (forward
    # only), the layering, the plugin's machinery, the second process of a multi-process run and
    # the inference fuzzer (forward types); the program fuzzer (each program differentiated) runs
    # the other versions' share. The examples run once, below, under every announced default.
    unaffected = ["test_cli.py", "test_audit_html.py", "test_docs_claims.py", "test_layering.py", "test_plugin.py",
                  "test_multiprocess.py", "test_fuzz_inference.py", "test_examples.py"]
    _run_tests(session, jax, tokamax=True, env=UPGRADE_FLAGS, counts=("0", "50"), deselect=[
        *(f"tests/test_maxtext.py::test_moe_gmm_forward_and_gradients[{route}-tokamax]" for route in ("ep", "fsdp"))],
               files=["tests", *(arg for name in unaffected for arg in ("--ignore", f"tests/{name}"))])
    # (the benchmark's workloads use jax.nn.relu and gelu inside shard_map: refused by JAX there)
    session.run("python", "-m", "pytest", "-n", "auto", "tests/test_examples.py",
                "--deselect", "tests/test_examples.py::test_benchmark_smoke",
                env={"PYTHONDONTWRITEBYTECODE": None, **flags})


@nox.session
@nox.parametrize(("python", "jax"), PYTHON_MATRIX)
def tests_python(session: nox.Session, jax: str) -> None:
    """Runs the Python-sensitive part of the suite on Python 3.10, 3.11 and 3.13, one JAX each."""
    _run_tests(session, jax, files=PYTHON_SUITE)


@nox.session(python="3.12")
def typecheck(session: nox.Session) -> None:
    """``mypy --strict`` on the package and on a user's view of it, against the newest JAX."""
    _install(session, f"jax=={JAX_MATRIX[-1]}", f"jaxlib=={JAX_MATRIX[-1]}", "mypy>=1.10", "-e", ".[test]")
    session.run("mypy", "--strict", "reprules", "tests/typing/usage.py", *session.posargs)


# The site's tools, pinned (mkdocstrings[python] brings mkdocstrings-python and griffe).
DOCS_TOOLS = ["mkdocs==1.6.1", "mkdocstrings[python]==1.0.8", "mkdocstrings-python==2.0.11", "mkdocs-material==9.8.1"]


@nox.session(python="3.12")
def docs(session: nox.Session) -> None:
    """The documentation site (``.docs/``), built with warnings as errors into ``.docs/site/``.

    Then ``tests/test_docs_site.py`` opens every page of it in headless Chromium at 1280 px
    (nothing scrolls sideways; skipped, saying so, without Chromium). Its code examples are
    run by ``tests/test_docs.py`` in the ``tests`` sessions.
    """
    _install(session, f"jax=={JAX_MATRIX[-1]}", f"jaxlib=={JAX_MATRIX[-1]}", *DOCS_TOOLS, "pytest>=8",
             "-e", ".")
    session.run("mkdocs", "build", "--strict", "--config-file", ".docs/mkdocs.yml", *session.posargs,
                env={"NO_MKDOCS_2_WARNING": "1"})
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "tests/test_docs_site.py",
                env={"REPRULES_DOCS_SITE": ".docs/site"})


@nox.session(python="3.12")
def main(session: nox.Session) -> None:
    """The main job, on the newest supported JAX: ``reprules audit`` of its default workload (not in the default run)."""
    _install(session, f"jax=={JAX_MATRIX[-1]}", f"jaxlib=={JAX_MATRIX[-1]}", "-e", ".")
    session.run("reprules", "audit", *session.posargs)


@nox.session(python="3.12")
def coverage(session: nox.Session) -> None:
    """Every op of the kernel libraries reprules has packs or cases for, measured on CPU.

    ``.ci/coverage/run.py``: each op in its own process, unsharded, with checking off, with
    checking on and only ``import reprules``, and under ``reprules.inference()``; prints the
    README's coverage table. Arguments go to the script: ``-- jax --json coverage.json``.
    Not in the default sessions: it takes tens of minutes on CPU.
    """
    jax = JAX_MATRIX[-1]
    pins = (f"jax=={jax}", f"jaxlib=={jax}")
    _install(session, *pins, "-e", ".[test,tokamax,triton]")
    _install(session, "--no-deps", EJKERNEL, MAXTEXT, KUPS, RECURRENTGEMMA, *LEVANTER, *FLASH_ATTN2)
    _install(session, *pins, *EJKERNEL_IMPORTS, *MAXTEXT_IMPORTS, WARP, *KUPS_IMPORTS, *RECURRENTGEMMA_IMPORTS,
             *LEVANTER_IMPORTS, *FLASH_ATTN2_IMPORTS, AUGAX)
    session.run("python", ".ci/coverage/run.py", *(f"--except={name}" for name in PINNED), *session.posargs)


@nox.session(python="3.12")
def coverage_pinned(session: nox.Session) -> None:
    """``coverage`` for the kernel libraries that pin JAX 0.11.2 (tpu-inference, deltanet-tpu), on JAX 0.11.2.

    The same script and setting, only these libraries; arguments go to the script after
    them: ``-- --json coverage_pinned.json``. Their tests run in its environment:
    ``.nox/coverage_pinned/bin/python -m pytest tests/test_tpu_inference.py tests/test_deltanet.py``.
    Not in the default sessions.
    """
    jax = JAX_MATRIX[-2]
    pins = (f"jax=={jax}", f"jaxlib=={jax}")
    _install(session, *pins, "-e", ".[test]", DELTANET, *TPU_INFERENCE_IMPORTS)
    _install(session, "--no-deps", TPU_INFERENCE)
    session.run("python", ".ci/coverage/run.py", *PINNED, *session.posargs)
