"""The public ``gmm`` / ``tgmm``: checks, tiling, the launch, and ``gmm``'s
VJP (its gradients are a ``gmm`` and a ``tgmm``)."""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from mpmd import _jax
from mpmd.kernels import _common
from mpmd.kernels.grouped_matmul._checks import (
  SUPPORTED_DTYPES,
  check_existing_out,
  check_gmm_operands,
  check_group_offset,
  check_num_actual_groups,
  check_tgmm_operands,
)
from mpmd.kernels.grouped_matmul._kernels import (
  GmmConfig,
  TgmmConfig,
  default_buffer_count,
  gmm_call,
  tgmm_call,
)
from mpmd.kernels.grouped_matmul._metadata import group_rows
from mpmd.kernels.grouped_matmul._windows import (
  gmm_windows_call,
  tgmm_windows_call,
)
from mpmd.kernels.grouped_matmul.tiling import (
  Tiling,
  TilingFn,
  default_tiling,
  resolve_tiling,
)
from mpmd.types import Interpret


def _active_rows(
  group_sizes: jax.Array, group_offset: jax.Array, num_local: int, m: int
) -> jax.Array:
  """(m, 1) bool: rows that belong to one of the local groups."""
  lo, hi = group_rows(group_sizes, group_offset, num_local, m)
  rows = lax.broadcasted_iota(jnp.int32, (m, 1), 0)
  return jnp.logical_and(rows >= lo[0], rows < hi[-1])


