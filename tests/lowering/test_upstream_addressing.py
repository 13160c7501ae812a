"""Multi-mesh addressing follows upstream's rules (issue 12, points 2, 10).

Programs of our own in the style of upstream's SparseCore MPMD programs: a
VectorSubcoreMesh and a ScalarSubcoreMesh share their core axis, signals
name another mesh's programs by a partial ``device_id`` (the caller's own
index fills the rest), and VMEM_SHARED scratch needs no ``@ mesh`` owner.
Each runs on CPU (the TPU simulator path) and cross-lowers for TPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from addressing_util import SUBCORES, devices, on_two_devices, sc_meshes
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from lowerings import tpu_text as lower_for_tpu

import mpmd
from mpmd import _jax

TARGET = "v6e"  # a generation with SparseCores
LANES = 8


def handshake(x, *, cores=1, full_core_spec=False):
  """Each scalar subcore stages its row of ``x`` in shared HBM and signals
  the vector subcores of its own SparseCore, naming only ``subcore``; each
  vector subcore waits, copies the row to its block of the output, and
  signals its scalar subcore back (``device_id=None``: the owner of the
  semaphore is the scalar mesh, the core axis is the caller's)."""
  vector, scalar = sc_meshes(cores)

  def vector_fn(x_hbm, o_hbm, staged, tec_sem, scs_sem):
    c = jax.lax.axis_index("s_core")
    s = jax.lax.axis_index("subcore")
    pl.semaphore_wait(tec_sem, 1)
    pltpu.sync_copy(staged.at[c], o_hbm.at[c, s])
    device_id = {"s_core": c} if full_core_spec else None
    pl.semaphore_signal(scs_sem, 1, device_id=device_id)

  def scalar_fn(x_hbm, o_hbm, staged, tec_sem, scs_sem):
    c = jax.lax.axis_index("s_core")
    pltpu.sync_copy(x_hbm.at[c], staged.at[c])
    for i in range(jax.lax.axis_size("subcore")):
      device_id = {"subcore": i}
      if full_core_spec:
        device_id |= {"s_core": c}
      pl.semaphore_signal(tec_sem, 1, device_id=device_id)
    pl.semaphore_wait(scs_sem, jax.lax.axis_size("subcore"))

  return mpmd.mpmd_map(
    [(vector, vector_fn), (scalar, scalar_fn)],
    jax.ShapeDtypeStruct((cores, SUBCORES, LANES), x.dtype),
    scratch_types=[
      pltpu.HBM(x.shape, x.dtype),
      pltpu.SemaphoreType.REGULAR(()) @ vector,  # scalar -> vector
      pltpu.SemaphoreType.REGULAR(()) @ scalar,  # vector -> scalar
    ],
  )(x)


def handshake_reference(x):
  return jnp.broadcast_to(x[:, None, :], (x.shape[0], SUBCORES, LANES))


# Mosaic of jax 0.10.2 cannot serialize a scalar subcore's signal to a
# vector subcore; we say so (the CPU fallback runs such programs anyway).
OLD_MOSAIC = _jax.JAX_VERSION < (0, 11)


def assert_lowers_to_one_kernel(f, *args):
  if OLD_MOSAIC:
    with pytest.raises(
      NotImplementedError,
      match=r"Mosaic on jax 0.10.2 cannot lower a semaphore_signal from a "
      r"ScalarSubcoreMesh program to a VectorSubcoreMesh program",
    ):
      lower_for_tpu(f, *args)
    return
  # Mosaic's own MPMD takes the same program: one custom call.
  assert lower_for_tpu(f, *args).count("tpu_custom_call") == 1


@pytest.mark.parametrize("full_core_spec", [False, True])
@pytest.mark.parametrize("cores", [1, 2])
def test_meshes_sharing_the_core_axis_signal_each_other(cores, full_core_spec):
  x = jnp.arange(cores * LANES, dtype=jnp.int32).reshape(cores, LANES)
  f = functools.partial(handshake, cores=cores, full_core_spec=full_core_spec)
  with mpmd.tpu_target(TARGET):
    np.testing.assert_array_equal(f(x), handshake_reference(x))
    assert_lowers_to_one_kernel(f, x)


def _scalar_signals_vector_subcores(device_id, **kw):
  """Each vector subcore waits for one signal; the scalar subcore sends
  SUBCORES of them, the ``i``-th to ``device_id(i)``."""
  vector, scalar = sc_meshes()

  def vector_fn(_, sem):
    pl.semaphore_wait(sem, 1)

  def scalar_fn(_, sem):
    for i in range(SUBCORES):
      pl.semaphore_signal(sem, device_id=device_id(i))

  return mpmd.mpmd_map(
    [(vector, vector_fn), (scalar, scalar_fn)],
    jax.ShapeDtypeStruct((8,), jnp.int32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(()) @ vector],
    **kw,
  )


def test_the_issue_reproducer_runs_and_lowers():
  with mpmd.tpu_target(TARGET):
    f = _scalar_signals_vector_subcores(lambda i: {"s_core": 0, "subcore": i})
    assert f().shape == (8,)  # no deadlock: every vector subcore signalled
    assert_lowers_to_one_kernel(f)


@pytest.mark.parametrize("subcores", [2, 16])
def test_vector_subcores_signal_their_own_scalar_subcore(subcores):
  """Issue 36 item 2: with ``device_id=None`` a vector subcore's signal to
  a semaphore the scalar mesh owns reaches its own SparseCore's scalar
  subcore (the meshes share the core axis). Only the scalar subcores wait,
  so the fast path took the launch, and gave each signal to the caller's
  own copy of the semaphore: a DeadlockError. Each scalar subcore waits for
  exactly its own vector subcores: a signal sent to the other SparseCore
  would leave one short (a deadlock) and the other counting (leftover)."""
  with mpmd.tpu_target("v7x"):
    vector, scalar = sc_meshes(2, subcores=subcores)

    def vector_fn(x_hbm, o_hbm, scs_sem):
      c = jax.lax.axis_index("s_core")
      s = jax.lax.axis_index("subcore")
      pltpu.sync_copy(x_hbm.at[c], o_hbm.at[c, s])
      pl.semaphore_signal(scs_sem, 1)

    def scalar_fn(x_hbm, o_hbm, scs_sem):
      pl.semaphore_wait(scs_sem, jax.lax.axis_size("subcore"))

    f = mpmd.mpmd_map(
      [(vector, vector_fn), (scalar, scalar_fn)],
      jax.ShapeDtypeStruct((2, subcores, LANES), jnp.int32),
      scratch_types=[pltpu.SemaphoreType.REGULAR(()) @ scalar],
    )
    x = jnp.arange(2 * LANES, dtype=jnp.int32).reshape(2, LANES)
    with mpmd.typed_errors():
      out = jax.block_until_ready(jax.jit(f)(x))
    want = jnp.broadcast_to(x[:, None, :], (2, subcores, LANES))
    np.testing.assert_array_equal(out, want)
    # Vector to scalar signals only: Mosaic of every supported jax takes it.
    assert lower_for_tpu(f, x).count("tpu_custom_call") == 1


def test_a_signal_to_the_wrong_subcore_leaves_a_waiter_stuck():
  """The partial device_id really selects the program: signalling subcore 0
  twice leaves subcore 1 waiting (a deadlock), which the simulator reports
  naming the user's mesh, never the merged kernel's axis."""
  with mpmd.tpu_target(TARGET):
    f = _scalar_signals_vector_subcores(
      lambda i: {"subcore": 0}, interpret=pltpu.InterpretParams()
    )
    with mpmd.deadlock_timeout(2.0):
      with (
        pytest.raises(mpmd.DeadlockError, match=r"deadlock") as info,
        mpmd.typed_errors(),
      ):
        jax.block_until_ready(f())
  message = str(info.value)
  assert "_mpmd_programs" not in message
  assert "mesh 0 program 1 (s_core=0, subcore=1)" in message, message


def _missing_axis_call():
  vector, scalar = sc_meshes()

  def vector_fn(_, sem):
    pl.semaphore_wait(sem, 1)

  def scalar_fn(_, sem):
    pl.semaphore_signal(sem, device_id={"s_core": jax.lax.axis_index("s_core")})

  return mpmd.mpmd_map(
    [(vector, vector_fn), (scalar, scalar_fn)],
    jax.ShapeDtypeStruct((8,), jnp.int32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(()) @ vector],
  )


# Upstream's own words (tpu_pallas_mpmd_test.py), so its tests match ours.
MISSING_SUBCORE = (
  r"When addressing SC_VECTOR_SUBCORE from SC_SCALAR_SUBCORE and "
  r"specifying .* the following axes are missing from the mesh: "
  r"\{'subcore'\}"
)


def test_leaving_out_an_axis_the_caller_lacks_is_upstreams_error():
  with mpmd.tpu_target(TARGET):
    f = _missing_axis_call()
    with pytest.raises(ValueError, match=MISSING_SUBCORE) as info:
      f()
    with pytest.raises(ValueError, match=MISSING_SUBCORE):
      lower_for_tpu(f)
  message = str(info.value)
  # Named in the user's terms: the kernel, both meshes, their axes.
  assert "scalar_fn" in message
  assert "mesh 0 {'s_core': 1, 'subcore': 2} (sc_vector_subcore)" in message
  assert "mesh 1 {'s_core': 1} (sc_scalar_subcore)" in message
  assert "_mpmd_programs" not in message


def test_naming_an_axis_the_target_lacks_is_an_error():
  with mpmd.tpu_target(TARGET):
    vector, scalar = sc_meshes()

    def vector_fn(_, sem):
      pl.semaphore_signal(sem, device_id={"subcore": 0})

    def scalar_fn(_, sem):
      pl.semaphore_wait(sem, 1)

    f = mpmd.mpmd_map(
      [(vector, vector_fn), (scalar, scalar_fn)],
      jax.ShapeDtypeStruct((8,), jnp.int32),
      scratch_types=[pltpu.SemaphoreType.REGULAR(()) @ scalar],
    )
    with pytest.raises(
      ValueError,
      match=r"vector_fn .*: semaphore_signal \(at .*\) of .* "
      r"names device_id axes "
      r"\['subcore'\] that the target mesh 1 \{'s_core': 1\} "
      r"\(sc_scalar_subcore\) does not have",
    ):
      f()


def vmem_shared_exchange(x, cores):
  """Each scalar subcore puts its row in its SparseCore's VMEM_SHARED (no
  owner: the memory space says whose it is) and signals its vector
  subcores, which read it back. One buffer per SparseCore: with a single
  buffer the cores would overwrite each other's row."""
  vector, scalar = sc_meshes(cores)

  def vector_fn(x_hbm, o_hbm, shared, sem):
    c = jax.lax.axis_index("s_core")
    s = jax.lax.axis_index("subcore")
    pl.semaphore_wait(sem, 1)
    pltpu.sync_copy(shared, o_hbm.at[c, s])

  def scalar_fn(x_hbm, o_hbm, shared, sem):
    c = jax.lax.axis_index("s_core")
    pltpu.sync_copy(x_hbm.at[c], shared)
    for i in range(SUBCORES):
      pl.semaphore_signal(sem, 1, device_id={"subcore": i})

  return mpmd.mpmd_map(
    [(vector, vector_fn), (scalar, scalar_fn)],
    jax.ShapeDtypeStruct((cores, SUBCORES, LANES), x.dtype),
    scratch_types=[
      pltpu.VMEM_SHARED((LANES,), x.dtype),
      pltpu.SemaphoreType.REGULAR(()) @ vector,
    ],
  )(x)


@pytest.mark.parametrize("cores", [1, 2])
def test_vmem_shared_scratch_needs_no_owner(cores):
  x = jnp.arange(cores * LANES, dtype=jnp.int32).reshape(cores, LANES) + 1
  f = functools.partial(vmem_shared_exchange, cores=cores)
  with mpmd.tpu_target(TARGET):
    np.testing.assert_array_equal(f(x), handshake_reference(x))
    assert_lowers_to_one_kernel(f, x)


def _vmem_shared_rows(x, *, handshake):
  """Vector subcore 0 of each SparseCore writes its row of ``x`` to
  VMEM_SHARED; the scalar subcore of the same SparseCore reads it back
  (after a signal when ``handshake``). One buffer shared by both
  SparseCores would give both the last row written."""
  vector, scalar = sc_meshes(2)

  def vector_fn(x_hbm, o_hbm, shared, ready):
    del o_hbm
    c = jax.lax.axis_index("s_core")

    @pl.when(jax.lax.axis_index("subcore") == 0)
    def _():
      pltpu.sync_copy(x_hbm.at[c], shared)
      if handshake:
        pl.semaphore_signal(ready, device_id={"s_core": c})

  def scalar_fn(x_hbm, o_hbm, shared, ready):
    del x_hbm
    if handshake:
      pl.semaphore_wait(ready, 1)
    pltpu.sync_copy(shared, o_hbm.at[jax.lax.axis_index("s_core")])

  return mpmd.mpmd_map(
    [(vector, vector_fn), (scalar, scalar_fn)],
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      pltpu.VMEM_SHARED((LANES,), x.dtype),
      pltpu.SemaphoreType.REGULAR(()) @ scalar,
    ],
    debug=True,
  )(x)


