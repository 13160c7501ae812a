"""The context a kernel of one mesh is traced in, among its launch's meshes.

Here (not in the primitive's module) so that lowering modules that retrace
kernels need not import the primitive, which imports them.
"""

import contextlib
from collections.abc import Sequence

from mpmd import _jax, targets
from mpmd._jax import core, pallas_core


def axis_env(meshes: Sequence[pallas_core.Mesh]) -> dict[core.AxisName, int]:
  """The axis names and sizes of all meshes (validated to agree upstream)."""
  env = {}
  for mesh in meshes:
    env.update(mesh.shape)
  return env


@contextlib.contextmanager
def tracing_context(mesh: pallas_core.Mesh, meshes: Sequence[pallas_core.Mesh]):
  """The context in which a kernel of ``mesh`` is (re)traced.

  Every mesh's axes are bound, so that a kernel can name the programs of
  other meshes (``device_id={"consumer": 1}``). Pallas' TPU queries answer
  for the TPU target off-TPU (``emit_pipeline`` asks them).
  """
  with (
    mesh.tracing_context(),
    core.extend_axis_env_nd(axis_env(meshes).items()),
    _jax.no_vma_check(),
    targets.answering(),
  ):
    yield
