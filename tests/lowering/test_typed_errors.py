"""Typed launch errors on every call of a jitted function (issue 36, item 7).

A computation's first call goes through JAX's Python dispatch, which
raises XLA's failure as a ``JaxRuntimeError``; later calls go through its
C++ dispatch, which raises a plain ``ValueError``. ``mpmd.typed_errors``
finds the launch error by the key its report carries, on either path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd._lowering import errors

ROWS, COLS = 8, 128
CALLS = 3


def _window(start_hbm, x_hbm, o_hbm, start_smem):
  """Copies the rows from a start read at run time (past the end: OOB)."""
  pltpu.sync_copy(start_hbm, start_smem)
  pltpu.sync_copy(x_hbm.at[pl.ds(start_smem[0], ROWS)], o_hbm)


def _windows():
  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), _window)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.SMEM((1,), jnp.int32)],
    )
  )


def _waits_for(count_hbm, o_hbm, count_smem, sem):
  """Signals itself once, then waits for a count read at run time (more
  than 1: forever)."""
  del o_hbm
  pltpu.sync_copy(count_hbm, count_smem)
  pl.semaphore_signal(sem, 1)
  pl.semaphore_wait(sem, count_smem[0])


def _waiting(interpret):
  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), _waits_for)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SemaphoreType.REGULAR(()),
      ],
      interpret=interpret,
    )
  )


X = jnp.arange(2 * ROWS * COLS, dtype=jnp.float32).reshape(-1, COLS)
GOOD, PAST_THE_END = jnp.array([ROWS], jnp.int32), jnp.array([12], jnp.int32)


@pytest.mark.parametrize("first_call_succeeds", [True, False])
def test_out_of_bounds_is_typed_on_every_call(first_call_succeeds):
  f = _windows()
  if first_call_succeeds:
    np.testing.assert_array_equal(f(GOOD, X), X[ROWS:])
  for _ in range(CALLS):
    with pytest.raises(mpmd.OutOfBoundsError, match="out of bounds of 'x_hbm'"):
      with mpmd.typed_errors():
        jax.block_until_ready(f(PAST_THE_END, X))
  np.testing.assert_array_equal(f(GOOD, X), X[ROWS:])


def test_later_calls_fail_as_jax_reports_them_outside_typed_errors():
  """What ``typed_errors`` has to see through: after a successful call,
  JAX raises a plain ValueError (its C++ dispatch), not a LaunchError."""
  f = _windows()
  jax.block_until_ready(f(GOOD, X))
  with pytest.raises(Exception) as caught:  # noqa: PT011 (checked below)
    jax.block_until_ready(f(PAST_THE_END, X))
  assert not isinstance(caught.value, mpmd.LaunchError)
  assert isinstance(caught.value, (ValueError, jax.errors.JaxRuntimeError))
  assert errors.reports_launch(caught.value)


@pytest.mark.parametrize(
  "interpret", [None, pltpu.InterpretParams()], ids=["default", "simulator"]
)
def test_deadlock_is_typed_on_every_call(interpret):
  f = _waiting(interpret)
  one, two = jnp.array([1], jnp.int32), jnp.array([2], jnp.int32)
  jax.block_until_ready(f(one))
  with mpmd.deadlock_timeout(1.0):
    for _ in range(CALLS):
      with pytest.raises(mpmd.DeadlockError, match="^mpmd_map deadlock"):
        with mpmd.typed_errors():
          jax.block_until_ready(f(two))
  jax.block_until_ready(f(one))


def test_the_typed_error_reads_as_written():
  """The key travels in XLA's report only: the typed error's message is
  the error's own."""
  f = _windows()
  jax.block_until_ready(f(GOOD, X))
  with pytest.raises(mpmd.OutOfBoundsError) as caught:
    with mpmd.typed_errors():
      jax.block_until_ready(f(PAST_THE_END, X))
  assert "mpmd launch error" not in str(caught.value)
  assert str(caught.value).startswith("mpmd_map: kernel _window at ")


def test_an_error_quoting_a_launch_errors_text_is_not_that_error():
  """Errors are found by their key, not by their words: a user's error
  that quotes a launch error's message stays the user's."""
  raised = errors.remember(mpmd.DeadlockError("mpmd_map deadlock: quoted"))
  message = str(raised).split(" [mpmd launch error")[0]
  with pytest.raises(ValueError, match="quoted"):
    with mpmd.typed_errors():
      raise ValueError(f"a user's error: {message}")
  with pytest.raises(mpmd.DeadlockError, match="^mpmd_map deadlock: quoted$"):
    with mpmd.typed_errors():
      raise ValueError(f"INTERNAL: CpuCallback error: {raised}")


