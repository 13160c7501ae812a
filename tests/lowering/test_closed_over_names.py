"""Run-time errors of kernels that close over a traced offset name the
user's kernel and Refs on every CPU path (issue 36, item 8), not mpmd's
internal re-traces ("kernel body at primitives/mpmd_map.py", 'refs[4]',
'args[0]'), and the checking executor runs such kernels at all (it took
every operand for a Ref: AttributeError on the closed-over scalar)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mpmd

ROWS, COLS, WINDOW = 16, 128, 8
CORE = mpmd.tensorcore_mesh("core", num_cores=1)
OUT = jax.ShapeDtypeStruct((WINDOW, COLS), jnp.float32)
INTERNAL = ("mpmd_map.py", "api.py", "refs[", "args[", "kernel body at")


def _rows():
  return jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS)


def _out_of_bounds(f, *args, names):
  with pytest.raises(mpmd.OutOfBoundsError) as raised, mpmd.typed_errors():
    jax.block_until_ready(f(*args))
  message = str(raised.value)
  for name in names:
    assert name in message, (name, message)
  for internal in INTERNAL:
    assert internal not in message, (internal, message)


def _copy_from(start, interpret=None):
  def oob_copy(x_hbm, o_hbm):
    pltpu.sync_copy(x_hbm.at[pl.ds(start, WINDOW)], o_hbm)

  return mpmd.mpmd_map([(CORE, oob_copy)], OUT, interpret=interpret)


@pytest.mark.parametrize(
  "interpret", [None, mpmd.CheckParams()], ids=["fast", "checker"]
)
def test_a_closed_over_start(interpret):
  @jax.jit
  def f(x, start):
    return _copy_from(start, interpret)(x)

  _out_of_bounds(f, _rows(), 12, names=["oob_copy", "'x_hbm'"])
  np.testing.assert_array_equal(f(_rows(), 8), _rows()[8:])


def test_a_closed_over_start_into_a_ref_input():
  """A Ref input becomes an output of the discharged launch: it keeps its
  name there."""

  @jax.jit
  def f(x, start):
    return _copy_from(start)(jax.new_ref(x))

  _out_of_bounds(f, _rows(), 12, names=["oob_copy", "'x_hbm'"])
  np.testing.assert_array_equal(f(_rows(), 4), _rows()[4:12])


def test_a_view_with_a_traced_index():
  @jax.jit
  def f(x, i, start):
    return _copy_from(start)(jax.new_ref(x).at[i])

  xs = jnp.stack([_rows(), _rows() + 1])
  _out_of_bounds(f, xs, 1, 12, names=["oob_copy", "'x_hbm'"])
  np.testing.assert_array_equal(f(xs, 1, 8), _rows()[8:] + 1)


def test_the_checker_runs_a_closed_over_scalar_in_a_handshake(capsys):
  """Programs that wait on each other take the checking executor by
  default; one of them closes over a traced scalar."""
  mesh = mpmd.tensorcore_mesh("core", num_cores=2)

  @jax.jit
  def f(x, scale):
    def kernel(x_hbm, o_hbm, buf, sem):
      c = jax.lax.axis_index("core")

      @pl.when(c == 0)
      def _():
        pltpu.sync_copy(x_hbm, buf)
        buf[...] = buf[...] * scale
        pltpu.sync_copy(buf, o_hbm)
        pl.semaphore_signal(sem, 1, core_index=1)

      @pl.when(c == 1)
      def _():
        pl.semaphore_wait(sem, 1)

    return mpmd.mpmd_map(
      [(mesh, kernel)],
      jax.ShapeDtypeStruct((WINDOW, COLS), jnp.float32),
      scratch_types=[
        pltpu.VMEM((WINDOW, COLS), jnp.float32),
        pltpu.SemaphoreType.REGULAR(()),
      ],
      debug=True,
    )(x)

  x = _rows()[:WINDOW]
  np.testing.assert_array_equal(f(x, 3.0), np.asarray(x) * 3.0)
  assert "takes the check path" in capsys.readouterr().out


@pytest.mark.parametrize(
  "interpret", [None, mpmd.CheckParams()], ids=["fast", "checker"]
)
def test_refs_in_a_pytree_of_scratch_are_named_by_their_path(interpret):
  # Scratch given as a dict reaches the kernel as keyword arguments: an
  # error names the Ref by its path in them, not by its position among
  # the flattened operands.
  def oob_stage(x_hbm, o_hbm, *, stage, extra):
    pltpu.sync_copy(x_hbm.at[pl.ds(0, WINDOW)], stage["rows"])
    pltpu.sync_copy(stage["rows"].at[pl.ds(4, WINDOW)], o_hbm)
    del extra

  f = mpmd.mpmd_map(
    [(CORE, oob_stage)],
    OUT,
    scratch_types=dict(
      stage=dict(rows=pltpu.VMEM((WINDOW, COLS), jnp.float32)),
      extra=pltpu.VMEM((WINDOW, COLS), jnp.float32),
    ),
    interpret=interpret,
  )
  _out_of_bounds(jax.jit(f), _rows(), names=["oob_stage", "stage['rows']"])
