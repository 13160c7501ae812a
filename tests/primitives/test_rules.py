"""The transformation rules of mpmd_map_p: vmap, discharge, DCE, AD, checks."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import mpmd

SHAPE = (8, 128)


def affine_kernel(x_hbm, o_hbm, buf):
  pltpu.sync_copy(x_hbm, buf)
  buf[...] = buf[...] * 2.0 + jax.lax.axis_index("core").astype(jnp.float32)
  pltpu.sync_copy(buf, o_hbm)


def affine(x):
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=1)
  return mpmd.mpmd_map(
    [(mesh, affine_kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[pltpu.VMEM(x.shape, x.dtype)],
  )(x)


def launches(jaxpr) -> int:
  return sum(e.primitive is mpmd.mpmd_map_p for e in jaxpr.eqns)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("in_axis", [0, 1])
def test_vmap_any_batch_size_equals_separate_calls(rng, batch, in_axis):
  xs = jnp.asarray(rng.standard_normal((batch, *SHAPE)), jnp.float32)
  xs = jnp.moveaxis(xs, 0, in_axis)
  got = jax.vmap(affine, in_axes=in_axis)(xs)
  want = jnp.stack(
    [affine(jnp.take(xs, b, axis=in_axis)) for b in range(batch)]
  )
  np.testing.assert_array_equal(got, want)


def test_vmap_with_an_unbatched_operand(rng):
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=1)

  def add(x_hbm, y_hbm, o_hbm, bx, by):
    pltpu.sync_copy(x_hbm, bx)
    pltpu.sync_copy(y_hbm, by)
    bx[...] += by[...]
    pltpu.sync_copy(bx, o_hbm)

  f = mpmd.mpmd_map(
    [(mesh, add)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)] * 2,
  )
  xs = jnp.asarray(rng.standard_normal((3, *SHAPE)), jnp.float32)
  y = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  np.testing.assert_array_equal(jax.vmap(f, (0, None))(xs, y), xs + y[None])


def test_same_shapes_do_not_recompile(rng):
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, **kw: (
      compiles.append(event)
      if event == "/jax/core/compile/backend_compile_duration"
      else None
    )
  )
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  y = x + 1.0
  jitted = jax.jit(affine)
  affine(x), jitted(x)  # eager (the primitive's impl) and jit
  before = len(compiles)
  affine(y), jitted(y)
  assert len(compiles) == before
  affine(jnp.zeros((16, 128), jnp.float32))
  assert len(compiles) > before  # a new shape does compile


def test_enable_checks_and_typecheck(rng):
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  with jax.enable_checks(True):
    closed = jax.make_jaxpr(affine)(x)
    jax.extend.core.check_jaxpr(closed.jaxpr)
    np.testing.assert_array_equal(jax.jit(affine)(x), x * 2.0)


def test_typecheck_rejects_a_mismatched_operand():
  closed = jax.make_jaxpr(affine)(jnp.zeros(SHAPE, jnp.float32))
  [eqn] = closed.jaxpr.eqns
  bad_out = (jax.typeof(jnp.zeros((4, 4), jnp.float32)),)
  bad = closed.jaxpr.replace(
    eqns=[eqn.replace(params={**eqn.params, "out_avals": bad_out})]
  )
  with pytest.raises(
    Exception,
    match="kernel operand 1 is f32\\[8,128\\] but "
    "the launch passes f32\\[4,4\\]",
  ):
    jax.extend.core.check_jaxpr(bad)


def test_dce_drops_an_unused_launch():
  def f(x):
    affine(x)
    return x + 1.0

  jaxpr = jax.make_jaxpr(f)(jnp.zeros(SHAPE, jnp.float32))
  assert launches(jaxpr.jaxpr) == 1
  lowered = jax.jit(f).trace(jnp.zeros(SHAPE, jnp.float32)).lower()
  # After DCE nothing of the kernel is left in the module.
  assert "dma" not in lowered.as_text().lower()
  from mpmd._jax import pe

  dced, used = pe.dce_jaxpr(jaxpr.jaxpr, [True])
  assert launches(dced) == 0 and used == [True]


def test_grad_of_a_surrounding_function(rng):
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)

  def loss(w):
    # The kernel's input does not depend on w: it is not differentiated.
    return jnp.sum(w * affine(x))

  np.testing.assert_allclose(jax.grad(loss)(x), x * 2.0)

  def loss_stop(w):
    return jnp.sum(affine(jax.lax.stop_gradient(w)) * w)

  np.testing.assert_allclose(jax.grad(loss_stop)(x), x * 2.0)
  np.testing.assert_allclose(jax.grad(jax.checkpoint(loss_stop))(x), x * 2.0)


def test_mutable_ref_input_is_discharged(rng):
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=1)

  def bump(counter_hbm, x_hbm, o_hbm, buf, cbuf):
    pltpu.sync_copy(x_hbm, buf)
    pltpu.sync_copy(counter_hbm, cbuf)
    cbuf[...] += 1.0
    pltpu.sync_copy(cbuf, counter_hbm)
    pltpu.sync_copy(buf, o_hbm)

  f = mpmd.mpmd_map(
    [(mesh, bump)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[
      pltpu.VMEM(SHAPE, jnp.float32),
      pltpu.VMEM((8, 128), jnp.float32),
    ],
  )
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)

  @jax.jit
  def twice(x):
    counter = jax.new_ref(jnp.zeros((8, 128), jnp.float32))
    f(counter, x)
    y = f(counter, x)
    return y, counter[...]

  y, count = twice(x)
  np.testing.assert_array_equal(y, x)
  np.testing.assert_array_equal(count, 2.0)


def test_input_output_aliases(rng):
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=1)

  def accumulate(x_hbm, acc_in, acc_out, buf, acc):
    del acc_in  # the same buffer as acc_out
    pltpu.sync_copy(x_hbm, buf)
    pltpu.sync_copy(acc_out, acc)
    acc[...] += buf[...]
    pltpu.sync_copy(acc, acc_out)

  f = mpmd.mpmd_map(
    [(mesh, accumulate)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)] * 2,
    input_output_aliases={1: 0},
  )
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  acc = jnp.full(SHAPE, 10.0, jnp.float32)
  np.testing.assert_allclose(f(x, acc), x + 10.0)
  np.testing.assert_allclose(jax.jit(f)(x, acc), x + 10.0)


def test_differentiating_through_a_kernel_says_what_to_do():
  with pytest.raises(
    NotImplementedError,
    match="not differentiable by JAX. "
    "Give the function that calls mpmd_map a jax.custom_vjp",
  ):
    jax.grad(lambda x: jnp.sum(affine(x)))(jnp.ones(SHAPE, jnp.float32))
