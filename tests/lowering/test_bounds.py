"""DMA windows past their buffers fail on the CPU paths, as on hardware.

Pallas' discharge rules slice with ``lax.dynamic_slice``, which clamps: a
DMA of rows [12, 20) of a 16-row buffer used to copy rows [8, 16). A window
fixed in the kernel now fails when the kernel is traced, for TPU meshes,
whatever the platform the launch is then lowered for, one the kernel
computes when the launch runs; both with an ``mpmd.OutOfBoundsError`` (at
trace time also a ``ValueError``, as JAX's own indexing check is), and
both name the kernel, the Ref, the window and the shape, on the fast path
(local DMAs: ``sync_copy``, ``make_async_copy``) and on the lockstep path
(remote DMAs), for sources and destinations. The next launch still works.

Also here: the fast path's semaphores (int32 byte counts, as on the
lockstep path) and waits on ``pl.run_scoped`` semaphores that come before
their signal, which would block forever on hardware.
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rings
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd

ROWS, COLS, WINDOW = 16, 128, 8
NAME = "oob_copy"
CORE = mpmd.tensorcore_mesh("core", num_cores=1)
NUM_DEVICES = 2

# Starts past either end: each window [start, start + 8) leaves 16 rows.
DYNAMIC_STARTS = [12, 100, -4]


def _static_start(start: int):
  # Python ints past the end already fail in JAX's own indexing, where
  # ``.at`` is written (JAX_REJECTS); a concrete jnp scalar and a negative
  # int do not.
  return start if start < 0 else jnp.int32(start)


STATIC_STARTS = [(-4, "-4:4"), (12, "12:20"), (100, "100:108")]


def _window(start: int) -> str:
  return f".at[{start}:{start + WINDOW}, 0:{COLS}]"


def _copy(kind: str, src, dst, sem) -> None:
  if kind == "sync_copy":
    pltpu.sync_copy(src, dst)
  else:
    copy = pltpu.make_async_copy(src, dst, sem)
    copy.start()
    copy.wait()


def _windows(side: str, start, x_hbm, o_hbm):
  """The (source, destination) of a copy of 8 rows, ``side`` at ``start``."""
  if side == "source":
    return x_hbm.at[pl.ds(start, WINDOW)], o_hbm.at[pl.ds(0, WINDOW)]
  return x_hbm.at[pl.ds(0, WINDOW)], o_hbm.at[pl.ds(start, WINDOW)]


def _ref(side: str) -> str:
  if side == "source":
    return f"'x_hbm' (input 1, f32[{ROWS},{COLS}])"
  return f"'o_hbm' (output 0, f32[{ROWS},{COLS}])"


def _rows():
  return jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)


# -- the fast path ------------------------------------------------------------


@functools.cache
def _fast(kind: str, side: str, static_start=None):
  """A launch copying 8 rows with its ``side`` at a start read from the
  first operand (or ``static_start``, fixed in the kernel)."""

  def oob_copy(start_hbm, x_hbm, o_hbm, start_smem, sem):
    pltpu.sync_copy(start_hbm, start_smem)
    start = (
      start_smem[0] if static_start is None else _static_start(static_start)
    )
    src, dst = _windows(side, start, x_hbm, o_hbm)
    _copy(kind, src, dst, sem)

  return jax.jit(
    mpmd.mpmd_map(
      [(CORE, oob_copy)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SemaphoreType.DMA(()),
      ],
      name=NAME,
    )
  )


def _start(value: int):
  return jnp.array([value], jnp.int32)


@contextlib.contextmanager
def _fails_at_run_time(*parts: str):
  with pytest.raises(mpmd.OutOfBoundsError) as info, mpmd.typed_errors():
    yield
  error = info.value
  for part in parts:
    assert part in str(error), (part, str(error))


def _assert_names_the_window(error, side: str, window: str) -> None:
  """``error``, raised when the launch was traced, names the kernel, the
  DMA's ``side`` window (its rows ``window``) and that side's ref."""
  message = str(error)
  for part in (
    f"kernel {NAME} at ",
    f"a DMA's {side} window .at[{window}, 0:{COLS}]",
    f"out of bounds of {_ref(side)}",
  ):
    assert part in message, (part, message)
  # The DMA's line (the kernel's, or the ring helper's), not the kernel's def.
  assert re.search(r"\(at .*/tests/.*\.py:\d+:\d+ \(\w+\);", message), message


def _still_healthy(run_good) -> None:
  """The process works on: the same launch in bounds, and unrelated code
  with an ordered callback."""
  run_good()
  g = jax.jit(
    lambda x: (io_callback(lambda v: None, None, x, ordered=True), x + 1)[1]
  )
  np.testing.assert_array_equal(g(jnp.ones(3)), np.full(3, 2.0))
  jax.effects_barrier()  # no error left behind


FAST_CASES = [
  (kind, side)
  for kind in ("sync_copy", "async_copy")
  for side in ("source", "destination")
]


@pytest.mark.parametrize("start", DYNAMIC_STARTS)
@pytest.mark.parametrize("kind, side", FAST_CASES)
def test_fast_path_dynamic_window_fails_at_run_time(kind, side, start):
  f = _fast(kind, side)
  with _fails_at_run_time(
    f"kernel {NAME} at ",
    "mesh 0 program 0 (core=0)",
    f"a DMA's {side} window {_window(start)}",
    f"out of bounds of {_ref(side)}",
  ):
    jax.block_until_ready(f(_start(start), _rows()))

  def good():
    out = f(_start(0), _rows())
    np.testing.assert_array_equal(out[:WINDOW], _rows()[:WINDOW])

  _still_healthy(good)


@pytest.mark.parametrize("start, window", STATIC_STARTS)
@pytest.mark.parametrize("kind, side", FAST_CASES)
def test_fast_path_static_window_fails_when_traced(kind, side, start, window):
  f = _fast(kind, side, start)
  with pytest.raises(mpmd.OutOfBoundsError) as info:
    f.trace(_start(0), _rows())
  assert isinstance(info.value, ValueError)
  _assert_names_the_window(info.value, side, window)


# Windows that JAX's own indexing rejects where ``.at[...]`` is written:
# (the indexer, the window as reported, JAX's words).
JAX_REJECTS = {
  "rows": (lambda x: x.at[pl.ds(12, WINDOW)], "12:20, 0:128", "start=12"),
  "past the end": (lambda x: x.at[pl.ds(ROWS, 1)], "16:17, 0:128", "start=16"),
  "columns": (lambda x: x.at[:, pl.ds(64, COLS)], "0:16, 64:192", "size=128"),
  "ellipsis": (lambda x: x.at[..., pl.ds(COLS, 8)], "0:16, 128:136", "=128"),
  "python slice": (lambda x: x.at[ROWS : ROWS + 8], "16:24, 0:128", "=16"),
}


@pytest.mark.parametrize("case", list(JAX_REJECTS))
def test_windows_jax_rejects_name_the_kernel_and_ref(case):
  """Python ints past the end fail in JAX's indexing, as the kernel is
  traced: the same typed error, naming the kernel and the Ref (JAX's
  ValueError named neither)."""
  index, window, jax_words = JAX_REJECTS[case]

  def oob_copy(x_hbm, o_hbm):
    pltpu.sync_copy(index(x_hbm), o_hbm.at[0])

  f = mpmd.mpmd_map(
    [(CORE, oob_copy)], jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)
  )
  with pytest.raises(mpmd.OutOfBoundsError) as info:
    jax.jit(f).trace(_rows())
  assert isinstance(info.value, ValueError)  # as JAX's own error is
  message = str(info.value)
  for part in (
    "kernel oob_copy at ",
    f"the window .at[{window}] is out of bounds of "
    f"'x_hbm' (input 0, f32[{ROWS},{COLS}])",
    jax_words,
  ):
    assert part in message, (part, message)
  # The line that wrote the window, not only the kernel's def.
  assert re.search(r"\(at .*test_bounds.py:\d+; hardware would fault", message)


def test_a_view_out_of_bounds_names_its_ref_and_the_view():
  def oob_copy(x_hbm, o_hbm):
    pltpu.sync_copy(x_hbm.at[pl.ds(8, WINDOW)].at[pl.ds(4, WINDOW)], o_hbm)

  f = mpmd.mpmd_map(
    [(CORE, oob_copy)], jax.ShapeDtypeStruct((WINDOW, COLS), jnp.float32)
  )
  with pytest.raises(
    mpmd.OutOfBoundsError,
    match=r"the window \.at\[4:12, 0:128\] is out of bounds of 'x_hbm' "
    r"\(input 0, f32\[16,128\]\), in its view of shape \(8, 128\)",
  ):
    jax.jit(f).trace(_rows())


def test_other_indexing_errors_stay_jax_s():
  """Not a window out of bounds: JAX's ValueError, as it wrote it."""

  def bad(x_hbm, o_hbm):
    pltpu.sync_copy(x_hbm.at[0, 0, 0], o_hbm)

  f = mpmd.mpmd_map([(CORE, bad)], jax.ShapeDtypeStruct((), jnp.float32))
  with pytest.raises(ValueError) as info:
    jax.jit(f).trace(_rows())
  assert not isinstance(info.value, mpmd.OutOfBoundsError)


