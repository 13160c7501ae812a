"""The checking executor: schedules, oracles, replay, timeline.

Kernels here are the kind users write (a producer and consumers on two
meshes) and our own shipped kernels, correct and with synchronisation bugs
injected (``sync_bugs``): the checker must stay silent on the first and
name each of the second, with a schedule that replays it.
"""

import json

import example_scripts
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sync_bugs
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd.kernels import all_gather_matmul, matmul_reduce_scatter

# The example's producer and consumers, then copies with a bug each.
_example = example_scripts.load("producer_consumer")
ROWS, COLS = 8, 128
CONSUMERS = _example.NUM_CONSUMERS
producer, consumers = _example.producer, _example.consumers
produce, consume = _example.produce, _example.consume


def consume_without_wait(x_hbm, o_hbm, staged, ready, buf):
  del x_hbm, ready
  c = jax.lax.axis_index("consumer")
  pltpu.sync_copy(staged, buf)
  buf[...] = buf[...] + c.astype(jnp.float32)
  pltpu.sync_copy(buf, o_hbm.at[c])


def produce_without_signal(x_hbm, o_hbm, staged, ready, buf):
  del o_hbm, ready
  pltpu.sync_copy(x_hbm, buf)
  buf[...] = buf[...] * 2.0
  pltpu.sync_copy(buf, staged)


def two_meshes(consumer=consume, producer_fn=produce, interpret=None):
  def f(x):
    return mpmd.mpmd_map(
      [(consumers, consumer), (producer, producer_fn)],
      jax.ShapeDtypeStruct((CONSUMERS, ROWS, COLS), jnp.float32),
      scratch_types=[
        pltpu.HBM((ROWS, COLS), jnp.float32),
        pltpu.SemaphoreType.REGULAR @ consumers,
        pltpu.VMEM((ROWS, COLS), jnp.float32) @ consumers,
      ],
      interpret=interpret,
    )(x)

  return jax.jit(f)


X = jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)


def reference(x):
  return 2.0 * x[None] + jnp.arange(CONSUMERS, dtype=x.dtype)[:, None, None]


# -- a correct kernel ---------------------------------------------------------


def test_correct_kernel_has_no_failures_and_right_numbers():
  f = two_meshes()
  report = mpmd.explore(f, X, schedules=24)
  assert report.schedules_run == 24
  assert report.failures == [], str(report)
  for schedule in ("default", "random:5", "pct3:8"):
    np.testing.assert_array_equal(
      mpmd.replay(f, X, schedule=schedule), reference(X)
    )


def test_check_params_as_interpret():
  for schedule in ("default", 3, "pct2:1"):
    f = two_meshes(interpret=mpmd.CheckParams(schedule=schedule))
    np.testing.assert_array_equal(f(X), reference(X))


# -- each oracle, named -------------------------------------------------------


def test_missing_wait_is_a_race_or_an_uninitialized_read():
  f = two_meshes(consumer=consume_without_wait)
  report = mpmd.explore(f, X, schedules=24)
  kinds = {failure.kind for failure in report.failures}
  assert kinds <= {"race", "uninitialized", "nondeterministic"}, kinds
  assert "race" in kinds, str(report)
  race = next(x for x in report.failures if x.kind == "race")
  assert isinstance(race.error, mpmd.RaceError)
  message = str(race.error)
  assert "'staged'" in message and "test_check.py" in message


def test_deadlock_names_waiters_counts_and_lines():
  f = two_meshes(producer_fn=produce_without_signal)
  report = mpmd.explore(f, X, schedules=4)
  [failure] = report.failures
  assert failure.kind == "deadlock"
  message = str(failure.error)
  for c in range(CONSUMERS):
    assert f"program {{'consumer': {c}}} waits (semaphore_wait" in message
  assert "on 'ready'" in message and "for 1; it holds 0 now" in message
  assert "test_check.py" in message  # the kernel's line


def test_typed_errors_on_every_call_of_a_jitted_function():
  checked = mpmd.CheckParams(schedule="default")
  f = two_meshes(producer_fn=produce_without_signal, interpret=checked)
  for _ in range(3):
    with pytest.raises(mpmd.DeadlockError, match="it holds 0 now"):
      with mpmd.typed_errors():
        jax.block_until_ready(f(X))
  # The process stays healthy: a correct launch runs after the failures.
  np.testing.assert_array_equal(two_meshes(interpret=checked)(X), reference(X))


