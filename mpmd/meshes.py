"""Mesh constructors that mean the same on every supported jax version."""

import numpy as np

from mpmd import _jax, targets
from mpmd.types import Mesh


class _Devices(np.ndarray):
  """A mesh's device array that compares whole, as a bool.

  jax 0.10.2's ``TensorCoreMesh`` is a dataclass over a numpy array of cores,
  so two meshes of two cores or more compare with an ambiguous array truth
  value (a ``ValueError``). JAX's abstract-eval cache compares Ref types
  whose memory space is ``VMEM @ mesh`` when their hashes nearly collide, so
  a kernel over two such meshes failed at random. jax 0.11 made the mesh a
  dataclass of ``(axis_name, num_cores)`` (drop with jax 0.10).
  """

  def __eq__(self, other):
    return np.array_equal(self, other)

  def __ne__(self, other):
    return not np.array_equal(self, other)


def tensorcore_mesh(axis_name: str, num_cores: int | None = None) -> Mesh:
  """A Pallas mesh of TPU TensorCores, one program per core.

  The same mesh as ``pltpu.TensorCoreMesh(axis_name=..., num_cores=...)``
  (jax 0.11+) or ``pltpu.create_tensorcore_mesh`` (jax 0.10.2, deprecated
  later), built without deprecation warnings on either.

  Args:
    axis_name: the mesh's one axis, read in kernels with
      ``jax.lax.axis_index(axis_name)``.
    num_cores: the number of programs. By default, the TensorCores of the
      attached TPU, or off-TPU those of the ``mpmd.tpu_target`` in force
      (1 for the default ``"v5e"``).

  Example::

    >>> mesh = mpmd.tensorcore_mesh("core", num_cores=2)
    >>> dict(mesh.shape)
    {'core': 2}
  """
  if not isinstance(axis_name, str):
    raise TypeError(
      f"tensorcore_mesh: expected 'axis_name' to be a str, got {axis_name!r}"
    )
  if num_cores is None:
    num_cores = targets.num_cores()
  if isinstance(num_cores, bool) or not isinstance(num_cores, int):
    raise TypeError(
      f"tensorcore_mesh: expected 'num_cores' to be an int, got {num_cores!r}"
    )
  if num_cores < 1:
    raise ValueError(
      f"tensorcore_mesh: expected 'num_cores' >= 1, got {num_cores}"
    )
  return comparable(_jax.tensorcore_mesh(axis_name, num_cores))


def comparable(mesh: Mesh) -> Mesh:
  """``mesh``, made to compare as a bool where it holds a device array (a
  TensorCoreMesh of jax 0.10.2, see ``_Devices``): the same object, its
  devices viewed as ``_Devices``."""
  devices = getattr(mesh, "devices", None)
  if type(devices) is np.ndarray:
    object.__setattr__(mesh, "devices", devices.view(_Devices))
  return mesh
