"""The upstream GPU pipeline programs' shared pieces: upstream tests' usual
knobs, and how a case runs (simulated on CPU, race-checked, or cross-lowered
for CUDA). Imported by module name: pytest puts this directory on sys.path.
"""

import gpu_test_util as util
import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
import pytest

import mpmd
from mpmd.kernels import gpu

WG = "wg"
MEMORY_REGISTERS = 40


def ws(body, **kw):
  """``emit_pipeline_warp_specialized`` with upstream tests' usual knobs."""
  kw.setdefault("memory_registers", MEMORY_REGISTERS)
  kw.setdefault("wg_axis", WG)
  kw.setdefault("num_compute_wgs", 1)
  return gpu.emit_pipeline_warp_specialized(body, **kw)


def add_one(_, x, o):
  o[...] = x[...] + 1


def ws_mesh(num_compute_wgs=1, **kw):
  return plgpu.Mesh(num_threads=num_compute_wgs + 1, thread_name=WG, **kw)


def blocks_sum(x, block):
  """Sum of the (block)-shaped tiles of a 2D ``x``."""
  m, n = x.shape
  bm, bn = block
  return x.reshape(m // bm, bm, n // bn, bn).sum((0, 2))


class PipelineCases:
  """Base of the upstream pipeline programs; a backend mixin runs them."""

  interpret = None

  def launch(self, kernel, out_types, *args, mesh=None, scratch_types=()):
    """Runs ``kernel`` in one ``mpmd_map`` launch (None when lowering)."""
    raise NotImplementedError

  def check(self, out, expected, *, where=None, **tol):
    """Compares ``out`` with ``expected`` (where ``where`` holds)."""
    raise NotImplementedError

  def _call(self, kernel, out_types, mesh, scratch_types):
    return mpmd.mpmd_map(
      [(mesh or plgpu.Mesh(), kernel)],
      out_types,
      scratch_types=scratch_types,
      interpret=self.interpret,
    )


class Simulated:
  """Mosaic GPU simulator on CPU (``interpret=None``) vs plain jnp."""

  def launch(self, kernel, out_types, *args, mesh=None, scratch_types=()):
    return self._call(kernel, out_types, mesh, scratch_types)(*args)

  def check(self, out, expected, *, where=None, **tol):
    for o, e in zip(
      jax.tree.leaves(out), jax.tree.leaves(expected), strict=True
    ):
      assert o.shape == e.shape and o.dtype == e.dtype
      if where is not None:
        where = np.broadcast_to(where, o.shape)
        o, e = np.asarray(o)[where], np.asarray(e)[where]
      if tol:
        np.testing.assert_allclose(o, e, **tol)
      else:
        np.testing.assert_array_equal(o, e)


class RaceChecked(Simulated):
  """Runs a case with the simulator's race detector; fails on a race."""

  interpret = util.race_detecting_params()

  def launch(self, *args, **kwargs):
    out = super().launch(*args, **kwargs)
    assert not util.races_found()
    return out


class CudaLowered:
  """Cross-lowered for CUDA on this host: one Mosaic GPU call per launch."""

  interpret = False

  def launch(self, kernel, out_types, *args, mesh=None, scratch_types=()):
    call = self._call(kernel, out_types, mesh, scratch_types)
    text = util.cuda_lowering_text(call, *args)
    assert len(util.MOSAIC_GPU_CALL.findall(text)) == 1
    return None

  def check(self, out, expected, *, where=None, **tol):
    del expected, where, tol
    assert out is None  # Lowered, not run.


def backend_classes(cases, race_checked):
  """The test classes of ``cases`` (a :class:`PipelineCases` subclass):
  simulated, plus ``test_no_race`` rerunning the ``race_checked`` cases
  (``(method name, kwargs)`` pairs) under the race detector; and
  cross-lowered for CUDA. A module binds them to ``Test...`` names."""
  checked = type(f"{cases.__name__}RaceChecked", (RaceChecked, cases), {})

  class SimulatedCases(Simulated, cases):
    @pytest.mark.parametrize("case, kwargs", race_checked)
    def test_no_race(self, case, kwargs):
      getattr(checked(), case)(**kwargs)

  class CudaLoweredCases(CudaLowered, cases):
    pass

  return SimulatedCases, CudaLoweredCases
