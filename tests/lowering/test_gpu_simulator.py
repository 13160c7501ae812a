"""The Mosaic GPU simulator path: races are errors, numpy reaches callbacks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import mpmd
from mpmd import _jax

SHAPE = (8, 128)


def _launch(kernel, interpret):
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")
  return mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    interpret=interpret,
  )


def _racy(x_ref, o_ref):
  # Both warpgroups write all of the output, nothing orders the writes.
  o_ref[...] = x_ref[...] + jax.lax.axis_index("wg").astype(jnp.float32)


def _halves(x_ref, o_ref):
  # Each warpgroup adds one to its half of the rows.
  half = SHAPE[0] // 2
  rows = pl.ds(jax.lax.axis_index("wg") * half, half)
  o_ref[rows, :] = x_ref[rows, :] + 1.0


def test_a_race_is_a_race_error(rng):
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  params = mpmd.GPUInterpretParams(detect_races=True)
  # Eager: the launch's own error type, its message short.
  with pytest.raises(
    mpmd.RaceError, match="^mpmd_map: the simulator's race detector found"
  ):
    jax.block_until_ready(_launch(_racy, params)(x))
  # The next launch starts from a clean simulator.
  out = _launch(_halves, params)(x)
  np.testing.assert_array_equal(out, x + 1.0)


def test_a_race_can_be_recorded_instead(rng):
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  params = mpmd.GPUInterpretParams(detect_races=True)
  with mpmd.race_policy("record"):
    jax.block_until_ready(_launch(_racy, params)(x))
    assert mpmd.get_races().races_found
    np.testing.assert_array_equal(_launch(_halves, params)(x), x + 1.0)
    assert not mpmd.get_races().races_found


def test_simulator_callbacks_take_numpy(rng):
  """Simulator callbacks get numpy arguments (docs/design.md, trap 3);
  jax 0.11+ rebuilds its thread objects from them with ``_to_int``, which
  we teach numpy."""
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  np.testing.assert_array_equal(_launch(_halves, None)(x), x + 1.0)
  to_int = getattr(_jax.gpu().simulator_memory, "_to_int", None)
  assert to_int is None or to_int(np.int32(3)) == 3