def test_remember_keys_each_error_once():
  first = errors.remember(mpmd.RaceError("a race"))
  again = errors.remember(first)  # a copy raised again: a new key
  assert str(first).startswith("a race [mpmd launch error ")
  assert str(again).startswith("a race [mpmd launch error ")
  assert str(again).count("[mpmd launch error") == 1
  assert str(first) != str(again)


def test_an_eager_launch_raises_typed_on_every_call():
  """Without jit (and without typed_errors) the launch raises its own
  error, every time."""
  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), _window)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[pltpu.SMEM((1,), jnp.int32)],
  )
  np.testing.assert_array_equal(f(GOOD, X), X[ROWS:])
  for _ in range(CALLS):
    with pytest.raises(mpmd.OutOfBoundsError, match="out of bounds of 'x_hbm'"):
      jax.block_until_ready(f(PAST_THE_END, X))


def test_an_eager_vmap_raises_typed():
  """An eager vmap of a launch (one launch per batch element, in a
  lax.map) raises the launch's own error, as an eager call does."""
  f = jax.vmap(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), _window)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.SMEM((1,), jnp.int32)],
    ),
    in_axes=(0, None),
  )
  starts = jnp.stack([GOOD, GOOD])
  np.testing.assert_array_equal(f(starts, X), jnp.stack([X[ROWS:]] * 2))
  for _ in range(2):
    with pytest.raises(mpmd.OutOfBoundsError, match="out of bounds of 'x_hbm'"):
      f(jnp.stack([GOOD, PAST_THE_END]), X)


def _simulated(body, out_shape, mesh, **kwargs):
  return mpmd.mpmd_map([(mesh, body)], out_shape, **kwargs)


def _racy(o_ref):
  # Two warpgroups write one buffer, nothing orders them.
  o_ref[...] = jnp.full((ROWS, COLS), jax.lax.axis_index("wg"), jnp.float32)


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
def test_simulator_errors_are_typed_on_every_call(jitted):
  """The threaded simulators' errors (each launch one host callback per
  device, running the device's simulation as a computation of its own):
  typed on the first call and on later ones, of one jitted function (in
  typed_errors) or of an eager launch, and a good call between them runs."""
  wrap = jax.jit if jitted else (lambda f: f)
  oob = wrap(
    _simulated(
      _window,
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      mpmd.tensorcore_mesh("core", num_cores=1),
      scratch_types=[pltpu.SMEM((1,), jnp.int32)],
      interpret=pltpu.InterpretParams(),
    )
  )
  racy = wrap(
    _simulated(
      _racy,
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      plgpu.Mesh(num_threads=2, thread_name="wg"),
      interpret=mpmd.GPUInterpretParams(detect_races=True),
    )
  )
  for _ in range(CALLS):
    with pytest.raises(
      mpmd.OutOfBoundsError, match=r"on 'x_hbm' \(input 1, f32\[16,128\]\)"
    ):
      with mpmd.typed_errors():
        jax.block_until_ready(oob(PAST_THE_END, X))
    np.testing.assert_array_equal(oob(GOOD, X), X[ROWS:])
  for _ in range(CALLS):
    with pytest.raises(mpmd.RaceError, match="racing on a buffer"):
      with mpmd.typed_errors():
        jax.block_until_ready(racy())


def _into_ref(start_hbm, x_ref, o_hbm, start_smem):
  """Writes 8 rows into a Ref input from a start read at run time."""
  pltpu.sync_copy(start_hbm, start_smem)
  pltpu.sync_copy(o_hbm, x_ref.at[pl.ds(start_smem[0], ROWS)])


@pytest.mark.parametrize(
  "interpret", [None, pltpu.InterpretParams()], ids=["default", "simulator"]
)
def test_a_ref_input_out_of_bounds_is_named_as_the_input(interpret):
  """A Ref passed to the launch becomes an output aliased to it inside;
  errors name it as the user passed it: input 1, not output 1."""
  launch = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), _into_ref)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[pltpu.SMEM((1,), jnp.int32)],
    interpret=interpret,
  )

  @jax.jit
  def f(start, x):
    ref = jax.new_ref(x)
    launch(start, ref)
    return ref[...]

  with pytest.raises(mpmd.OutOfBoundsError) as caught:
    with mpmd.typed_errors():
      jax.block_until_ready(f(PAST_THE_END, X))
  assert "'x_ref' (input 1, f32[16,128])" in str(caught.value)
  assert "output 1" not in str(caught.value)
