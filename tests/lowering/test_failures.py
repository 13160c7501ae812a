"""A failed launch: a typed, short error, and a healthy process after it.

Failures happen inside XLA host callbacks. They must not poison JAX's
runtime token (every later ordered callback would re-raise them), must reach
the caller as ``mpmd.DeadlockError`` / ``OutOfBoundsError`` / ``RaceError``
(eagerly, or under ``mpmd.typed_errors``), and launches from several
threads must not disturb each other: only the launch that hangs fails.
"""

import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import _jax, _patches
from mpmd._lowering import callbacks, errors, watchdog

ROWS, COLS = 8, 128
NUM_DEVICES = 2
SIMULATOR = pltpu.InterpretParams()


def _hang(x_hbm, o_hbm, sem):
  del x_hbm, o_hbm
  pl.semaphore_wait(sem, 1)  # nobody signals


def _copy(x_hbm, o_hbm, sem):
  del sem
  pltpu.sync_copy(x_hbm, o_hbm)


def _oob(x_hbm, o_hbm, sem):
  del sem
  start = jax.lax.axis_index("core") + ROWS // 2  # known at run time only
  pltpu.sync_copy(x_hbm.at[pl.ds(start, ROWS)], o_hbm)  # rows 4..11 of 8


def _launch(body, name=None, **kwargs):
  return mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), body)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
    interpret=SIMULATOR,
    name=name or body.__name__,
    **kwargs,
  )


def _per_device(body, before=None, **kwargs):
  """``body`` on every device of a shard_map, in the simulator; device 0
  first runs ``before(x)`` (a host callback), if given."""
  mesh = jax.make_mesh(
    (NUM_DEVICES,), ("x",), devices=jax.devices()[:NUM_DEVICES]
  )
  launch = _launch(body, **kwargs)

  def per_device(x):
    if before is not None:
      d = jax.lax.axis_index("x")
      shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
      x = io_callback(lambda x, d: before(x) if d == 0 else x, shape, x, d)
    return launch(x)

  f = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jax.device_put(
    jnp.arange(NUM_DEVICES * ROWS * COLS, dtype=jnp.float32).reshape(-1, COLS),
    jax.NamedSharding(mesh, P("x")),
  )
  return f, x


def _healthy() -> None:
  """Later launches, and unrelated ordered callbacks, still work."""
  f, x = _per_device(_copy)
  np.testing.assert_array_equal(f(x), x)
  g = jax.jit(
    lambda x: (io_callback(lambda v: None, None, x, ordered=True), x + 1)[1]
  )
  np.testing.assert_array_equal(g(jnp.ones(3)), np.full(3, 2.0))
  jax.effects_barrier()  # no error left behind


@pytest.mark.parametrize(
  "body, error, words",
  [
    (
      _hang,
      mpmd.DeadlockError,
      r"waits on the semaphore 'sem' \(scratch 0, semaphore\[\]\) for 1 "
      r"\(it holds 0 now\) at .*test_failures.py:\d+",
    ),
    (
      _oob,
      mpmd.OutOfBoundsError,
      r"out of bounds \(hardware faults\) in kernel _oob, on 'x_hbm' "
      r"\(input 0, f32\[8,128\]\): "
      r"Out-of-bounds read .* buffer has shape \(8, 128\)",
    ),
  ],
)
def test_a_failed_launch_under_shard_map_leaves_the_process_healthy(
  body, error, words
):
  f, x = _per_device(body)
  with mpmd.deadlock_timeout(1.0), pytest.raises(error, match=words):
    with mpmd.typed_errors():
      jax.block_until_ready(f(x))
  _healthy()


def _device_1_waits_for_device_0(sem, x_hbm, o_hbm):
  d = jax.lax.axis_index("x")

  @pl.when(d == 0)
  def _():
    pl.semaphore_signal(sem, 1, device_id={"x": 1})

  @pl.when(d == 1)
  def _():
    pl.semaphore_wait(sem, 1)

  pltpu.sync_copy(x_hbm, o_hbm)