def test_vmem_shared_is_per_sparsecore(capsys):
  x = jnp.arange(2 * LANES, dtype=jnp.int32).reshape(2, LANES)
  with mpmd.tpu_target(TARGET):
    out = _vmem_shared_rows(x, handshake=True)
  np.testing.assert_array_equal(out, x)
  assert "takes the check path" in capsys.readouterr().out


def test_vmem_shared_read_without_a_handshake_is_a_race_on_the_fast_path():
  """Without synchronisation the launch takes the fast path, which proves
  the race (run one after another, the programs would get the rows)."""
  x = jnp.arange(2 * LANES, dtype=jnp.int32).reshape(2, LANES)
  with mpmd.tpu_target(TARGET):
    with pytest.raises(mpmd.RaceError, match="data race on 'shared'"):
      _vmem_shared_rows(x, handshake=False)


@pytest.mark.parametrize(
  "scratch",
  [pltpu.VMEM((LANES,), jnp.int32), pltpu.SMEM((LANES,), jnp.int32)],
  ids=["vmem", "smem"],
)
def test_unowned_per_core_scratch_with_several_meshes_is_not_implemented(
  scratch,
):
  with mpmd.tpu_target(TARGET):
    vector, scalar = sc_meshes()
  with pytest.raises(
    NotImplementedError,
    match=r"scratch_types leaf 0 in (vmem|smem) without an owner in a "
    r"launch of several meshes",
  ):
    mpmd.mpmd_map(
      [(vector, lambda *_: None), (scalar, lambda *_: None)],
      jax.ShapeDtypeStruct((8,), jnp.int32),
      scratch_types=[scratch],
    )


