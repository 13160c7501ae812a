"""``mpmd.kernels.ragged_all_to_all`` against plain JAX.

XLA:CPU cannot run ``jax.lax.ragged_all_to_all``, so the reference is the
all-gather of every device's arguments and one gather per slice
(``ragged_all_to_all_util.reference``), on arrays stacked along a leading
device axis. ``RaggedAllToAllTest`` is the test base, one subclass per
implementation on simulated CPU devices (the CPU fallback): routings with
empty slots, devices that send nothing, packed and padded layouts, 1-D and
2-D meshes, groups, offset dtypes, gradients, vmap:

* ``TestWindow``: ``implementation="window"`` (the CPU fallback's default:
  windows of rows, the lockstep path), also its window modes and run-time
  bounds errors;
* ``TestConditional``: ``implementation="conditional"`` (what a TPU runs:
  conditional chunks).

Other execution paths:

* ``TestTpuSimulator``: both implementations in the threaded TPU simulator,
  with its race detector.
* ``TestChecker``: both under the checking executor's explore.
* ``TestTpuLowering``: both, and the gradient, cross-lowered for TPU from
  this CPU host.

Errors raised before lowering are at the end.
"""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from launches import kernel_path
from lowerings import tpu_text
from ragged_all_to_all_util import (
  Routing,
  place,
  random_routing,
  run_stacked,
  stacked,
  stacked_mesh,
)

import mpmd
import mpmd.kernels
from mpmd._lowering import paths
from mpmd.kernels.moe import ragged


def ragged_fn(axis_name="x", **kwargs):
  return functools.partial(
    mpmd.kernels.ragged_all_to_all, axis_name=axis_name, **kwargs
  )


def forced(implementation, interpret=None, axis_name="x"):
  """The kernel with its implementation and CPU path forced (the public
  function takes no ``interpret``)."""

  def fn(*args):
    groups = ragged.check_groups("test", axis_name, None)
    return ragged.checked_call(
      groups, *args, implementation=implementation, interpret=interpret
    )

  return fn


