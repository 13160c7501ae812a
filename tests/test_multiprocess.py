"""Collective kernels across processes, with jax.distributed as the engine.

Two local processes (coordinator on 127.0.0.1, gloo collectives, 2 CPU
devices each: one 4-device ring) run tests/multiprocess_worker.py: both
collective matmul kernels on the CPU fallback's lockstep path against their
plain-XLA references, a kernel that needs the TPU simulator across the two
processes (a clear error), and a simulator launch on one process's own
device (it runs). Each process saves the shards it holds; the tests here
compare them. That the kernels run at all shows they took the lockstep path
(a simulator launch across processes raises). The job is bounded in time
and both processes are killed on failure.
"""

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

NUM_PROCESSES = 2
DEVICES = 4  # 2 per process (the worker's DEVICES_PER_PROCESS)
# Both processes import JAX, compile four collective programs and launch the
# simulator once on 2 shared cores: 30-70 s; several times that is a hang.
JOB_TIMEOUT_S = 300
WORKER = Path(__file__).with_name("multiprocess_worker.py")
KERNELS = ("all_gather_matmul", "matmul_reduce_scatter")


def _kernel_tolerances() -> dict[str, float]:
  """The f32 tolerances of the kernels' single-process tests."""
  path = Path(__file__).parent / "kernels" / "collective_matmul_util.py"
  spec = importlib.util.spec_from_file_location("_cm_test_util", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.tolerances(jnp.float32)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
  """This process's environment without JAX / XLA settings (a forced device
  count in XLA_FLAGS, say): the worker configures itself."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("XLA_", "JAX_", "TPU_"))
  }
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _logs(out: Path) -> str:
  return "\n".join(
    f"--- process {i} ---\n"
    + (out / f"process{i}.log").read_text(errors="replace")[-4000:]
    for i in range(NUM_PROCESSES)
  )


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """Runs the two-process job once; returns (reports, shards) of both."""
  out = tmp_path_factory.mktemp("multiprocess")
  port = _free_port()
  procs = []
  try:
    for i in range(NUM_PROCESSES):
      # Output to files, not pipes: a full pipe would stall one process
      # while the other waits for it in a collective.
      with open(out / f"process{i}.log", "w") as log:
        procs.append(
          subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(NUM_PROCESSES)]
            + [str(port), str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_worker_env(),
          )
        )
    try:
      for p in procs:
        p.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      pytest.fail(f"the job ran past {JOB_TIMEOUT_S} s:\n{_logs(out)}")
  finally:
    for p in procs:
      if p.poll() is None:
        # SIGKILL: jax.distributed catches SIGTERM (preemption notice).
        p.kill()
        p.wait()
  codes = [p.returncode for p in procs]
  assert codes == [0] * NUM_PROCESSES, f"exit codes {codes}:\n{_logs(out)}"
  reports = [
    json.loads((out / f"process{i}.json").read_text())
    for i in range(NUM_PROCESSES)
  ]
  shards = [
    dict(np.load(out / f"process{i}.npz")) for i in range(NUM_PROCESSES)
  ]
  return reports, shards


# Every test shares one two-process job of 30-70 s on 2 cores.
pytestmark = pytest.mark.slow


def test_the_job_is_one_ring_over_two_processes(job):
  reports, _ = job
  for report in reports:
    assert report["process_count"] == NUM_PROCESSES
    assert report["device_count"] == DEVICES
    assert report["local_device_count"] == DEVICES // NUM_PROCESSES


@pytest.mark.parametrize("kernel", KERNELS)
def test_collective_kernel_across_processes_matches_xla(job, kernel):
  _, shards = job
  tolerances = _kernel_tolerances()
  blocks = set()
  for process in shards:
    mine = sorted(k for k in process if k.startswith(f"{kernel}/"))
    # Each process holds the output blocks of its own two devices.
    assert len(mine) == DEVICES // NUM_PROCESSES, sorted(process)
    for key in mine:
      rows = key.split("/")[1]
      want = process[f"{kernel}_reference/{rows}"]
      np.testing.assert_allclose(process[key], want, **tolerances)
      blocks.add(rows)
  assert len(blocks) == DEVICES, blocks  # together: the whole output


@pytest.mark.parametrize(
  "mesh,spans",
  [
    ("mesh", r"this launch spans processes \[0, 1\]\."),
    (
      "abstract_mesh",
      r"this launch may span processes \(jax\.process_count\(\) is 2 and "
      r"the lowering does not know the launch's devices\)\.",
    ),
  ],
)
def test_a_simulator_kernel_across_processes_is_a_clear_error(job, mesh, spans):
  reports, _ = job
  for report in reports:
    error = report["simulator_errors"][mesh]
    assert error is not None, "the launch ran instead of raising"
    assert error["type"] == "NotImplementedError"
    message = error["message"]
    assert re.match(
      r"mpmd_map: kernel conditional_send at \S+multiprocess_worker\.py:\d+ "
      r"needs the CPU fallback's tpu-simulator path \(interpret= gave TPU "
      r"InterpretParams\)",
      message,
    ), message
    assert re.search(spans, message), message
    assert "runs kernels on the lockstep path" in message, message
    assert "the checking executor (interpret=None" in message, message
    assert "or run it in one process" in message, message


def test_the_checking_executor_runs_a_kernel_across_processes(job):
  """The same kernel on its default path: each process gathers the ring's
  inputs, runs every device's program and keeps its own devices' blocks."""
  _, shards = job
  rows = set()
  for process in shards:
    x = process["checked_send_input"]
    want = np.roll(x, len(x) // DEVICES, axis=0)
    for key in process:
      if key.startswith("checked_send/"):
        start, stop = (int(r) for r in key.split("/")[1].split(":"))
        np.testing.assert_array_equal(process[key], want[start:stop])
        rows.add((start, stop))
  assert len(rows) == DEVICES, rows


def test_the_simulator_still_runs_on_one_process_devices(job):
  _, shards = job
  for process in shards:
    np.testing.assert_array_equal(
      process["local_simulator"], process["local_simulator_input"]
    )