def test_a_closed_over_traced_start_names_the_kernel_and_its_refs():
  """The start is a traced value of the caller the kernel closes over: the
  run-time error names the user's kernel and Refs (on jax 0.10.2 it named
  mpmd's internal re-trace, ``body`` and ``'args[0]'``)."""

  @jax.jit
  def f(x, start):
    def oob_copy(x_hbm, o_hbm):
      pltpu.sync_copy(x_hbm.at[pl.ds(start, WINDOW)], o_hbm)

    return mpmd.mpmd_map(
      [(CORE, oob_copy)], jax.ShapeDtypeStruct((WINDOW, COLS), jnp.float32)
    )(x)

  with _fails_at_run_time(
    f"kernel oob_copy at {__file__}",
    f"a DMA's source window .at[12:20, 0:{COLS}] is out of bounds of "
    f"'x_hbm' (input 0, f32[{ROWS},{COLS}])",
  ):
    jax.block_until_ready(f(_rows(), 12))
  np.testing.assert_array_equal(f(_rows(), 8), _rows()[8:])


def test_in_bounds_windows_copy_exactly():
  """The last window that fits, on both sides: no false alarm."""
  for side in ("source", "destination"):
    out = _fast("async_copy", side)(_start(ROWS - WINDOW), _rows())
    got = out[:WINDOW] if side == "source" else out[ROWS - WINDOW :]
    want = _rows()[ROWS - WINDOW :] if side == "source" else _rows()[:WINDOW]
    np.testing.assert_array_equal(got, want)


