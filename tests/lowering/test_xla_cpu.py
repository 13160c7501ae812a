"""What the lockstep path relies on XLA:CPU for (``mpmd._lowering.xla_cpu``),
checked on compiled programs: a new XLA that sees through one of the
helpers fails one of these tests, where the launches that rely on it would
hang in a collective instead.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rings
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd import _jax
from mpmd._lowering import xla_cpu

N = 4
ROWS = (8, 128)
CORE = mpmd.tensorcore_mesh("core", num_cores=1)


def _mesh():
  return jax.make_mesh((N,), ("x",), devices=jax.devices()[:N])


def _sharded(fn, in_specs, out_specs):
  return jax.jit(
    jax.shard_map(
      fn, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
  )


def _rows(shape=ROWS):
  count = int(N * np.prod(shape))
  x = jnp.arange(count, dtype=jnp.float32) / float(count)
  x = x.reshape(N * shape[0], *shape[1:])
  return jax.device_put(x, NamedSharding(_mesh(), P("x")))


def _entry(hlo: str) -> dict[str, str]:
  """The entry computation's instructions: name -> the rest of its line."""
  entry = hlo.split("\nENTRY ", 1)[1].split("\n}", 1)[0]
  return dict(re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = (.*)$", entry, re.M))


def _ancestors(hlo: str, name: str) -> list[str]:
  """The lines of the entry computation that ``name`` depends on, each
  followed by the text of the computation it calls (a fusion's)."""
  computations = dict(
    re.findall(r"^(?:ENTRY )?%?([\w.-]+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M)
  )
  lines = _entry(hlo)
  seen, todo = set(), [name]
  while todo:
    for operand in re.findall(r"%([\w.-]+)", lines.get(todo.pop(), "")):
      if operand in lines and operand not in seen:
        seen.add(operand)
        todo.append(operand)
  found = []
  for n in seen:
    called = re.findall(r"calls=%?([\w.-]+)", lines[n])
    found.append(lines[n] + "".join(computations.get(c, "") for c in called))
  return found


def _op(line: str) -> str:
  """The opcode of an instruction line (its text after the shape)."""
  match = re.match(r"(?:\([^)]*\)|\S+) ([\w-]+)\(", line)
  return match.group(1) if match else ""


# The collectives an exchange makes: small data gathered, large data shifted.
_COLLECTIVES = ("all-gather", "collective-permute")


def _named(hlo: str, op: str) -> list[str]:
  return [n for n, line in _entry(hlo).items() if _op(line) == op]


# -- witness: a collective waits for a whole value ----------------------------


def test_a_witness_computes_the_whole_value():
  """Alone, ``witness(d)`` makes XLA compute all of ``d`` (jaxlib >= 0.11);
  one element of ``d`` alone it computes from ``d``'s operands. jaxlib
  0.10.2's XLA fuses through the barrier when nothing else reads ``d``
  whole: in an exchange the ring shift does (the tests below)."""
  a = jnp.ones((64, 48), jnp.float32)

  def computes_exp_whole(fn) -> bool:
    hlo = jax.jit(fn).lower(a).compile().as_text()
    return any(
      line.startswith("f32[64,48]") and _op(line) in ("exponential", "fusion")
      for line in _entry(hlo).values()
    )

  witnessed = computes_exp_whole(lambda a: xla_cpu.witness(jnp.exp(a)))
  assert witnessed == (_jax.JAX_VERSION >= (0, 11))
  assert not computes_exp_whole(lambda a: jnp.ravel(jnp.exp(a))[:1])


def test_a_witness_feeds_the_whole_value_to_a_collective():
  """A collective handed ``witness(d)`` runs after all of ``d``: XLA keeps
  the computation of ``d`` whole, upstream of the collective, rather than
  computing the one element the collective reads from ``d``'s operands."""

  def body(x):
    d = jnp.exp(x)
    shifted = lax.ppermute(d, "x", [(i, (i + 1) % N) for i in range(N)])
    gathered = lax.all_gather(xla_cpu.witness(d), "x")
    return shifted + gathered.sum()

  fn = _sharded(body, P("x"), P("x"))
  hlo = fn.lower(_rows()).compile().as_text()
  [gather] = _named(hlo, "all-gather")
  whole = f"f32[{ROWS[0]},{ROWS[1]}]"
  assert any(
    line.startswith(whole) and "exponential" in line
    for line in _ancestors(hlo, gather)
  ), hlo


def test_an_exchange_waits_for_the_data_it_shifts():
  """A DMA whose data moves by ring shift, to a device read at run time:
  the exchange's all_gather (its target) also waits for the data, computed
  whole. XLA would otherwise run it as soon as the target is known, and a
  device waiting in it for the others holds one of XLA's threads (one per
  device), which the devices still computing need."""
  rows = (256, 512)  # 512 KiB: shifted, not gathered (exchange._GATHER_BYTES)

  def kernel(table_hbm, x_hbm, o_hbm, table, buf, send, recv):
    pltpu.sync_copy(table_hbm, table)
    pltpu.sync_copy(x_hbm, buf)
    buf[...] = jnp.exp(buf[...])
    right = table[jax.lax.axis_index("x")]
    copy = pltpu.make_async_remote_copy(
      buf, o_hbm, send, recv, device_id={"x": right}
    )
    copy.start()
    copy.wait()

  def per_device(table, x):
    return mpmd.mpmd_map(
      [(CORE, kernel)],
      jax.ShapeDtypeStruct(rows, jnp.float32),
      scratch_types=[
        pltpu.SMEM((N,), jnp.int32),
        pltpu.VMEM(rows, jnp.float32),
        pltpu.SemaphoreType.DMA,
        pltpu.SemaphoreType.DMA,
      ],
    )(table, x)

  fn = _sharded(per_device, (P(), P("x")), P("x"))
  table = jnp.roll(jnp.arange(N, dtype=jnp.int32), -1)
  x = _rows(rows)
  expected = np.roll(np.exp(np.asarray(x)).reshape(N, *rows), 1, axis=0)
  np.testing.assert_allclose(fn(table, x), expected.reshape(x.shape), rtol=1e-6)
  hlo = fn.lower(table, x).compile().as_text()
  # The exchange's, then every device's end-of-launch verdict (which
  # depends on it: later in the schedule).
  [gather, _] = _named(hlo, "all-gather")
  whole = f"f32[{rows[0]},{rows[1]}]"
  assert any(
    line.startswith(whole) and "exponential" in line
    for line in _ancestors(hlo, gather)
  )


# -- arrival: a count that exists only once a collective has run -------------


def test_arrival_is_not_folded():
  """A count gated by ``arrival`` of a collective's result is computed from
  that result: XLA does not fold it to the constant it always is."""

  def body(x):
    moved = lax.ppermute(x, "x", [(i, (i + 1) % N) for i in range(N)])
    count = jnp.where(xla_cpu.arrival(moved), jnp.int32(5), jnp.int32(0))
    return moved, count[None]

  fn = _sharded(body, P("x"), (P("x"), P("x")))
  moved, count = fn(_rows())
  np.testing.assert_array_equal(count, [5] * N)
  hlo = fn.lower(_rows()).compile().as_text()
  lines = _entry(hlo)
  root = next(n for n, line in lines.items() if " tuple(" in f" {line}")
  outputs = re.findall(r"%([\w.-]+)", lines[root])
  [count_out] = [o for o in outputs if lines[o].startswith("s32[1]")]
  assert any(
    _op(line) == "collective-permute" for line in _ancestors(hlo, count_out)
  ), hlo


def test_a_failure_report_waits_for_the_collective():
  """A launch whose semaphore counts every device knows when traced (a ring
  shift of known devices): its failure report, a conditional callback on
  those counts, still runs only after the collective that moves the data.
  If XLA folded the counts, the report of a device could run first and
  raise, and the others would wait for it in the collective forever."""

  def kernel(x_hbm, o_hbm, send, recv):
    copy = rings.copy_to_right(x_hbm, o_hbm, send, recv, N)
    copy.wait_send()
    copy.wait_recv()

  def per_device(x):
    return mpmd.mpmd_map(
      [(CORE, kernel)],
      jax.ShapeDtypeStruct(ROWS, jnp.float32),
      scratch_types=[pltpu.SemaphoreType.DMA(())] * 2,
    )(x)

  fn = _sharded(per_device, P("x"), P("x"))
  expected = np.roll(np.asarray(_rows()).reshape(N, *ROWS), 1, axis=0)
  np.testing.assert_array_equal(fn(_rows()), expected.reshape(N * ROWS[0], -1))
  hlo = fn.lower(_rows()).compile().as_text()
  reports = _named(hlo, "conditional")
  assert reports, "the failure report is no longer conditional: folded?"
  for report in reports:
    upstream = [_op(line) for line in _ancestors(hlo, report)]
    assert any(op in _COLLECTIVES for op in upstream), hlo


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.bool_])
def test_arrival_is_true(dtype):
  value = jnp.zeros((3,), dtype)
  assert bool(xla_cpu.arrival(value))
  assert xla_cpu.arrival(jnp.zeros((0,), dtype)) is None
