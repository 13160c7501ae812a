"""Programs that spin on a semaphore (``semaphore_read`` in a ``while``
loop) never take the fast path: there a program whose semaphore nobody
signals looped forever inside XLA. The checking executor runs them: a
spin that another program ends runs to its result, one that nobody ends
is a ``DeadlockError`` after ``MAX_STEPS`` steps, not a hang."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mpmd
from mpmd._lowering.check import machine

ROWS, COLS = 8, 128
TWO_CORES = mpmd.tensorcore_mesh("core", num_cores=2)


def _spinning(signal: bool, debug: bool = False):
  """Core 1 spins until its flag is up, counting its reads; core 0 raises
  the flag (if ``signal``). Both copy their rows of ``x``."""

  def kernel(x_hbm, o_hbm, reads_hbm, flag, reads):
    core = lax.axis_index("core")
    reads[0] = 0

    @pl.when(core == 0)
    def _():
      if signal:
        pl.semaphore_signal(flag, 1, core_index=1)

    @pl.when(core == 1)
    def _():
      reads[0] = lax.while_loop(
        lambda n: pl.semaphore_read(flag) == 0, lambda n: n + 1, 1
      )
      pl.semaphore_wait(flag, 1)
      pltpu.sync_copy(reads, reads_hbm)

    rows = pl.ds(core * ROWS, ROWS)
    pltpu.sync_copy(x_hbm.at[rows], o_hbm.at[rows])

  return mpmd.mpmd_map(
    [(TWO_CORES, kernel)],
    (
      jax.ShapeDtypeStruct((2 * ROWS, COLS), jnp.float32),
      jax.ShapeDtypeStruct((1,), jnp.int32),
    ),
    scratch_types=[pltpu.SemaphoreType.REGULAR, pltpu.SMEM((1,), jnp.int32)],
    debug=debug,
  )


def _rows():
  return jnp.arange(2 * ROWS * COLS, dtype=jnp.float32).reshape(-1, COLS)


def test_a_spin_another_program_ends_runs(capsys):
  out, reads = jax.jit(_spinning(signal=True, debug=True))(_rows())
  np.testing.assert_array_equal(out, _rows())
  assert int(reads[0]) >= 1
  assert "check path: it reads a semaphore inside a while loop" in (
    capsys.readouterr().out
  )


def test_a_spin_nobody_ends_is_a_deadlock(monkeypatch):
  monkeypatch.setattr(machine, "MAX_STEPS", 5_000)  # (a million by default)
  with (
    pytest.raises(
      mpmd.DeadlockError,
      match=r"kernel kernel at .*: no progress in 5000 steps: programs "
      r"spinning on semaphore reads that never change\? .*\n  mesh 0 "
      r"program \{'core': 1\} reads 'flag' \(mesh 0 program \{'core': 1\}\) "
      r"\(semaphore_read at .*test_spins.py:\d+:\d+ .*\); it holds 0",
    ),
    mpmd.typed_errors(),
  ):
    jax.block_until_ready(jax.jit(_spinning(signal=False))(_rows()))
  out, _ = jax.jit(_spinning(signal=True))(_rows())  # and the next runs
  np.testing.assert_array_equal(out, _rows())