def test_extra_signal_is_a_leftover():
  def produce_twice(x_hbm, o_hbm, staged, ready, buf):
    produce(x_hbm, o_hbm, staged, ready, buf)
    pl.semaphore_signal(ready, 1, device_id={"consumer": 1})

  report = mpmd.explore(two_meshes(producer_fn=produce_twice), X, schedules=4)
  [failure] = report.failures
  assert failure.kind == "leftover"
  assert isinstance(failure.error, mpmd.LeftoverError)
  message = str(failure.error)
  assert "'ready' (mesh 0 program {'consumer': 1}) holds 1" in message
  # ... and which signal counted it last: the extra one.
  extra = 'pl.semaphore_signal(ready, 1, device_id={"consumer": 1})'
  assert "(last counted by signal 'ready'" in message, message
  assert f"at {__file__}:{_line_of(extra)}:" in message, message


def test_out_of_bounds_dma_window():
  def oob(x_hbm, o_hbm, start_smem):
    pltpu.sync_copy(x_hbm.at[pl.ds(start_smem[0], ROWS)], o_hbm)

  def f(start, x):
    def kernel(start_hbm, x_hbm, o_hbm, start_smem):
      pltpu.sync_copy(start_hbm, start_smem)
      oob(x_hbm, o_hbm, start_smem)

    return mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.SMEM((1,), jnp.int32)],
      interpret=mpmd.CheckParams(),
    )(start, x)

  x = jnp.zeros((2 * ROWS, COLS), jnp.float32)
  np.testing.assert_array_equal(jax.jit(f)(jnp.array([ROWS], jnp.int32), x), 0)
  with pytest.raises(mpmd.OutOfBoundsError, match="out of bounds"):
    with mpmd.typed_errors():
      jax.block_until_ready(jax.jit(f)(jnp.array([ROWS + 1], jnp.int32), x))


# -- replay and determinism ---------------------------------------------------


def test_failing_schedules_replay_every_time():
  f = two_meshes(consumer=consume_without_wait)
  report = mpmd.explore(f, X, schedules=16)
  assert report.failures
  for failure in report.failures:
    for _ in range(10):
      with pytest.raises(type(failure.error)) as raised:
        mpmd.replay(f, X, schedule=failure.schedule)
      assert str(raised.value) == str(failure.error)


def test_same_schedule_same_event_log(tmp_path):
  f = two_meshes()
  logs = []
  for k in range(2):
    path = tmp_path / f"trace{k}.json"
    out = mpmd.timeline(f, X, path=str(path), schedule="random:11")
    np.testing.assert_array_equal(out, reference(X))
    logs.append(path.read_text())
  assert logs[0] == logs[1]
  other = tmp_path / "other.json"
  mpmd.timeline(f, X, path=str(other), schedule="random:12")
  assert other.read_text() != logs[0]  # another schedule, another order


def test_shrunk_schedule_is_a_steps_string_that_still_fails():
  f = two_meshes(consumer=consume_without_wait)
  report = mpmd.explore(f, X, schedules=16, seed=3)
  race = [x for x in report.failures if x.kind == "race"]
  assert race, str(report)
  assert race[0].schedule.startswith("steps:")
  with pytest.raises(mpmd.RaceError):
    mpmd.replay(f, X, schedule=race[0].schedule)


@pytest.mark.parametrize(
  "schedule, says",
  [
    ("steps:3/1:p0", "launch 3: the function ran 1 launches"),
    ("steps:0/1:p9", "0/1:p9: step 1 offered "),
    ("steps:0/1:d7", "0/1:d7: step 1 offered "),
    ("steps:0/100000:p1", "0/100000:p1: launch 0 ended after "),
  ],
)
def test_a_pick_the_run_does_not_offer_is_named(schedule, says):
  """A hand-written (or mistyped) schedule whose picks never happen would
  replay the default schedule silently: it is an error naming them."""
  with pytest.raises(
    ValueError, match="names picks the run did not offer"
  ) as e:
    mpmd.replay(two_meshes(), X, schedule=schedule)
  assert says in str(e.value)


