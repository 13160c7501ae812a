"""The transformation rules of mpmd_map_p: vmap, discharge, DCE, AD, checks."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from launches import launch_eqns

import mpmd
from mpmd._lowering import paths

SHAPE = (8, 128)


def affine_kernel(x_hbm, o_hbm, buf):
  pltpu.sync_copy(x_hbm, buf)
  buf[...] = buf[...] * 2.0 + jax.lax.axis_index("core").astype(jnp.float32)
  pltpu.sync_copy(buf, o_hbm)


def affine(x):
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)
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


def _add(x_hbm, y_hbm, o_hbm, bx, by):
  """``o = x + y`` through two VMEM buffers."""
  pltpu.sync_copy(x_hbm, bx)
  pltpu.sync_copy(y_hbm, by)
  bx[...] += by[...]
  pltpu.sync_copy(bx, o_hbm)


def _adder(kernel=_add, **kw):
  """``kernel`` (by default :func:`_add`) on one TensorCore, with two f32
  VMEM buffers of SHAPE, for an f32 output of SHAPE."""
  return mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)] * 2,
    **kw,
  )


def test_vmap_with_an_unbatched_operand(rng):
  f = _adder()
  xs = jnp.asarray(rng.standard_normal((3, *SHAPE)), jnp.float32)
  y = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  np.testing.assert_array_equal(jax.vmap(f, (0, None))(xs, y), xs + y[None])


def test_same_shapes_do_not_recompile(rng):
  from jax._src import monitoring

  compiles = []

  def listener(event, _, **kw):
    del kw
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    _check_no_recompile(rng, compiles)
  finally:
    monitoring.unregister_event_duration_listener(listener)


def _check_no_recompile(rng, compiles):
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


def test_enable_checks_with_ref_operands_and_a_closed_over_scalar(rng):
  """Discharge re-traces the kernel with more operands than it had names
  for; JAX's own test base runs everything under enable_checks."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)

  @jax.jit
  def copy_refs(x):
    x_ref, o_ref = jax.new_ref(x), jax.empty_ref(jax.typeof(x))
    mpmd.mpmd_map([(mesh, pltpu.sync_copy)])(x_ref, o_ref)
    return jax.freeze(o_ref)

  @jax.jit
  def scale(x, s):
    def kernel(x_hbm, o_hbm, buf):
      pltpu.sync_copy(x_hbm, buf)
      buf[...] = buf[...] * s
      pltpu.sync_copy(buf, o_hbm)

    return mpmd.mpmd_map(
      [(mesh, kernel)],
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=[pltpu.VMEM(x.shape, x.dtype)],
    )(x)

  with jax.enable_checks(True):
    np.testing.assert_array_equal(copy_refs(x), x)
    np.testing.assert_array_equal(scale(x, jnp.float32(3.0)), x * 3.0)


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
  def dead(x):
    affine(x)
    return x + 1.0

  def live(x):
    return affine(x) + 1.0

  x = jnp.zeros(SHAPE, jnp.float32)
  for f, launches_left in ((dead, 0), (live, 1)):
    text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == launches_left
  from mpmd._jax import pe

  jaxpr = jax.make_jaxpr(dead)(x)
  assert launches(jaxpr.jaxpr) == 1
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
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)

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
  def accumulate(x_hbm, acc_in, acc_out, buf, acc):
    del acc_in  # the same buffer as acc_out: read there, acc += x
    _add(x_hbm, acc_out, acc_out, buf, acc)

  f = _adder(accumulate, input_output_aliases={1: 0})
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


def counter_kernel(counter_hbm, x_hbm, o_hbm, buf, cbuf):
  pltpu.sync_copy(x_hbm, buf)
  pltpu.sync_copy(counter_hbm, cbuf)
  cbuf[...] += 1.0
  pltpu.sync_copy(cbuf, counter_hbm)
  buf[...] = buf[...] * 2.0
  pltpu.sync_copy(buf, o_hbm)


def counted(counter, x):
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)
  return mpmd.mpmd_map(
    [(mesh, counter_kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      pltpu.VMEM(x.shape, x.dtype),
      pltpu.VMEM(counter.shape, jnp.float32),
    ],
  )(counter, x)


@pytest.mark.parametrize("remat", [False, True])
def test_grad_with_a_ref_operand_runs_the_kernel_once(rng, remat):
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)

  def loss(w):
    counter = jax.new_ref(jnp.zeros((8, 128), jnp.float32))
    y = counted(counter, jax.lax.stop_gradient(w))
    return jnp.sum(w * y), counter[...]

  f = jax.checkpoint(loss) if remat else loss
  (grad, count) = jax.grad(f, has_aux=True)(x)
  np.testing.assert_allclose(grad, 2.0 * x)
  np.testing.assert_array_equal(count, 1.0)  # neither skipped nor repeated


def test_vmap_rejects_writes_to_an_unbatched_ref(rng):
  xs = jnp.asarray(rng.standard_normal((3, *SHAPE)), jnp.float32)

  @jax.jit
  def f(xs):
    counter = jax.new_ref(jnp.zeros((8, 128), jnp.float32))
    return jax.vmap(lambda x: counted(counter, x))(xs)

  with pytest.raises(
    ValueError,
    match="writes the unbatched Ref operand 0: "
    "every batch element would write it",
  ):
    f(xs)


