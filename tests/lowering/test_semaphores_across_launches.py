"""Semaphores that cross launches: a launch returns a semaphore, the next
takes it.

As upstream hands an in-flight DMA from one kernel to the next (its DMA
semaphore an output of the first, an input of the second), the count a
launch leaves (bytes of DMAs not yet waited, signals not yet waited) is
what the next launch finds. Checked on the CPU fast path and the lockstep
path; the TPU simulator refuses clearly; both launches lower for TPU.
"""

import base64
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rings
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd

ROWS = (8, 128)
ROW_BYTES = 8 * 128 * 4
CORE = mpmd.tensorcore_mesh("core", num_cores=1)
F32 = jax.ShapeDtypeStruct(ROWS, jnp.float32)
COUNT = pltpu.SMEM((1,), jnp.int32)


def _start(x_hbm, o_hbm, sem):
  pltpu.make_async_copy(x_hbm, o_hbm, sem).start()


def _copy_start(interpret=None):
  """Starts a DMA of x into the output and returns its semaphore."""
  return mpmd.mpmd_map(
    [(CORE, _start)],
    (F32, pltpu.SemaphoreType.DMA(())),
    interpret=interpret,
  )


def _copy_done(waits=1, interpret=None):
  """Waits (``waits`` times) for the DMA the previous launch started; the
  output is that DMA's destination (aliased)."""

  def done(x_hbm, o_in, sem, o_hbm):
    del o_in
    for _ in range(waits):
      pltpu.make_async_copy(x_hbm, o_hbm, sem).wait()

  return mpmd.mpmd_map(
    [(CORE, done)],
    F32,
    input_output_aliases={1: 0},
    interpret=interpret,
  )


def _raises_deadlock(f, *args, match: str) -> None:
  with pytest.raises(mpmd.DeadlockError, match=match), mpmd.typed_errors():
    jax.block_until_ready(f(*args))


def _read_count(sem, count):
  count[0] = pl.semaphore_read(sem)


@pytest.mark.parametrize("interpret", [None, True], ids=["default", "hlo"])
def test_in_flight_dma_completes_in_the_next_launch(rng, interpret):
  x = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)

  @jax.jit
  def f(x):
    out, sem = _copy_start(interpret)(x)
    return _copy_done(interpret=interpret)(x, out, sem)

  np.testing.assert_array_equal(f(x), x)


def test_the_dma_semaphore_carries_its_bytes():
  count = mpmd.mpmd_map([(CORE, _read_count)], COUNT)

  @jax.jit
  def f(x):
    _, sem = _copy_start()(x)
    return count(sem)

  np.testing.assert_array_equal(f(jnp.ones(ROWS, jnp.float32)), [ROW_BYTES])


def test_several_dmas_in_flight_cross_one_launch(rng):
  x = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)

  @jax.jit
  def f(x):
    out, sem = _copy_start()(x)
    out2, sem2 = _copy_start()(x + 1)
    return (
      _copy_done()(x, out, sem),
      _copy_done()(x, out2, sem2),
    )

  y, y2 = f(x)
  np.testing.assert_array_equal(y, x)
  np.testing.assert_array_equal(y2, x + 1)


def test_waiting_for_more_than_was_signalled_is_a_deadlock():
  @jax.jit
  def f(x):
    out, sem = _copy_start()(x)
    return _copy_done(waits=2)(x, out, sem)

  _raises_deadlock(
    f,
    jnp.ones(ROWS, jnp.float32),
    match=r"fast path .* waited on a semaphore more than it was signalled",
  )


def _signal(n):
  def kernel(sem):
    pl.semaphore_signal(sem, n)

  return mpmd.mpmd_map(
    [(CORE, kernel)], pltpu.SemaphoreType.REGULAR(()), name="signal"
  )


def _wait(n):
  """Waits for ``n`` on the semaphore it takes, returns what is left."""

  def kernel(sem, count):
    pl.semaphore_wait(sem, n)
    count[0] = pl.semaphore_read(sem)

  return mpmd.mpmd_map([(CORE, kernel)], COUNT, name="wait")


def test_regular_semaphore_signals_cross_launches():
  @jax.jit
  def f():
    return _wait(2)(_signal(3)())

  # A semaphore input is the launch's own copy: what it waits for is gone
  # only inside the launch.
  np.testing.assert_array_equal(f(), [1])


