"""Meshes shared by the addressing tests (test_dma_addressing,
test_upstream_addressing, test_many_programs): SparseCore mesh pairs and
two devices under ``shard_map``."""

import jax
from jax.experimental.pallas import tpu_sc as plsc

SUBCORES = 2


def sc_meshes(cores=1, *, subcores=SUBCORES, core_axis="s_core"):
  """A VectorSubcoreMesh and a ScalarSubcoreMesh sharing ``core_axis``."""
  vector = plsc.VectorSubcoreMesh(
    core_axis_name=core_axis,
    subcore_axis_name="subcore",
    num_cores=cores,
    num_subcores=subcores,
  )
  scalar = plsc.ScalarSubcoreMesh(axis_name=core_axis, num_cores=cores)
  return vector, scalar


def devices():
  """Two devices on axis ``x``."""
  return jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])


def on_two_devices(call, x):
  """``call`` on each half of ``x`` (split on axis ``x`` of
  :func:`devices`), the outputs concatenated the same way."""
  return jax.shard_map(
    call,
    mesh=devices(),
    in_specs=jax.P("x"),
    out_specs=jax.P("x"),
    check_vma=False,
  )(x)