def _indexed(index):
  """A launch copying the window ``index(x_hbm, start)`` (``start`` read at
  run time) into ``o_hbm``'s first rows."""

  def oob_copy(start_hbm, x_hbm, o_hbm, start_smem, sem):
    pltpu.sync_copy(start_hbm, start_smem)
    src = index(x_hbm, start_smem[0])
    rows = src.shape[0] if len(src.shape) == 2 else None
    dst = o_hbm.at[0] if rows is None else o_hbm.at[pl.ds(0, rows)]
    _copy("async_copy", src, dst, sem)

  return mpmd.mpmd_map(
    [(CORE, oob_copy)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[pltpu.SMEM((1,), jnp.int32), pltpu.SemaphoreType.DMA(())],
    name=NAME,
  )


INDEXERS = {
  # A window of a window: rows 4 + [6, 10) lie in the buffer, not in the
  # 8-row view the second .at[] indexes.
  "chain": (
    lambda x, i: x.at[pl.ds(4, WINDOW)].at[pl.ds(i, 4)],
    6,
    f".at[4:12, 0:{COLS}].at[6:10, 0:{COLS}]",
    "(its successive .at[] index shapes (16, 128), (8, 128))",
  ),
  "integer": (lambda x, i: x.at[i], ROWS, f".at[{ROWS}, 0:{COLS}]", ""),
  # Not wrapped around as in NumPy: Mosaic takes the index as an offset.
  "negative integer": (lambda x, i: x.at[i], -1, f".at[-1, 0:{COLS}]", ""),
  "columns": (
    lambda x, i: x.at[pl.ds(0, 4), pl.ds(i, COLS)],
    1,
    f".at[0:4, 1:{COLS + 1}]",
    "",
  ),
}


@pytest.mark.parametrize("case", list(INDEXERS))
def test_indexers_and_chains_dynamic(case):
  index, start, window, shapes = INDEXERS[case]
  with _fails_at_run_time(f"window {window}", shapes):
    jax.block_until_ready(_indexed(index)(_start(start), _rows()))


@pytest.mark.parametrize("case", list(INDEXERS))
def test_indexers_and_chains_static(case):
  index, start, window, shapes = INDEXERS[case]

  def at_literal(x, _):
    # Python ints as integer indices; as slice starts JAX rejects them
    # itself (without naming the kernel), so those are jnp scalars made in
    # the kernel (literals too).
    return index(x, start if "integer" in case else jnp.int32(start))

  with pytest.raises(ValueError, match=r"window .*out of bounds") as info:
    jax.eval_shape(_indexed(at_literal), _start(0), _rows())
  assert f"window {window}" in str(info.value)
  assert shapes in str(info.value)


def test_only_the_program_that_runs_a_window_checks_it():
  """Program 1 of 2 would copy row 2 of 2, under a condition that stops it:
  what never runs never fails (as on hardware)."""

  def kernel(x_hbm, o_hbm, sem):
    core = jax.lax.axis_index("core")

    @pl.when(core < 1)
    def _():
      _copy("async_copy", x_hbm.at[core + 1], o_hbm.at[core], sem)

  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=2), kernel)],
    jax.ShapeDtypeStruct((2, COLS), jnp.float32),
    scratch_types=[pltpu.SemaphoreType.DMA(())],
  )
  x = _rows()[:2]
  np.testing.assert_array_equal(f(x)[0], x[1])


