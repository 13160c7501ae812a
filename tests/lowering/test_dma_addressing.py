"""DMAs addressed to another program of the launch (issue 12).

Upstream's rules, as for signals (``mpmd._lowering.addressing``): the target
mesh is the receive semaphore's owner (``DMA @ mesh``), ``device_id`` names
its axes, and axes it leaves out take the caller's own index. The DMA lands
in the target program's memory and signals the target's receive semaphore;
the issuer waits on its own send semaphore (``wait_send``).

On jax 0.12 each program runs on CPU (the TPU simulator) and cross-lowers
for TPU. jax 0.10.2's simulator lands every DMA on the issuing core and its
Mosaic cannot address another SparseCore program by a DMA: both say so.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from addressing_util import SUBCORES, devices, on_two_devices, sc_meshes
from jax.experimental.pallas import tpu as pltpu
from lowerings import tpu_text as lower_for_tpu

import mpmd
from mpmd import _jax

SC_TARGET = "v6e"  # a generation with SparseCores
TC_TARGET = "v4"  # two TensorCores per chip
LANES = 8
NEW_JAX = _jax.JAX_VERSION >= (0, 12)

# A vector subcore writes its VMEM back to HBM with sync_copy, whose
# semaphore Mosaic ignores for such push streams, and says so (jax 0.12).
push_stream_warning = pytest.mark.filterwarnings(
  "ignore:Destination semaphore is ignored for push streams"
)

OLD_SIMULATOR = (
  r"addressed to another program of the launch, which the TPU simulator "
  r"of jax 0\.10\.2 cannot run"
)
OLD_MOSAIC = (
  r"Mosaic on jax 0\.10\.2 cannot lower a DMA \((dma_start|dma_wait)\) "
  r"from a SparseCore program"
)


def check_runs(f, args, expected, *, simulator: bool = False):
  """Runs on CPU with the expected result: on the checking executor (the
  default for programs that wait on each other) on every jax; in the TPU
  simulator (``simulator``) on jax 0.12, whose limit jax 0.10.2 names."""
  if not simulator or NEW_JAX:
    np.testing.assert_array_equal(f(*args), expected)
    return
  with pytest.raises(NotImplementedError, match=OLD_SIMULATOR):
    f(*args)


def check_lowers(f, args, *, sparsecore: bool):
  """Cross-lowers for TPU to one kernel (Mosaic's own MPMD for SparseCore
  meshes, the merged kernel for TensorCores)."""
  if sparsecore and not NEW_JAX:
    with pytest.raises(NotImplementedError, match=OLD_MOSAIC):
      lower_for_tpu(f, *args)
    return
  assert lower_for_tpu(f, *args).count("tpu_custom_call") == 1


def scatter_to_vector_vmem(x, *, cores):
  """Each scalar subcore DMAs row ``i`` of its block straight into vector
  subcore ``i``'s VMEM (device_id names only ``subcore``: the core axis is
  the caller's), waiting on its own send semaphore; each vector subcore
  waits on its receive semaphore and writes its VMEM out."""
  vector, scalar = sc_meshes(cores)

  def vector_fn(x_hbm, o_hbm, vmem, recv_sem, send_sem):
    del send_sem
    c = jax.lax.axis_index("s_core")
    s = jax.lax.axis_index("subcore")
    pltpu.make_async_copy(x_hbm.at[c, s], vmem, recv_sem).wait()
    pltpu.sync_copy(vmem, o_hbm.at[c, s])

  def scalar_fn(x_hbm, o_hbm, vmem, recv_sem, send_sem):
    del o_hbm
    c = jax.lax.axis_index("s_core")
    for i in range(SUBCORES):
      pltpu.async_remote_copy(
        x_hbm.at[c, i], vmem, send_sem, recv_sem, device_id={"subcore": i}
      ).wait_send()

  return mpmd.mpmd_map(
    [(vector, vector_fn), (scalar, scalar_fn)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      pltpu.VMEM((LANES,), x.dtype) @ vector,
      pltpu.SemaphoreType.DMA(()) @ vector,  # received by a vector subcore
      pltpu.SemaphoreType.DMA(()) @ scalar,  # sent by a scalar subcore
    ],
  )(x)


@push_stream_warning
@pytest.mark.parametrize("cores", [1, 2])
def test_scalar_subcore_dmas_into_vector_subcore_vmem(cores):
  x = jnp.arange(cores * SUBCORES * LANES, dtype=jnp.int32).reshape(
    cores, SUBCORES, LANES
  )
  f = functools.partial(scatter_to_vector_vmem, cores=cores)
  with mpmd.tpu_target(SC_TARGET):
    check_runs(f, (x,), x)
    check_lowers(f, (x,), sparsecore=True)


def vector_ring(x, *, cores, interpret=None):
  """Vector subcore ``s`` DMAs its row into subcore ``s + 1``'s VMEM (the
  caller's own mesh, addressed by ``subcore`` alone)."""
  vector, _ = sc_meshes(cores)

  def kernel(x_hbm, o_hbm, vmem, recv_sem, send_sem):
    c = jax.lax.axis_index("s_core")
    s = jax.lax.axis_index("subcore")
    peer = jax.lax.rem(s + 1, SUBCORES)
    pltpu.async_remote_copy(
      x_hbm.at[c, s], vmem, send_sem, recv_sem, device_id={"subcore": peer}
    ).wait_send()
    pltpu.make_async_copy(x_hbm.at[c, s], vmem, recv_sem).wait()
    pltpu.sync_copy(vmem, o_hbm.at[c, s])

  return mpmd.mpmd_map(
    [(vector, kernel)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      pltpu.VMEM((LANES,), x.dtype),
      pltpu.SemaphoreType.DMA(()),
      pltpu.SemaphoreType.DMA(()),
    ],
    interpret=interpret,
  )(x)


