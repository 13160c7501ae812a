"""Naming the TPU generation to trace and lower for when none is attached.

Some Pallas TPU helpers (``pltpu.emit_pipeline``, tiling queries) ask the
attached TPU for its generation while tracing. On a CPU host there is none, so
kernels are traced (and cross-lowered) for a named target instead.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import jax

from mpmd._jax import mesh_lib


class TpuTarget(NamedTuple):
  device_kind: str
  num_cores: int


# Short names a kernel author types -> what a TPU of that kind reports.
TPU_TARGETS = {
  "v4": TpuTarget("TPU v4", 2),
  "v5e": TpuTarget("TPU v5 lite", 1),
  "v5p": TpuTarget("TPU v5p", 2),
  "v6e": TpuTarget("TPU v6 lite", 1),
  "v7x": TpuTarget("TPU7x", 2),
}
DEFAULT_TPU_TARGET = "v5e"

_current = contextvars.ContextVar("mpmd_tpu_target", default=None)


@contextlib.contextmanager
def tpu_target(name: str = DEFAULT_TPU_TARGET) -> Iterator[TpuTarget]:
  """Traces and lowers ``mpmd_map`` kernels for a named TPU generation.

  Args:
    name: one of ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``, ``"v7x"``.

  Without this context, a CPU host uses ``"v5e"`` and a TPU host its own
  chip. Example::

    with mpmd.tpu_target("v6e"):
      lowered = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",))
  """
  if name not in TPU_TARGETS:
    raise ValueError(
      f"tpu_target: expected 'name' in {sorted(TPU_TARGETS)}, got {name!r}"
    )
  token = _current.set(name)
  try:
    with _abstract_device(TPU_TARGETS[name]):
      yield TPU_TARGETS[name]
  finally:
    _current.reset(token)


@contextlib.contextmanager
def _abstract_device(target: TpuTarget) -> Iterator[None]:
  mesh = mesh_lib.get_abstract_mesh()
  device = mesh_lib.AbstractDevice(
    device_kind=target.device_kind,
    num_cores=target.num_cores,
    platform="tpu",
  )
  with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=device)):
    yield


@contextlib.contextmanager
def tpu_facts() -> Iterator[None]:
  """Makes TPU hardware queries answerable while tracing / lowering.

  A no-op on a TPU host or where an abstract TPU device is already in force;
  elsewhere the innermost ``tpu_target`` (default ``"v5e"``).
  """
  current = mesh_lib.get_abstract_mesh().abstract_device
  if (current is not None and current.platform == "tpu") or (
    _current.get() is None and jax.default_backend() == "tpu"
  ):
    yield
    return
  with _abstract_device(TPU_TARGETS[_current.get() or DEFAULT_TPU_TARGET]):
    yield