def _signal_device_1(x_hbm, o_hbm, sem):
  """Device 0 signals device 1, which waits: device 1 needs device 0."""
  _device_1_waits_for_device_0(sem, x_hbm, o_hbm)


def _with_barrier_semaphore(x_hbm, o_hbm, sem):
  """The same, synchronized by the launch's barrier semaphore (a collective
  id): the simulator then has no start barrier; device 1 waits in the
  kernel for a device that never came."""
  del sem
  _device_1_waits_for_device_0(pltpu.get_barrier_semaphore(), x_hbm, o_hbm)


_WAITS_FOR_DEVICE_0 = {
  "start barrier": (_signal_device_1, {}),
  "barrier semaphore": (
    _with_barrier_semaphore,
    {"compiler_params": pltpu.CompilerParams(collective_id=0)},
  ),
}


@pytest.mark.parametrize("waits", sorted(_WAITS_FOR_DEVICE_0))
def test_a_device_that_fails_before_the_launch_ends_it(waits):
  """Device 0's computation fails before its part of the launch, which
  device 1 waits for (at the simulator's start barrier, or in the kernel):
  the caller gets device 0's failure, not a hang, and the next launch
  runs (issue 36)."""
  body, kwargs = _WAITS_FOR_DEVICE_0[waits]

  def fail(x):
    raise ValueError("device 0 failed before the launch")

  f, x = _per_device(body, fail, **kwargs)
  with mpmd.deadlock_timeout(1.0):
    with pytest.raises(Exception, match="device 0 failed before the launch"):
      jax.block_until_ready(f(x))
  _healthy()


@pytest.mark.parametrize("waits", sorted(_WAITS_FOR_DEVICE_0))
def test_a_device_that_begins_the_launch_too_late_is_named(waits):
  """Device 0 computes for longer than the deadlock timeout before its part
  of the launch, while device 1 waits for it and nothing moves: a
  DeadlockError that names the device that never began the launch, and
  what the other one waits for.

  Device 0 comes late: to the failed launch (it then fails with it) or,
  once that launch has handed the simulator on, to a launch of its own,
  where it waits for device 1 in turn. Either report is right."""
  body, kwargs = _WAITS_FOR_DEVICE_0[waits]

  def slow(x):
    time.sleep(2.0)
    return x

  f, x = _per_device(body, slow, **kwargs)
  with mpmd.deadlock_timeout(1.0), pytest.raises(mpmd.DeadlockError) as caught:
    with mpmd.typed_errors():
      jax.block_until_ready(f(x))
  message = str(caught.value)
  absent = re.search(
    r"Device (\d) never began this launch: its computation", message
  )
  assert absent, message
  assert "computes for longer than the timeout" in message
  waiting = "0" if absent[1] == "1" else "1"
  barrier = (
    f"device {waiting} mesh 0 program 0 (core=0) waits on the semaphore of "
    "the launch's barrier (pltpu.get_barrier_semaphore(), collective id 0) "
    "for 1"
  )
  start = f"device {waiting} waits at the launch's start for every device"
  end = f"device {waiting} waits at the launch's end for every device"
  if waits == "barrier semaphore":
    # Device 0 alone waits for nobody in the kernel, only at the end.
    assert barrier in message or (waiting == "0" and end in message), message
  else:
    assert start in message, message
  _healthy()


def test_an_eager_launch_raises_its_own_error_short():
  with mpmd.deadlock_timeout(1.0):
    with pytest.raises(mpmd.DeadlockError) as caught:
      _launch(_hang)(jnp.ones((ROWS, COLS), jnp.float32))
  message = str(caught.value)
  assert message.startswith("mpmd_map deadlock: a simulated program waited")
  assert (
    "device 0 mesh 0 program 0 (core=0) waits on the semaphore 'sem'" in message
  )
  assert "Traceback" not in message
  # Still JAX's runtime error, for code that catches that.
  assert isinstance(caught.value, jax.errors.JaxRuntimeError)
  _healthy()


def _simulated_launch(num_devices):
  key = watchdog.LaunchInfo((), None, 10.0, "raise")
  for d in range(num_devices):
    watchdog.enter(key, (num_devices,), lambda: None, lambda: None, (d,))
  return key


