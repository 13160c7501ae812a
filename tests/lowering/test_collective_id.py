"""A TPU launch's collective id, as Mosaic checks it: the barrier semaphore
needs one, and one without the barrier semaphore is an error (unless
``allow_collective_id_without_custom_barrier``). The CPU fallback rejects
what the TPU lowering rejects, with Mosaic's words in its message."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd

NEEDS_ID = "collective_id has to be specified when using a custom barrier"
NO_BARRIER = "collective_id has to be unspecified or None when not using a"
AUTO = "jax_pallas_auto_assign_collective_ids"


def _meet(x_hbm, o_hbm):
  barrier = pltpu.get_barrier_semaphore()
  me = jax.lax.axis_index("x")
  pl.semaphore_signal(barrier, 1, device_id={"x": 1 - me})
  pl.semaphore_wait(barrier, 1)
  pltpu.sync_copy(x_hbm, o_hbm)


def _copy(x_hbm, o_hbm):
  pltpu.sync_copy(x_hbm, o_hbm)


def _launch(kernel, compiler_params, interpret=None):
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  tc = mpmd.tensorcore_mesh("core", num_cores=1)

  def per_device(x):
    return mpmd.mpmd_map(
      [(tc, kernel)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      compiler_params=compiler_params,
      interpret=interpret,
    )(x)

  f = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  return f, jax.device_put(x, NamedSharding(mesh, P("x")))


def _lower_for_tpu(f, x):
  with mpmd.tpu_target():
    return f.trace(x).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize(
  "kernel, compiler_params, phrase",
  [
    (_meet, None, NEEDS_ID),
    (_copy, pltpu.CompilerParams(collective_id=3), NO_BARRIER),
  ],
  ids=["barrier_without_id", "id_without_barrier"],
)
def test_what_mosaic_rejects_the_cpu_fallback_rejects(
  kernel, compiler_params, phrase
):
  f, x = _launch(kernel, compiler_params)
  with pytest.raises(ValueError, match=phrase):
    _lower_for_tpu(f, x)
  with pytest.raises(ValueError, match=phrase) as e:
    f(x)
  assert f"mpmd_map: kernel {kernel.__name__} at " in str(e.value)


@pytest.mark.parametrize(
  "kernel, compiler_params",
  [
    (_meet, pltpu.CompilerParams(collective_id=0)),
    (
      _copy,
      pltpu.CompilerParams(
        collective_id=0, allow_collective_id_without_custom_barrier=True
      ),
    ),
    (_copy, None),
  ],
  ids=["barrier_with_id", "id_allowed_without_barrier", "neither"],
)
def test_what_mosaic_accepts_runs(kernel, compiler_params):
  f, x = _launch(kernel, compiler_params)
  assert "tpu_custom_call" in _lower_for_tpu(f, x)
  np.testing.assert_array_equal(f(x), x)


def test_auto_assigned_ids_are_mosaics_to_check():
  """JAX 0.11+ can assign collective ids itself (from the lowering
  context): then the id is Mosaic's to check, not the CPU fallback's.
  JAX 0.10.2 has no such option: the check always applies."""
  f, x = _launch(_meet, None)
  if not hasattr(jax.config, AUTO):
    with pytest.raises(ValueError, match=NEEDS_ID):
      f(x)
    return
  for mode in ("yes", "override"):
    jax.config.update(AUTO, mode)
    try:
      np.testing.assert_array_equal(f(x), x)
    finally:
      jax.config.update(AUTO, "no")


def test_upstreams_simulator_runs_what_it_runs_upstream():
  """interpret=pltpu.InterpretParams() asks for upstream's TPU simulator,
  which does not check collective ids: a launch with an id and no barrier
  runs there, as it does upstream."""
  f, x = _launch(
    _copy,
    pltpu.CompilerParams(collective_id=3),
    interpret=pltpu.InterpretParams(),
  )
  np.testing.assert_array_equal(f(x), x)
