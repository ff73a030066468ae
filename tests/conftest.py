"""Test set-up: 8 fake CPU devices before any JAX backend starts."""

from reprules import testing

testing.fake_cpu_devices(8)  # before anything starts JAX's backend

import jax  # noqa: E402
import pytest  # noqa: E402

import reprules  # noqa: E402


def pytest_sessionstart(session):
    if jax.device_count() < 8:
        raise pytest.UsageError(
            f"reprules' tests need 8 fake CPU devices, found {jax.device_count()}: a JAX backend "
            "started before tests/conftest.py could set XLA_FLAGS."
        )


@pytest.fixture(autouse=True)
def _clean_registry():
    """Every test starts and ends with no rules and no JAX patches (cleared before too: a
    test module's import-time registration would otherwise reach the worker's first test)."""
    _unregister_all()
    yield
    _unregister_all()


def _unregister_all():
    for reg in list(reprules.registered().values()):
        kernel = reg.kernel()
        if kernel is not None:
            reprules.unregister(kernel)


@pytest.fixture
def no_inference():
    """reprules as with ``REPRULES_INFER=0``: no rule derived from a kernel body, even
    for a kernel JAX would refuse (what every test about the teaching MissingRuleError needs)."""
    import reprules

    with reprules.inference(False):
        yield


@pytest.fixture
def dormant():
    """reprules as with ``REPRULES_DORMANT=1``: JAX patched only while rules (or
    inference) need it. Importing Pallas arms reprules in every test otherwise."""
    from reprules import _shim

    was = _shim.armed()
    _shim.disarm()
    yield
    if was:
        _shim.arm()


@pytest.fixture
def mesh():
    """The (4, 2) ('data', 'model') mesh most tests run on."""
    from helpers import make_mesh

    return make_mesh()


@pytest.fixture(scope="module")
def data():
    """The mesh, an ``x`` split over 'data' (data-dependent: XLA folds no constant) and a
    replicated weight ``w``: the data-parallel case of the sound-types tests."""
    from helpers import make_mesh, put, randn
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh()
    x = put(randn(0, (8, 16)) + 2.0, mesh, P("data", None))
    w = put(randn(1, (16,)), mesh, P())
    return mesh, x, w
