"""``mpmd.kernel``: upstream's ``pl.kernel`` call, single and list forms
(issue 36, item 6)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import tpu_sc as plsc

import mpmd

SHAPE = (8, 128)
OUT = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
VMEM = pltpu.VMEM(SHAPE, jnp.float32)


def _double(x_hbm, o_hbm, buf):
  pltpu.sync_copy(x_hbm, buf)
  buf[...] *= 2
  pltpu.sync_copy(buf, o_hbm)


def _core(name="core"):
  return mpmd.tensorcore_mesh(name, num_cores=1)


@pytest.fixture
def x(rng):
  return jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)


def _params(fn):
  return {
    n: (p.kind, p.default) for n, p in inspect.signature(fn).parameters.items()
  }


def test_takes_upstreams_arguments_as_upstream_does():
  """Every parameter of the installed ``pl.kernel``, of the same kind
  (positional or keyword-only); ours also takes ``out_type``'s and
  ``scratch_types``' earlier names."""
  ours, theirs = _params(mpmd.kernel), _params(pl.kernel)
  assert list(ours)[:2] == list(theirs)[:2] == ["body", "out_type"]
  for name, (kind, _) in theirs.items():
    assert ours[name][0] == kind, name
  assert set(ours) - set(theirs) == {"out_shape", "scratch_shapes"}
  assert ours["interpret"][1] is None  # mpmd_map's default


def test_single_form_runs_like_mpmd_map(x):
  f = mpmd.kernel(_double, OUT, mesh=_core(), scratch_types=[VMEM])
  g = mpmd.mpmd_map([(_core(), _double)], OUT, scratch_types=[VMEM])
  np.testing.assert_array_equal(f(x), 2 * x)
  np.testing.assert_array_equal(jax.jit(f)(x), g(x))
  [eqn] = jax.make_jaxpr(f)(x).eqns
  assert eqn.primitive is mpmd.mpmd_map_p


def test_single_form_lowers_for_tpu(x):
  f = mpmd.kernel(_double, OUT, mesh=_core(), scratch_types=[VMEM])
  text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text


def test_decorator_form(x):
  @mpmd.kernel(out_type=OUT, mesh=_core(), scratch_types=[VMEM], name="dbl")
  def doubled(x_hbm, o_hbm, buf):
    _double(x_hbm, o_hbm, buf)

  np.testing.assert_array_equal(doubled(x), 2 * x)
  [eqn] = jax.make_jaxpr(doubled)(x).eqns
  assert eqn.params["name"] == "dbl"


def test_earlier_argument_names(x):
  f = mpmd.kernel(_double, out_shape=OUT, mesh=_core(), scratch_shapes=[VMEM])
  np.testing.assert_array_equal(f(x), 2 * x)


def test_list_form_runs_one_body_per_mesh(x):
  producer, consumer = _core("producer"), _core("consumer")

  def produce(x_hbm, o_hbm, staged, ready, buf, _):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = buf[...] + 1.0
    pltpu.sync_copy(buf, staged)
    pl.semaphore_signal(ready, 1, device_id={"consumer": 0})

  def consume(x_hbm, o_hbm, staged, ready, _, buf):
    pl.semaphore_wait(ready, 1)
    pltpu.sync_copy(staged, buf)
    buf[...] = buf[...] * 3.0
    pltpu.sync_copy(buf, o_hbm)

  f = mpmd.kernel(
    body=[produce, consume],
    mesh=[producer, consumer],
    out_type=OUT,
    scratch_types=[
      pltpu.HBM(SHAPE, jnp.float32),
      pltpu.SemaphoreType.REGULAR @ consumer,
      (pltpu.VMEM @ producer)(SHAPE, jnp.float32),
      (pltpu.VMEM @ consumer)(SHAPE, jnp.float32),
    ],
  )
  np.testing.assert_allclose(jax.jit(f)(x), (x + 1.0) * 3.0)
  [eqn] = jax.make_jaxpr(f)(x).eqns
  assert [tuple(m.shape) for m in eqn.params["meshes"]] == [
    ("producer",),
    ("consumer",),
  ]