@pytest.mark.parametrize(
  "consequence",
  [
    threading.BrokenBarrierError(),
    RuntimeError("Computation failed on (0, 0) with exception: ..."),
  ],
  ids=["barrier broken", "failure check"],
)
def test_a_device_that_only_saw_another_fail_reports_the_first_failure(
  consequence,
):
  """One device faults and breaks the simulator's barrier; the simulator
  forgets why once every device has reached its clean-up barrier. The other
  device's callback may report first, with only the consequence in hand:
  it must still raise the launch's own error."""
  key, reported = _simulated_launch(2), {}

  def other_device():
    reported["other"] = watchdog.failed(consequence)

  thread = threading.Thread(target=other_device)
  thread.start()
  time.sleep(0.2)  # let it report first
  reported["first"] = watchdog.failed(IndexError("Out-of-bounds read"))
  thread.join(timeout=30)
  for _ in range(2):
    watchdog.leave(key, None)
  assert isinstance(reported["first"], mpmd.OutOfBoundsError)
  assert reported["other"] is reported["first"]


def test_any_other_simulator_failure_is_a_launch_error_that_ends_the_launch():
  key = _simulated_launch(1)
  failure = watchdog.failed(ValueError("unsupported by the simulator"))
  assert type(failure) is mpmd.LaunchError
  assert str(failure) == (
    "mpmd_map: the simulated kernel failed: "
    "ValueError: unsupported by the simulator"
  )
  # The device leaves, having failed, and the next launch runs.
  assert watchdog.leave(key, failure) is failure
  f, x = _per_device(_copy)
  np.testing.assert_array_equal(f(x), x)


def test_a_signal_to_a_program_past_the_mesh_is_out_of_bounds():
  """Known at run time only: the simulator faults, as the hardware would."""
  a = mpmd.tensorcore_mesh("a", num_cores=1)
  b = mpmd.tensorcore_mesh("b", num_cores=1)

  def signals(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, 1, core_index=jax.lax.axis_index("a") + 5)

  f = mpmd.mpmd_map(
    [(a, signals), (b, lambda *refs: None)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(()) @ a],
    interpret=SIMULATOR,
  )
  with pytest.raises(mpmd.OutOfBoundsError, match="out of bounds"):
    f(jnp.ones((ROWS, COLS), jnp.float32))
  _healthy()


def test_under_jit_the_error_is_typed_inside_typed_errors_only():
  f, x = _per_device(_hang)
  with mpmd.deadlock_timeout(1.0):
    with pytest.raises(jax.errors.JaxRuntimeError) as caught:
      jax.block_until_ready(f(x))
    assert not isinstance(caught.value, mpmd.LaunchError)
    # XLA quotes the callback's traceback: a few lines, not the simulator's.
    assert "DeadlockError: mpmd_map deadlock" in str(caught.value)
    assert str(caught.value).count("\n  File ") <= 6

    @mpmd.typed_errors()
    def run():
      return jax.block_until_ready(f(x))

    with pytest.raises(mpmd.DeadlockError, match="^mpmd_map deadlock"):
      run()
  _healthy()


def test_typed_errors_leaves_other_errors_alone():
  with pytest.raises(ValueError, match="unrelated"):
    with mpmd.typed_errors():
      raise ValueError("unrelated")
  with mpmd.typed_errors():
    pass


def test_fast_path_out_of_bounds_is_typed():
  def dynamic_oob(start_hbm, x_hbm, o_hbm, start_smem):
    pltpu.sync_copy(start_hbm, start_smem)
    pltpu.sync_copy(x_hbm.at[pl.ds(start_smem[0], ROWS)], o_hbm)

  f = jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), dynamic_oob)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.SMEM((1,), jnp.int32)],
    )
  )
  x = jnp.arange(2 * ROWS * COLS, dtype=jnp.float32).reshape(-1, COLS)
  with pytest.raises(mpmd.OutOfBoundsError, match="out of bounds of 'x_hbm'"):
    with mpmd.typed_errors():
      jax.block_until_ready(f(jnp.array([12], jnp.int32), x))
  np.testing.assert_array_equal(f(jnp.array([8], jnp.int32), x), x[ROWS:])