def _sum_over_new_axes(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
  """Sums a cotangent over the mesh axes it varies over and its primal not.

  Inside ``shard_map`` a replicated operand (e.g. lhs under expert sharding)
  meets per-device metadata; its cotangent is the sum of every device's
  contribution, which is what autodiff's transpose of the implicit
  broadcast (``pvary``) would give.
  """
  extra = (
    jax.typeof(cotangent).manual_axis_type.varying
    - jax.typeof(primal).manual_axis_type.varying
  )
  if not extra:
    return cotangent
  return lax.psum(cotangent, tuple(sorted(extra)))


IMPLEMENTATIONS = _common.Implementations(tpu="tiled", cpu="windows")


def _resolve(
  name: str,
  implementation: Any,
  tiling: Tiling | TilingFn | None,
  interpret: Interpret,
  m: int,
  k: int,
  n: int,
) -> Tiling | None:
  """The tiling of the implementation to run: ``tiling`` checked (the
  TPU's default where None) for ``"tiled"``, None for ``"windows"``, which
  runs no tiles (the configs carry the choice that way)."""
  if implementation is None and tiling is not None:
    implementation = "tiled"  # a tiling asks for the tiled kernel
  implementation = IMPLEMENTATIONS.resolve(name, implementation, interpret)
  if implementation == "windows":
    if tiling is not None:
      raise ValueError(
        f"{name}: 'tiling' applies to implementation='tiled' only (the "
        f"'windows' implementation runs no tiles), got tiling={tiling!r} "
        "with implementation='windows'"
      )
    return None
  if tiling is None:
    # What a TPU runs, on every platform.
    return default_tiling(m, k, n, platform="tpu")
  return resolve_tiling(name, tiling, m, k, n)


def _gmm_call(lhs, rhs, group_sizes, group_offset, existing_out, cfg):
  """The tiled kernel, or the windows one where the tiling is None."""
  call = gmm_windows_call if cfg.tiling is None else gmm_call
  return call(lhs, rhs, group_sizes, group_offset, existing_out, cfg)


def _tgmm_call(lhs, rhs, group_sizes, group_offset, existing_out, cfg):
  call = tgmm_windows_call if cfg.tiling is None else tgmm_call
  return call(lhs, rhs, group_sizes, group_offset, existing_out, cfg)


# JAX's cache utility: jax.clear_caches() empties it.
@_jax.util.cache(max_size=256, trace_context_in_key=False)
def _differentiable_gmm(cfg: GmmConfig):
  """gmm with a custom VJP for one static configuration."""

  @jax.custom_vjp
  def f(lhs, rhs, group_sizes, group_offset, existing_out):
    return _gmm_call(lhs, rhs, group_sizes, group_offset, existing_out, cfg)

  def fwd(lhs, rhs, group_sizes, group_offset, existing_out):
    out = f(lhs, rhs, group_sizes, group_offset, existing_out)
    # A zero-size slice remembers existing_out's type (its varying mesh
    # axes) for free.
    existing_type = None if existing_out is None else existing_out[:0]
    return out, (lhs, rhs, group_sizes, group_offset, existing_type)

  def bwd(res, grad):
    lhs, rhs, group_sizes, group_offset, existing_type = res
    m = lhs.shape[0]
    num_local = rhs.shape[0]
    if cfg.tiling is None:
      dlhs_tiling = None
    else:
      tm, tk, tn = cfg.tiling
      dlhs_tiling = (tm, tn, tk)
    # d lhs = grad @ rhs^T per group: a gmm with K and N swapped.
    dlhs = _gmm_call(
      grad,
      rhs,
      group_sizes,
      group_offset,
      None,
      cfg._replace(
        tiling=dlhs_tiling,
        preferred_element_type=jnp.dtype(lhs.dtype),
        transpose_rhs=not cfg.transpose_rhs,
      ),
    )
    # d rhs[g] = lhs[rows_g]^T @ grad[rows_g]: a tgmm over the local groups.
    drhs = _tgmm_call(
      lhs.T,
      grad,
      group_sizes,
      group_offset,
      None,
      TgmmConfig(
        tiling=cfg.tiling,
        preferred_element_type=jnp.dtype(rhs.dtype),
        num_actual_groups=num_local,
        interpret=cfg.interpret,
        buffer_count=cfg.buffer_count,
      ),
    )
    if cfg.transpose_rhs:
      drhs = jnp.swapaxes(drhs, 1, 2)
    if existing_type is None:
      dexisting = None
    else:
      # existing_out survives only in rows outside the local groups.
      active = _active_rows(group_sizes, group_offset, num_local, m)
      dexisting = jnp.where(active, jnp.zeros((), grad.dtype), grad)
      dexisting = _sum_over_new_axes(dexisting, existing_type)
    dlhs = _sum_over_new_axes(dlhs, lhs)
    drhs = _sum_over_new_axes(drhs, rhs)
    return dlhs, drhs, None, None, dexisting

  f.defvjp(fwd, bwd)
  return f


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: Any = jnp.float32,
  tiling: Tiling | TilingFn | None = None,
  group_offset: jax.Array | int | None = None,
  existing_out: jax.Array | None = None,
  transpose_rhs: bool = False,
  interpret: Interpret = None,
  implementation: Literal["tiled", "windows"] | None = None,
) -> jax.Array:
  """Grouped matmul: ``out[rows_i] = lhs[rows_i] @ rhs[i]`` for each group.

  Rows of ``lhs`` are sorted by group: group ``i`` owns rows
  ``sum(group_sizes[:i]) .. sum(group_sizes[:i+1])``. Rows past
  ``sum(group_sizes)``, and rows of groups outside the local shard, are zero
  (or keep ``existing_out``). Differentiable in ``lhs``, ``rhs`` and
  ``existing_out`` (custom VJP: d lhs by ``gmm`` with the transposed rhs,
  d rhs by ``tgmm``).

  Args:
    lhs: ``(m, k)`` float32, bfloat16 or float16.
    rhs: ``(num_local_groups, k, n)`` (``(num_local_groups, n, k)`` with
      ``transpose_rhs``), any supported float dtype; with expert sharding it
      holds only groups ``group_offset .. group_offset + num_local_groups``.
    group_sizes: ``(num_groups,)`` int32, non-negative (a concrete array is
      checked); ``num_groups >= num_local_groups``. As in
      ``jax.lax.ragged_dot``, rows past m of sizes that sum past m do not
      exist. A traced negative size cannot be checked: it makes the next
      groups' ranges overlap earlier ones, where ragged_dot adds the
      products of every group holding a row and gmm takes the first group.
    preferred_element_type: dtype of the output (float32, bfloat16, float16);
      accumulation is always float32.
    tiling: tiles of the ``"tiled"`` implementation: ``(tm, tk, tn)``; a
      function ``(m, k, n) -> (tm, tk, tn)``; or None for the TPU's
      (``default_tiling(m, k, n, platform="tpu")``, megablox's). ``tm``
      must divide ``m``; K and N may be ragged (the remainders are
      separate strips). Passing one with ``implementation=None`` selects
      ``"tiled"``.
    group_offset: int32 scalar: the first global group held by ``rhs``.
    existing_out: ``(m, n)`` of ``preferred_element_type``: rows outside the
      local groups keep these values (the result of other shards).
    transpose_rhs: ``rhs`` is given as ``(num_local_groups, n, k)``.
    interpret: passed to ``mpmd_map``: None runs natively on TPU and on the
      CPU fallback on CPU; True or ``pltpu.InterpretParams()`` forces the
      interpreters.
    implementation: which kernel runs; both lower for TPU and run on the
      CPU fallback, and agree up to rounding. ``"tiled"``: megablox's
      pipeline of ``tiling`` tiles, one small dot per (row tile, group)
      visit: what a TPU runs. ``"windows"``: per group, a dot per whole
      chunk of 256 of its rows and one over a masked tail window (see
      ``grouped_matmul.windows``): a few large dots, for the CPU
      fallback, where every tile is a loop iteration around an XLA dot
      (the tiled kernel measured 2-3x one dense matmul of the same FLOPs
      there on MoE-like groups). None (the default): ``"tiled"`` when a
      ``tiling``
      is given or when building for TPU (on a TPU, inside
      ``mpmd.tpu_target``) or simulating one (``interpret`` a
      ``pltpu.InterpretParams``), else ``"windows"``: so a plain CPU run
      tests the windows kernel; pass ``implementation="tiled"`` to run on
      CPU what a TPU runs.

  Returns:
    ``(m, n)`` array of ``preferred_element_type``.

  Raises:
    TypeError: an argument of the wrong kind or dtype.
    ValueError: wrong ranks or shapes, mismatched K, a tiling that does not
      fit or comes with ``implementation="windows"``, negative (concrete)
      ``group_sizes``, an unknown ``implementation``, or a platform neither
      implementation lowers for (CUDA) without ``interpret``.

  Example:
    >>> lhs = jnp.ones((256, 64), jnp.float32)
    >>> rhs = jnp.ones((4, 64, 32), jnp.float32)
    >>> sizes = jnp.array([64, 0, 100, 60], jnp.int32)
    >>> gmm(lhs, rhs, sizes).shape
    (256, 32)
  """
  name = "gmm"
  transpose_rhs = _common.check_bool(name, "transpose_rhs", transpose_rhs)
  m, k, n = check_gmm_operands(name, lhs, rhs, group_sizes, transpose_rhs)
  num_groups = group_sizes.shape[0]
  out_dtype = _common.as_dtype(
    name, "preferred_element_type", preferred_element_type, SUPPORTED_DTYPES
  )
  offset = check_group_offset(name, group_offset, num_groups, rhs.shape[0])
  check_existing_out(name, existing_out, (m, n), out_dtype)
  cfg = GmmConfig(
    tiling=_resolve(name, implementation, tiling, interpret, m, k, n),
    preferred_element_type=out_dtype,
    transpose_rhs=transpose_rhs,
    interpret=interpret,
    buffer_count=default_buffer_count(),
  )
  return _jitted(_differentiable_gmm(cfg))(
    lhs, rhs, group_sizes, offset, existing_out
  )