@pytest.mark.parametrize(
  "schedule, error",
  [
    ("sometimes", ValueError),
    ("random:x", ValueError),
    ("pct0:1", ValueError),
    ("steps:0/1:q3", ValueError),
    (7, TypeError),
  ],
)
def test_bad_schedule_strings(schedule, error):
  with pytest.raises(error, match="schedule"):
    mpmd.replay(two_meshes(), X, schedule=schedule)


@pytest.mark.parametrize(
  "option, value, error",
  [
    ("schedules", 0, ValueError),  # (it checked nothing, and passed)
    ("schedules", -1, ValueError),
    ("schedules", 2.0, TypeError),
    ("depth", 0, ValueError),
    ("max_failures", 0, ValueError),
  ],
)
def test_explore_rejects_bad_counts(option, value, error):
  with pytest.raises(error, match=f"mpmd.explore: expected '{option}'"):
    mpmd.explore(two_meshes(), X, **{option: value})
  if option == "schedules":
    with pytest.raises(error, match=f"expected '{option}'"):
      mpmd.testing.assert_schedule_independent(two_meshes(), X, schedules=value)


def test_a_function_without_launches_has_nothing_to_check():
  def plain(x):
    return x + 1

  for check in (
    lambda: mpmd.explore(plain, X, schedules=2),
    lambda: mpmd.replay(plain, X, schedule="random:1"),
  ):
    with pytest.raises(ValueError, match="'plain' ran no mpmd_map launch"):
      check()


def test_a_launch_for_pallas_simulator_is_not_explored():
  f = _copy(interpret=pltpu.InterpretParams())
  with pytest.raises(
    ValueError,
    match=r"ran no mpmd_map launch on the checking executor, .*: its "
    r"launches run in the simulator their interpret= names "
    r"\(InterpretParams\); give them interpret=None to check them",
  ):
    mpmd.explore(f, X, schedules=2)


def test_explore_says_which_launches_it_did_not_explore():
  simulated, checked = _copy(interpret=pltpu.InterpretParams()), _copy()
  report = mpmd.explore(lambda x: checked(simulated(x)), X, schedules=2)
  assert report.ok and report.unchecked == ("InterpretParams",)
  assert "not explored: launches run in InterpretParams" in str(report)
  assert mpmd.explore(checked, X, schedules=2).unchecked == ()


def test_check_params_rejects_bad_values():
  with pytest.raises(TypeError, match="'schedule'"):
    mpmd.CheckParams(schedule=1.5)
  with pytest.raises(ValueError, match="unknown schedule"):
    mpmd.CheckParams(schedule="always")
  with pytest.raises(TypeError, match="'identical_writes_race'.*'no'"):
    mpmd.CheckParams(identical_writes_race="no")  # pyrefly: ignore


# -- timeline -----------------------------------------------------------------


def test_timeline_is_a_chrome_trace(tmp_path):
  path = tmp_path / "trace.json"
  mpmd.timeline(two_meshes(), X, path=str(path), schedule="random:2")
  trace = json.loads(path.read_text())
  events = trace["traceEvents"]
  names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
  assert names >= {
    "mesh 0 program {'consumer': 0}",
    "mesh 0 program {'consumer': 1}",
    "mesh 1 program {'producer': 0}",
    "DMAs",
  }
  spans = [e for e in events if e.get("ph") == "X"]
  assert all(e["dur"] > 0 and e["ts"] >= 0 for e in spans)
  assert {"compute", "dma_start", "signal", "wait"} <= {
    e.get("cat") if e.get("cat") != "program" else e["name"] for e in spans
  }
  # Each thread's spans are in order and do not overlap.
  by_thread = {}
  for e in spans:
    if e["tid"] != 3:  # DMAs overlap, as they do on hardware
      by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
  for thread in by_thread.values():
    for a, b in zip(thread, thread[1:], strict=False):
      assert a["ts"] + a["dur"] <= b["ts"]
  # Each signal -> wait arrow starts before it ends.
  starts = {e["id"]: e for e in events if e.get("ph") == "s"}
  ends = [e for e in events if e.get("ph") == "f"]
  # Per consumer a semaphore wait and two DMA waits; the producer two.
  assert len(ends) == CONSUMERS * 3 + 2
  for e in ends:
    assert starts[e["id"]]["ts"] <= e["ts"]


# -- shipped kernels: clean, and with bugs injected ---------------------------

D = 4