def _tiled(num_tiles: int, loop: str):
  """Each of 2 cores copies its 8 rows tile by tile (4 rows) in a loop of
  ``num_tiles`` steps, of which 2 fit."""
  tile = WINDOW // 2

  def kernel(x_hbm, o_hbm, buf):
    core = jax.lax.axis_index("core")

    def step(t):
      rows = pl.ds(core * WINDOW + t * tile, tile)
      pltpu.sync_copy(x_hbm.at[rows], buf)
      pltpu.sync_copy(buf, o_hbm.at[rows])

    if loop == "pl.loop":
      pl.loop(0, num_tiles)(step)
    else:

      def body(t):
        step(t)
        return t + 1

      jax.lax.while_loop(lambda t: t < num_tiles, body, 0)

  return jax.jit(
    mpmd.mpmd_map(
      [(mpmd.tensorcore_mesh("core", num_cores=2), kernel)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.VMEM((tile, COLS), jnp.float32)],
      name=NAME,
    )
  )


@pytest.mark.parametrize("loop", ["pl.loop", "while_loop"])
def test_windows_proven_in_bounds_cost_no_callback(loop):
  """Windows of loop counters and core indices that an interval analysis
  proves in bounds, and sync_copy's waits, are not checked at run time: the
  launch keeps jax's fast dispatch (no host callback)."""
  f = _tiled(2, loop)
  assert "callback" not in f.lower(_rows()).as_text()
  np.testing.assert_array_equal(f(_rows()), _rows())