@_jax.util.cache(max_size=256, trace_context_in_key=False)
def _jitted(f):
  return jax.jit(f)


def tgmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: Any = jnp.float32,
  tiling: Tiling | TilingFn | None = None,
  group_offset: jax.Array | int | None = None,
  num_actual_groups: int | None = None,
  existing_out: jax.Array | None = None,
  interpret: Interpret = None,
  implementation: Literal["tiled", "windows"] | None = None,
) -> jax.Array:
  """Transposed grouped matmul: ``out[i] = lhs[:, rows_i] @ rhs[rows_i]``.

  The weight gradient of ``gmm``. Group ``i`` owns rows (of ``rhs``; columns
  of ``lhs``) ``sum(group_sizes[:i]) .. sum(group_sizes[:i+1])``; empty groups
  give zeros.

  Args:
    lhs: ``(k, m)`` float32, bfloat16 or float16 (e.g. activations, transposed).
    rhs: ``(m, n)`` float (e.g. output gradients).
    group_sizes: ``(num_groups,)`` int32, non-negative, as for ``gmm``: a
      concrete array is checked; rows past m do not exist; after a traced
      negative size, a row in several groups' ranges belongs to the first.
    preferred_element_type: output dtype; accumulation is float32.
    tiling: as for ``gmm``: tiles of the ``"tiled"`` implementation,
      ``(tm, tk, tn)``, a function ``(m, k, n) -> tiling``, or None for the
      TPU's; ``tm`` must divide ``m``, K and N may be ragged.
    group_offset: int32 scalar: the first group computed (expert sharding).
    num_actual_groups: groups computed, from ``group_offset``; defaults to
      all ``num_groups``.
    existing_out: ``(num_actual_groups, k, n)`` of
      ``preferred_element_type``, added to the result.
    interpret: as for ``gmm``.
    implementation: ``"tiled"`` (what a TPU runs), ``"windows"`` (the CPU
      fallback's default) or None, chosen as for ``gmm``.

  Returns:
    ``(num_actual_groups, k, n)`` array of ``preferred_element_type``.

  Raises:
    TypeError: an argument of the wrong kind or dtype.
    ValueError: wrong ranks or shapes, mismatched M, a tiling that does not
      fit or comes with ``implementation="windows"``,
      ``num_actual_groups`` out of range, negative (concrete)
      ``group_sizes``, an unknown ``implementation`` or an unsupported
      platform (as for ``gmm``).

  Example:
    >>> lhs = jnp.ones((64, 256), jnp.float32)
    >>> rhs = jnp.ones((256, 32), jnp.float32)
    >>> sizes = jnp.array([64, 0, 100, 60], jnp.int32)
    >>> tgmm(lhs, rhs, sizes).shape
    (4, 64, 32)
  """
  name = "tgmm"
  k, m, n = check_tgmm_operands(name, lhs, rhs, group_sizes)
  num_groups = group_sizes.shape[0]
  num_actual_groups = check_num_actual_groups(
    name, num_actual_groups, num_groups
  )
  out_dtype = _common.as_dtype(
    name, "preferred_element_type", preferred_element_type, SUPPORTED_DTYPES
  )
  offset = check_group_offset(
    name, group_offset, num_groups, int(num_actual_groups)
  )
  check_existing_out(
    name, existing_out, (int(num_actual_groups), k, n), out_dtype
  )
  cfg = TgmmConfig(
    tiling=_resolve(name, implementation, tiling, interpret, m, k, n),
    preferred_element_type=out_dtype,
    num_actual_groups=int(num_actual_groups),
    interpret=interpret,
    buffer_count=default_buffer_count(),
  )
  return _jitted_tgmm(cfg)(lhs, rhs, group_sizes, offset, existing_out)


@_jax.util.cache(max_size=256, trace_context_in_key=False)
def _jitted_tgmm(cfg: TgmmConfig):
  return jax.jit(functools.partial(_tgmm_call, cfg=cfg))
