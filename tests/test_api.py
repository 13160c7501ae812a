"""The public API end to end: run on CPU, lower for TPU / CUDA, bad input."""

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from python_runs import run_python

import mpmd
from mpmd import _jax

SHAPE = (16, 128)


def tc_mesh(name="core", num_cores=1):
  return mpmd.tensorcore_mesh(name, num_cores=num_cores)


def scale_kernel(x_hbm, o_hbm, buf):
  pltpu.sync_copy(x_hbm, buf)
  buf[...] = buf[...] * 3.0 + 1.0
  pltpu.sync_copy(buf, o_hbm)


def scale(x, **kw):
  return mpmd.mpmd_map(
    [(tc_mesh(), scale_kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[pltpu.VMEM(x.shape, x.dtype)],
    **kw,
  )(x)


def test_single_mesh_runs_on_cpu_without_flags(rng):
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
  # XLA may fuse x * 3 + 1 into one FMA on one side only: 1 ulp near 0.
  tol = dict(rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(scale(x), x * 3.0 + 1.0, **tol)
  np.testing.assert_allclose(jax.jit(scale)(x), x * 3.0 + 1.0, **tol)


def test_public_surface():
  assert set(mpmd.__all__) >= {"mpmd_map", "mpmd_map_p", "tpu_target"}
  assert mpmd.mpmd_map_p.name == "mpmd_map"
  assert mpmd.mpmd_map.__doc__ and "Example" in mpmd.mpmd_map.__doc__


def test_every_public_function_has_an_example():
  functions = [
    name for name in mpmd.__all__ if inspect.isfunction(getattr(mpmd, name))
  ]
  assert "get_races" in functions
  missing = [n for n in functions if "Example" not in getattr(mpmd, n).__doc__]
  assert not missing


def test_pytree_outputs_and_multicore_axis_index(rng):
  x = jnp.asarray(rng.standard_normal((2, 8, 128)), jnp.float32)

  def kernel(x_hbm, outs, buf):
    c = jax.lax.axis_index("core")
    pltpu.sync_copy(x_hbm.at[c], buf)
    buf[...] = buf[...] + c.astype(jnp.float32)
    pltpu.sync_copy(buf, outs["shifted"].at[c])
    pltpu.sync_copy(x_hbm.at[c], outs["copy"].at[c])

  f = mpmd.mpmd_map(
    [(tc_mesh(num_cores=2), kernel)],
    {
      "shifted": jax.ShapeDtypeStruct(x.shape, x.dtype),
      "copy": jax.ShapeDtypeStruct(x.shape, x.dtype),
    },
    scratch_types=[pltpu.VMEM((8, 128), jnp.float32)],
  )
  out = f(x)
  np.testing.assert_array_equal(out["copy"], x)
  np.testing.assert_array_equal(
    out["shifted"], x + jnp.arange(2, dtype=jnp.float32)[:, None, None]
  )


def test_tpu_cross_lowering():
  x = jnp.ones(SHAPE, jnp.float32)
  text = jax.jit(scale).trace(x).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text


def test_launch_takes_the_arguments_as_checked():
  # mpmd_map checks its arguments once, when it is called, and its function
  # launches with what was checked: a metadata dict changed afterwards (to
  # a value the check refuses) does not reach the lowering.
  metadata = {"owner": "test"}
  f = mpmd.mpmd_map(
    [(tc_mesh(), scale_kernel)],
    jax.ShapeDtypeStruct(SHAPE, jnp.float32),
    scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)],
    metadata=metadata,
  )
  metadata["owner"] = 1
  x = jnp.ones(SHAPE, jnp.float32)
  text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
  [found] = re.findall(r'kernel_metadata = "([^"]*)"', text)
  assert r"\22owner\22:\22test\22" in found


def test_multi_platform_lowering_and_export():
  x = jnp.ones(SHAPE, jnp.float32)
  text = (
    jax.jit(scale).trace(x).lower(lowering_platforms=("cpu", "tpu")).as_text()
  )
  assert "tpu_custom_call" in text
  exported = jax.export.export(jax.jit(scale), platforms=("cpu", "tpu"))(x)
  assert exported.platforms == ("cpu", "tpu")
  np.testing.assert_allclose(exported.call(x), x * 3.0 + 1.0)


def gpu_add_one(x):
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")

  def body(x_ref, o_ref):
    rows = pl.ds(jax.lax.axis_index("wg") * 64, 64)
    o_ref[rows, :] = x_ref[rows, :] + 1.0

  return mpmd.mpmd_map([(mesh, body)], jax.ShapeDtypeStruct(x.shape, x.dtype))(
    x
  )


def test_gpu_mesh_runs_in_simulator_and_lowers_for_cuda(rng):
  x = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
  np.testing.assert_allclose(gpu_add_one(x), x + 1.0)
  text = (
    jax.jit(gpu_add_one).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  )
  assert re.search(r"custom_call @mosaic_gpu", text)


def test_tpu_target_names_the_generation():
  x = jnp.zeros((16, 256), jnp.float32)

  def kernel(x_hbm, o_hbm):
    def body(x_vmem, o_vmem):
      o_vmem[...] = x_vmem[...] + 1.0

    # emit_pipeline asks the TPU generation while tracing.
    pltpu.emit_pipeline(
      body,
      grid=(2,),
      in_specs=[pl.BlockSpec((8, 256), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((8, 256), lambda i: (i, 0))],
    )(x_hbm, o_hbm)

  f = mpmd.mpmd_map(
    [(tc_mesh(), kernel)], jax.ShapeDtypeStruct(x.shape, x.dtype)
  )
  np.testing.assert_array_equal(f(x), x + 1.0)  # default target on CPU
  for target in mpmd.TPU_TARGETS:
    with mpmd.tpu_target(target):
      text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("target, cores", [("v5p", 2), ("v6e", 1)])
def test_tpu_target_counts_a_tensorcore_meshs_default_cores(target, cores):
  """A mesh built without ``num_cores`` counts the attached device's cores,
  which a CPU device lacks: under a target, the target's."""
  with mpmd.tpu_target(target):
    if _jax.JAX_VERSION >= (0, 11):
      mesh = pltpu.TensorCoreMesh(axis_name="core")
    else:  # its mesh is built from devices
      mesh = pltpu.create_tensorcore_mesh("core")
  assert dict(mesh.shape) == {"core": cores}


def test_multicore_meshes_and_their_refs_compare_as_bools():
  """JAX's abstract-eval cache compares two Ref types whose hashes nearly
  collide; ``VMEM @ mesh`` over two-core meshes of jax 0.10.2 raised an
  ambiguous array truth value there (a kernel over two such meshes failed
  at random in CI)."""
  a, b = tc_mesh("a", 2), tc_mesh("b", 2)
  assert a == tc_mesh("a", 2) and hash(a) == hash(tc_mesh("a", 2))
  assert a != b and a != tc_mesh("a", 3)

  def ref(mesh):
    return (pltpu.VMEM @ mesh)(SHAPE, jnp.float32).get_ref_aval()

  assert ref(a) == ref(tc_mesh("a", 2)) and ref(a) != ref(b)


def _upstream_mesh(name, num_cores):
  if _jax.JAX_VERSION >= (0, 11):
    return pltpu.TensorCoreMesh(axis_name=name, num_cores=num_cores)
  return pltpu.create_tensorcore_mesh(name, num_cores=num_cores)


def test_upstream_multicore_meshes_compare_as_bools_once_launched():
  """Meshes built with Pallas' own constructor: a launch takes them as
  they are and makes them comparable (the same failure, on jax 0.10.2)."""
  a, b = _upstream_mesh("a", 2), _upstream_mesh("b", 2)

  def kernel(x_hbm, *refs, i):
    c = jax.lax.axis_index("ab"[i])
    pltpu.sync_copy(x_hbm, refs[2 + i])
    pltpu.sync_copy(refs[2 + i], refs[i].at[c])

  x = jnp.ones(SHAPE, jnp.float32)
  f = mpmd.mpmd_map(
    [(m, functools.partial(kernel, i=i)) for i, m in enumerate((a, b))],
    [jax.ShapeDtypeStruct((2, *SHAPE), jnp.float32)] * 2,
    scratch_types=[(pltpu.VMEM @ m)(SHAPE, jnp.float32) for m in (a, b)],
  )
  for out in f(x):
    np.testing.assert_array_equal(out, jnp.broadcast_to(x, out.shape))
  assert a != b and not a == b


# -- bad input ----------------------------------------------------------------


def _noop(*refs):
  del refs


OUT = jax.ShapeDtypeStruct(SHAPE, jnp.float32)


def _returns_a_value():
  def returns(x_ref, o_ref):
    return x_ref[...]

  mpmd.mpmd_map([(tc_mesh(), returns)], OUT)(jnp.zeros(SHAPE, jnp.float32))


def _closes_over_an_array():
  captured = jnp.ones(SHAPE, jnp.float32)

  def closes(x_ref, o_ref):
    o_ref[...] = x_ref[...] + captured

  mpmd.mpmd_map([(tc_mesh(), closes)], OUT)(jnp.zeros(SHAPE, jnp.float32))


def _unknown_tpu_target():
  with mpmd.tpu_target("v99"):
    pass


# (id, a call with bad input, the error it raises, its message's regex)
BAD_INPUT = [
  pytest.param(
    lambda: mpmd.mpmd_map([], OUT),
    ValueError,
    "at least one .mesh, fn. pair",
    id="empty_list",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map(_noop, OUT),
    TypeError,
    "'meshes_and_fns' to be a sequence",
    id="not_a_sequence",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map([({"x": 2}, _noop)], OUT),
    TypeError,
    r"meshes_and_fns\[0\]\[0\] to be a Pallas mesh .* got dict",
    id="not_a_mesh",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map([(tc_mesh(), 3)], OUT),
    TypeError,
    r"meshes_and_fns\[0\]\[1\] to be callable, got int",
    id="fn_not_callable",
  ),
  pytest.param(
    _returns_a_value,
    ValueError,
    r"must return None \(write to its output refs\), but it returned f32\[",
    id="fn_returns_a_value",
  ),
  pytest.param(
    _closes_over_an_array,
    ValueError,
    r"closes over arrays \['f32\[16,128\]'\]; pass them as inputs",
    id="closed_over_array",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map(
      [(tc_mesh(), _noop), (tc_mesh(num_cores=2), _noop)], OUT
    ),
    ValueError,
    "axis 'core' has size 1 in mesh 0 but size 2 in mesh 1",
    id="conflicting_axis_sizes",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map([(tc_mesh(), _noop)], "f32[16,128]"),
    TypeError,
    r"out_types leaf 0 to be a jax.ShapeDtypeStruct, a JAX type .* got str",
    id="out_types_not_shape_dtype",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map(
      [
        (tc_mesh(), _noop),
        (plgpu.Mesh(num_threads=1, thread_name="wg"), _noop),
      ],
      OUT,
    ),
    ValueError,
    "cannot mix GPU meshes",
    id="mixed_tpu_and_gpu_meshes",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map(
      [(tc_mesh(), _noop)], OUT, input_output_aliases={0: 0}
    )(jnp.zeros((8,), jnp.float32)),
    ValueError,
    r"input 0 \(f32\[8\]\) cannot alias output 0 \(f32\[16,128\]\)",
    id="bad_alias",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map(
      [(tc_mesh(), _noop)], OUT, interpret=mpmd.GPUInterpretParams()
    ),
    ValueError,
    r"expected 'interpret' for TPU meshes \(pltpu.InterpretParams\), got "
    r"InterpretGPUParams",
    id="interpret_params_of_the_wrong_platform",
  ),
  pytest.param(
    lambda: mpmd.mpmd_map([(tc_mesh(), _noop)], OUT, interpret="yes"),
    TypeError,
    "expected 'interpret' to be None, True",
    id="interpret_of_the_wrong_kind",
  ),
  pytest.param(
    _unknown_tpu_target,
    ValueError,
    r"tpu_target: expected 'name' in",
    id="unknown_tpu_target",
  ),
]


@pytest.mark.parametrize("call, error, match", BAD_INPUT)
def test_bad_input(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_closed_over_scalar_is_fine():
  factor = jnp.float32(2.5)

  def closes(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = buf[...] * factor
    pltpu.sync_copy(buf, o_hbm)

  f = mpmd.mpmd_map(
    [(tc_mesh(), closes)], OUT, scratch_types=[pltpu.VMEM(SHAPE, jnp.float32)]
  )
  x = jnp.ones(SHAPE, jnp.float32)
  np.testing.assert_allclose(f(x), x * 2.5)


def _copy(x_hbm, o_hbm):
  pltpu.sync_copy(x_hbm, o_hbm)


@pytest.mark.parametrize(
  "as_type",
  [
    jax.typeof,
    lambda x: jax.core.ShapedArray(x.shape, x.dtype),
    lambda x: x,
    np.asarray,
  ],
  ids=["typeof", "ShapedArray", "jax_array", "numpy_array"],
)
def test_out_types_as_jax_types_or_arrays(rng, as_type):
  """Upstream takes "a PyTree of jax.ShapeDtypeStruct or JAX types"."""
  x = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)

  def kernel(x_hbm, outs):
    _copy(x_hbm, outs["out"])

  def f(x):
    return mpmd.mpmd_map([(tc_mesh(), kernel)], {"out": as_type(x)})(x)

  np.testing.assert_array_equal(f(x)["out"], x)
  if as_type is not np.asarray:  # a tracer has no numpy value
    np.testing.assert_array_equal(jax.jit(f)(x)["out"], x)


def test_out_type_of_a_traced_value_keeps_its_varying_axes():
  """Inside shard_map (check_vma=True), ``jax.typeof(r)`` says how ``r``
  varies over the mesh, and the output is declared so: here invariant,
  although an output that does not say would vary like all the inputs."""
  mesh = jax.make_mesh((2,), ("x",))
  spec = jax.sharding.PartitionSpec

  def kernel(x_hbm, r_hbm, o_hbm):
    del x_hbm
    pltpu.sync_copy(r_hbm, o_hbm)

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(spec("x"), spec()),
    out_specs=spec(),
  )
  def f(x, r):
    out = mpmd.mpmd_map([(tc_mesh(), kernel)], jax.typeof(r))(x, r)
    assert not jax.typeof(out).manual_axis_type.varying
    return out

  x = jnp.zeros((16, 128), jnp.float32)
  r = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  x = jax.device_put(x, jax.NamedSharding(mesh, spec("x")))
  np.testing.assert_array_equal(f(x, r), r)


def test_gpu_kernel_closing_over_a_scalar(rng):
  offset = jnp.float32(10.0)
  mesh = plgpu.Mesh(num_threads=2, thread_name="wg")

  def body(x_ref, o_ref):
    o_ref[...] = x_ref[...] + offset

  f = mpmd.mpmd_map(
    [(mesh, body)], jax.ShapeDtypeStruct((128, 128), jnp.float32)
  )
  x = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
  np.testing.assert_allclose(f(x), x + 10.0)
  text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_the_kernels_after_a_plain_import_mpmd():
  # A fresh interpreter: this one imported mpmd.kernels already.
  result = run_python(
    "import mpmd\n"
    "print(mpmd.kernels.moe.__name__, mpmd.kernels.ragged_all_to_all.__name__,"
    " mpmd.kernels.gmm.__name__, mpmd.kernels.gpu.pipeline.__name__)",
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  names = ["moe", "ragged_all_to_all", "gmm", "pipeline"]
  assert result.stdout.split() == names
  with pytest.raises(AttributeError, match="no attribute 'kernal'"):
    mpmd.kernal  # noqa: B018 (the lookup is the test)