def _ring(kind, schedule="ring"):
  mesh = jax.make_mesh((D,), ("x",), devices=jax.devices()[:D])
  rng = np.random.default_rng(0)
  if kind == "ag":
    m, k, n = 8 * D, 128 * D, 128
    specs, out = (P(None, "x"), P()), P("x")

    def fn(a, b):
      return all_gather_matmul(a, b, axis_name="x", implementation=schedule)
  else:
    m, k, n = 8 * D, 128 * D, 128
    specs, out = (P(None, "x"), P("x")), P("x")

    def fn(a, b):
      return matmul_reduce_scatter(a, b, axis_name="x", implementation=schedule)

  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
  args = [
    jax.device_put(a, NamedSharding(mesh, s))
    for a, s in zip((lhs, rhs), specs, strict=True)
  ]

  def build():
    return jax.jit(
      jax.shard_map(
        fn, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False
      )
    )

  return build, args


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("schedule", ["ring", "direct"])
def test_shipped_collective_matmuls_are_clean(kind, schedule):
  build, args = _ring(kind, schedule)
  f = build()
  report = mpmd.explore(f, *args, schedules=6)
  assert report.failures == [], str(report)
  np.testing.assert_array_equal(
    mpmd.replay(f, *args, schedule="random:1"), f(*args)
  )


BUGS = [
  (kernel, primitive, k, how)
  for kernel in ("ag", "rs")
  for primitive, how, ks in [
    ("dma_wait", sync_bugs.DROP, (0, 1, 2)),
    ("semaphore_wait", sync_bugs.DROP, (0, 1)),
    ("semaphore_signal", sync_bugs.DROP, (0, 2)),
    ("semaphore_wait", sync_bugs.WEAKEN, (0,)),
    ("semaphore_signal", sync_bugs.TWICE, (1,)),
  ]
  for k in ks
] + [
  ("two_meshes", primitive, k, how)
  for primitive, how, ks in [
    ("dma_wait", sync_bugs.DROP, (0, 1)),
    ("semaphore_wait", sync_bugs.DROP, (0,)),
    ("semaphore_signal", sync_bugs.DROP, (0, 1)),
    ("semaphore_signal", sync_bugs.TWICE, (0,)),
  ]
  for k in ks
]


@pytest.mark.parametrize("kernel, primitive, k, how", BUGS)
def test_injected_bug_is_found_and_replays(kernel, primitive, k, how):
  if kernel == "two_meshes":
    build, args = two_meshes, (X,)
  else:
    build, args = _ring(kernel)
  sync_bugs.assert_found_and_replays(
    build, args, primitive, k, how, schedules=16
  )


def test_assert_schedule_independent():
  mpmd.testing.assert_schedule_independent(two_meshes(), X, schedules=4)
  with pytest.raises(AssertionError, match="depends on the schedule"):
    mpmd.testing.assert_schedule_independent(
      two_meshes(consumer=consume_without_wait), X, schedules=4
    )


# -- cheap checks on the fast path ---------------------------------------------


def _one_program(body, scratch):
  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=2), body)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=scratch,
    )
  )


