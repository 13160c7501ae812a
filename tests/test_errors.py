"""Bad input to ``mpmd_map`` and ``tpu_target``: a typed error, before
lowering.

Each row of the table is a call that must raise the given ``ValueError`` (a
bad value) or ``TypeError`` (the wrong kind of object) with a message naming
the argument, what was expected and what came. Launches are only traced
(``jax.jit(f).trace``), never lowered: the errors come from our checks, not
from a lowering or a simulator. The kernels' tables are next to their
tests (``tests/kernels/test_*_errors.py``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from error_cases import Case, params, raises
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd import _jax
from mpmd.kernels import gpu

# -- mpmd_map -----------------------------------------------------------------

ROWS = (8, 128)
OUT = jax.ShapeDtypeStruct(ROWS, jnp.float32)
X = jnp.zeros(ROWS, jnp.float32)
# Where an operation is: this file's line, as trace-time checks give it.
AT = r"\(at .*test_errors.py:\d+:\d+ .*\)"


def tc(name="core", num_cores=1):
  return mpmd.tensorcore_mesh(name, num_cores=num_cores)


def wg_mesh():
  return plgpu.Mesh(num_threads=2, thread_name="wg")


def copy_kernel(x_hbm, o_hbm, *scratch):
  del scratch
  pltpu.sync_copy(x_hbm, o_hbm)


def noop(*refs):
  del refs


def launch(fns, out_types=OUT, args=(X,), **kw):
  """Builds the launch and traces it (no lowering)."""
  f = mpmd.mpmd_map(fns, out_types, **kw)
  return jax.jit(f).trace(*args)


def signal(device_id):
  def kernel(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, 1, device_id=device_id)
    pl.semaphore_wait(sem, 1)

  return kernel


def signal_core(core_index):
  def kernel(x_hbm, o_hbm, sem):
    pl.semaphore_signal(sem, 1, core_index=core_index)

  return kernel


def reads_axis(axis):
  def kernel(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] += jax.lax.axis_index(axis).astype(jnp.float32)
    pltpu.sync_copy(buf, o_hbm)

  return kernel


SEM = [pltpu.SemaphoreType.REGULAR(())]
VMEM = [pltpu.VMEM(ROWS, jnp.float32)]


# Kernels that touch HBM / ANY Refs in place, which Mosaic TPU rejects
# ("Loads are only allowed on VMEM and SMEM references").
def load_input(x_hbm, o_hbm):
  o_hbm[...] = x_hbm[...]


def load_scalar(x_hbm, o_hbm, s):
  s[0] = x_hbm[0, 0]


def store_output(x_hbm, o_hbm, buf):
  pltpu.sync_copy(x_hbm, buf)
  o_hbm[...] = buf[...]


def load_in_loop(x_hbm, o_hbm, scratch):
  def body(i, carry):
    return carry + scratch[i, 0]

  jax.lax.fori_loop(0, 8, body, jnp.float32(0))


def load_scoped_hbm(x_hbm, o_hbm):
  def body(buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[0, 0] += 1

  pl.run_scoped(body, pltpu.HBM(ROWS, jnp.float32))


def pass_ref(x):
  x_ref, o_ref = jax.new_ref(x), jax.empty_ref(jax.typeof(x))
  mpmd.mpmd_map([(tc(), load_input)])(x_ref, o_ref)
  return jax.freeze(o_ref)


def close_over_ref(x):
  x_ref = jax.new_ref(x)

  def kernel(o_hbm):
    o_hbm[...] = x_ref[...]

  return mpmd.mpmd_map([(tc(), kernel)], OUT)()


MPMD_MAP_CASES = [
  Case(
    "empty",
    lambda: mpmd.mpmd_map([], OUT),
    ValueError,
    r"expected at least one \(mesh, fn\) pair in 'meshes_and_fns'",
  ),
  Case(
    "not_a_sequence",
    lambda: mpmd.mpmd_map(noop, OUT),
    TypeError,
    r"expected 'meshes_and_fns' to be a sequence .* got function",
  ),
  Case(
    "mesh_of_zero_cores",
    lambda: mpmd.mpmd_map([(_jax.tensorcore_mesh("c", 0), noop)], OUT),
    ValueError,
    r"expected meshes_and_fns\[0\]\[0\] to be a mesh with at least one "
    r"program along every axis, got axis sizes \{'c': 0\}",
  ),
  Case(
    "vmem_scratch_on_a_gpu_mesh",
    lambda: mpmd.mpmd_map([(wg_mesh(), noop)], OUT, scratch_types=VMEM),
    ValueError,
    r"expected scratch_types leaf 0 in a GPU memory space .* got VMEM",
  ),
  Case(
    "gpu_smem_scratch_on_a_tpu_mesh",
    lambda: mpmd.mpmd_map(
      [(tc(), noop)], OUT, scratch_types=[plgpu.SMEM(ROWS, jnp.float32)]
    ),
    ValueError,
    r"expected scratch_types leaf 0 in a TPU memory space .* got SMEM",
  ),
  Case(
    "device_id_of_an_unknown_axis",
    lambda: launch([(tc(), signal({"nope": 0}))], scratch_types=SEM),
    ValueError,
    r"semaphore_signal "
    + AT
    + r" names device_id axis 'nope', which is not an axis "
    r"of the kernel meshes or of an enclosing shard_map \{'core': 1\}",
  ),
  Case(
    "kernel_of_too_few_parameters",
    lambda: launch([(tc(), load_input)], scratch_types=VMEM),
    TypeError,
    r"kernel load_input at .*:\d+ is called with its inputs, then its outputs, "
    r"then its scratch Refs \(3 positional arguments\), but its signature "
    r"does not take them: too many positional arguments",
  ),
  Case(
    "device_id_past_the_axis",
    lambda: launch([(tc(num_cores=2), signal({"core": 2}))], scratch_types=SEM),
    mpmd.OutOfBoundsError,  # (a StaticOutOfBoundsError: a ValueError too)
    r"names device_id \{'core': 2\}: expected an index in \[0, 2\) along "
    r"axis 'core' \(at .*test_errors.py:\d+",  # the signal's line
  ),
  Case(
    "core_index_past_the_mesh",
    lambda: launch(
      [(tc("a", num_cores=2), signal_core(2)), (tc("b"), noop)],
      scratch_types=[SEM[0] @ tc("a", num_cores=2)],
    ),
    mpmd.OutOfBoundsError,
    r"semaphore_signal names core_index=2: expected an index in \[0, 2\) "
    r"\(the programs of its mesh \{'a': 2\}\)",
  ),
  Case(
    "aliases_by_name",
    lambda: mpmd.mpmd_map([(tc(), noop)], OUT, input_output_aliases={"x": 0}),
    TypeError,
    r"expected 'input_output_aliases' to map int input indices to int "
    r"output indices, got \{'x': 0\}",
  ),
  Case(
    "aliases_as_a_list",
    lambda: mpmd.mpmd_map([(tc(), noop)], OUT, input_output_aliases=[0]),
    TypeError,
    r"expected 'input_output_aliases' to be a dict .* got list: \[0\]",
  ),
  Case(
    "aliases_out_of_range",
    lambda: launch([(tc(), noop)], input_output_aliases={1: 0}),
    ValueError,
    r"input_output_aliases \{1: 0\} is out of range for 1 inputs and 1 "
    "outputs",
  ),
  Case(
    "name_not_a_str",
    lambda: mpmd.mpmd_map([(tc(), noop)], OUT, name=5),
    TypeError,
    r"expected 'name' to be a str or None, got 5",
  ),
  Case(
    "compiler_params_as_a_dict",
    lambda: mpmd.mpmd_map([(tc(), noop)], OUT, compiler_params={"mosaic": {}}),
    TypeError,
    r"expected 'compiler_params' for TPU meshes to be None or a "
    r"pltpu.CompilerParams, got dict",
  ),
  Case(
    "gpu_compiler_params_on_a_tpu_mesh",
    lambda: mpmd.mpmd_map(
      [(tc(), noop)], OUT, compiler_params=plgpu.CompilerParams()
    ),
    TypeError,
    r"'compiler_params' for TPU meshes .* got CompilerParams",
  ),
  Case(
    "cost_estimate_as_a_str",
    lambda: mpmd.mpmd_map([(tc(), noop)], OUT, cost_estimate="cheap"),
    TypeError,
    r"expected 'cost_estimate' to be None or a pl.CostEstimate, got 'cheap'",
  ),
  Case(
    "metadata_with_int_keys",
    lambda: mpmd.mpmd_map([(tc(), noop)], OUT, metadata={1: "one"}),
    TypeError,
    r"expected 'metadata' to be None or a mapping of str to str",
  ),
  Case(
    "negative_out_shape",
    lambda: mpmd.mpmd_map(
      [(tc(), noop)], jax.ShapeDtypeStruct((-8, 128), jnp.float32)
    ),
    ValueError,
    r"expected out_types leaf 0 to have a shape of non-negative ints, got "
    r"\(-8, 128\)",
  ),
  Case(
    "negative_scratch_shape",
    lambda: mpmd.mpmd_map(
      [(tc(), noop)], OUT, scratch_types=[pltpu.VMEM((8, -1), jnp.float32)]
    ),
    ValueError,
    r"expected scratch_types leaf 0 to have a shape of non-negative ints, "
    r"got \(8, -1\)",
  ),
  Case(
    "out_type_not_a_type",
    lambda: mpmd.mpmd_map([(tc(), noop)], "f32[8,128]"),
    TypeError,
    r"expected out_types leaf 0 to be a jax.ShapeDtypeStruct, a JAX type",
  ),
  Case(
    "interpret_not_a_flag",
    lambda: mpmd.mpmd_map([(tc(), noop)], OUT, interpret="yes"),
    TypeError,
    r"expected 'interpret' to be None, True, an InterpretParams or ",
  ),
  Case(
    "axis_index_of_an_unknown_axis",
    lambda: launch([(tc(), reads_axis("nope"))], scratch_types=VMEM),
    ValueError,
    r"kernel kernel at .* names axis 'nope', which is not an axis of its "
    r"mesh \{'core': 1\} \(and there is no enclosing shard_map\)",
  ),
  Case(
    "axis_index_of_an_unknown_axis_with_two_meshes",
    lambda: launch(
      [(tc("a"), noop), (tc("b"), reads_axis("nope"))],
      scratch_types=[(pltpu.VMEM @ tc("b"))(ROWS, jnp.float32)],
    ),
    ValueError,
    r"not an axis of its mesh \{'b': 1\}, of the launch's other meshes "
    r"\{'a': 1\}",
  ),
  Case(
    "dma_of_another_shape",
    lambda: launch(
      [(tc(), copy_kernel)], jax.ShapeDtypeStruct((16, 128), jnp.float32)
    ),
    ValueError,
    r"a DMA " + AT + r" copies from 'x_hbm' \(input 0, .*\) into 'o_hbm' "
    r"\(out_types "
    r"leaf 0, .*\): expected the same shape and dtype on both sides, got "
    r"f32\[8,128\] and f32\[16,128\]",
  ),
  Case(
    "dma_of_another_dtype",
    lambda: launch(
      [(tc(), copy_kernel)], jax.ShapeDtypeStruct(ROWS, jnp.int32)
    ),
    ValueError,
    r"got f32\[8,128\] and i32\[8,128\]",
  ),
  Case(
    "dma_of_another_input_rank",
    lambda: launch([(tc(), copy_kernel)], args=(jnp.zeros((1024,)),)),
    ValueError,
    r"a DMA "
    + AT
    + r" copies from 'x_hbm' .* got f32\[1024\] and f32\[8,128\]",
  ),
  Case(
    "dma_into_a_window_of_another_shape",
    lambda: launch(
      [
        (
          tc(),
          lambda x_hbm, o_hbm, buf: pltpu.sync_copy(x_hbm.at[pl.ds(0, 4)], buf),
        )
      ],
      scratch_types=VMEM,
    ),
    ValueError,
    r"into 'buf' \(scratch_types leaf 0, .*\): .* got f32\[4,128\] and "
    r"f32\[8,128\]",
  ),
  Case(
    "load_from_an_any_input",
    lambda: launch([(tc(), load_input)]),
    ValueError,
    r"kernel load_input at .*: reads 'x_hbm' \(input 0, .*\) in place "
    + AT
    + r", but "
    r"it is in ANY memory: on TPU only VMEM and SMEM Refs can be read or "
    r"written directly; copy .* pltpu.sync_copy",
  ),
  Case(
    "scalar_load_from_an_any_input",
    lambda: launch(
      [(tc(), load_scalar)], scratch_types=[pltpu.SMEM((1,), jnp.float32)]
    ),
    ValueError,
    r"reads 'x_hbm' \(input 0, .*\) in place "
    + AT
    + r", but it is in ANY memory",
  ),
  Case(
    "store_into_an_any_output",
    lambda: launch([(tc(), store_output)], scratch_types=VMEM),
    ValueError,
    r"writes 'o_hbm' \(out_types leaf 0, .*\) in place "
    + AT
    + r", but it is in ANY "
    r"memory",
  ),
  Case(
    "load_from_hbm_scratch_in_a_loop",
    lambda: launch(
      [(tc(), load_in_loop)], scratch_types=[pltpu.HBM(ROWS, jnp.float32)]
    ),
    ValueError,
    r"reads 'scratch' \(scratch_types leaf 0, .*\) in place "
    + AT
    + r", but it is in "
    r"HBM memory",
  ),
  Case(
    "load_from_a_scoped_hbm_allocation",
    lambda: launch([(tc(), load_scoped_hbm)]),
    ValueError,
    r"kernel load_scoped_hbm at .*: reads pl.run_scoped's 'buf' "
    r"\(Ref<hbm>\{f32\[8,128\]\}\) in place " + AT + r", but it is "
    r"in HBM memory",
  ),
  Case(
    "load_from_a_passed_ref",
    lambda: jax.jit(pass_ref).trace(X),
    ValueError,
    r"reads 'x_hbm' \(input 0, .*\) in place "
    + AT
    + r", but it is in ANY memory",
  ),
  Case(
    "load_from_a_closed_over_ref",
    lambda: jax.jit(close_over_ref).trace(X),
    ValueError,
    r"reads a closed-over Ref \(.*\) in place "
    + AT
    + r", but it is in ANY memory",
  ),
  Case(
    "load_from_any_on_the_simulator_path",
    lambda: launch([(tc(), load_input)], interpret=pltpu.InterpretParams()),
    ValueError,
    r"reads 'x_hbm' \(input 0, .*\) in place "
    + AT
    + r", but it is in ANY memory",
  ),
  Case(
    "gpu_collective_scratch_over_an_unknown_axis",
    lambda: launch(
      [
        (
          wg_mesh(),
          lambda x, o: pl.run_scoped(
            lambda s: None,
            plgpu.SMEM((8,), jnp.float32),
            collective_axes="nope",
          ),
        )
      ],
      jax.ShapeDtypeStruct((128, 128), jnp.float32),
      args=(jnp.zeros((128, 128), jnp.float32),),
    ),
    ValueError,
    r"run_scoped\(collective_axes=\('nope',\)\) names \['nope'\], which are "
    r"not axes of the kernel's mesh \{'wg': 2\}",
  ),
]


@pytest.mark.parametrize("case", params(MPMD_MAP_CASES))
def test_mpmd_map_bad_input(case):
  assert raises(case).startswith("mpmd_map: ")


def test_mpmd_map_table_is_large_enough():
  assert len(MPMD_MAP_CASES) >= 10


def test_in_place_access_where_the_hardware_allows_it():
  """VMEM and SMEM Refs (scratch, scoped allocations) are read and written
  in place on TPU meshes; GPU kernels read and write GMEM in place (Mosaic
  GPU lowers it)."""

  def tpu_kernel(x_hbm, o_hbm, buf, count):
    pltpu.sync_copy(x_hbm, buf)
    count[0] = buf[0, 0] + 1

    def scoped(tmp):
      tmp[...] = buf[...] + count[0]
      pltpu.sync_copy(tmp, o_hbm)

    pl.run_scoped(scoped, pltpu.VMEM(ROWS, jnp.float32))

  f = mpmd.mpmd_map(
    [(tc(), tpu_kernel)],
    OUT,
    scratch_types=[*VMEM, pltpu.SMEM((1,), jnp.float32)],
  )
  np.testing.assert_array_equal(
    f(jnp.ones(ROWS, jnp.float32)), np.full(ROWS, 3.0)
  )
  jax.jit(f).trace(X).lower(lowering_platforms=("tpu",))

  def gpu_kernel(x_gmem, o_gmem):
    o_gmem[...] = x_gmem[...] + 1

  square = jnp.ones((128, 128), jnp.float32)
  out = mpmd.mpmd_map(
    [(plgpu.Mesh(num_threads=1, thread_name="wg"), gpu_kernel)],
    jax.ShapeDtypeStruct(square.shape, square.dtype),
  )(square)
  np.testing.assert_array_equal(out, np.full(square.shape, 2.0))


def test_collective_axes_beyond_the_warpgroups_name_the_user_axes():
  """Before, the GPU simulator reported the merged kernel's axis:
  "Collective axis `blk` not found among axes `['_mpmd_programs']`"."""
  mesh = plgpu.Mesh(
    grid=(2,), grid_names=("blk",), num_threads=2, thread_name="wg"
  )

  def kernel(x, o):
    pl.run_scoped(
      lambda s: None, plgpu.SMEM((8,), jnp.float32), collective_axes="blk"
    )

  f = mpmd.mpmd_map([(mesh, kernel)], jax.ShapeDtypeStruct((8,), jnp.float32))
  message = raises(
    Case(
      "grid_axis",
      lambda: f(jnp.zeros((8,), jnp.float32)),
      ValueError,
      r"run_scoped\(collective_axes=\('blk',\)\): expected no collective "
      r"axes or only the warpgroup axis \('wg',\) of the kernel's mesh "
      r"\{'blk': 2, 'wg': 2\}",
    )
  )
  assert "_mpmd_programs" not in message


# -- tpu_target ---------------------------------------------------------------

TPU_TARGET_CASES = [
  Case(
    f"{type(name).__name__}_{name!r}",
    functools.partial(mpmd.tpu_target, name),
    TypeError,
    r"tpu_target: expected 'name' to be a str \(one of \['v4', 'v5e', "
    rf"'v5p', 'v6e', 'v7x'\]\), got {type(name).__name__}",
  )
  for name in (["v5e"], ("v5e",), {"v5e"}, None, 5, b"v5e", 5.0)
] + [
  Case(
    f"unknown_{name!r}",
    functools.partial(mpmd.tpu_target, name),
    ValueError,
    r"tpu_target: expected 'name' in \['v4', 'v5e', 'v5p', 'v6e', 'v7x'\], "
    rf"got '{name}'",
  )
  for name in ("v99", "", "V5E", "v5 lite", "TPU v5 lite", " v5e")
]


@pytest.mark.parametrize("case", params(TPU_TARGET_CASES))
def test_tpu_target_bad_input(case):
  """Raised by the call itself, before any ``with``."""
  raises(case)


def test_tpu_target_table_is_large_enough():
  assert len(TPU_TARGET_CASES) >= 10


# -- the GPU kernels ----------------------------------------------------------


def test_gpu_matmul_out_dtype_not_a_dtype():
  a = jnp.zeros((128, 128), jnp.bfloat16)
  with pytest.raises(
    TypeError, match=r"matmul: expected 'out_dtype' to be a dtype, got 'banana'"
  ):
    gpu.matmul(a, a, out_dtype="banana")
