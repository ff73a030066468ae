"""reprules across 2 processes x 4 CPU devices, through JAX's own multi-process runtime.

The test starts two ``tests/_multiprocess_worker.py`` processes on a localhost
coordinator (``jax.distributed.initialize``, gloo CPU collectives), each with
4 fake CPU devices, so the (4, 2) ``("data", "model")`` mesh spans both
processes (``data`` crosses the process boundary). Each runs, with rules
registered and checking on: the #21855 model, a data-parallel MLP, a
tensor-parallel MLP and a 2-layer transformer (``reprules._demo.transformer``), all
with Pallas kernels under ``custom_vjp``. The losses
and gradients must equal those of the same steps on one process with 8 devices
(computed here) and the unsharded reference, and ``reprules.testing`` must find
no defensive collective and exactly the needed psums.

JAX 0.4.x is skipped: its CPU backend aborts (``BadStatusOrAccess``) on any
cross-process collective once a process has more than one local device.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import _multiprocess_worker as worker
import reprules
from helpers import JAX_VERSION, copy_kernel
from reprules._demo import transformer

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
TIMEOUT_S = 240  # both workers, start to finish (about 15 s on 2 cores)
HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(
    JAX_VERSION < (0, 5, 0),
    reason="JAX 0.4.x CPU backend: cross-process gloo collectives abort (BadStatusOrAccess) with more "
    "than one local device per process (checked on 0.4.28; works from 0.5.3)",
)

STEPS = ("issue21855", "dp_mlp", "tp_mlp", "transformer")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out_dir: str) -> list[tuple[int, str]]:
    """Runs the workers to completion; returns (exit code, log) per process."""
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs, logs = [], []
    try:
        for i in range(NUM_PROCESSES):
            log = open(os.path.join(out_dir, f"log-{i}.txt"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "_multiprocess_worker.py"),
                 "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(NUM_PROCESSES),
                 "--process-id", str(i), "--local-devices", str(LOCAL_DEVICES), "--out", out_dir],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.path.dirname(HERE)))
        deadline = time.monotonic() + TIMEOUT_S
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    results = []
    for code, log in zip(codes, logs):
        log.seek(0)
        text = "".join(line for line in log if not line.startswith("[Gloo]"))
        log.close()
        results.append((code, text))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(per-process npz and json, single-process results) of every step."""
    import json

    out_dir = str(tmp_path_factory.mktemp("multiprocess"))
    results = _launch(out_dir)
    failed = [(i, code, text) for i, (code, text) in enumerate(results) if code != 0]
    if failed:
        details = "\n".join(
            f"--- process {i}: {'timed out after %d s' % TIMEOUT_S if code is None else f'exit code {code}'}\n"
            f"{text[-4000:]}" for i, code, text in failed)
        pytest.fail(f"multi-process workers failed (JAX {jax.__version__}):\n{details}", pytrace=False)
    processes = []
    for i in range(NUM_PROCESSES):
        with open(os.path.join(out_dir, f"process-{i}.json")) as f:
            summary = json.load(f)
        arrays = dict(np.load(os.path.join(out_dir, f"process-{i}.npz")))
        processes.append((summary, arrays))

    # The same steps on this process's 8 devices, with the same rules.
    worker.register_rules()
    try:
        mesh = worker.make_mesh(jax.devices()[: NUM_PROCESSES * LOCAL_DEVICES])

        def place(value, spec):
            return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))

        steps = worker.workloads(mesh, place)
        single = {}
        for name, step in steps.items():
            loss, grads = jax.jit(step.step)(*step.args)
            single[name] = (float(loss), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)],
                            step.reference(), step.psum_axes)
    finally:
        reprules.unregister(copy_kernel)
        for kernel in transformer.kernels():
            reprules.unregister(kernel)
    return processes, single