def assert_equal(got, want):
  # Rows move bit for bit: no tolerance.
  if not jnp.issubdtype(got.dtype, jnp.complexfloating):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class RaggedAllToAllTest:
  """The cases every implementation runs on simulated CPU devices
  (interpret=None: the CPU fallback); subclasses pick the implementation."""

  implementation = None

  def fn(self, axis_name="x", **kwargs):
    return ragged_fn(axis_name, implementation=self.implementation, **kwargs)

  @pytest.mark.parametrize(
    "devices,k,trailing,dtype",
    [
      (2, 1, (8,), jnp.float32),
      (2, 3, (), jnp.int32),
      (3, 2, (4,), jnp.float16),  # an odd device count
      (4, 2, (2, 4), jnp.bfloat16),
      pytest.param(8, 2, (8,), jnp.float32, marks=pytest.mark.slow),
      pytest.param(8, 1, (16,), jnp.bfloat16, marks=pytest.mark.slow),
    ],
  )
  def test_matches_reference(self, rng, devices, k, trailing, dtype):
    r = random_routing(
      rng, devices=devices, k=k, rows=13, trailing=trailing, dtype=dtype
    )
    mesh = stacked_mesh((devices,), ("x",))
    assert_equal(run_stacked(self.fn(), mesh, *r.args), r.expected())

  @pytest.mark.parametrize(
    "pad", [False, pytest.param(True, marks=pytest.mark.slow)]
  )
  def test_empty_slots_and_a_silent_device(self, rng, pad):
    # Packed: empty slots share their offsets with non-empty ones.
    r = random_routing(rng, devices=4, k=2, rows=9, empty_senders=(2,), pad=pad)
    assert not np.asarray(r.send_sizes[2]).any()
    assert not np.asarray(r.recv_sizes[:, 4:6]).any()
    mesh = stacked_mesh((4,), ("x",))
    assert_equal(run_stacked(self.fn(), mesh, *r.args), r.expected())

  @pytest.mark.parametrize(
    "dtype", [jnp.complex64, jnp.int4, jnp.bool_, jnp.float8_e4m3fn]
  )
  def test_any_dtype(self, rng, dtype):
    # Moved bit for bit: complex pairs and sub-byte types included.
    r = random_routing(rng, devices=2, k=2, rows=8, trailing=(3,))
    if dtype == jnp.complex64:
      operand = lax.complex(r.operand, r.operand[:, ::-1])
    else:
      operand = r.operand
    r = r._replace(operand=operand.astype(dtype), output=r.output.astype(dtype))
    mesh = stacked_mesh((2,), ("x",))
    got = run_stacked(self.fn(), mesh, *r.args)
    assert got.dtype == dtype
    assert_equal(got, r.expected())

  def test_eager_shard_map(self, rng):
    # Not under jit: the kernel is lowered inside the shard_map's own
    # (manual) mesh context.
    r = random_routing(rng, devices=2, k=2, rows=8)
    mesh = stacked_mesh((2,), ("x",))
    got = stacked(self.fn(), mesh)(*place(mesh, *r.args))
    assert_equal(got, r.expected())

  def test_unwritten_rows_keep_their_values(self, rng):
    r = random_routing(rng, devices=2, k=2, rows=8)
    mesh = stacked_mesh((2,), ("x",))
    got = np.asarray(run_stacked(self.fn(), mesh, *r.args))
    written = np.zeros(got.shape[:2], bool)
    for t in range(2):
      for i in range(4):
        j, s = divmod(i, 2)
        start = int(r.output_offsets[j, t * 2 + s])
        written[t, start : start + int(r.recv_sizes[t, i])] = True
    assert (~written).any()
    np.testing.assert_array_equal(got[~written], np.asarray(r.output)[~written])
    # Nothing sent: the output unchanged.
    silent = r._replace(
      send_sizes=0 * r.send_sizes, recv_sizes=0 * r.recv_sizes
    )
    got = run_stacked(self.fn(), mesh, *silent.args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(r.output))

  @pytest.mark.parametrize(
    "dtype",
    [
      np.int8,
      np.uint32,
      *(pytest.param(d, marks=pytest.mark.slow) for d in (np.uint8, np.int16)),
    ],
  )
  def test_offsets_of_any_integer_dtype(self, rng, dtype):
    r = random_routing(rng, devices=2, k=2, rows=10)
    metadata = [jnp.asarray(np.asarray(x).astype(dtype)) for x in r.metadata]
    mesh = stacked_mesh((2,), ("x",))
    got = run_stacked(self.fn(), mesh, r.operand, r.output, *metadata)
    assert_equal(got, r.expected())

  @pytest.mark.parametrize(
    "axis_name,groups",
    [
      ("y", [[0, 1], [2, 3]]),
      ("x", [[0, 2], [1, 3]]),
      (("x", "y"), [[0, 1, 2, 3]]),
      pytest.param(("y", "x"), [[0, 2, 1, 3]], marks=pytest.mark.slow),
    ],
  )
  def test_2d_mesh(self, rng, axis_name, groups):
    # Devices stacked in mesh order: global index 2 * x + y.
    r = random_routing(rng, devices=4, k=2, rows=9, groups=groups)
    mesh = stacked_mesh((2, 2), ("x", "y"))
    got = run_stacked(self.fn(axis_name), mesh, *r.args)
    assert_equal(got, r.expected())

  def test_axis_index_groups(self, rng):
    groups = [[0, 3], [2, 1]]
    r = random_routing(rng, devices=4, k=1, rows=7, groups=groups)
    mesh = stacked_mesh((4,), ("x",))
    fn = self.fn(axis_index_groups=groups)
    assert_equal(run_stacked(fn, mesh, *r.args), r.expected())

  @pytest.mark.parametrize(
    "pad", [False, pytest.param(True, marks=pytest.mark.slow)]
  )
  def test_grad(self, rng, pad):
    r = random_routing(rng, devices=4, k=2, rows=9, pad=pad, trailing=(3,))
    mesh = stacked_mesh((4,), ("x",))
    weights = jnp.asarray(rng.standard_normal(r.output.shape), jnp.float32)
    fn = stacked(self.fn(), mesh)
    metadata = place(mesh, *r.metadata)

    def ours(operand, output):
      return jnp.sum(fn(operand, output, *metadata) * weights)

    def reference(operand, output):
      routed = r._replace(operand=operand, output=output)
      return jnp.sum(routed.expected() * weights)

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(
      *place(mesh, r.operand, r.output)
    )
    want = jax.grad(reference, argnums=(0, 1))(r.operand, r.output)
    for g, w in zip(got, want, strict=True):
      assert_equal(g, w)

  def test_grad_of_output_with_an_empty_slot_at_a_used_offset(self, rng):
    # Device 1 receives an empty slice from device 0 at offset 1, where its
    # own slice of 2 rows lands: rows 1 and 2 are written, no other row
    # (the packed layout where issue 35 reports JAX's own transpose rule
    # getting the output's gradient wrong).
    operand = jnp.asarray(rng.standard_normal((2, 4, 3)), jnp.float32)
    output = jnp.asarray(rng.standard_normal((2, 5, 3)), jnp.float32)
    metadata = [
      jnp.asarray(a, jnp.int32)
      for a in (
        [[0, 0], [0, 1]],  # input_offsets
        [[1, 0], [0, 2]],  # send_sizes
        [[0, 1], [4, 1]],  # output_offsets
        [[1, 0], [0, 2]],  # recv_sizes
      )
    ]
    r = Routing(operand, output, *metadata, groups=[[0, 1]])
    mesh = stacked_mesh((2,), ("x",))
    fn = stacked(self.fn(), mesh)
    placed = place(mesh, *metadata)
    weights = jnp.asarray(rng.standard_normal(output.shape), jnp.float32)

    def ours(operand, output):
      return jnp.sum(fn(operand, output, *placed) * weights)

    d_output = jax.jit(jax.grad(ours, argnums=1))(*place(mesh, operand, output))
    written = np.zeros((2, 5), bool)
    written[0, 0] = True  # device 0 keeps its own row 0
    written[1, 1:3] = True
    want = np.where(written[..., None], 0.0, np.asarray(weights))
    np.testing.assert_array_equal(np.asarray(d_output), want)
    assert_equal(run_stacked(self.fn(), mesh, *r.args), r.expected())

  def test_vmap(self, rng):
    first = random_routing(rng, devices=2, k=1, rows=6, pad=False)
    # A second routing of the same shapes: every size halved (a receiver's
    # sizes are its senders' sizes, so they stay consistent).
    second = first._replace(
      operand=first.operand + 1,
      send_sizes=first.send_sizes // 2,
      recv_sizes=first.recv_sizes // 2,
    )
    batch = [first, second]
    mesh = stacked_mesh((2,), ("x",))
    args = [jnp.stack([b.args[i] for b in batch], axis=1) for i in range(6)]
    got = run_stacked(jax.vmap(self.fn()), mesh, *args)
    for i, b in enumerate(batch):
      assert_equal(got[:, i], b.expected())

  def test_second_call_does_not_recompile(self, rng):
    first = random_routing(rng, devices=2, k=1, rows=10, trailing=(5,))
    # The same shapes, another routing.
    second = first._replace(
      send_sizes=first.send_sizes // 2, recv_sizes=first.recv_sizes // 2
    )
    mesh = stacked_mesh((2,), ("x",))
    fn = jax.jit(stacked(self.fn(), mesh))
    jax.block_until_ready(fn(*place(mesh, *first.args)))
    args = jax.block_until_ready(place(mesh, *second.args))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("jax")
    with jax.log_compiles(True):
      logger.addHandler(handler)
      try:
        got = jax.block_until_ready(fn(*args))
      finally:
        logger.removeHandler(handler)
    compiles = [r.getMessage() for r in records]
    assert not [m for m in compiles if "Compiling" in m], compiles
    assert_equal(got, second.expected())

  @pytest.mark.parametrize(
    "field,device,slot,value,k",
    [
      ("input_offsets", 0, 1, 20, 1),
      ("input_offsets", 1, 0, -1, 1),
      ("send_sizes", 1, 1, -2, 1),
      ("output_offsets", 0, 1, 40, 1),
      ("output_offsets", 1, 1, 40, 1),  # to itself
      # k = 3: the whole operand moves once per peer.
      ("input_offsets", 0, 4, 30, 3),
      ("output_offsets", 1, 2, 40, 3),
    ],
  )
  def test_out_of_bounds_at_run_time(self, rng, field, device, slot, value, k):
    r = random_routing(rng, devices=2, k=k, rows=8)
    n, m = r.operand.shape[1], r.output.shape[1]
    assert ragged.moves_whole_operand(n, m, k) == (k > 1)
    bad = getattr(r, field).at[device, slot].set(value)
    r = r._replace(**{field: bad})
    mesh = stacked_mesh((2,), ("x",))
    with pytest.raises(mpmd.OutOfBoundsError) as e, mpmd.typed_errors():
      jax.block_until_ready(run_stacked(self.fn(), mesh, *r.args))
    # The argument and the slice, not the window the kernel moves.
    message = str(e.value)
    assert f"device {{'x': {device}}}'s slice {slot} " in message
    assert f"{field}[{slot}] = {value}" in message
    assert "a TPU would fault" in message

  @pytest.mark.parametrize(
    "delta,error,why",
    [
      (1, mpmd.DeadlockError, "wait forever for rows never sent"),
      (-1, mpmd.LeftoverError, "rows would arrive that it never waits for"),
    ],
  )
  def test_recv_sizes_that_disagree_with_the_senders(
    self, rng, delta, error, why, caplog
  ):
    """JAX leaves it undefined; a TPU would hang or leave rows unawaited:
    on CPU, an error says which size disagrees (and only it: JAX logs no
    traceback of the failed callback)."""
    r = random_routing(rng, devices=2, k=2, rows=8)
    sent = int(r.send_sizes[1, 2])  # device 1's slice 0 to device 1
    announced = r.recv_sizes.at[1, 2].set(sent + delta)
    r = r._replace(recv_sizes=announced)
    mesh = stacked_mesh((2,), ("x",))
    with pytest.raises(error) as e, mpmd.typed_errors():
      jax.block_until_ready(run_stacked(self.fn(), mesh, *r.args))
    assert (
      f"device {{'x': 1}} announces recv_sizes[2] = {sent + delta} rows of "
      f"slice 0 from device {{'x': 1}}, which sends {sent} (its "
      "send_sizes[2])" in str(e.value)
    )
    assert why in str(e.value)
    logged = [r.getMessage() for r in caplog.records]
    assert not [m for m in logged if "callback failed" in m], logged

  def test_recv_sizes_that_disagree_in_one_element_of_a_vmap(self, rng):
    good = random_routing(rng, devices=2, k=1, rows=6, pad=False)
    bad = good._replace(recv_sizes=good.recv_sizes + 1)
    mesh = stacked_mesh((2,), ("x",))
    args = [
      jnp.stack([b.args[i] for b in (good, bad)], axis=1) for i in range(6)
    ]
    with (
      pytest.raises(mpmd.DeadlockError, match="announces"),
      mpmd.typed_errors(),
    ):
      jax.block_until_ready(run_stacked(jax.vmap(self.fn()), mesh, *args))

  def test_every_device_raises_so_none_waits_in_a_later_exchange(self, rng):
    """Only device 1's recv_sizes disagree; device 0, had it gone on into
    the second exchange alone, would wait there for device 1 until
    XLA:CPU aborts the process."""
    r = random_routing(rng, devices=2, k=1, rows=8)
    r = r._replace(recv_sizes=r.recv_sizes.at[1, 0].add(1))
    exchange = self.fn()

    def twice(operand, output, *metadata):
      once = exchange(operand, output, *metadata)
      return exchange(once, output, *metadata)

    mesh = stacked_mesh((2,), ("x",))
    with pytest.raises(mpmd.DeadlockError), mpmd.typed_errors():
      jax.block_until_ready(run_stacked(twice, mesh, *r.args))
    # The process is healthy: the next call runs.
    good = random_routing(rng, devices=2, k=1, rows=8)
    assert_equal(run_stacked(exchange, mesh, *good.args), good.expected())