@pytest.mark.parametrize("loop", ["pl.loop", "while_loop"])
def test_a_loop_one_step_too_long_fails_at_run_time(loop):
  """The third step of core 1 reads rows [16, 20): the analysis proves
  nothing, the run-time check finds it."""
  with _fails_at_run_time(
    "mesh 0 program 1 (core=1)",
    f"a DMA's source window .at[16:20, 0:{COLS}]",
  ):
    jax.block_until_ready(_tiled(3, loop)(_rows()))


# A Ref read or written in place at an index known at run time only: JAX's
# dynamic_slice / dynamic_update_slice would clamp it onto the last rows.
ACCESSES = {
  "smem store": (
    lambda s, v, i: s.__setitem__(i, 99),
    "a store's window .at[4]",
  ),
  "smem load": (
    lambda s, v, i: s.__setitem__(0, s[i]),
    "a load's window .at[4]",
  ),
  "vmem rows": (
    lambda s, v, i: v.__setitem__(
      (pl.ds(i * 8, 8), slice(None)), jnp.ones((8, COLS), jnp.float32)
    ),
    "a store's window .at[32:40, 0:128]",
  ),
}


@pytest.mark.parametrize("case", list(ACCESSES))
def test_fast_path_in_place_access_past_a_ref_fails_at_run_time(case):
  access, window = ACCESSES[case]

  def kernel(i_hbm, o_hbm, i_smem, s, v):
    pltpu.sync_copy(i_hbm, i_smem)
    s[...] = jnp.zeros((4,), jnp.int32)
    v[...] = jnp.zeros((32, COLS), jnp.float32)
    access(s, v, i_smem[0])
    pltpu.sync_copy(s, o_hbm)

  f = jax.jit(
    mpmd.mpmd_map(
      [(CORE, kernel)],
      jax.ShapeDtypeStruct((4,), jnp.int32),
      scratch_types=[
        pltpu.SMEM((1,), jnp.int32),
        pltpu.SMEM((4,), jnp.int32),
        pltpu.VMEM((32, COLS), jnp.float32),
      ],
    )
  )
  ref = "'s' (scratch 1, i32[4])" if "smem" in case else "'v' (scratch 2"
  with _fails_at_run_time(window, f"out of bounds of {ref}", "test_bounds.py"):
    jax.block_until_ready(f(jnp.array([4], jnp.int32)))
  # In bounds, the same launch runs.
  assert f(jnp.array([3], jnp.int32)).shape == (4,)


def test_in_place_accesses_proven_in_bounds_cost_no_callback():
  def kernel(x_hbm, o_hbm, v):
    pltpu.sync_copy(x_hbm, v)

    @pl.loop(0, ROWS // 8)
    def _(t):
      rows = pl.ds(t * 8, 8)
      v[rows, :] = v[rows, :] + 1.0

    pltpu.sync_copy(v, o_hbm)

  f = jax.jit(
    mpmd.mpmd_map(
      [(CORE, kernel)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.VMEM((ROWS, COLS), jnp.float32)],
    )
  )
  assert "callback" not in f.lower(_rows()).as_text()
  np.testing.assert_array_equal(f(_rows()), _rows() + 1.0)


# -- the lockstep path --------------------------------------------------------


@functools.cache
def _lockstep(side: str, static_start=None, debug=False):
  """Each of 2 devices sends 8 rows to the next; ``side``'s window starts at
  the first operand's value (or at ``static_start``)."""
  num = NUM_DEVICES

  def oob_copy(start_hbm, x_hbm, o_hbm, start_smem, send, recv):
    pltpu.sync_copy(start_hbm, start_smem)
    start = (
      start_smem[0] if static_start is None else _static_start(static_start)
    )
    src, dst = _windows(side, start, x_hbm, o_hbm)
    rings.copy_to_right(src, dst, send, recv, num).wait()

  def per_device(start, x):
    return mpmd.mpmd_map(
      [(CORE, oob_copy)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.SMEM((1,), jnp.int32)]
      + [pltpu.SemaphoreType.DMA(())] * 2,
      name=NAME,
      debug=debug,
    )(start, x)

  mesh = jax.make_mesh((num,), ("x",), devices=jax.devices()[:num])
  return mesh, jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(P(), P("x")),
      out_specs=P("x"),
      check_vma=False,
    )
  )