def remote_ring(x, *, num_cores):
  """Under shard_map over 2 devices, core c of a multi-core TensorCore mesh
  sends its block to the other device with device_id={"x": peer} (the core
  axis left out) and then signals the peer the same way: both land on core
  c of the peer, the caller's own core."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=num_cores)

  def kernel(x_hbm, o_hbm, send_sem, recv_sem, ready):
    c = jax.lax.axis_index("core")
    peer = 1 - jax.lax.axis_index("x")
    copy = pltpu.make_async_remote_copy(
      x_hbm.at[c],
      o_hbm.at[c],
      send_sem,
      recv_sem,
      device_id={"x": peer},
    )
    copy.start()
    copy.wait()
    pl.semaphore_signal(ready, 1, device_id={"x": peer})
    pl.semaphore_wait(ready, 1)

  call = mpmd.mpmd_map(
    [(mesh, kernel)],
    jax.ShapeDtypeStruct((num_cores, *x.shape[1:]), x.dtype),
    scratch_types=[
      pltpu.SemaphoreType.DMA(()),
      pltpu.SemaphoreType.DMA(()),
      pltpu.SemaphoreType.REGULAR(()),
    ],
  )
  return on_two_devices(call, x)


def test_remote_operations_leave_the_core_axis_to_the_caller():
  num_cores = 2
  x = jnp.arange(2 * num_cores * 8 * 128, dtype=jnp.float32).reshape(
    2 * num_cores, 8, 128
  )
  x = jax.device_put(x, jax.NamedSharding(devices(), jax.P("x")))
  f = jax.jit(functools.partial(remote_ring, num_cores=num_cores))
  out = f(x)
  # Device d's block c comes from device 1 - d's block c.
  halves = x.reshape(2, num_cores, 8, 128)
  np.testing.assert_array_equal(out, halves[::-1].reshape(x.shape))
  with mpmd.tpu_target("v4"):  # two TensorCores per chip
    text = lower_for_tpu(f, x)
  assert text.count("tpu_custom_call") == 1