def test_a_semaphore_passes_through_launches():
  def add(sem_in, sem_out):
    del sem_in  # aliased to sem_out
    pl.semaphore_signal(sem_out, 4)
    pl.semaphore_wait(sem_out, 2)

  add = mpmd.mpmd_map(
    [(CORE, add)],
    pltpu.SemaphoreType.REGULAR(()),
    input_output_aliases={0: 0},
  )

  @jax.jit
  def f():
    return _wait(5)(add(_signal(3)()))

  np.testing.assert_array_equal(f(), [0])


def test_waiting_on_a_regular_semaphore_input_for_too_much_is_a_deadlock():
  @jax.jit
  def f():
    return _wait(4)(_signal(3)())

  _raises_deadlock(
    f, match=r"more than it was signalled[^\n]*\n  mesh 0 program 0 .*: 'sem'"
  )


# -- the lockstep path: remote DMAs under shard_map --------------------------


def _ring(n):
  return jax.make_mesh(
    (n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
  )


def _send_right(n):
  """Sends x to the right neighbour; the receive is left in flight."""

  def kernel(x_hbm, o_hbm, recv, send):
    copy = rings.copy_to_right(x_hbm, o_hbm, send, recv, n)
    copy.wait_send()

  return mpmd.mpmd_map(
    [(CORE, kernel)],
    (F32, pltpu.SemaphoreType.DMA(())),
    scratch_types=[pltpu.SemaphoreType.DMA(())],
    debug=True,
  )


def _receive_and_send_right(n, waits=1):
  """Waits for the receive of the previous launch, then sends the data on
  (a remote DMA: the lockstep path)."""

  def kernel(x_hbm, o_in, recv_in, o_hbm, send, recv):
    del o_in
    for _ in range(waits):
      pltpu.make_async_copy(x_hbm, o_hbm, recv_in).wait()
    rings.copy_to_right(o_hbm, o_hbm, send, recv, n).wait()

  return mpmd.mpmd_map(
    [(CORE, kernel)],
    F32,
    scratch_types=[pltpu.SemaphoreType.DMA(())] * 2,
    input_output_aliases={1: 0},
    debug=True,
  )


def _two_hops(n, waits=1):
  def per_device(x):
    out, recv = _send_right(n)(x)
    return _receive_and_send_right(n, waits)(x, out, recv)

  spec = P("x")
  return jax.jit(
    jax.shard_map(
      per_device, mesh=_ring(n), in_specs=spec, out_specs=spec, check_vma=False
    )
  )


def _rows(mesh, n):
  x = jnp.arange(n * np.prod(ROWS), dtype=jnp.float32)
  return jax.device_put(
    x.reshape(n * ROWS[0], ROWS[1]), NamedSharding(mesh, P("x"))
  )


def test_lockstep_receive_completes_in_the_next_launch(capsys):
  n = 4
  x = _rows(_ring(n), n)
  y = _two_hops(n)(x)
  # Two hops to the right: device i holds the block of device i - 2.
  np.testing.assert_array_equal(y, np.roll(np.asarray(x), 2 * ROWS[0], axis=0))
  assert capsys.readouterr().out.count("takes the lockstep path") == 2


def test_lockstep_wait_for_too_much_names_the_semaphore_input():
  n = 2
  x = _rows(_ring(n), n)
  _raises_deadlock(
    _two_hops(n, waits=2),
    x,
    match=r"(?s)lockstep path.*device \(x=0\) waits on 'recv_in' \(input 2, "
    r"dma_sem",
  )


# -- what no CPU path carries ------------------------------------------------


def test_the_tpu_simulator_refuses_semaphore_operands():
  @jax.jit
  def f(x):
    out, sem = _copy_start(pltpu.InterpretParams())(x)
    return _copy_done()(x, out, sem)

  with pytest.raises(
    NotImplementedError,
    match=r"semaphores as inputs or outputs of a launch in the TPU simulator",
  ):
    f(jnp.ones(ROWS, jnp.float32))


def test_semaphore_operands_of_several_programs_are_refused():
  two = mpmd.tensorcore_mesh("core", num_cores=2)
  f = mpmd.mpmd_map([(two, _start)], (F32, pltpu.SemaphoreType.DMA(())))
  with pytest.raises(
    NotImplementedError,
    match=r"semaphores as inputs or outputs of a launch of several programs "
    r"\(this one runs 2\)",
  ):
    jax.jit(f)(jnp.ones(ROWS, jnp.float32))


def test_semaphore_outputs_outside_jit_are_refused():
  with pytest.raises(
    NotImplementedError, match="semaphore outputs outside jax.jit"
  ):
    _copy_start()(jnp.ones(ROWS, jnp.float32))


# -- TPU cross-lowering ------------------------------------------------------


def _upstream_copy(x):
  """The same two kernels through upstream's pallas_call."""
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  sem_spec = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)
  out, sem = pl.pallas_call(
    _start,
    out_shape=(F32, pltpu.SemaphoreType.DMA(())),
    in_specs=[any_spec],
    out_specs=(any_spec, sem_spec),
  )(x)

  def done(x_hbm, o_in, sem, o_hbm):
    del o_in
    pltpu.make_async_copy(x_hbm, o_hbm, sem).wait()

  return pl.pallas_call(
    done,
    out_shape=F32,
    in_specs=[any_spec, any_spec, sem_spec],
    out_specs=any_spec,
    input_output_aliases={1: 0},
  )(x, out, sem)