def test_list_form_on_sparsecores_as_upstream_writes_it():
  """Upstream's test_parallel_subkernels_with_kernel, through us."""
  with mpmd.tpu_target("v7x"):
    vector = plsc.VectorSubcoreMesh(
      core_axis_name="s_core", subcore_axis_name="subcore", num_cores=2
    )
    scalar = plsc.ScalarSubcoreMesh(axis_name="s_core", num_cores=2)
    x = jnp.arange(16, dtype=jnp.int32)

    def vector_fn(x_hbm, o_hbm, shared):
      pltpu.sync_copy(x_hbm, shared)
      buf = jax.empty_ref(jax.typeof(x), memory_space=pltpu.VMEM)
      pltpu.sync_copy(shared, buf)
      buf[...] = buf[...] * 3
      pltpu.sync_copy(buf, o_hbm.at[: x.size])

    def scalar_fn(x_hbm, o_hbm, shared):
      del shared
      buf = jax.empty_ref(jax.typeof(x), memory_space=pltpu.SMEM)
      pltpu.sync_copy(x_hbm, buf)

      @pl.loop(0, x.size)
      def _(i):
        buf[i] = buf[i] * 4

      pltpu.sync_copy(buf, o_hbm.at[x.size :])

    out = mpmd.kernel(
      body=[vector_fn, scalar_fn],
      mesh=[vector, scalar],
      out_type=jax.ShapeDtypeStruct([x.size * 2], x.dtype),
      scratch_types=(pltpu.VMEM_SHARED(x.shape, x.dtype),),
    )(x)
  np.testing.assert_array_equal(out[: x.size], 3 * x)
  np.testing.assert_array_equal(out[x.size :], 4 * x)


def test_force_tpu_interpret_mode_runs_tpu_kernels_in_the_simulator(x):
  f = mpmd.kernel(_double, OUT, mesh=_core(), scratch_types=[VMEM])
  with pltpu.force_tpu_interpret_mode():
    g = mpmd.kernel(_double, OUT, mesh=_core(), scratch_types=[VMEM])
  [plain] = jax.make_jaxpr(f)(x).eqns
  [forced] = jax.make_jaxpr(g)(x).eqns
  assert plain.params["interpret"] is None
  assert isinstance(forced.params["interpret"], pltpu.InterpretParams)
  np.testing.assert_array_equal(g(x), 2 * x)


def test_force_tpu_interpret_mode_leaves_gpu_kernels_alone():
  def copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  with pltpu.force_tpu_interpret_mode():
    f = mpmd.kernel(copy, OUT, mesh=plgpu.Mesh(num_threads=1, thread_name="wg"))
  y = jnp.ones(SHAPE, jnp.float32)
  [eqn] = jax.make_jaxpr(f)(y).eqns
  assert eqn.params["interpret"] is None
  np.testing.assert_array_equal(f(y), y)


# -- bad calls: clear errors when kernel is called, before any tracing --------


def _not_traced(*refs):
  raise AssertionError("traced")


@pytest.mark.parametrize(
  ("kwargs", "error", "words"),
  [
    (
      dict(body=[_not_traced, _not_traced], mesh=_core()),
      ValueError,
      r"mesh must be a sequence when body is a sequence of callables; "
      r"expected 'mesh' to be a sequence of 2 meshes, got TensorCoreMesh",
    ),
    (
      dict(body=[_not_traced, _not_traced], mesh=[_core("a")]),
      ValueError,
      r"body and mesh sequences must have the same length; got 2 bodies "
      r"and 1 meshes",
    ),
    (
      dict(body=_not_traced, mesh=[_core("a"), _core("b")]),
      ValueError,
      r"mesh cannot be a sequence when body is a single callable; got a "
      r"list of 2",
    ),
    (
      dict(mesh=(_core("a"), _core("b"))),
      ValueError,
      r"mesh cannot be a sequence when using kernel as a decorator; got a "
      r"tuple of 2",
    ),
    (dict(body=[], mesh=[]), ValueError, r"expected a non-empty 'body'"),
    (
      dict(body=3, mesh=_core()),
      TypeError,
      r"expected 'body' to be a kernel function \(a callable\), got int: 3",
    ),
    (
      dict(body=[_not_traced, "f"], mesh=[_core("a"), _core("b")]),
      TypeError,
      r"expected 'body\[1\]' to be a kernel function \(a callable\), got "
      r"str: 'f'",
    ),
    (
      dict(body=_not_traced, out_type=OUT, out_shape=OUT, mesh=_core()),
      TypeError,
      r"got both 'out_type' and its earlier name 'out_shape'",
    ),
    (
      dict(body=_not_traced, scratch_types=(), scratch_shapes=(), mesh=_core()),
      TypeError,
      r"got both 'scratch_types' and its earlier name 'scratch_shapes'",
    ),
  ],
  ids=[
    "bodies_one_mesh",
    "lengths",
    "one_body_meshes",
    "decorator_meshes",
    "empty",
    "body_not_callable",
    "entry_not_callable",
    "out_type_twice",
    "scratch_twice",
  ],
)
def test_bad_calls(kwargs, error, words):
  with pytest.raises(error, match=r"^mpmd\.kernel: " + words):
    mpmd.kernel(**kwargs)


def test_a_decorated_non_callable_is_a_type_error():
  decorate = mpmd.kernel(out_type=OUT, mesh=_core())
  with pytest.raises(
    TypeError, match=r"expected the decorated function to be a kernel"
  ):
    decorate(None)


def test_is_public():
  assert "kernel" in mpmd.__all__
  assert mpmd.kernel.__doc__ and ">>> g = mpmd.kernel(" in mpmd.kernel.__doc__
