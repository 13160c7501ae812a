"""Naming the TPU generation to trace and lower for when none is attached.

Some Pallas TPU helpers (``pltpu.emit_pipeline``, tiling queries) ask the
attached TPU for its generation while tracing. On a CPU host there is none, so
kernels are traced (and cross-lowered) for a named target instead: the
innermost ``tpu_target``, else ``"v5e"``. Only inside ``tpu_target`` and
while we trace or lower a kernel (``answering``): elsewhere JAX is asked.
"""

import contextlib
from collections.abc import Generator
from typing import NamedTuple

import jax

from mpmd import _jax, _patches
from mpmd._jax import config, mesh_lib


class TpuTarget(NamedTuple):
  device_kind: str
  num_cores: int


# Short names a kernel author types -> what a TPU of that kind reports.
TPU_TARGETS = {
  "v4": TpuTarget("TPU v4", 2),
  "v5e": TpuTarget("TPU v5 lite", 1),
  "v5p": TpuTarget("TPU v5p", 2),
  "v6e": TpuTarget("TPU v6 lite", 1),
  # A TPU7x logical device is one TensorCore (no megacore).
  "v7x": TpuTarget("TPU7x", 1),
}
DEFAULT_TPU_TARGET = "v5e"

# A JAX config state in the trace context: jit / make_jaxpr caches then key
# on the target, and MPMD_TPU_TARGET=v6e in the environment sets a default.
_target = config.optional_enum_state(
  name="mpmd_tpu_target",
  enum_values=list(TPU_TARGETS),
  default=None,
  help="TPU generation (v4, v5e, ...) to trace and lower for off-TPU.",
  include_in_trace_context=True,
)


def tpu_target(
  name: str = DEFAULT_TPU_TARGET,
) -> contextlib.AbstractContextManager[TpuTarget]:
  """Traces and lowers TPU kernels for a named TPU generation.

  Args:
    name: one of ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``, ``"v7x"``.

  Without it, a CPU host uses ``$MPMD_TPU_TARGET`` or ``"v5e"``, and a TPU
  host its own chip (an attached TPU always wins). Example::

    >>> def copy(x_hbm, o_hbm):
    ...   pltpu.sync_copy(x_hbm, o_hbm)
    >>> f = mpmd.mpmd_map([(mpmd.tensorcore_mesh("core"), copy)],
    ...                   jax.ShapeDtypeStruct((8, 128), jnp.float32))
    >>> with mpmd.tpu_target("v6e"):
    ...   lowered = jax.jit(f).trace(jnp.ones((8, 128))).lower(
    ...       lowering_platforms=("tpu",))
    >>> "tpu_custom_call" in lowered.as_text()
    True

  Raises:
    TypeError: ``name`` is not a str (checked when called, before ``with``).
    ValueError: ``name`` is not a known generation.
  """
  if not isinstance(name, str):
    raise TypeError(
      f"tpu_target: expected 'name' to be a str (one of "
      f"{sorted(TPU_TARGETS)}), got {type(name).__name__}: {name!r}"
    )
  if name not in TPU_TARGETS:
    raise ValueError(
      f"tpu_target: expected 'name' in {sorted(TPU_TARGETS)}, got {name!r}"
    )
  return _in_target(name)


@contextlib.contextmanager
def _in_target(name: str) -> Generator[TpuTarget, None, None]:
  with _target(name), answering():
    yield TPU_TARGETS[name]


def explicit() -> TpuTarget | None:
  """The target of the innermost ``tpu_target`` context, if any.

  Kernels whose defaults differ per platform (tile sizes) read it: inside
  ``tpu_target`` the author is building for TPU even on a CPU host.
  """
  name = _target.value
  return None if name is None else TPU_TARGETS[name]


def platform() -> str:
  """The platform kernels are being built for: ``"tpu"`` inside
  ``tpu_target`` (cross-lowering on a CPU host), else the abstract mesh's
  device platform under ``shard_map``, else the default backend.

  Kernels pick per-platform defaults (tile sizes, buffering) from it.
  """
  if explicit() is not None:
    return "tpu"
  device = mesh_lib.get_abstract_mesh().abstract_device
  if device is not None:
    return device.platform
  return jax.default_backend()


def current() -> TpuTarget:
  """The TPU generation kernels are traced for when no TPU is attached."""
  return TPU_TARGETS[_target.value or DEFAULT_TPU_TARGET]


def num_cores() -> int:
  """TensorCores per device: the attached TPU's, else the target's."""
  if _no_tpu_attached():
    return current().num_cores
  return _jax.tpu().info.get_num_device_cores()


def _no_tpu_attached() -> bool:
  abstract = mesh_lib.get_abstract_mesh().abstract_device
  if abstract is not None:
    return abstract.platform != "tpu"
  return jax.default_backend() != "tpu"


def _answer() -> tuple[str, int] | None:
  """What Pallas' TPU queries answer in ``answering()``: the target where no
  TPU is attached (None: ask the hardware)."""
  if not _no_tpu_attached():
    return None
  target = current()
  return target.device_kind, target.num_cores


def answering() -> contextlib.AbstractContextManager[None]:
  """Inside: Pallas' TPU hardware queries answer for the target off-TPU.

  Pallas asks ``tpu_info`` for the attached TPU while tracing
  (``emit_pipeline``) and lowering; with none attached it raises
  "Unsupported TPU device kind: cpu". ``tpu_target`` enters this, and so do
  the tracing and lowering of every kernel. Outside, JAX answers as usual.
  """
  return _patches.tpu_queries_answered(_answer)