def _sharded_rows(mesh):
  x = jnp.arange(NUM_DEVICES * ROWS * COLS, dtype=jnp.float32)
  return jax.device_put(
    x.reshape(NUM_DEVICES * ROWS, COLS), NamedSharding(mesh, P("x"))
  )


@pytest.mark.parametrize("start", DYNAMIC_STARTS)
@pytest.mark.parametrize("side", ["source", "destination"])
def test_lockstep_remote_dma_dynamic_window_fails_at_run_time(side, start):
  mesh, f = _lockstep(side)
  x = _sharded_rows(mesh)
  with _fails_at_run_time(
    f"kernel {NAME} at ",
    "device (x=0)",
    f"a DMA's {side} window {_window(start)}",
    f"out of bounds of {_ref(side)}",
    f"(at {rings.__file__}:",  # the line of the DMA: a helper's
  ):
    jax.block_until_ready(f(_start(start), x))
  _still_healthy(functools.partial(_lockstep_in_bounds, side))


def test_a_failed_first_call_leaves_no_error_behind():
  """A computation's first call takes JAX's Python dispatch, which keeps
  every device's runtime token for ``effects_barrier`` (and exit), on
  every supported jax: a launch's failure report, which declares no
  effect, must end with its call there too, without ``typed_errors``."""
  # The launch that runs after it has run before (a first call would
  # replace the tokens), the failing one is a new jit.
  _lockstep_in_bounds("source")
  mesh, f = _lockstep.__wrapped__("source")
  with pytest.raises(jax.errors.JaxRuntimeError, match="out of bounds"):
    jax.block_until_ready(f(_start(12), _sharded_rows(mesh)))
  _still_healthy(functools.partial(_lockstep_in_bounds, "source"))


def _lockstep_in_bounds(side: str) -> None:
  mesh, f = _lockstep(side)
  x = _sharded_rows(mesh)
  out = np.asarray(f(_start(0), x)).reshape(NUM_DEVICES, ROWS, COLS)
  blocks = np.asarray(x).reshape(NUM_DEVICES, ROWS, COLS)
  np.testing.assert_array_equal(
    out[:, :WINDOW], np.roll(blocks, 1, axis=0)[:, :WINDOW]
  )


def test_remote_dmas_take_the_lockstep_path(capsys):
  mesh, f = _lockstep.__wrapped__("source", debug=True)
  f(_start(0), _sharded_rows(mesh))
  assert "lockstep path" in capsys.readouterr().out


@pytest.mark.parametrize("start, window", STATIC_STARTS)
@pytest.mark.parametrize("side", ["source", "destination"])
def test_lockstep_remote_dma_static_window_fails_when_traced(
  side, start, window
):
  mesh, f = _lockstep(side, start)
  with pytest.raises(ValueError) as info:
    f.trace(_start(0), _sharded_rows(mesh))
  _assert_names_the_window(info.value, side, window)


def _copies_row(row: int, **kw):
  return mpmd.mpmd_map(
    [(CORE, lambda x_hbm, o_hbm: pltpu.sync_copy(x_hbm.at[row], o_hbm))],
    jax.ShapeDtypeStruct((COLS,), jnp.float32),
    name=NAME,
    **kw,
  )


def test_static_windows_fail_on_the_simulator_path_too():
  """The check at trace time, before a path is chosen, covers the
  simulator as well."""
  f = _copies_row(ROWS, interpret=pltpu.InterpretParams())
  with pytest.raises(ValueError, match=rf"window \.at\[{ROWS}, 0:{COLS}\]"):
    jax.jit(f).trace(_rows())


