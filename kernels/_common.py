"""What the kernels share: input checks, output types, meshes.

Every check names the public function and the argument, says what was
expected and what came, and raises before anything is traced:
``TypeError`` when the argument is the wrong kind of object (not an array,
not an int, an unsupported dtype), ``ValueError`` when it is the right kind
with a wrong value (rank, shape, range, divisibility).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from mpmd import _jax, meshes, targets
from mpmd.types import Mesh

# A remote DMA's or signal's ``device_id``: its mesh coordinate along each
# axis (the type Pallas takes on every supported jax: 0.10's is a dict, not
# a Mapping, so its value type must match exactly).
DeviceCoords = dict[str | tuple[str, ...], int | jax.Array]


def dtype_names(dtypes: Iterable[DTypeLike]) -> str:
  """``"float32, bfloat16 or float16"``: dtypes for a message."""
  names = [jnp.dtype(d).name for d in dtypes]
  return (
    names[0]
    if len(names) == 1
    else ", ".join(names[:-1]) + (f" or {names[-1]}")
  )


def check_array(
  fn: str,
  arg: str,
  x: Any,
  *,
  rank: int | None = None,
  shape_doc: str = "",
  nonempty: bool = False,
) -> None:
  """An array (anything with ``shape`` and ``dtype``) of the given rank.

  ``shape_doc`` (e.g. ``"(m, k)"``) is shown in the messages; ``nonempty``
  rejects zero-sized dimensions.
  """
  doc = f" {shape_doc}" if shape_doc else ""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(
      f"{fn}: expected '{arg}' to be an array{doc}, got {type(x).__name__}"
    )
  shape = tuple(x.shape)
  if rank is not None and len(shape) != rank:
    raise ValueError(
      f"{fn}: expected '{arg}' of rank {rank}{doc}, got rank {len(shape)} "
      f"with shape {shape}"
    )
  if nonempty and 0 in shape:
    raise ValueError(
      f"{fn}: expected '{arg}'{doc} with no zero-sized dimension, got "
      f"shape {shape}"
    )


def check_dtype(
  fn: str, arg: str, x: Any, allowed: Collection[Any]
) -> np.dtype:
  """``x``'s dtype is one of ``allowed``; returns it."""
  dtype = jnp.dtype(x.dtype)
  if dtype not in {jnp.dtype(d) for d in allowed}:
    raise TypeError(
      f"{fn}: expected '{arg}' of dtype {dtype_names(allowed)}, got "
      f"{dtype.name}"
    )
  return dtype


def as_dtype(
  fn: str, arg: str, value: Any, allowed: Collection[Any]
) -> np.dtype:
  """``value`` names one of the ``allowed`` dtypes; returns it."""
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(
      f"{fn}: expected '{arg}' to be a dtype, got {value!r}"
    ) from None
  if dtype not in {jnp.dtype(d) for d in allowed}:
    raise TypeError(
      f"{fn}: expected '{arg}' {dtype_names(allowed)}, got {dtype.name}"
    )
  return dtype


def check_bool(fn: str, arg: str, value: Any) -> bool:
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"{fn}: expected '{arg}' to be a bool, got {value!r}")
  return bool(value)


def check_int(
  fn: str,
  arg: str,
  value: Any,
  *,
  minimum: int = 1,
  multiple_of: int = 1,
  why: str = "",
) -> int:
  """An int (not a bool) ``>= minimum`` and a multiple of ``multiple_of``;
  ``why`` says what the multiple stands for."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(f"{fn}: expected '{arg}' to be an int, got {value!r}")
  value = int(value)
  if value < minimum:
    raise ValueError(f"{fn}: expected '{arg}' >= {minimum}, got {value}")
  if value % multiple_of:
    reason = f" ({why})" if why else ""
    raise ValueError(
      f"{fn}: expected '{arg}' to be a multiple of {multiple_of}{reason}, "
      f"got {value}"
    )
  return value


def varying_axes(*operands: Any) -> frozenset[Hashable]:
  """The manual mesh axes any of ``operands`` varies over (inside
  ``jax.shard_map(..., check_vma=True)``; empty outside)."""
  return frozenset().union(
    *(jax.typeof(x).manual_axis_type.varying for x in operands)
  )


def vary(x: jax.Array, varying: frozenset[Hashable]) -> jax.Array:
  """``x``, made to vary also over the manual mesh axes ``varying`` (see
  :func:`varying_axes`): an operand aliased to an output must have the
  output's type."""
  missing = varying - varying_axes(x)
  if not missing:
    return x
  # Axis names are any hashables (in practice strings, which sort as is).
  return jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")


