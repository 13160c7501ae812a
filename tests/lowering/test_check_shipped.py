"""Every shipped TPU kernel, demo and example runs clean on the checker.

The demos (``mpmd lower NAME``) are explored under a few schedules each and
must match their normal run bit for bit; the TPU examples run as scripts
with ``MPMD_CHECK`` set, so every launch in them takes a random schedule of
its own and their own correctness checks run on its results.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import mpmd
from mpmd import demos
from mpmd.kernels import gmm, tgmm


def _runnable(demo) -> bool:
  """A demo with concrete arguments (some carry only shapes, to lower)."""
  return "tpu" in demo.platforms and not any(
    isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(demo.args)
  )


TPU_DEMOS = sorted(
  name for name, make in demos.registered().items() if _runnable(make())
)


@pytest.mark.parametrize("name", TPU_DEMOS)
def test_demo_is_clean_under_explore(name):
  demo = demos.registered()[name]()
  devices = jax.devices()[: demo.num_devices]
  assert len(devices) == demo.num_devices
  f = jax.jit(demo.fn)
  report = mpmd.explore(f, *demo.args, schedules=4)
  assert report.failures == [], str(report)
  checked = mpmd.replay(f, *demo.args, schedule="random:2")
  for got, want in zip(
    jax.tree.leaves(checked), jax.tree.leaves(f(*demo.args)), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("tiling", [None, (32, 128, 128)])
def test_grouped_matmuls_are_clean(tiling):
  rng = np.random.default_rng(0)
  m, k, n = 64, 128, 128
  lhs = jax.numpy.asarray(rng.standard_normal((m, k)), np.float32)
  rhs = jax.numpy.asarray(rng.standard_normal((3, k, n)), np.float32)
  sizes = jax.numpy.array([20, 0, 44], np.int32)
  forward = jax.jit(lambda a, b, s: gmm(a, b, s, tiling=tiling))
  transposed = jax.jit(lambda a, b, s: tgmm(a.T, b, s, tiling=tiling))
  for f, args in (
    (forward, (lhs, rhs, sizes)),
    (transposed, (lhs, lhs, sizes)),
  ):
    report = mpmd.explore(f, *args, schedules=3)
    assert report.failures == [], str(report)
    np.testing.assert_array_equal(
      mpmd.replay(f, *args, schedule="random:1"), f(*args)
    )


EXAMPLES = Path(__file__).parent.parent.parent / "examples"
TPU_EXAMPLES = [
  "collective_matmul",
  "grouped_matmul",
  "moe_expert_parallel",
  "producer_consumer",
  "quickstart",
  "ring_all_reduce",
]


@pytest.mark.slow
@pytest.mark.parametrize("example", TPU_EXAMPLES)
def test_example_is_clean_with_every_launch_checked(example):
  env = dict(os.environ, MPMD_CHECK="random:0")
  run = subprocess.run(
    [sys.executable, str(EXAMPLES / f"{example}.py")],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip() and "FAIL" not in run.stdout, run.stdout
