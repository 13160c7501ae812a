"""The public collective matmuls and their VJPs (each kernel's backward
pass is built from the other kernel)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from mpmd.kernels import _common
from mpmd.kernels.collective_matmul._all_gather import AgConfig, ag_kernel_call
from mpmd.kernels.collective_matmul._direct import (
  ag_direct_call,
  rs_direct_call,
)
from mpmd.kernels.collective_matmul._reduce_scatter import (
  RsConfig,
  rs_geometry,
  rs_kernel_call,
)
from mpmd.kernels.collective_matmul._ring import Ring, check_ring, make_streams
from mpmd.kernels.collective_matmul._tiles import dot_precision
from mpmd.kernels.collective_matmul.checks import (
  BlockSizes,
  check_block_sizes,
  check_operands,
  pick_blocks,
)
from mpmd.types import Interpret

IMPLEMENTATIONS = _common.Implementations(tpu="ring", cpu="direct")


def resolve_implementation(
  fn_name: str, implementation: Any, schedule: Any, interpret: Interpret
) -> str:
  """``implementation``, or ``schedule``, its deprecated alias (with a
  warning), resolved by ``IMPLEMENTATIONS`` (None: the platform's)."""
  if schedule is not None:
    warnings.warn(
      f"{fn_name}: 'schedule' is deprecated, pass "
      f"implementation={schedule!r} instead",
      DeprecationWarning,
      stacklevel=3,
    )
    if implementation is not None:
      raise TypeError(
        f"{fn_name}: got both 'implementation' ({implementation!r}) and "
        f"its deprecated alias 'schedule' ({schedule!r}); pass "
        "'implementation' only"
      )
    implementation = schedule
  return IMPLEMENTATIONS.resolve(fn_name, implementation, interpret)


def _direct(implementation: str, ring) -> bool:
  # A ring of one device exchanges nothing: either implementation is one
  # matmul.
  return implementation == "direct" and ring.size > 1


def _ag_call(
  config: AgConfig, lhs, rhs, *, return_gathered: bool
) -> tuple[jax.Array, jax.Array | None]:
  if _direct(config.implementation, config.ring):
    return ag_direct_call(config, lhs, rhs, return_gathered=return_gathered)
  return ag_kernel_call(config, lhs, rhs, return_gathered=return_gathered)


def _ag_call_gathered(
  config: AgConfig, lhs, rhs
) -> tuple[jax.Array, jax.Array]:
  """``_ag_call``'s output and the gathered ``lhs``."""
  out, gathered = _ag_call(config, lhs, rhs, return_gathered=True)
  assert gathered is not None  # asked for
  return out, gathered


def _rs_call(config: RsConfig, lhs, rhs):
  if _direct(config.implementation, config.ring):
    return rs_direct_call(config, lhs, rhs)
  return rs_kernel_call(config, lhs, rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ag_matmul(config: AgConfig, lhs: jax.Array, rhs: jax.Array):
  out, _ = _ag_call(config, lhs, rhs, return_gathered=False)
  return out


def _ag_matmul_fwd(config, lhs, rhs):
  out, gathered = _ag_call_gathered(config, lhs, rhs)
  return out, (gathered, rhs)


def _ag_matmul_bwd(config, residuals, d_out):
  # out = G @ rhs with G = all_gather(lhs). d_G = d_out @ rhs^T is needed on
  # every device but lhs's shard only gets its own columns, summed over the
  # ring: a matmul + reduce-scatter along the columns. d_rhs is local.
  gathered, rhs = residuals
  dtype = gathered.dtype
  d_out = d_out.astype(dtype)
  rs_config = RsConfig(
    ring=config.ring,
    scatter_dimension=1,
    bidirectional=config.bidirectional,
    buffering=config.buffering,
    out_dtype=jnp.dtype(jnp.float32),
    block_sizes=BlockSizes(),
    interpret=config.interpret,
    implementation=config.implementation,
  )
  d_lhs = _rs_matmul(rs_config, d_out, rhs.T)
  d_rhs = jnp.dot(
    gathered.T,
    d_out,
    preferred_element_type=jnp.float32,
    precision=dot_precision(dtype),
  )
  return d_lhs.astype(dtype), d_rhs.astype(dtype)


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)


def all_gather_matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  axis_name: str | tuple[str, ...],
  bidirectional: bool = True,
  buffering: int = 2,
  preferred_element_type: Any = jnp.float32,
  block_sizes: BlockSizes | None = None,
  ring: Sequence[int] | None = None,
  implementation: Literal["ring", "direct"] | None = None,
  interpret: Interpret = None,
  schedule: str | None = None,
) -> jax.Array:
  """``all_gather(lhs, axis_name, axis=1, tiled=True) @ rhs``, fused.

  Call inside ``jax.shard_map``. In the ``"ring"`` implementation (what a
  TPU runs, see ``implementation``) the shards of ``lhs`` travel around the
  ring of devices
  along ``axis_name`` while each device multiplies the shards that have
  arrived with the matching rows of its ``rhs``; see the module docstring.
  Differentiable: the VJP is a :func:`matmul_reduce_scatter` (for ``lhs``)
  and a local matmul with the gathered ``lhs`` that the forward kernel keeps
  (for ``rhs``).

  Args:
    lhs: local shard ``(n, k_local)``, float32 or bfloat16; the global
      operand is sharded along its columns (the contraction) over
      ``axis_name``.
    rhs: local ``(k_local * D, m)`` of the same dtype, ``D`` the ring length.
    axis_name: the mesh axis of the ring, or a tuple of axes (flattened in
      the order given, as ``jax.lax.all_gather`` does). On a multi-axis
      mesh, the devices that differ only along these axes form one ring.
    bidirectional: split the rows of ``lhs`` in two halves travelling in
      opposite directions (any ring length; needs ``n`` even, otherwise the
      unidirectional ring is used).
    buffering: receive slots per ring direction (1, 2, 4, ...; the ring
      implementation only, as ``bidirectional``): how far a device may run
      ahead of its neighbour.
    preferred_element_type: output dtype, float32 (default) or bfloat16;
      accumulation is always in float32.
    block_sizes: tiles of the local matmul pipeline (see :class:`BlockSizes`).
    ring: order in which the ring visits the devices, a permutation of
      ``range(D)`` of flattened axis indices; default ``0, 1, ..., D-1``.
      The result does not depend on it (only the communication pattern).
    implementation: which schedule runs; both lower for TPU and run on the
      CPU fallback, and give the same result up to rounding.
      ``"ring"``: the shards travel the ring, each transfer hidden behind
      the matmul of the shard before it (see the module docstring): what a
      TPU runs. ``"direct"``: every device DMAs its shard straight to every
      other device, then one matmul of the gathered ``lhs``: it hides
      nothing, but on the CPU fallback, where devices run in step and
      nothing overlaps, it is one exchange between them instead of
      ``D - 1`` (for large shards one ring shift per peer). None (the
      default): ``"ring"`` when building for TPU (on a TPU, inside
      ``mpmd.tpu_target``, or with ``$MPMD_TPU_TARGET`` set) or simulating
      one (``interpret`` a ``pltpu.InterpretParams``), else ``"direct"``:
      so a plain CPU run tests the direct schedule; pass
      ``implementation="ring"`` to run on CPU what a TPU runs.
      ``bidirectional`` and ``buffering`` shape the ring only.
    interpret: passed to ``mpmd.mpmd_map``: ``None`` compiles on TPU and
      runs the CPU fallback on CPU; a ``pltpu.InterpretParams`` forces the
      TPU simulator (e.g. with ``detect_races=True``).
    schedule: deprecated alias of ``implementation`` (warns).

  Returns:
    ``(n, m)`` array of ``preferred_element_type``, equal on every device of
    the ring.

  Raises:
    ValueError: called outside ``shard_map``, ``axis_name`` not a manual
      axis of the mesh, ``rhs.shape[0] != k_local * D``, bad ``ring``,
      ``buffering`` or block sizes, an unknown ``implementation``, or a
      platform neither implementation lowers for (CUDA) without
      ``interpret``.
    TypeError: unsupported or mismatched dtypes, non-array operands, an
      ``implementation`` that is not a str, both ``implementation`` and
      ``schedule``.

  Example:
    >>> mesh = jax.make_mesh((4,), ("x",))
    >>> lhs = jnp.ones((8, 512), jnp.bfloat16)  # sharded along K
    >>> rhs = jnp.ones((512, 128), jnp.bfloat16)  # replicated
    >>> f = jax.jit(jax.shard_map(
    ...     functools.partial(all_gather_matmul, axis_name="x"),
    ...     mesh=mesh, in_specs=(P(None, "x"), P()), out_specs=P(),
    ...     check_vma=False))
    >>> f(jax.device_put(lhs, NamedSharding(mesh, P(None, "x"))),
    ...   jax.device_put(rhs, NamedSharding(mesh, P()))).shape
    (8, 128)
  """
  fn_name = "all_gather_matmul"
  out_dtype = check_operands(fn_name, lhs, rhs, preferred_element_type)
  ring_ = check_ring(fn_name, axis_name, ring)
  _check_gathered_rows(fn_name, lhs, rhs, ring_)
  config = AgConfig(
    ring=ring_,
    bidirectional=_common.check_bool(fn_name, "bidirectional", bidirectional),
    buffering=_common.check_int(fn_name, "buffering", buffering),
    out_dtype=out_dtype,
    block_sizes=check_block_sizes(fn_name, block_sizes),
    interpret=interpret,
    implementation=resolve_implementation(
      fn_name, implementation, schedule, interpret
    ),
  )
  _check_ag_tiles(fn_name, config, lhs.shape, rhs.shape[1])
  return _ag_matmul(config, lhs, rhs)