def out_type(
  shape: tuple[int, ...],
  dtype: DTypeLike,
  varying: frozenset[Hashable] = frozenset(),
) -> jax.ShapeDtypeStruct:
  """A kernel output type that varies over ``varying`` (see
  :func:`varying_axes`), as ``shard_map(check_vma=True)`` needs."""
  return jax.ShapeDtypeStruct(
    shape,
    dtype,
    manual_axis_type=jax.sharding.ManualAxisType(varying=varying),
  )


def operand_names(names: Sequence[str]):
  """Gives a kernel written as ``kernel(*refs)`` the operand names
  ``names``, so that errors and the checker's reports name its Refs
  (``x_tile``, not ``refs[14]``): JAX reads names from the signature.

  >>> @operand_names(("x", "o"))
  ... def kernel(*refs):
  ...   x, o = refs
  >>> list(inspect.signature(kernel).parameters)
  ['x', 'o']
  """

  def name(kernel: Callable[..., None]) -> Callable[..., None]:
    only = inspect.Parameter.POSITIONAL_ONLY
    kernel.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
      [inspect.Parameter(n, only) for n in names]
    )
    return kernel

  return name


def traced_in_x32(body: Callable[..., Any]) -> Callable[..., Any]:
  """A TPU kernel body traced with ``jax_enable_x64`` off. Mosaic takes
  32-bit indices, and with x64 on every Python int the body indexes a Ref
  with (``sem.at[0]``, ``pl.ds(i * 128, 128)``) is an int64. For bodies
  that compute nothing in 64 bits (they may move 64-bit data by DMA)."""

  @functools.wraps(body)
  def traced(*refs: Any) -> Any:
    with _jax.config.enable_x64(False):
      return body(*refs)

  return traced


def single_core_mesh() -> Mesh:
  """The one-TensorCore mesh of the TPU kernels (its axis: ``"core"``)."""
  return meshes.tensorcore_mesh("core", num_cores=1)


class Implementations(NamedTuple):
  """A kernel's two named implementations (its backends, as tokamax names
  them): ``tpu``, what a TPU runs, and ``cpu``, the CPU fallback's default.

  Both lower for TPU (Mosaic) and run on the CPU fallback; which one runs
  when a caller passes ``implementation=None`` is the one documented rule of
  :meth:`resolve`.
  """

  tpu: str
  cpu: str

  @property
  def names(self) -> tuple[str, str]:
    return (self.tpu, self.cpu)

  def resolve(self, fn: str, implementation: Any, interpret: Any) -> str:
    """The implementation to run: ``implementation`` when named, else
    ``tpu`` when building for TPU (on a TPU, inside ``mpmd.tpu_target``)
    or simulating one (``interpret`` a ``pltpu.InterpretParams``), else
    ``cpu``. Raises before anything is traced: ``TypeError`` for a name
    that is not a str, ``ValueError`` for an unknown one or a platform no
    implementation lowers for (CUDA, say) without an interpreter."""
    if implementation is None:
      simulated = isinstance(interpret, pltpu.InterpretParams)
      tpu = simulated or targets.platform() == "tpu"
      implementation = self.tpu if tpu else self.cpu
    elif not isinstance(implementation, str):
      raise TypeError(
        f"{fn}: expected 'implementation' to be a str in {self.names} or "
        f"None, got {type(implementation).__name__}: {implementation!r}"
      )
    elif implementation not in self.names:
      raise ValueError(
        f"{fn}: expected 'implementation' in {self.names} or None, got "
        f"{implementation!r}"
      )
    platform = targets.platform()
    if interpret is None and platform not in _NATIVE_PLATFORMS:
      # Else the launch fails while lowering, deep inside mpmd_map, with
      # "CUDA lowering needs Mosaic GPU meshes".
      raise ValueError(
        f"{fn}: implementation {implementation!r} lowers for TPU (Mosaic) "
        f"and runs on the CPU fallback, as every implementation of {fn} "
        f"does; none lowers for platform {platform!r}. Build for TPU "
        "inside mpmd.tpu_target(), or pass "
        "interpret=pltpu.InterpretParams() to run the TPU simulator"
      )
    return implementation


