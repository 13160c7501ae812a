"""Checks upstream's ``mpmd_map`` makes, made the same way here.

Each test is a program written against upstream's semantics: where upstream
raises, so do we (same error type, the same gist); where we deliberately
accept more, the test shows what the program then means.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import hijax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import tpu_sc as plsc
from jax.sharding import PartitionSpec as P

import mpmd

ROWS = (8, 128)
OUT = jax.ShapeDtypeStruct(ROWS, jnp.float32)
VMEM = [pltpu.VMEM(ROWS, jnp.float32)]


def tc(name="core", num_cores=1):
  return mpmd.tensorcore_mesh(name, num_cores=num_cores)


def copy(x_hbm, o_hbm):
  pltpu.sync_copy(x_hbm, o_hbm)


def idle(*refs):
  del refs


# -- meshes -------------------------------------------------------------------


@pytest.fixture
def sparsecores():
  """A TPU generation with SparseCores (meshes ask for its facts)."""
  with mpmd.tpu_target("v7x"):
    yield


def scalar_mesh(axis="sc", num_cores=2):
  return plsc.ScalarSubcoreMesh(axis_name=axis, num_cores=num_cores)


def vector_mesh(core_axis="sc", num_cores=2, subcore_axis="subcore"):
  return plsc.VectorSubcoreMesh(
    core_axis_name=core_axis,
    subcore_axis_name=subcore_axis,
    num_cores=num_cores,
    num_subcores=16,
  )


SAME_CORE_AXIS = (
  r"the ScalarSubcoreMesh meshes_and_fns\[0\]\[0\] should have the same core "
  r"axis name and number of cores as the VectorSubcoreMesh "
  r"meshes_and_fns\[1\]\[0\]"
)
AXES_UNLIKE_THE_TENSORCORE = (
  r"the ScalarSubcoreMesh meshes_and_fns\[\d\]\[0\] should have axis "
  r"names different from the TensorCoreMesh meshes_and_fns\[\d\]\[0\]: "
  r"both name \['sc'\]"
)

# (id, the meshes (made under a SparseCore target), the ValueError's regex)
BAD_MESHES = [
  # SparseCore meshes share their core axis: its name and number of cores.
  pytest.param(
    lambda: (scalar_mesh("sc"), vector_mesh("core")),
    SAME_CORE_AXIS,
    id="core_axis_names",
  ),
  pytest.param(
    lambda: (scalar_mesh(num_cores=1), vector_mesh(num_cores=2)),
    SAME_CORE_AXIS,
    id="numbers_of_cores",
  ),
  # One SparseCore mesh of each kind.
  pytest.param(
    lambda: (scalar_mesh(), scalar_mesh("other")),
    r"expected at most one ScalarSubcoreMesh in 'meshes_and_fns'",
    id="two_scalar_meshes",
  ),
  pytest.param(
    lambda: (vector_mesh(), vector_mesh(subcore_axis="s2")),
    r"expected at most one VectorSubcoreMesh in 'meshes_and_fns'",
    id="two_vector_meshes",
  ),
  # SparseCore axes are not named like the TensorCore mesh's axis, whichever
  # comes first.
  pytest.param(
    lambda: (tc("sc", 2), scalar_mesh("sc", 2)),
    AXES_UNLIKE_THE_TENSORCORE,
    id="tensorcore_axis_name_tensorcore_first",
  ),
  pytest.param(
    lambda: (scalar_mesh("sc", 2), tc("sc", 2)),
    AXES_UNLIKE_THE_TENSORCORE,
    id="tensorcore_axis_name_tensorcore_second",
  ),
]


@pytest.mark.parametrize("meshes, match", BAD_MESHES)
def test_bad_sparsecore_meshes(sparsecores, meshes, match):
  with pytest.raises(ValueError, match=match):
    mpmd.mpmd_map([(m, idle) for m in meshes()], OUT)


def test_several_tensorcore_meshes_are_our_extension():
  """Upstream: "You can't use two different TensorCoreMeshes". Here each
  mesh runs its own function, with its own axis names."""

  def first(x_hbm, o_hbm, buf):
    del buf  # the other mesh's
    pltpu.sync_copy(x_hbm.at[0], o_hbm.at[0])

  def second(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm.at[1], buf)
    buf[...] = buf[...] * 2.0 + jax.lax.axis_index("b").astype(jnp.float32)
    pltpu.sync_copy(buf, o_hbm.at[1])

  x = jnp.ones((2, *ROWS), jnp.float32)
  b = tc("b")
  out = mpmd.mpmd_map(
    [(tc("a"), first), (b, second)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[(pltpu.VMEM @ b)(ROWS, jnp.float32)],
  )(x)
  np.testing.assert_array_equal(out[0], np.ones(ROWS))
  np.testing.assert_array_equal(out[1], np.full(ROWS, 2.0))


# -- Refs ---------------------------------------------------------------------


def passes_one_ref_twice(x):
  ref = jax.new_ref(x)
  mpmd.mpmd_map([(tc(), copy)])(ref, ref)
  return jax.freeze(ref)


def closes_over_a_passed_ref(x):
  ref, out = jax.new_ref(x), jax.empty_ref(jax.typeof(x))

  def kernel(x_hbm, o_hbm):
    del x_hbm
    pltpu.sync_copy(ref, o_hbm)

  mpmd.mpmd_map([(tc(), kernel)])(ref, out)
  return jax.freeze(out)


# (id, a program of an array, the NotImplementedError's regex)
BAD_REFS = [
  pytest.param(
    passes_one_ref_twice,
    r"cannot pass the same Ref into a mpmd_map more than once: inputs 0 and "
    r"1 are one Ref",
    id="the_same_ref_passed_twice",
  ),
  pytest.param(
    closes_over_a_passed_ref,
    r"closes over the Ref it is also passed as input 0; closed-over Refs "
    r"that alias a passed-in Ref are not supported",
    id="a_ref_closed_over_and_passed",
  ),
]


@pytest.mark.parametrize("program, match", BAD_REFS)
def test_bad_refs(program, match):
  with pytest.raises(NotImplementedError, match=match):
    jax.jit(program).trace(jnp.ones(ROWS, jnp.float32))


def test_distinct_refs_passed_and_closed_over_run():
  @jax.jit
  def f(x):
    src, out, extra = (
      jax.new_ref(x),
      jax.empty_ref(jax.typeof(x)),
      jax.new_ref(x + 1),
    )

    def kernel(x_hbm, o_hbm, buf, more):
      pltpu.sync_copy(x_hbm, buf)
      pltpu.sync_copy(extra, more)
      buf[...] += more[...]
      pltpu.sync_copy(buf, o_hbm)

    mpmd.mpmd_map([(tc(), kernel)], scratch_types=VMEM * 2)(src, out)
    return jax.freeze(out)

  np.testing.assert_array_equal(
    f(jnp.ones(ROWS, jnp.float32)), np.full(ROWS, 3.0)
  )


# -- vmap ---------------------------------------------------------------------


def scaled(s, x):
  def kernel(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = buf[...] * s
    pltpu.sync_copy(buf, o_hbm)

  return mpmd.mpmd_map([(tc(), kernel)], OUT, scratch_types=VMEM)(x)


@pytest.mark.parametrize("jit_inside", [False, True])
def test_vmap_over_a_closed_over_scalar_is_upstreams_error(jit_inside):
  """Upstream: "Closed-over scalar constants cannot be batched", whether
  the kernel is traced under vmap or in a jit that vmap then batches."""
  scales = jnp.arange(3, dtype=jnp.float32)
  x = jnp.ones(ROWS, jnp.float32)
  f = jax.jit(scaled) if jit_inside else scaled
  with pytest.raises(ValueError, match="Closed-over scalar constants cannot"):
    jax.vmap(f, in_axes=(0, None))(scales, x)


def test_vmap_over_an_unbatched_closed_over_scalar_runs():
  x = jnp.ones((3, *ROWS), jnp.float32)
  out = jax.vmap(scaled, in_axes=(None, 0))(jnp.float32(2), x)
  np.testing.assert_array_equal(out, np.full((3, *ROWS), 2.0))


def test_batched_closed_over_scalar_is_reported_before_kernel_checks():
  """Upstream's batching rule runs before Mosaic sees the kernel, so its
  error comes first for a kernel that also writes HBM in place."""

  def writes_hbm(s):
    def kernel(o_hbm):
      o_hbm[...] = jnp.broadcast_to(s, ROWS)

    return mpmd.mpmd_map([(tc(), kernel)], OUT)()

  with pytest.raises(ValueError, match="Closed-over scalar constants cannot"):
    jax.vmap(writes_hbm)(jnp.arange(3, dtype=jnp.float32))


# -- check_vma ----------------------------------------------------------------

NUM_DEVICES = 2
VARYING = jax.ShapeDtypeStruct(
  ROWS,
  jnp.float32,
  manual_axis_type=jax.sharding.ManualAxisType(varying=frozenset({"x"})),
)


def adds_device_index(out_type):
  def kernel(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] += jax.lax.axis_index("x").astype(jnp.float32)
    pltpu.sync_copy(buf, o_hbm)

  return lambda x: mpmd.mpmd_map(
    [(tc(), kernel)], out_type, scratch_types=VMEM
  )(x)


REPLICATED = P()


def in_shard_map(fn, out_specs, in_specs=REPLICATED):
  mesh = jax.make_mesh(
    (NUM_DEVICES,), ("x",), devices=jax.devices()[:NUM_DEVICES]
  )
  x = jnp.zeros((NUM_DEVICES * ROWS[0] if in_specs else ROWS[0], ROWS[1]))
  x = jax.device_put(x, jax.NamedSharding(mesh, in_specs))
  return jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  )(x)


# Upstream's words (jax 0.10.2 and 0.12), which our message includes.
NO_MANUAL_AXIS_TYPE = (
  r"out_types leaf 0 \(f32\[8,128\]\) to say how it varies.*"
  r"When `check_vma=True` on `jax.shard_map`, `manual_axis_type` on "
  r"`jax.ShapeDtypeStruct` must not be `None`"
)

# (id, the output type, shard_map's out_specs, the ValueError's regex)
BAD_VMA = [
  # As upstream: under check_vma, a ShapeDtypeStruct says how it varies,
  # whatever the out_specs.
  pytest.param(
    OUT, P(), NO_MANUAL_AXIS_TYPE, id="no_manual_axis_type_out_specs_replicated"
  ),
  pytest.param(
    OUT, P("x"), NO_MANUAL_AXIS_TYPE, id="no_manual_axis_type_out_specs_sharded"
  ),
  # The kernel says its output varies over x; out_specs says replicated:
  # shard_map's own check_vma error, as upstream.
  pytest.param(
    VARYING,
    P(),
    r"out_specs which require replication",
    id="declared_type_that_out_specs_contradicts",
  ),
]


@pytest.mark.parametrize("out_type, out_specs, match", BAD_VMA)
def test_check_vma_errors(out_type, out_specs, match):
  with pytest.raises(ValueError, match=match):
    in_shard_map(adds_device_index(out_type), out_specs)


def test_check_vma_a_declared_type_runs():
  out = in_shard_map(adds_device_index(VARYING), P("x"))
  want = np.repeat(np.arange(NUM_DEVICES, dtype=np.float32), ROWS[0])
  np.testing.assert_array_equal(out[:, 0], want)


def test_check_vma_without_manual_axis_type_is_an_error_as_upstream():
  """Inputs varying over x do not make the output's type: upstream's
  condition, before any kernel is traced (we used to infer it)."""
  traced = []

  def kernel(x_hbm, o_hbm, buf):
    traced.append(True)

  f = lambda x: mpmd.mpmd_map([(tc(), kernel)], OUT, scratch_types=VMEM)(x)
  with pytest.raises(ValueError, match=NO_MANUAL_AXIS_TYPE):
    in_shard_map(f, P("x"), in_specs=P("x"))
  assert not traced


def test_check_vma_takes_the_type_of_an_array():
  """``jax.typeof(x)`` as the out type carries how ``x`` varies."""

  def kernel(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    buf[...] += 1.0
    pltpu.sync_copy(buf, o_hbm)

  f = lambda x: mpmd.mpmd_map(
    [(tc(), kernel)], jax.typeof(x), scratch_types=VMEM
  )(x)
  out = in_shard_map(f, P("x"), in_specs=P("x"))
  np.testing.assert_array_equal(out, np.ones((NUM_DEVICES * ROWS[0], ROWS[1])))


def test_check_vma_false_needs_no_manual_axis_type():
  mesh = jax.make_mesh(
    (NUM_DEVICES,), ("x",), devices=jax.devices()[:NUM_DEVICES]
  )
  x = jnp.zeros((NUM_DEVICES * ROWS[0], ROWS[1]))
  x = jax.device_put(x, jax.NamedSharding(mesh, P("x")))
  f = jax.shard_map(
    adds_device_index(OUT),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
    check_vma=False,
  )
  out = jax.jit(f)(x)
  want = np.repeat(np.arange(NUM_DEVICES, dtype=np.float32), ROWS[0])
  np.testing.assert_array_equal(out[:, 0], want)


# -- upstream features we do not support -------------------------------------


class _OneValue:
  """Types whose instances are all equal: the class is all they hold."""

  def __hash__(self):
    return hash(type(self))

  def __eq__(self, other):
    return isinstance(other, type(self))

  def __repr__(self):
    return type(self).__name__


class Opaque(_OneValue, hijax.HiType):
  """A hijax type (upstream lowers such types to their parts)."""


def test_hijax_out_types_are_not_supported():
  with pytest.raises(
    NotImplementedError,
    match=r"hijax types \(jax.experimental.hijax.HiType\) are not supported: "
    r"out_types leaf 0 is a Opaque",
  ):
    mpmd.mpmd_map([(tc(), idle)], Opaque())


def test_fuser_dtypes_are_not_supported():
  """``fuser.physicalize`` of a program that hands mpmd_map an array of a
  fuser dtype: upstream's physicalize rule refuses it ("Fusion type found
  in avals"); so do we, before tracing (kernels that use fuser dtypes
  inside are physicalized: tests/test_physicalize.py)."""
  from jax._src.pallas.fuser import fusible_dtype

  class Pair(_OneValue, fusible_dtype.FusionDType):
    def abstract_unpack(self, x):
      return (jax.core.ShapedArray(x.shape, jnp.float32),) * 2

    def abstract_pack(self, a, b):
      del b
      return jax.core.ShapedArray(a.shape, self)

    def pull_block_spec_one_step(self, *args, **kwargs):
      raise NotImplementedError

    def unpack_push_block_spec(self, *args, **kwargs):
      raise NotImplementedError

    def unpack_pull_block_spec(self, *args, **kwargs):
      raise NotImplementedError

  def f(a, b):
    pair = fusible_dtype.pack(a, b, dtype=Pair())
    return mpmd.mpmd_map([(tc(), idle)], OUT)(pair)

  x = jnp.ones(ROWS, jnp.float32)
  with pytest.raises(
    NotImplementedError,
    match=r"Pallas fuser dtypes \(fuser.physicalize\) are not supported as "
    r"launch operands \(upstream: Fusion type found in avals\): input 0 "
    r"has dtype Pair",
  ):
    fusible_dtype.physicalize(f)(x, x)


def selects(x_hbm, index_hbm, o_hbm, index, sem):
  """Copies block ``index`` of ``x_hbm``, a Ref chosen at run time."""
  pltpu.sync_copy(index_hbm, index)
  src = pl.select_ref(index[0], x_hbm.at[0], x_hbm.at[1])
  copy = pltpu.make_async_copy(src, o_hbm, sem)
  copy.start()
  copy.wait()


def select_launch(interpret):
  return mpmd.mpmd_map(
    [(tc(), selects)],
    OUT,
    scratch_types=[pltpu.SMEM((1,), jnp.int32), pltpu.SemaphoreType.DMA(())],
    interpret=interpret,
  )


SELECT_ARGS = (jnp.ones((2, *ROWS), jnp.float32), jnp.ones((1,), jnp.int32))
SELECT_ERROR = (
  r"the CPU fallback cannot run pl.select_ref \(a Ref chosen at run time, "
  r"here by 'dma_start'\).* The kernel still lowers for TPU"
)


@pytest.mark.parametrize(
  "interpret", [True, pltpu.InterpretParams()], ids=["hlo", "simulator"]
)
def test_select_ref_when_interpreted_fails_at_trace_time(interpret):
  with pytest.raises(NotImplementedError, match=SELECT_ERROR):
    jax.jit(select_launch(interpret)).trace(*SELECT_ARGS)


def test_select_ref_on_cpu_fails_when_lowered_and_lowers_for_tpu():
  traced = jax.jit(select_launch(None)).trace(*SELECT_ARGS)
  text = traced.lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text
  with pytest.raises(NotImplementedError, match=SELECT_ERROR):
    traced.lower(lowering_platforms=("cpu",))


def test_hijax_scratch_is_not_supported():
  # Raised before the kernel is traced (upstream's closed-over hijax Ref
  # test stages its copy through such scratch): the same refusal as for
  # inputs and outputs, not a type error of the launch's typecheck.
  with pytest.raises(
    NotImplementedError,
    match=r"hijax types \(jax.experimental.hijax.HiType\) are not supported: "
    r"scratch_types leaf 1 is a AbstractRef",
  ):
    mpmd.mpmd_map(
      [(tc(), idle)], OUT, scratch_types=[VMEM[0], pltpu.VMEM.like(Opaque())]
    )()


@dataclasses.dataclass(frozen=True)
class Boxed:
  """A value of a hijax type: one array in a box."""

  value: jax.Array


@dataclasses.dataclass(frozen=True)
class BoxedType(hijax.HiType):
  inner: jax.core.ShapedArray

  def lo_ty(self):
    return [self.inner]

  def lower_val(self, hi_val):
    return [hi_val.value]

  def raise_val(self, value):
    return Boxed(value)


hijax.register_hitype(Boxed, lambda b: BoxedType(jax.typeof(b.value)))


def test_closed_over_hijax_values_are_not_supported():
  # What a kernel closes over is checked as its operands are.
  from mpmd import _arguments

  boxed = Boxed(jnp.zeros(ROWS, jnp.float32))
  info = jax.make_jaxpr(idle)(1.0).jaxpr.debug_info
  with pytest.raises(
    NotImplementedError,
    match=r"hijax types .* are not supported: a value kernel .* closes over "
    r"is a BoxedType",
  ):
    _arguments.check_consts([boxed], info)