@push_stream_warning
def test_vector_subcores_dma_into_each_others_vmem():
  cores = 2
  x = jnp.arange(cores * SUBCORES * LANES, dtype=jnp.int32).reshape(
    cores, SUBCORES, LANES
  )
  f = functools.partial(vector_ring, cores=cores)
  with mpmd.tpu_target(SC_TARGET):
    # Subcore s holds what subcore s - 1 sent.
    check_runs(f, (x,), jnp.roll(x, 1, axis=1))
    simulated = functools.partial(f, interpret=pltpu.InterpretParams())
    check_runs(simulated, (x,), jnp.roll(x, 1, axis=1), simulator=True)
    check_lowers(f, (x,), sparsecore=True)


def gather_in_scalar_smem(x, *, cores, device_id: bool):
  """Each vector subcore DMAs its row into its scalar subcore's SMEM (the
  receive semaphore's owner), naming the core by ``device_id`` (or not,
  which a SparseCore program may not)."""
  vector, scalar = sc_meshes(cores)

  def vector_fn(x_hbm, o_hbm, smem, recv_sem, send_sem):
    del o_hbm
    c = jax.lax.axis_index("s_core")
    s = jax.lax.axis_index("subcore")
    src, dst = x_hbm.at[c, s], smem.at[s]
    if device_id:
      pltpu.async_remote_copy(
        src, dst, send_sem, recv_sem, device_id={"s_core": c}
      ).wait_send()
    else:  # no send semaphore: nothing to wait on here
      pltpu.make_async_copy(src, dst, recv_sem).start()

  def scalar_fn(x_hbm, o_hbm, smem, recv_sem, send_sem):
    del send_sem
    c = jax.lax.axis_index("s_core")
    for s in range(SUBCORES):
      pltpu.make_async_copy(x_hbm.at[c, s], smem.at[s], recv_sem).wait()
    pltpu.sync_copy(smem, o_hbm.at[c])

  return mpmd.mpmd_map(
    [(vector, vector_fn), (scalar, scalar_fn)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      pltpu.SMEM((SUBCORES, LANES), x.dtype) @ scalar,
      pltpu.SemaphoreType.DMA(()) @ scalar,
      pltpu.SemaphoreType.DMA(()) @ vector,
    ],
  )(x)


def test_vector_subcores_dma_into_scalar_subcore_smem():
  cores = 2
  x = jnp.arange(cores * SUBCORES * LANES, dtype=jnp.int32).reshape(
    cores, SUBCORES, LANES
  )
  f = functools.partial(gather_in_scalar_smem, cores=cores, device_id=True)
  with mpmd.tpu_target(SC_TARGET):
    check_runs(f, (x,), x)
    check_lowers(f, (x,), sparsecore=True)


def test_a_sparsecore_dma_to_another_mesh_needs_a_device_id():
  """Upstream's Mosaic addresses a SparseCore DMA only by its device_id
  (without one, the receive semaphore's owner is another mesh and Mosaic
  fails to verify): an error at trace time, on every path."""
  x = jnp.zeros((2, SUBCORES, LANES), jnp.int32)
  f = functools.partial(gather_in_scalar_smem, cores=2, device_id=False)
  with mpmd.tpu_target(SC_TARGET):
    with pytest.raises(
      ValueError,
      match=r"kernel vector_fn .*: a DMA \(dma_start\) \(at .*\) of .* "
      r"lands on mesh 1 "
      r"\{'s_core': 2\} \(sc_scalar_subcore\) .* without a device_id: .* "
      r"pass device_id=\{'s_core': ...\}",
    ):
      f(x)


def tensorcore_handoff(x):
  """TensorCore mesh ``a`` DMAs ``x`` into mesh ``b``'s VMEM; ``b`` adds
  one and writes it out. Mosaic has no MPMD across TensorCores: the merged
  kernel names ``b``'s program as a core."""
  a = mpmd.tensorcore_mesh("a", num_cores=1)
  b = mpmd.tensorcore_mesh("b", num_cores=1)

  def fa(x_hbm, o_hbm, vmem, recv_sem, send_sem):
    del o_hbm
    pltpu.async_remote_copy(
      x_hbm, vmem, send_sem, recv_sem, device_id={"b": 0}
    ).wait_send()

  def fb(x_hbm, o_hbm, vmem, recv_sem, send_sem):
    del send_sem
    pltpu.make_async_copy(x_hbm, vmem, recv_sem).wait()
    vmem[...] += 1
    pltpu.sync_copy(vmem, o_hbm)

  return mpmd.mpmd_map(
    [(a, fa), (b, fb)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      pltpu.VMEM(x.shape, x.dtype) @ b,
      pltpu.SemaphoreType.DMA(()) @ b,
      pltpu.SemaphoreType.DMA(()) @ a,
    ],
  )(x)


