"""Every way upstream lets a kernel name a device (a dict of axes, a tuple
of mesh coordinates, an index alone) means the same device on every CPU
path; a tuple of the wrong length is upstream's error. (LOGICAL flat ids
go with the deprecated ``device_id_type=``.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd

ROWS = (8, 128)


def _right(form, axes, sizes):
  """The next device along the last axis, as each form names it."""
  me = {a: jax.lax.axis_index(a) for a in axes}
  right = dict(me, **{axes[-1]: jax.lax.rem(me[axes[-1]] + 1, sizes[-1])})
  coords = tuple(right[a] for a in axes)
  return {
    "dict": right,
    "tuple": coords,
    "list": list(coords),
    "scalar": coords[0],
  }[form]


def _shift(form, shape, interpret=None):
  axes = ("x", "y")[: len(shape)]
  mesh = jax.make_mesh(shape, axes, devices=jax.devices()[: np.prod(shape)])

  def kernel(x_hbm, o_hbm, send, recv):
    copy = pltpu.make_async_remote_copy(
      x_hbm, o_hbm, send, recv, device_id=_right(form, axes, shape)
    )
    copy.start()
    copy.wait()

  local = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.DMA] * 2,
    interpret=interpret,
  )
  spec = P(axes)
  f = jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
    )
  )
  n = int(np.prod(shape))
  x = jnp.arange(n * ROWS[0] * ROWS[1], dtype=jnp.float32)
  x = x.reshape(n * ROWS[0], ROWS[1])
  return f, jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize(
  "interpret", [None, mpmd.CheckParams()], ids=["default", "check"]
)
@pytest.mark.parametrize(
  "form, shape",
  [
    ("dict", (4,)),
    ("tuple", (4,)),
    ("list", (4,)),
    ("scalar", (4,)),
    ("dict", (2, 2)),
    ("tuple", (2, 2)),
  ],
)
def test_every_form_names_the_same_device(form, shape, interpret):
  f, x = _shift(form, shape, interpret)
  blocks = np.asarray(x).reshape(*shape, *ROWS)
  # Device (.., i) sends its block to (.., i + 1): it holds its left's.
  want = np.roll(blocks, 1, axis=len(shape) - 1).reshape(x.shape)
  with mpmd.typed_errors():
    np.testing.assert_array_equal(f(x), want)


@pytest.mark.parametrize(
  "device_id, shown",
  [(lambda x: (x,), r"\(i32\[\],\)"), (lambda x: x, r"i32\[\]")],
  ids=["one_tuple", "scalar"],
)
def test_a_device_id_holds_one_index_per_mesh_axis(device_id, shown):
  def kernel(x_hbm, o_hbm, send, recv):
    x_axis = jax.lax.axis_index("x")
    copy = pltpu.make_async_remote_copy(
      x_hbm, o_hbm, send, recv, device_id=device_id(x_axis)
    )
    copy.start()
    copy.wait()

  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])
  local = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.DMA] * 2,
  )
  spec = P(("x", "y"))
  g = jax.shard_map(
    local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
  )
  x = jnp.ones((4 * ROWS[0], ROWS[1]), jnp.float32)
  with pytest.raises(
    ValueError,
    match=rf"names device_id {shown}: a device_id that is not a dict holds "
    r"one index per axis of the enclosing shard_map's mesh \('x', 'y'\).*"
    r"Number of device ids must match the number of mesh axes, but got 1 "
    r"ids for a 2D mesh",
  ):
    jax.jit(g).trace(jax.device_put(x, NamedSharding(mesh, spec)))


def test_a_tuple_without_a_shard_map_names_no_device():
  def kernel(x_hbm, o_hbm, ready):
    @pl.when(jax.lax.axis_index("core") == 0)
    def _():
      pl.semaphore_signal(ready, 1, device_id=(1,))

    pltpu.sync_copy(x_hbm, o_hbm)

  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=2), kernel)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR],
  )
  with pytest.raises(
    ValueError, match=r"names device_id \(1,\): .* got 1 ids for a 0D mesh"
  ):
    f(jnp.ones(ROWS, jnp.float32))


def test_a_literal_tuple_index_past_its_axis_fails_when_traced():
  def kernel(x_hbm, o_hbm, send, recv):
    copy = pltpu.make_async_remote_copy(
      x_hbm, o_hbm, send, recv, device_id=(4,)
    )
    copy.start()
    copy.wait()

  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  local = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.DMA] * 2,
  )
  g = jax.shard_map(
    local, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
  )
  x = jnp.ones((4 * ROWS[0], ROWS[1]), jnp.float32)
  with pytest.raises(
    mpmd.OutOfBoundsError,
    match=r"device_id \(4,\): expected an index in \[0, 4\)",
  ):
    jax.jit(g).trace(jax.device_put(x, NamedSharding(mesh, P("x"))))


@pytest.mark.parametrize("form", ["tuple", "scalar"])
def test_the_forms_lower_for_tpu(form):
  f, x = _shift(form, (4,))
  text = f.trace(x).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text