def _own_rows(*refs):
  """Each core's half of the rows of each of ``refs`` (cores that write
  the same rows go to the checking executor, which tells same bytes)."""
  rows = pl.ds(jax.lax.axis_index("core") * (ROWS // 2), ROWS // 2)
  return [r.at[rows] for r in refs]


def test_fast_path_rejects_a_signal_nobody_waits_for():
  def signals(x_hbm, o_hbm, sem):
    pltpu.sync_copy(*_own_rows(x_hbm, o_hbm))
    pl.semaphore_signal(sem, 1)

  f = _one_program(signals, [pltpu.SemaphoreType.REGULAR(())])
  with pytest.raises(mpmd.LeftoverError, match="program 1 .core=1."):
    with mpmd.typed_errors():
      jax.block_until_ready(f(X))


def test_fast_path_rejects_a_dma_nobody_waits_for():
  def starts(x_hbm, o_hbm, sem):
    pltpu.make_async_copy(*_own_rows(x_hbm, o_hbm), sem).start()

  f = _one_program(starts, [pltpu.SemaphoreType.DMA(())])
  with pytest.raises(mpmd.LeftoverError, match="not back to zero"):
    with mpmd.typed_errors():
      jax.block_until_ready(f(X))
  # Waited for, the same copy is fine.

  def copies(x_hbm, o_hbm, sem):
    copy = pltpu.make_async_copy(*_own_rows(x_hbm, o_hbm), sem)
    copy.start()
    copy.wait()

  np.testing.assert_array_equal(
    _one_program(copies, [pltpu.SemaphoreType.DMA(())])(X), X
  )


def test_event_log_is_the_same_on_every_supported_jax(tmp_path):
  """The golden digests were taken on jax 0.10.2 and 0.12.0.1 (equal):
  a schedule names one run, whatever JAX runs it."""
  import hashlib
  from pathlib import Path

  root = str(Path(__file__).resolve().parents[2])
  digests = {}
  for schedule in ("random:11", "pct3:4:40"):
    path = tmp_path / "trace.json"
    mpmd.timeline(two_meshes(), X, path=str(path), schedule=schedule)
    text = path.read_text().replace(root, "<repo>")
    events = json.loads(text)["traceEvents"]
    blob = json.dumps(events, sort_keys=True).encode()
    digests[schedule] = hashlib.sha256(blob).hexdigest()[:16]
  assert digests == GOLDEN_DIGESTS


# The events name source lines: the kernels' in examples/producer_consumer.py
# and their buffers (a scope's by its function's parameters); moving them
# changes these digests, on every jax alike.
GOLDEN_DIGESTS = {
  "random:11": "84a4ee6199f7e0cd",
  "pct3:4:40": "0f7f88bc6e37ca75",
}


def test_unsupported_operation_is_named_not_reported_as_a_failure():
  def bitcasts(x_hbm, o_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)
    view = buf.bitcast(jnp.int32)
    view[...] = view[...] + 1
    pltpu.sync_copy(buf, o_hbm)

  f = jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=1), bitcasts)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.VMEM((ROWS, COLS), jnp.float32)],
    )
  )
  with pytest.raises(NotImplementedError, match="mpmd checker: .*transform"):
    mpmd.explore(f, X, schedules=2)


def test_fast_path_proves_a_race_between_programs_that_never_wait():
  """A loader and a consumer with no semaphore at all: on hardware they
  race, whichever is listed first (the fast path would run them one after
  another and get the numbers right, or all NaN)."""

  def load(x_hbm, o_hbm, staged):
    del o_hbm
    pltpu.sync_copy(x_hbm, staged)

  def use(x_hbm, o_hbm, staged):
    del x_hbm
    pltpu.sync_copy(staged, o_hbm)

  loader = mpmd.tensorcore_mesh("loader", num_cores=1)
  user = mpmd.tensorcore_mesh("user", num_cores=1)
  for order in ([(loader, load), (user, use)], [(user, use), (loader, load)]):
    f = jax.jit(
      mpmd.mpmd_map(
        order,
        jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
        scratch_types=[pltpu.HBM((ROWS, COLS), jnp.float32)],
      )
    )
    with pytest.raises(mpmd.RaceError, match="data race on 'staged'") as race:
      f(X)
    # Each access at its line (a sync_copy's DMA has none of its own).
    for line in ("pltpu.sync_copy(x_hbm, staged)", "sync_copy(staged, o_hbm)"):
      assert f"{__file__}:{_line_of(line)}:" in str(race.value), race.value


def test_fast_path_programs_on_their_own_parts_do_not_race():
  def each_row_block(x_hbm, o_hbm, staged):
    core = jax.lax.axis_index("core")
    rows = pl.ds(core * 4, 4)
    pltpu.sync_copy(x_hbm.at[rows], staged.at[rows])
    pltpu.sync_copy(staged.at[rows], o_hbm.at[rows])

  f = jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=2), each_row_block)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.HBM((ROWS, COLS), jnp.float32)],
    )
  )
  np.testing.assert_array_equal(f(X), X)


def _line_of(text: str) -> int:
  """The line of this file that holds ``text``."""
  with open(__file__) as source:
    return next(n for n, line in enumerate(source, 1) if text in line)


def _copy(interpret=None):
  """A one-program launch that copies its input."""

  def kernel(x_hbm, o_hbm):
    pltpu.sync_copy(x_hbm, o_hbm)

  return mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=1), kernel)],
    jax.ShapeDtypeStruct(X.shape, X.dtype),
    interpret=interpret,
  )