def _check_gathered_rows(fn_name: str, lhs, rhs, ring: Ring) -> None:
  k_local = lhs.shape[1]
  if rhs.shape[0] != k_local * ring.size:
    raise ValueError(
      f"{fn_name}: expected 'rhs' with k_local * ring = {k_local} * "
      f"{ring.size} = {k_local * ring.size} rows (lhs is {tuple(lhs.shape)}"
      f", ring {ring.axes!r} has {ring.size} devices), got "
      f"rhs.shape[0] = {rhs.shape[0]}"
    )


def _check_ag_tiles(fn_name: str, config: AgConfig, lhs_shape, m: int):
  # Check the tiles now, not deep inside the kernel trace.
  n, k_local = lhs_shape
  ring = config.ring
  if _direct(config.implementation, ring):
    rows, k_tiled = n, k_local * ring.size  # one matmul of everything
  else:
    streams = make_streams(n, config.bidirectional) if ring.size > 1 else ()
    rows, k_tiled = (streams[0].size if streams else n), k_local
  pick_blocks(fn_name, config.block_sizes, rows, k_tiled, m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rs_matmul(config: RsConfig, lhs: jax.Array, rhs: jax.Array):
  return _rs_call(config, lhs, rhs)


def _rs_matmul_fwd(config, lhs, rhs):
  return _rs_call(config, lhs, rhs), (lhs, rhs)


def _rs_matmul_bwd(config, residuals, d_out):
  # out = scatter(Z), Z = lhs @ rhs: d_Z = all_gather(d_out) along the
  # scattered dimension. The half of the VJP that contracts over that
  # dimension is an all-gather matmul; the other half is a local matmul
  # with the gathered d_out that the all-gather kernel keeps.
  lhs, rhs = residuals
  dtype = lhs.dtype
  d_out = d_out.astype(dtype)
  ag_config = AgConfig(
    ring=config.ring,
    bidirectional=config.bidirectional,
    buffering=config.buffering,
    out_dtype=jnp.dtype(jnp.float32),
    block_sizes=BlockSizes(),
    interpret=config.interpret,
    implementation=config.implementation,
  )
  precision = dot_precision(dtype)
  if config.scatter_dimension == 0:
    # d_rhs^T = all_gather(d_out^T, axis=1) @ lhs; d_lhs = d_Z @ rhs^T.
    d_rhs_t, d_z_t = _ag_call_gathered(ag_config, d_out.T, lhs)
    d_rhs = d_rhs_t.T
    d_lhs = jnp.dot(
      d_z_t.T, rhs.T, preferred_element_type=jnp.float32, precision=precision
    )
  else:
    # d_lhs = all_gather(d_out, axis=1) @ rhs^T; d_rhs = lhs^T @ d_Z.
    d_lhs, d_z = _ag_call_gathered(ag_config, d_out, rhs.T)
    d_rhs = jnp.dot(
      lhs.T, d_z, preferred_element_type=jnp.float32, precision=precision
    )
  return d_lhs.astype(dtype), d_rhs.astype(dtype)


_rs_matmul.defvjp(_rs_matmul_fwd, _rs_matmul_bwd)


def matmul_reduce_scatter(
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  axis_name: str | tuple[str, ...],
  scatter_dimension: int = 0,
  bidirectional: bool = True,
  buffering: int = 2,
  preferred_element_type: Any = jnp.float32,
  block_sizes: BlockSizes | None = None,
  ring: Sequence[int] | None = None,
  implementation: Literal["ring", "direct"] | None = None,
  interpret: Interpret = None,
  schedule: str | None = None,
) -> jax.Array:
  """``psum_scatter(lhs @ rhs, axis_name, scatter_dimension, tiled=True)``.

  Call inside ``jax.shard_map``. Each device's partial product ``lhs @ rhs``
  is cut into ``D`` blocks along ``scatter_dimension``; in the ``"ring"``
  implementation (what a TPU runs, see ``implementation``) the running sums
  of the blocks travel
  the ring, and every device adds its own partial block to the sum passing
  by, computing the next block while the previous sum is on the wire.
  Differentiable: the VJP is an :func:`all_gather_matmul` plus a local
  matmul with the gathered cotangent.

  Args:
    lhs: local ``(n, k)``, float32 or bfloat16 (typically the contraction
      dimension is sharded over ``axis_name``, making ``lhs @ rhs`` a
      partial sum).
    rhs: local ``(k, m)`` of the same dtype.
    axis_name: the mesh axis of the ring, or a tuple of axes (see
      :func:`all_gather_matmul`).
    scatter_dimension: 0 (rows) or 1 (columns) of ``lhs @ rhs``; must be
      divisible by ``D``.
    bidirectional: split each block in two halves (along the other
      dimension) travelling in opposite directions; needs that dimension
      even, otherwise the unidirectional ring is used.
    buffering: receive slots per ring direction (ring implementation only,
      as ``bidirectional``).
    preferred_element_type: output dtype, float32 (default) or bfloat16;
      partial sums always travel and accumulate in float32.
    block_sizes: tiles of the local matmul pipeline (see :class:`BlockSizes`).
    ring: ring order, as in :func:`all_gather_matmul`.
    implementation: ``"ring"`` (running sums travel the ring; what a TPU
      runs), ``"direct"`` (one matmul of the whole partial product, then
      every device DMAs block ``b`` straight to device ``b`` and sums what
      arrives; the CPU fallback's default), or None: the same default as
      :func:`all_gather_matmul`'s (``"ring"`` when building for or
      simulating a TPU, else ``"direct"``). The sums are added in another
      order, so results differ in rounding only.
    interpret: passed to ``mpmd.mpmd_map`` (see :func:`all_gather_matmul`).
    schedule: deprecated alias of ``implementation`` (warns).

  Returns:
    ``(n // D, m)`` (``scatter_dimension=0``) or ``(n, m // D)`` array of
    ``preferred_element_type``: this device's block of the summed product.

  Raises:
    ValueError: called outside ``shard_map``, ``axis_name`` not a manual
      axis of the mesh, contraction mismatch, scattered dimension not
      divisible by ``D``, bad ``scatter_dimension``, ``ring``, ``buffering``
      or block sizes, an unknown ``implementation`` or a platform neither
      implementation lowers for (as in :func:`all_gather_matmul`).
    TypeError: unsupported or mismatched dtypes, non-array operands, as in
      :func:`all_gather_matmul`.

  Example:
    >>> mesh = jax.make_mesh((4,), ("x",))
    >>> lhs = jnp.ones((64, 512), jnp.bfloat16)  # sharded along K
    >>> rhs = jnp.ones((512, 128), jnp.bfloat16)  # sharded along K
    >>> f = jax.jit(jax.shard_map(
    ...     functools.partial(matmul_reduce_scatter, axis_name="x"),
    ...     mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"),
    ...     check_vma=False))
    >>> f(jax.device_put(lhs, NamedSharding(mesh, P(None, "x"))),
    ...   jax.device_put(rhs, NamedSharding(mesh, P("x")))).shape
    (64, 128)
  """
  fn_name = "matmul_reduce_scatter"
  out_dtype = check_operands(fn_name, lhs, rhs, preferred_element_type)
  ring_ = check_ring(fn_name, axis_name, ring)
  _check_scatter(fn_name, lhs, rhs, scatter_dimension, ring_, axis_name)
  config = RsConfig(
    ring=ring_,
    scatter_dimension=scatter_dimension,
    bidirectional=_common.check_bool(fn_name, "bidirectional", bidirectional),
    buffering=_common.check_int(fn_name, "buffering", buffering),
    out_dtype=out_dtype,
    block_sizes=check_block_sizes(fn_name, block_sizes),
    interpret=interpret,
    implementation=resolve_implementation(
      fn_name, implementation, schedule, interpret
    ),
  )
  n, k = lhs.shape
  m = rhs.shape[1]
  if _direct(config.implementation, ring_):
    region = (n, m)  # one matmul of the whole partial product
  else:
    _, _, region = rs_geometry(config, n, m)
  pick_blocks(fn_name, config.block_sizes, region[0], k, region[1])
  return _rs_matmul(config, lhs, rhs)


def _check_scatter(
  fn_name: str, lhs, rhs, scatter_dimension, ring: Ring, axis_name
) -> None:
  """The contraction matches and ``scatter_dimension`` of ``lhs @ rhs``
  splits evenly over the ring."""
  n, k = lhs.shape
  if rhs.shape[0] != k:
    raise ValueError(
      f"{fn_name}: expected 'rhs' with lhs.shape[1] = {k} rows (the "
      f"contraction), got rhs.shape = {tuple(rhs.shape)}"
    )
  if scatter_dimension not in (0, 1) or isinstance(scatter_dimension, bool):
    raise ValueError(
      f"{fn_name}: expected 'scatter_dimension' 0 or 1, got "
      f"{scatter_dimension!r}"
    )
  scattered = (n, rhs.shape[1])[scatter_dimension]
  if scattered % ring.size:
    raise ValueError(
      f"{fn_name}: expected dimension {scatter_dimension} of lhs @ rhs "
      f"({scattered}) to be divisible by the ring length {ring.size} "
      f"(axis {axis_name!r}), got {scattered} % {ring.size} = "
      f"{scattered % ring.size}"
    )