def test_a_deadlock_in_one_thread_spares_another_threads_launch():
  """Launches from two threads take turns in the simulator; the watchdog
  fails only the launch that hangs, naming only its programs."""
  x = jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)
  hang, copy = jax.jit(_launch(_hang)), jax.jit(_launch(_copy))
  results = {}

  def run(name, f):
    try:
      results[name] = jax.block_until_ready(f(x))
    except Exception as e:  # noqa: BLE001 (checked below)
      results[name] = e

  with mpmd.deadlock_timeout(2.0), mpmd.typed_errors():
    threads = [
      threading.Thread(target=run, args=("hang", hang)),
      threading.Thread(target=run, args=("copy", copy)),
    ]
    threads[0].start()
    threads[1].start()
    for t in threads:
      t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
  np.testing.assert_array_equal(results["copy"], x)
  assert isinstance(results["hang"], jax.errors.JaxRuntimeError)
  assert "mpmd_map deadlock" in str(results["hang"])
  assert str(results["hang"]).count("waits on the semaphore") == 1
  _healthy()


def test_concurrent_correct_launches_from_threads():
  x = jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)
  f, (g, y) = jax.jit(_launch(_copy)), _per_device(_copy)
  results = {}

  def run(name, fn, arg):
    results[name] = [np.asarray(fn(arg)) for _ in range(3)]

  threads = [
    threading.Thread(target=run, args=("one", f, x)),
    threading.Thread(target=run, args=("shard_map", g, y)),
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads)
  for out in results["one"]:
    np.testing.assert_array_equal(out, x)
  for out in results["shard_map"]:
    np.testing.assert_array_equal(out, y)


class _Token:
  """A device's runtime token, as JAX keeps it for ``effects_barrier``."""

  def __init__(self, error):
    self.error = error

  def block_until_ready(self):
    raise self.error


def test_effects_barrier_forgets_a_launchs_error_only():
  """JAX keeps a failed first call's error in its runtime tokens; a
  launch's error reached its caller with the call's results, so
  ``effects_barrier`` passes over it, and raises any other as JAX would."""
  callbacks.install()
  assert _patches.installed()["runtime_token_errors"]
  launch = errors.remember(mpmd.DeadlockError("mpmd_map deadlock: a test's"))
  runtime = jax.errors.JaxRuntimeError
  tokens = _jax.dispatch.RuntimeTokenSet()
  tokens.output_runtime_tokens = {
    "device 0": _Token(runtime(f"INTERNAL: CpuCallback error: {launch}")),
    "device 1": _Token(runtime("INTERNAL: a user's callback failed")),
  }
  with pytest.raises(runtime, match="a user's callback failed"):
    tokens.block_until_ready()
  assert "device 0" not in tokens.output_runtime_tokens
  tokens.output_runtime_tokens = {"device 0": _Token(runtime(str(launch)))}
  tokens.block_until_ready()  # nothing else to raise


def test_settings_are_per_thread_and_taken_by_each_launch():
  """A context manager sets the timeout and race policy for its thread (as
  JAX's config context managers do); a launch takes them where it is
  lowered, so two threads may launch with different settings."""
  seen = {}

  def other_thread():
    seen["timeout"] = mpmd.get_deadlock_timeout()
    seen["policy"] = mpmd.get_race_policy()

  with mpmd.deadlock_timeout(0.5), mpmd.race_policy("record"):
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=30)
    assert mpmd.get_deadlock_timeout() == 0.5
    assert mpmd.get_race_policy() == "record"
  assert seen == {"timeout": 10.0, "policy": "raise"}
  assert mpmd.get_deadlock_timeout() == 10.0
  with mpmd.deadlock_timeout(0.5):
    with pytest.raises(mpmd.DeadlockError, match="more than 0.5 s"):
      jax.block_until_ready(_launch(_hang)(jnp.ones((ROWS, COLS))))
  _healthy()