def test_static_windows_fail_when_lowering_for_tpu_only():
  """A launch lowered for a TPU only (no CPU lowering at all) fails too,
  before Mosaic sees it: the window is the kernel's, whatever the target."""
  with pytest.raises(ValueError, match=rf"window \.at\[{ROWS}, 0:{COLS}\]"):
    jax.jit(_copies_row(ROWS)).trace(_rows()).lower(lowering_platforms=("tpu",))
  # The last row is in bounds, and lowers for a TPU.
  text = (
    jax.jit(_copies_row(ROWS - 1))
    .trace(_rows())
    .lower(lowering_platforms=("tpu",))
    .as_text()
  )
  assert "tpu_custom_call" in text


# -- semaphores ---------------------------------------------------------------


def test_fast_path_semaphores_count_int32_bytes():
  """Two 64 KiB DMAs pending on one semaphore: 131072 bytes, past int16
  (Pallas' discharge rules counted int16 elements), and no false deadlock."""
  rows = 128

  def kernel(x_hbm, o_hbm, count_hbm, sem, count_smem):
    copies = [
      pltpu.make_async_copy(
        x_hbm.at[pl.ds(i * rows, rows)], o_hbm.at[pl.ds(i * rows, rows)], sem
      )
      for i in range(2)
    ]
    for copy in copies:
      copy.start()
    count_smem[0] = pl.semaphore_read(sem)
    for copy in copies:
      copy.wait()
    pltpu.sync_copy(count_smem, count_hbm)

  x = jnp.arange(2 * rows * COLS, dtype=jnp.float32).reshape(2 * rows, COLS)
  out, count = mpmd.mpmd_map(
    [(CORE, kernel)],
    (
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      jax.ShapeDtypeStruct((1,), jnp.int32),
    ),
    scratch_types=[pltpu.SemaphoreType.DMA(()), pltpu.SMEM((1,), jnp.int32)],
    debug=True,
  )(x)
  np.testing.assert_array_equal(out, x)
  assert int(count[0]) == 2 * x.nbytes // 2


def _scoped_wait_before_signal(kind: str):
  """A pl.run_scoped semaphore waited on before its own signal (DMA start)
  in program order: on hardware the wait never returns."""

  def kernel(x_hbm, o_hbm):
    def scoped(sem):
      if kind == "regular":
        pl.semaphore_wait(sem, 1)
        pl.semaphore_signal(sem, 1)
      else:  # each core its own rows (no two programs write the same)
        rows = pl.ds(jax.lax.axis_index("core") * WINDOW, WINDOW)
        copy = pltpu.make_async_copy(x_hbm.at[rows], o_hbm.at[rows], sem)
        copy.wait()
        copy.start()

    sem = (
      pltpu.SemaphoreType.REGULAR
      if kind == "regular"
      else (pltpu.SemaphoreType.DMA)
    )
    pl.run_scoped(scoped, sem(()))

  return kernel


def _assert_deadlock(f, x, capsys, path: str, who: str) -> None:
  """``f(x)`` ends with a DeadlockError on ``path`` naming ``who`` and the
  early wait of kernel ``early_wait``."""
  with pytest.raises(mpmd.DeadlockError) as info, mpmd.typed_errors():
    jax.block_until_ready(f(x))
  assert path in capsys.readouterr().out
  message = str(info.value)
  for part in (
    f"mpmd_map deadlock: on the CPU {path}",
    "kernel early_wait at ",
    who,
    "waited on pl.run_scoped's 'sem'",
  ):
    assert part in message, (part, message)


@pytest.mark.parametrize("kind", ["regular", "dma"])
def test_fast_path_scoped_wait_before_its_signal_is_a_deadlock(kind, capsys):
  mesh = mpmd.tensorcore_mesh("core", num_cores=2)
  f = mpmd.mpmd_map(
    [(mesh, _scoped_wait_before_signal(kind))],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    name="early_wait",
    debug=True,
  )
  _assert_deadlock(
    f,
    _rows(),
    capsys,
    "fast path",
    "mesh 0 program 0 (core=0)",
  )
  _still_healthy(test_fast_path_scoped_signal_then_wait_runs)