def test_a_tensorcore_mesh_dmas_into_anothers_vmem():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  check_runs(tensorcore_handoff, (x,), x + 1)
  with mpmd.tpu_target(TC_TARGET):
    check_lowers(tensorcore_handoff, (x,), sparsecore=False)


def cross_device_and_core(x):
  """Under shard_map over 2 devices, core ``c`` of a 2-core TensorCore
  mesh DMAs its block into core ``1 - c``'s VMEM on the other device:
  device_id names a device axis and a kernel axis together."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=2)

  def kernel(x_hbm, o_hbm, vmem, recv_sem, send_sem):
    c = jax.lax.axis_index("core")
    peer = {"x": 1 - jax.lax.axis_index("x"), "core": 1 - c}
    pltpu.async_remote_copy(
      x_hbm.at[c], vmem, send_sem, recv_sem, device_id=peer
    ).wait_send()
    pltpu.make_async_copy(x_hbm.at[c], vmem, recv_sem).wait()
    pltpu.sync_copy(vmem, o_hbm.at[c])

  call = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct((2, *x.shape[1:]), x.dtype),
    scratch_types=[
      pltpu.VMEM(x.shape[1:], x.dtype),
      pltpu.SemaphoreType.DMA(()),
      pltpu.SemaphoreType.DMA(()),
    ],
  )
  return on_two_devices(call, x)


def test_a_dma_names_a_device_and_a_core():
  x = jnp.arange(4 * 8 * 128, dtype=jnp.float32).reshape(4, 8, 128)
  x = jax.device_put(x, jax.NamedSharding(devices(), jax.P("x")))
  f = jax.jit(cross_device_and_core)
  # Device d's core c holds device 1 - d's block 1 - c.
  check_runs(f, (x,), x[::-1])
  with mpmd.tpu_target(TC_TARGET):
    check_lowers(f, (x,), sparsecore=False)


def _bad_scatter(device_id, recv_owner="vector"):
  vector, scalar = sc_meshes()
  owner = {"vector": vector, "scalar": scalar}[recv_owner]

  def vector_fn(x_hbm, o_hbm, vmem, recv_sem, send_sem):
    del x_hbm, o_hbm, vmem, recv_sem, send_sem

  def scalar_fn(x_hbm, o_hbm, vmem, recv_sem, send_sem):
    del o_hbm
    pltpu.async_remote_copy(
      x_hbm.at[0], vmem, send_sem, recv_sem, device_id=device_id
    ).wait_send()

  return mpmd.mpmd_map(
    [(vector, vector_fn), (scalar, scalar_fn)],
    jax.ShapeDtypeStruct((1, LANES), jnp.int32),
    scratch_types=[
      pltpu.VMEM((LANES,), jnp.int32) @ vector,
      pltpu.SemaphoreType.DMA(()) @ owner,
      pltpu.SemaphoreType.DMA(()) @ scalar,
    ],
  )


def test_a_dma_naming_an_axis_the_target_lacks_is_an_error():
  x = jnp.zeros((1, LANES), jnp.int32)
  with mpmd.tpu_target(SC_TARGET):
    f = _bad_scatter({"subcore": 0}, recv_owner="scalar")
    with pytest.raises(
      ValueError,
      match=r"kernel scalar_fn .*: a DMA \(dma_start\) \(at .*\) of .* "
      r"names device_id axes "
      r"\['subcore'\] that the target mesh 1 \{'s_core': 1\} "
      r"\(sc_scalar_subcore\) does not have",
    ):
      f(x)


def test_a_dma_index_out_of_range_is_an_error():
  x = jnp.zeros((1, LANES), jnp.int32)
  with mpmd.tpu_target(SC_TARGET):
    f = _bad_scatter({"subcore": SUBCORES})
    with pytest.raises(
      ValueError,
      match=r"kernel scalar_fn .*: a DMA \(dma_start\) names device_id "
      r"\{'subcore': 2\}: expected an index in \[0, 2\) along axis "
      r"'subcore'",
    ):
      f(x)
    with pytest.raises(ValueError, match=r"expected an index in \[0, 2\)"):
      lower_for_tpu(f, x)


def test_a_dma_leaving_out_an_axis_the_caller_lacks_is_upstreams_error():
  x = jnp.zeros((1, LANES), jnp.int32)
  with mpmd.tpu_target(SC_TARGET):
    f = _bad_scatter({"s_core": 0})
    with pytest.raises(
      ValueError,
      match=r"scalar_fn .*When addressing SC_VECTOR_SUBCORE from "
      r"SC_SCALAR_SUBCORE and specifying .* the following axes are missing "
      r"from the mesh: \{'subcore'\}",
    ):
      f(x)