def _ours_copy(x):
  out, sem = _copy_start()(x)
  return _copy_done()(x, out, sem)


def _tpu_hlo(f):
  x = jnp.ones(ROWS, jnp.float32)
  with mpmd.tpu_target("v5e"):
    lowered = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",))
  return lowered.as_text()


def _custom_calls(text):
  """Each Mosaic custom call: its operand and result types, its config
  (less the kernel body and debug locations, which name our functions), and
  whether the kernel body has semaphore memory."""
  calls = []
  for line in text.splitlines():
    if "stablehlo.custom_call @tpu_custom_call" not in line:
      continue
    config = re.search(r'backend_config = "(.*?)"[,}]', line).group(1)
    config = json.loads(config.replace("\\22", '"'))["custom_call_config"]
    body = base64.b64decode(config.pop("body"))
    config.pop("debug_locations", None)
    signature = line.rsplit(" : ", 1)[1].strip()
    calls.append((signature, config, b"semaphore_mem" in body))
  return calls


def test_both_launches_lower_for_tpu_like_upstream():
  ours = _custom_calls(_tpu_hlo(_ours_copy))
  upstream = _custom_calls(_tpu_hlo(_upstream_copy))
  assert len(ours) == 2
  assert ours == upstream
  (start_type, start_config, _), (done_type, _, _) = ours
  # The semaphore crosses as an int32 scalar in semaphore memory: an output
  # of the first launch, an input of the second.
  assert start_type.endswith("-> (tensor<8x128xf32>, tensor<i32>)")
  assert start_config["output_memory_space_colors"] == [
    {"color": 2, "shape_index": [1]}
  ]
  assert "tensor<i32>) -> tensor<8x128xf32>" in done_type


def _signals_minus_one(x_hbm, o_hbm, sem):
  pl.semaphore_signal(sem, -1)  # nobody waits on it
  pltpu.sync_copy(x_hbm, o_hbm)


@pytest.mark.parametrize(
  "interpret, says",
  [
    (None, r"fast path, .* or a negative signal\):\n.*'sem'"),
    (mpmd.CheckParams(), r"'sem' .* holds -1"),
  ],
  ids=["fast", "check"],
)
def test_a_negative_signal_nobody_waits_on_is_left_over(interpret, says):
  """No wait found too little: the count ends at -1, left over on every
  path (the fast path took it for a wait that came up short)."""
  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), _signals_minus_one)],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
    interpret=interpret,
  )
  with pytest.raises(mpmd.LeftoverError, match=says), mpmd.typed_errors():
    jax.block_until_ready(f(jnp.ones(ROWS, jnp.float32)))


def _hands_on_then_signals_minus_one(x_hbm, o_hbm, sem):
  right = jax.lax.rem(jax.lax.axis_index("x") + 1, 2)
  pl.semaphore_signal(sem, 1, device_id={"x": right})
  pl.semaphore_wait(sem, 1)
  _signals_minus_one(x_hbm, o_hbm, sem)


def test_a_negative_signal_on_the_lockstep_path_is_left_over():
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  local = mpmd.mpmd_map(
    [
      (
        mpmd.tensorcore_mesh("core", num_cores=1),
        _hands_on_then_signals_minus_one,
      )
    ],
    jax.ShapeDtypeStruct(ROWS, jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
  )
  f = jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  x = jax.device_put(
    jnp.ones((2 * ROWS[0], ROWS[1]), jnp.float32), NamedSharding(mesh, P("x"))
  )
  with (
    pytest.raises(
      mpmd.LeftoverError,
      match=r"lockstep path, .* or a negative signal\):\n"
      r".*'sem' .*\(count -1\)",
    ),
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(f(x))