def test_fast_path_wait_before_signal_on_a_kernel_semaphore():
  """The count is back at zero by the end, yet the wait came first: the
  semaphore stays poisoned (Pallas' discharge let the count go negative and
  recover)."""

  def kernel(x_hbm, o_hbm, sem):
    del x_hbm, o_hbm
    pl.semaphore_wait(sem, 1)
    pl.semaphore_signal(sem, 1)

  f = mpmd.mpmd_map(
    [(mpmd.tensorcore_mesh("core", num_cores=2), kernel)],
    jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
    scratch_types=[pltpu.SemaphoreType.REGULAR(())],
  )
  with (
    pytest.raises(mpmd.DeadlockError, match="fast path") as info,
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(f(_rows()))
  message = str(info.value)
  for program in ("mesh 0 program 0 (core=0)", "mesh 0 program 1 (core=1)"):
    # Each program, the semaphore it waits on and the kernel.
    assert f"\n  {program}: 'sem' (scratch 0, " in message, message
  assert "in kernel kernel at " in message, message


def test_fast_path_scoped_signal_then_wait_runs():
  def kernel(x_hbm, o_hbm):
    def scoped(sem):
      pl.semaphore_signal(sem, 2)
      pl.semaphore_wait(sem, 2)
      pltpu.sync_copy(x_hbm, o_hbm)

    pl.run_scoped(scoped, pltpu.SemaphoreType.REGULAR(()))

  f = mpmd.mpmd_map(
    [(CORE, kernel)], jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)
  )
  np.testing.assert_array_equal(f(_rows()), _rows())


def test_lockstep_scoped_wait_before_its_signal_is_a_deadlock(capsys):
  num = NUM_DEVICES

  def kernel(x_hbm, o_hbm, send, recv):
    rings.copy_to_right(x_hbm, o_hbm, send, recv, num).wait()
    _scoped_wait_before_signal("regular")(x_hbm, o_hbm)

  def per_device(x):
    return mpmd.mpmd_map(
      [(CORE, kernel)],
      jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[pltpu.SemaphoreType.DMA(())] * 2,
      name="early_wait",
      debug=True,
    )(x)

  mesh = jax.make_mesh((num,), ("x",), devices=jax.devices()[:num])
  f = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
    )
  )
  _assert_deadlock(
    f, _sharded_rows(mesh), capsys, "lockstep path", "device (x=0)"
  )
  _still_healthy(functools.partial(_lockstep_in_bounds, "source"))


@pytest.mark.parametrize("kind", ["dma", "regular"])
def test_fast_path_scoped_semaphore_left_counting_is_a_leftover(kind):
  """A pl.run_scoped semaphore that ends its scope counting (a DMA nobody
  waited for, a signal nobody took): on hardware a DMA may land in memory
  the next scope reuses."""

  def kernel(x_hbm, o_hbm):
    def scoped(buf, sem):
      if kind == "dma":
        pltpu.make_async_copy(x_hbm, buf, sem).start()  # never waited
      else:
        pl.semaphore_signal(sem, 2)  # never taken

    semaphore = (
      pltpu.SemaphoreType.DMA if kind == "dma" else pltpu.SemaphoreType.REGULAR
    )
    pl.run_scoped(scoped, pltpu.VMEM((ROWS, COLS), jnp.float32), semaphore)
    pltpu.sync_copy(x_hbm, o_hbm)

  f = jax.jit(
    mpmd.mpmd_map(
      [(CORE, kernel)], jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)
    )
  )
  count = ROWS * COLS * 4 if kind == "dma" else 2
  with (
    pytest.raises(
      mpmd.LeftoverError,
      match=r"mpmd_map leftover: on the CPU fast path .* pl.run_scoped's 'sem' "
      r"\(at .*test_bounds.py:\d+:\d+ \(\S*kernel\)\), a "
      rf"semaphore, ends its scope at {count} ",
    ),
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(f(_rows()))