def _assemble(processes, name):
    """The loss (per process) and the full gradients, from the processes' shards."""
    losses = [float(arrays[f"{name}.loss"]) for _, arrays in processes]
    grads = []
    i = 0
    while f"{name}.grad{i}" in processes[0][1]:
        full = np.zeros_like(processes[0][1][f"{name}.grad{i}"])
        seen = np.zeros(full.shape, bool)
        for _, arrays in processes:
            mask = arrays[f"{name}.mask{i}"]
            full[mask] = arrays[f"{name}.grad{i}"][mask]
            seen |= mask
        assert seen.all(), f"{name}: gradient {i} has elements no process holds"
        grads.append(full)
        i += 1
    return losses, grads


def test_runtime_spans_two_processes(runs):
    processes, _ = runs
    for i, (summary, _) in enumerate(processes):
        info = summary["info"]
        assert info["process_index"] == i
        assert (info["process_count"], info["devices"], info["local_devices"]) == (2, 8, 4), info


@pytest.mark.parametrize("name", STEPS)
def test_same_loss_and_gradients_as_one_process(runs, name):
    processes, single = runs
    losses, grads = _assemble(processes, name)
    one_loss, one_grads, (ref_loss, ref_grads), _ = single[name]
    ref_grads = [np.asarray(g) for g in jax.tree_util.tree_leaves(ref_grads)]
    assert losses[0] == losses[1]  # a replicated scalar: identical on both processes
    np.testing.assert_allclose(losses[0], one_loss, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(losses[0], float(ref_loss), rtol=1e-5, atol=1e-5)
    assert len(grads) == len(one_grads) == len(ref_grads)
    for g, one, ref in zip(grads, one_grads, ref_grads):
        np.testing.assert_allclose(g, one, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", STEPS)
def test_only_the_needed_collectives(runs, name):
    processes, single = runs
    want = sorted(list(a) for a in single[name][3])
    for i, (summary, _) in enumerate(processes):
        step = summary["steps"][name]
        defensive = [c["describe"] for c in step["collectives"] if c["defensive"]]
        assert not defensive, f"process {i}, {name}: defensive collectives:\n" + step["table"]
        assert step["psum_axes"] == want, f"process {i}, {name}:\n" + step["table"]
        # Every psum the program or the rules wrote is compiled, not just traced.
        for c in step["collectives"]:
            if "jaxpr" in c["levels"]:
                assert c["levels"] == ["jaxpr", "stablehlo", "hlo"], c["describe"]


def test_transformer_bytes_per_process(runs):
    """Each device of each process moves what the formula (reprules._demo.scale) says one
    device of the 8 needs: the program's all-reduces, nothing defensive (compiled HLO
    adds the loss's 4-byte all-reduce, and JAX 0.5 an unmatched copy of one gradient's)."""
    processes, _ = runs
    mesh = dict(zip(worker.MESH_AXES, worker.MESH_SHAPE))
    expected = transformer.expected_bytes(worker.transformer_config(), mesh)
    for i, (summary, _) in enumerate(processes):
        step = summary["steps"]["transformer"]
        assert (step["jaxpr_bytes"], step["defensive_bytes"]) == (expected.needed, 0), (
            f"process {i}:\n" + step["table"])
        assert step["bytes"] - step["jaxpr_bytes"] <= 4 * worker.transformer_config().d_model, step["table"]


def test_check_off_run_shows_the_defensive_all_reduce(runs):
    """Without reprules (checking off), the #21855 backward all-reduces over
    ``model``, where ``x`` is replicated: the report sees it across processes."""
    processes, single = runs
    losses, grads = _assemble(processes, "issue21855_check_off")
    np.testing.assert_allclose(grads[0], single["issue21855_check_off"][1][0], rtol=1e-5, atol=1e-6)
    for summary, _ in processes:
        step = summary["steps"]["issue21855_check_off"]
        defensive = [c for c in step["collectives"] if c["defensive"]]
        assert [(c["kind"], c["axes"]) for c in defensive] == [("all-reduce", ["model"])], step["table"]