def test_aliases_must_be_distinct_arrays():
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)
  out = jax.ShapeDtypeStruct(SHAPE, jnp.float32)

  def copy(a, b, o):
    del b
    pltpu.sync_copy(a, o)

  x = jnp.ones(SHAPE, jnp.float32)
  twice = mpmd.mpmd_map([(mesh, copy)], out, input_output_aliases={0: 0, 1: 0})
  with pytest.raises(ValueError, match="aliases several inputs to one output"):
    twice(x, x)
  ref_alias = mpmd.mpmd_map([(mesh, copy)], out, input_output_aliases={0: 0})

  @jax.jit
  def g(x):
    return ref_alias(jax.new_ref(x), x)

  with pytest.raises(
    ValueError,
    match="input 0 is a Ref, which the kernels update in place already",
  ):
    g(x)


def test_interpret_true_refuses_a_synchronising_kernel():
  mesh = mpmd.tensorcore_mesh("core", num_cores=2)

  def kernel(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, 1, core_index=1 - jax.lax.axis_index("core"))
    pl.semaphore_wait(sem, 1)

  f = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
    interpret=True,
  )
  with pytest.raises(
    NotImplementedError,
    match=r"interpret=True runs each device's programs .* it signals a "
    r"semaphore of another program, and not in step on every device: it "
    r"is not inside a jax.shard_map .* Pass interpret=pltpu.Interpret",
  ):
    f(jnp.ones(SHAPE, jnp.float32))


def test_trace_cache_respects_the_tpu_target():
  x = jnp.zeros((16, 256), jnp.float32)
  mesh = mpmd.tensorcore_mesh("core", num_cores=1)
  seen = []

  def kernel(x_hbm, o_hbm):
    seen.append(pltpu.get_tpu_info().chip_version.name)
    pltpu.sync_copy(x_hbm, o_hbm)

  f = mpmd.mpmd_map([(mesh, kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype))
  for target in ("v5e", "v6e", "v5e"):
    with mpmd.tpu_target(target):
      jax.make_jaxpr(f)(x)
  assert seen == ["TPU_V5E", "TPU_V6E"]  # the second v5e trace is cached


# -- the CPU path: decided once, a param of the launch ------------------------


def _launch_eqn(f, *args):
  """The one mpmd_map launch in ``f``'s jaxpr (nested ones too)."""
  [eqn] = launch_eqns(f, *args)
  return eqn


def test_cpu_path_is_decided_once_and_equal_for_equal_launches():
  x = jnp.zeros(SHAPE, jnp.float32)
  first, second = _launch_eqn(affine, x), _launch_eqn(affine, x)
  path = first.params["cpu_path"]
  assert path.kind == paths.FAST, path
  assert path == second.params["cpu_path"]
  assert hash(path) == hash(second.params["cpu_path"])


def test_vmap_keeps_the_cpu_path():
  x = jnp.zeros(SHAPE, jnp.float32)
  batched = _launch_eqn(jax.vmap(affine), jnp.zeros((2, *SHAPE)))
  assert batched.params["cpu_path"] == _launch_eqn(affine, x).params["cpu_path"]


def _rebound(eqn, **params):
  """Runs ``eqn``'s launch again with some params replaced."""
  new = {**eqn.params, **params}
  return jax.jit(lambda *a: mpmd.mpmd_map_p.bind(*a, **new))


def test_the_cpu_lowering_runs_the_path_in_the_param(rng, capsys):
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  eqn = _launch_eqn(affine, x)
  forced = paths.Path(
    paths.TPU_SIMULATOR, "forced by the test", pltpu.InterpretParams()
  )
  [out] = _rebound(eqn, cpu_path=forced, debug=True)(x)
  assert "takes the tpu-simulator path: forced by the test" in (
    capsys.readouterr().out
  )
  np.testing.assert_array_equal(out, affine(x))


def test_a_lockstep_path_lowered_outside_its_shard_map_is_an_internal_error():
  x = jnp.zeros(SHAPE, jnp.float32)
  eqn = _launch_eqn(affine, x)
  wrong = paths.Path(paths.LOCKSTEP, "forced", manual_axes=("x",))
  with pytest.raises(
    RuntimeError, match=r"internal error: .* manual over axes"
  ):
    _rebound(eqn, cpu_path=wrong).lower(x)


@pytest.mark.parametrize(
  "cpu_path", ["fast", None, paths.Path("teleport", "no such path")]
)
def test_typecheck_rejects_a_bad_cpu_path(cpu_path):
  closed = jax.make_jaxpr(affine)(jnp.zeros(SHAPE, jnp.float32))
  [eqn] = closed.jaxpr.eqns
  bad = closed.jaxpr.replace(
    eqns=[eqn.replace(params={**eqn.params, "cpu_path": cpu_path})]
  )
  with pytest.raises(Exception, match="cpu_path must be a mpmd._lowering"):
    jax.extend.core.check_jaxpr(bad)