class TestWindow(RaggedAllToAllTest):
  """Every case with ``implementation="window"`` (the CPU fallback's
  default), and what only its windows do."""

  implementation = "window"

  @pytest.mark.parametrize("rows,whole", [(8, True), (60, False)])
  def test_window_modes(self, rng, rows, whole):
    # Few operand rows: the whole operand moves once per peer; many (and a
    # short output): a window per slice.
    r = random_routing(rng, devices=2, k=2, rows=rows, max_size=2)
    n, m = r.operand.shape[1], r.output.shape[1]
    assert ragged.moves_whole_operand(n, m, 2) == whole
    mesh = stacked_mesh((2,), ("x",))
    assert_equal(run_stacked(self.fn(), mesh, *r.args), r.expected())

  def test_takes_lockstep_path(self):
    mesh = stacked_mesh((2,), ("x",))
    f = jax.shard_map(self.fn(), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    shapes = [(16, 8), (12, 8), (4,), (4,), (4,), (4,)]
    args = [
      jax.ShapeDtypeStruct(
        s,
        jnp.float32 if len(s) == 2 else jnp.int32,
        sharding=NamedSharding(mesh, P("x")),
      )
      for s in shapes
    ]
    path = kernel_path(f, *args)
    assert path.kind == paths.LOCKSTEP, path


class TestConditional(RaggedAllToAllTest):
  """Every case with ``implementation="conditional"`` (what a TPU runs)
  on the CPU fallback."""

  implementation = "conditional"


def _overlapping():
  """Two senders whose slices overlap at row 1 of every receiver's
  output: sender 0's rows land at [0, 2), sender 1's at [1, 3)."""
  operand = jnp.arange(2 * 4 * 2, dtype=jnp.float32).reshape(2, 4, 2)
  output = -jnp.ones((2, 5, 2), jnp.float32)
  input_offsets = jnp.asarray([[0, 2], [0, 2]], jnp.int32)
  sizes = jnp.full((2, 2), 2, jnp.int32)
  output_offsets = jnp.asarray([[0, 0], [1, 1]], jnp.int32)
  return operand, output, input_offsets, sizes, output_offsets, sizes


def test_overlapping_slices_window_later_wins():
  mesh = stacked_mesh((2,), ("x",))
  got = run_stacked(
    ragged_fn("x", implementation="window"), mesh, *_overlapping()
  )
  operand = np.asarray(_overlapping()[0])
  # Receiver 0: sender 0's rows 0-1 at [0, 2), then sender 1's rows 0-1
  # over [1, 3).
  want = np.concatenate([operand[0, :1], operand[1, :2], -np.ones((2, 2))])
  np.testing.assert_array_equal(np.asarray(got)[0], want)


def test_overlapping_slices_conditional_race():
  mesh = stacked_mesh((2,), ("x",))
  with (
    pytest.raises(mpmd.RaceError, match=r"data race on 'output'"),
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(
      run_stacked(
        ragged_fn("x", implementation="conditional"), mesh, *_overlapping()
      )
    )


class TestTpuSimulator:
  """Both implementations, no race; conditional chunks are sent only when
  they carry rows."""

  @pytest.mark.parametrize("devices,k", [(2, 2), (4, 1)])
  def test_conditional_no_race(self, rng, devices, k):
    r = random_routing(rng, devices=devices, k=k, rows=9, pad=False)
    mesh = stacked_mesh((devices,), ("x",))
    fn = forced(
      "conditional", interpret=pltpu.InterpretParams(detect_races=True)
    )
    with mpmd.race_policy("record"):
      got = run_stacked(fn, mesh, *r.args)
      assert_equal(got, r.expected())
      assert not mpmd.get_races().races_found

  def test_window_no_race(self, rng):
    r = random_routing(rng, devices=2, k=2, rows=9)
    mesh = stacked_mesh((2,), ("x",))
    fn = forced("window", interpret=pltpu.InterpretParams(detect_races=True))
    with mpmd.race_policy("record"):
      got = run_stacked(fn, mesh, *r.args)
      assert_equal(got, r.expected())
      assert not mpmd.get_races().races_found


class TestChecker:
  """Both implementations under the checking executor (``mpmd.explore``):
  no deadlock, race or leftover semaphore under several schedules of the
  devices' programs, and a replayed schedule gives the reference."""

  @pytest.mark.parametrize("implementation", ragged.IMPLEMENTATIONS.names)
  def test_clean_under_explore(self, rng, implementation):
    r = random_routing(rng, devices=2, k=2, rows=9, pad=False)
    mesh = stacked_mesh((2,), ("x",))
    f = jax.jit(stacked(forced(implementation), mesh))
    args = place(mesh, *r.args)
    report = mpmd.explore(f, *args, schedules=4)
    assert report.failures == [], str(report)
    got = mpmd.replay(f, *args, schedule="random:2")
    assert_equal(got, r.expected())


class TestTpuLowering:
  def lower(self, fn, mesh, axes, shapes) -> str:
    spec = P(axes)
    args = [
      jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec))
      for s, d in shapes
    ]
    # Mosaic fills the mesh axes a device id leaves out with their
    # axis_index, in a function traced with vma checks that it cannot
    # lower (a pvary): on a multi-axis mesh, lower with check_vma=False.
    f = jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=spec,
      out_specs=spec,
      check_vma=len(mesh.axis_names) == 1,
    )
    with mpmd.tpu_target():
      return (
        jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
      )

  def assert_collective_kernel(self, text, count=1):
    assert text.count("tpu_custom_call") == count
    assert re.search(r"has_communication\\22: true", text)

  @pytest.mark.parametrize("implementation", [None, "window"])
  @pytest.mark.parametrize(
    "mesh_shape,axis_name,trailing",
    [((4,), "x", (128,)), ((2, 4), "y", (8, 128)), ((2, 2), "x", ())],
  )
  def test_lowers(self, implementation, mesh_shape, axis_name, trailing):
    names = ("x", "y")[: len(mesh_shape)]
    mesh = stacked_mesh(mesh_shape, names)
    d = mesh.shape[axis_name]
    count = np.prod(mesh_shape)
    shapes = [
      ((count * 64, *trailing), jnp.bfloat16),
      ((count * 96, *trailing), jnp.bfloat16),
    ] + [((count * 2 * d,), jnp.int32)] * 4
    fn = forced(implementation, axis_name=axis_name)
    self.assert_collective_kernel(self.lower(fn, mesh, names, shapes))

  @pytest.mark.parametrize("implementation", [None, "window"])
  def test_lowers_over_an_axis_of_one_device(self, implementation):
    """No peer, so no barrier handshake: and no collective id, which
    Mosaic rejects without a barrier semaphore."""
    mesh = stacked_mesh((1, 2), ("x", "y"))
    shapes = [
      ((2 * 64, 128), jnp.bfloat16),
      ((2 * 96, 128), jnp.bfloat16),
    ] + [((2 * 2,), jnp.int32)] * 4
    fn = forced(implementation, axis_name="x")
    text = self.lower(fn, mesh, ("x", "y"), shapes)
    assert text.count("tpu_custom_call") == 1

  def test_export_serializes(self):
    mesh = stacked_mesh((4,), ("x",))
    spec = NamedSharding(mesh, P("x"))
    f = jax.shard_map(ragged_fn(), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    args = [
      jax.ShapeDtypeStruct((4 * 64, 128), jnp.bfloat16, sharding=spec),
      jax.ShapeDtypeStruct((4 * 96, 128), jnp.bfloat16, sharding=spec),
    ] + [jax.ShapeDtypeStruct((4 * 4,), jnp.int32, sharding=spec)] * 4
    with mpmd.tpu_target():
      exported = jax.export.export(jax.jit(f), platforms=("tpu",))(*args)
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("tpu",)
    assert "tpu_custom_call" in restored.mlir_module()

  def test_grad_lowers(self):
    mesh = stacked_mesh((4,), ("x",))
    f = jax.shard_map(ragged_fn(), mesh=mesh, in_specs=P("x"), out_specs=P("x"))

    def loss(operand, output, *metadata):
      out = f(operand, output, *metadata)
      return jnp.sum(out.astype(jnp.float32))

    spec = NamedSharding(mesh, P("x"))
    args = [
      jax.ShapeDtypeStruct((4 * 32, 256), jnp.bfloat16, sharding=spec),
      jax.ShapeDtypeStruct((4 * 48, 256), jnp.bfloat16, sharding=spec),
    ] + [jax.ShapeDtypeStruct((4 * 4,), jnp.int32, sharding=spec)] * 4
    with mpmd.tpu_target():
      text = tpu_text(jax.grad(loss, argnums=(0, 1)), *args)
    # Forward, the offsets' exchange, the reverse exchange.
    self.assert_collective_kernel(text, count=3)


# -- errors before lowering ---------------------------------------------------


def _call_in_shard_map(args, **kwargs):
  mesh = stacked_mesh((2,), ("x",))
  fn = functools.partial(mpmd.kernels.ragged_all_to_all, **kwargs)
  f = jax.shard_map(
    lambda *a: fn(*(x[0] for x in a))[None],
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
  )
  spec = NamedSharding(mesh, P("x"))
  avals = [
    jax.ShapeDtypeStruct((2, *jnp.shape(a)), jnp.result_type(a), sharding=spec)
    for a in args
  ]
  return jax.jit(f).trace(*avals)


def _args(**changes):
  args = dict(
    operand=np.zeros((8, 4), np.float32),
    output=np.zeros((6, 4), np.float32),
    input_offsets=np.zeros(4, np.int32),
    send_sizes=np.zeros(4, np.int32),
    output_offsets=np.zeros(4, np.int32),
    recv_sizes=np.zeros(4, np.int32),
  )
  args.update(changes)
  return list(args.values())


@pytest.mark.parametrize(
  "changes,kwargs,error,match",
  [
    (
      dict(output=np.zeros((6, 4), jnp.bfloat16)),
      {},
      TypeError,
      "expected 'operand' and 'output' of the same dtype, got float32 and "
      "bfloat16",
    ),
    (
      dict(output=np.zeros((6, 5), np.float32)),
      {},
      ValueError,
      r"same trailing dimensions, got shapes \(8, 4\) and \(6, 5\)",
    ),
    (
      dict(send_sizes=np.zeros(4, np.float32)),
      {},
      TypeError,
      "expected 'send_sizes' of an integer dtype, got float32",
    ),
    (
      dict(recv_sizes=np.zeros(6, np.int32)),
      {},
      ValueError,
      "of the same length",
    ),
    (
      dict(
        input_offsets=np.zeros(3, np.int32),
        send_sizes=np.zeros(3, np.int32),
        output_offsets=np.zeros(3, np.int32),
        recv_sizes=np.zeros(3, np.int32),
      ),
      {},
      ValueError,
      "of length k \\* 2",
    ),
    (
      dict(output_offsets=np.zeros((2, 2), np.int32)),
      {},
      ValueError,
      "expected 'output_offsets' of rank 1",
    ),
    ({}, dict(axis_name="z"), ValueError, "'z' is not an axis"),
    (
      {},
      dict(axis_index_groups=[[0], [0]]),
      ValueError,
      "exactly once",
    ),
    (
      {},
      dict(axis_index_groups=[[0.5, 1]]),
      TypeError,
      "'axis_index_groups' to be None or a sequence of sequences of ints",
    ),
  ],
)
def test_errors(changes, kwargs, error, match):
  kwargs.setdefault("axis_name", "x")
  with pytest.raises(error, match=match):
    _call_in_shard_map(_args(**changes), **kwargs)


def test_outside_shard_map():
  with pytest.raises(ValueError, match="inside jax.shard_map"):
    mpmd.kernels.ragged_all_to_all(*_args(), axis_name="x")


def test_scalar_operand():
  with pytest.raises(ValueError, match="'operand' of rank >= 1"):
    _call_in_shard_map(_args(operand=np.float32(0)), axis_name="x")