# Where a TPU kernel runs without an interpreter: Mosaic, or the CPU
# fallback.
_NATIVE_PLATFORMS = ("tpu", "cpu")


# XLA:CPU multiplies an f32 (M, K) x (K, N) dot of few rows with one
# algorithm and one of more rows with another, and the two round a row
# differently (measured on jax 0.10.2 and 0.12.0.1, M a multiple of 8: M <=
# 40 rows one way, M >= 88 the other, the switch in between depending on K
# and N; within either, a row's result depends on no other row, nor on
# where it sits). Kernels whose products must agree bit for bit whatever
# rows surround them (the fused and the unfused MoE layer) pad every dot
# to at least this many rows on the CPU fallback.
STABLE_DOT_ROWS = 128


def rows_dot(
  x: jax.Array, w: jax.Array, contract_w: int, preferred_element_type
) -> jax.Array:
  """``x`` (M, K) times ``w`` (contracted on its dimension ``contract_w``):
  (M, N) in ``preferred_element_type``, each row rounded as XLA:CPU rounds
  it in a dot of many rows, whatever M (the dot runs on at least
  ``STABLE_DOT_ROWS`` rows, zeros past M, on the CPU fallback; elsewhere as
  given).

  Args:
    x: (M, K) float32 / bfloat16 / float16.
    w: (K, N) with ``contract_w=0``, (N, K) with ``contract_w=1``; of
      ``x``'s dtype.
    contract_w: the dimension of ``w`` that ``x``'s columns meet.
    preferred_element_type: the product's dtype (say float32).

  Example: eight rows alone, rounded as among 512.

    >>> x = jax.random.normal(jax.random.key(0), (512, 16))
    >>> w = jax.random.normal(jax.random.key(1), (16, 24))
    >>> few = rows_dot(x[:8], w, 0, jnp.float32)
    >>> few.shape, bool(jnp.all(few == rows_dot(x, w, 0, jnp.float32)[:8]))
    ((8, 24), True)
  """
  m = x.shape[0]
  if m < STABLE_DOT_ROWS and targets.platform() == "cpu":
    pad = jnp.zeros((STABLE_DOT_ROWS - m, x.shape[1]), x.dtype)
    x = jnp.concatenate([x, pad])
  y = jax.lax.dot_general(
    x,
    w,
    (((1,), (contract_w,)), ((), ())),
    preferred_element_type=preferred_element_type,
  )
  return y[:m]


def activated(activation, h: jax.Array, dtype) -> jax.Array:
  """``activation(h)`` in ``dtype``, rounded the same wherever it runs.

  XLA:CPU fuses an activation's operations with what surrounds them, and
  a fusion may round differently from another (the kind of fusion picks
  the code, say for ``tanh``), or from the operations run one by one. On
  the CPU fallback the activation is fenced off (optimization barriers on
  both sides), so that the fused MoE kernel and the unfused layer, whose
  neighbours differ, round each element alike. Elsewhere as given.

  Args:
    activation: elementwise, (M, N) float32 -> (M, N).
    h: (M, N) float32.
    dtype: the result's dtype.

  Example:
    >>> activated(jax.nn.gelu, jnp.zeros((8, 128)), jnp.bfloat16).dtype
    dtype(bfloat16)
  """
  if targets.platform() != "cpu":
    return activation(h).astype(dtype)
  h = jax.lax.optimization_barrier(h)
  return jax.lax.optimization_barrier(activation(h).astype(dtype))
