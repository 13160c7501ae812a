"""``ragged_all_to_all`` on ``mpmd_map``: remote DMAs of ragged row slices.

``jax.lax.ragged_all_to_all`` has no XLA:CPU implementation. This one is one
``mpmd_map`` launch per device, inside ``jax.shard_map``, that pushes each
slice of ``operand`` straight into ``output`` on its receiver by remote DMA.

A DMA has a static shape and a slice has a size known only at run time.
Two named implementations (``implementation=``) deal with that, both
lowering for TPU and running on the CPU fallback:

* ``"window"`` (the CPU fallback's default): every slice moves as one window of
  ``R = min(N, M)`` rows (the largest valid slice) that starts at the
  slice, or earlier where the window would run past ``operand`` (its
  ``shift`` says where the slice starts in it), into a staging slot of its
  receiver, one slot per (sender, slice); where ``k * R > N`` the whole
  ``operand`` moves once per peer instead, holding all ``k`` slices.
  Every device issues the same remote DMAs in step, none under a
  condition, so the lockstep path runs them as XLA collectives (a remote
  DMA under ``pl.when`` would send the launch to the threaded simulator).
  The sender's output offsets and shifts travel with the windows; after
  the launch the receiver takes, for each row of ``output``, the staged
  row that lands there (its own ``recv_sizes`` say how many rows of each
  window count), in plain XLA: a gather. Cost: ``min(k * R, N)`` rows per
  peer whatever the slices' sizes, and as many rows of staging per peer:
  what a CPU can afford, and each exchange is a few collectives that
  compile quickly.
* ``"conditional"`` (what a TPU runs): a slice of ``size`` rows moves as binary
  chunks straight into ``output`` (aliased): chunk ``b`` (``2**b`` rows)
  carries rows ``[prefix_b, prefix_b + 2**b)`` of the slice when bit ``b``
  of ``size`` is set, ``prefix_b`` being ``size`` with bits ``0..b``
  cleared; ``B = R.bit_length()`` chunks cover every valid size. A chunk is
  sent only when its bit is set, and the receiver waits for the chunks its
  own ``recv_sizes`` announce: only the slices' rows move, in at most ``B``
  DMAs per slice, with no staging. Slices a device sends to itself are
  local DMAs.

Before the first remote DMA every device meets its peers on the barrier
semaphore, so no row arrives before the receiver is inside the kernel
(with ``output`` in place, for the conditional schedule).

Bounds. A slice out of range (a negative offset or size, ``offset + size``
past ``N`` at the sender or past ``M`` at the receiver) is, on the CPU
fallback, an ``mpmd.OutOfBoundsError`` naming the device, the slice and
its arguments before any row moves (``_contract``), where JAX leaves the
result undefined; the kernels read it from row ``N`` of ``operand``, a
window that leaves the buffer, so a TPU faults rather than move rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd.kernels import _common
from mpmd.kernels.moe import _contract as contract
from mpmd.kernels.moe import _peers as peers_lib
from mpmd.kernels.moe._peers import Groups as Groups
from mpmd.kernels.moe._peers import check_arguments as check_arguments
from mpmd.kernels.moe._peers import check_groups as check_groups
from mpmd.types import Interpret

_FN = "ragged_all_to_all"
IMPLEMENTATIONS = _common.Implementations(tpu="conditional", cpu="window")
# Rows of the metadata the kernel reads (``_contract``'s layout).
_IN_OFF, _SEND, _OUT_OFF, _RECV = contract.FIELDS


class Config(NamedTuple):
  """Static parameters of one exchange (hashable)."""

  groups: Groups
  implementation: str  # "window" or "conditional"
  interpret: Interpret = None


# -- the window schedule (CPU) ------------------------------------------------

# Rows of the metadata that travels with the windows (per receiver, per
# slice): where the slice lands in the receiver's output, and where it
# starts in its window.
_TRAVEL_OFF, _TRAVEL_SHIFT = range(2)


def moves_whole_operand(n: int, m: int, k: int) -> bool:
  """Whether the window schedule moves the whole operand once per peer
  rather than a window per slice of the largest valid slice (which would
  move more rows)."""
  return n < k * min(n, m)


class _Windows(NamedTuple):
  """How the window schedule moves one exchange's slices."""

  whole: bool  # the whole operand once per peer (``moves_whole_operand``)
  window: int  # rows per window
  units: int  # windows per peer
  start: jax.Array  # (d * units,) int32: each window's first operand row
  travel: jax.Array  # (d, 2, k) int32: what travels to each receiver


def _plan_windows(d: int, n: int, m: int, meta) -> _Windows:
  k = meta.shape[1] // d
  in_off, size, out_off = meta[_IN_OFF], meta[_SEND], meta[_OUT_OFF]
  valid = contract.valid(in_off, size, out_off, n, m)
  whole = moves_whole_operand(n, m, k)
  window, units = (n, 1) if whole else (min(n, m), k)
  if whole:
    start = jnp.zeros((d,), jnp.int32)
    shift = in_off
    valid = jnp.all(valid.reshape(d, k), axis=1)
  else:
    start = jnp.minimum(in_off, n - window)
    shift = in_off - start
  # A window with an invalid slice is read from row n: out of bounds.
  start = jnp.where(valid, start, n)
  travel = jnp.stack([out_off, shift]).reshape(2, d, k).transpose(1, 0, 2)
  return _Windows(whole, window, units, start, travel)


def _window_body(groups: Groups, units: int, window: int):
  """The kernel: every window (and what travels with it) to its receiver's
  staging slot, the same unconditional DMAs on every device."""
  d = groups.size

  def body(operand, starts_hbm, travel, staging, arrived, starts, send, recv):
    pltpu.sync_copy(starts_hbm, starts)
    peers = peers_lib.Peers(groups)
    me = peers.position
    peers_lib.handshake(peers)

    def unit(source, q):
      return staging.at[pl.ds((source * units + q) * window, window)]

    copies = []
    for o in range(1, d):
      target = peers.position_at(o)
      copies.append(
        pltpu.make_async_remote_copy(
          travel.at[pl.ds(target, 1)],
          arrived.at[pl.ds(me, 1)],
          send,
          recv,
          device_id=peers.ids[o],
        )
      )
      for q in range(units):
        copies.append(
          pltpu.make_async_remote_copy(
            operand.at[pl.ds(starts[target * units + q], window)],
            unit(me, q),
            send,
            recv,
            device_id=peers.ids[o],
          )
        )
    for copy in copies:
      copy.start()
    pltpu.sync_copy(travel.at[pl.ds(me, 1)], arrived.at[pl.ds(me, 1)])
    for q in range(units):
      pltpu.sync_copy(
        operand.at[pl.ds(starts[me * units + q], window)], unit(me, q)
      )
    # Every peer sends this device the same windows it sends them.
    for copy in copies:
      copy.wait_recv()
    for copy in copies:
      copy.wait_send()

  return body


def _window_exchange(config: Config, operand, output, meta) -> jax.Array:
  groups = config.groups
  d = groups.size
  n, m = operand.shape[0], output.shape[0]
  trailing = operand.shape[1:]
  plan = _plan_windows(d, n, m, meta)
  window, units = plan.window, plan.units
  varying = peers_lib.varying(config.groups, operand, output, meta)
  out_types = (
    _common.out_type((d * units * window, *trailing), operand.dtype, varying),
    _common.out_type(plan.travel.shape, jnp.int32, varying),
  )
  itemsize = jnp.dtype(operand.dtype).itemsize
  row_bytes = math.prod(trailing) * itemsize
  staging, arrived = peers_lib.launch(
    groups,
    config.interpret,
    _window_body(groups, units, window),
    out_types,
    (
      pltpu.SMEM(plan.start.shape, jnp.int32),
      pltpu.SemaphoreType.DMA,
      pltpu.SemaphoreType.DMA,
    ),
    cost_estimate=pl.CostEstimate(
      flops=0,
      transcendentals=0,
      bytes_accessed=2 * d * units * window * row_bytes,
    ),
    name=_FN,
  )(operand, plan.start, plan.travel)
  return _land_windows(plan, staging, arrived, output, meta)


def _land_windows(plan: _Windows, staging, arrived, output, meta):
  """``output`` with each row that a received slice covers taken from the
  staged window holding it (a gather)."""
  d, _, k = arrived.shape
  m, trailing = output.shape[0], output.shape[1:]
  # arrived[j, :, s]: the slice of sender j's slot s; recv_sizes says how
  # many of its rows count.
  lands = arrived[:, _TRAVEL_OFF].reshape(d * k)
  shifts = arrived[:, _TRAVEL_SHIFT].reshape(d * k)
  sizes = meta[_RECV]
  rows = jnp.arange(m, dtype=jnp.int32)[:, None]
  inside = (rows >= lands[None, :]) & (rows < (lands + sizes)[None, :])
  # Where slices overlap, the later one wins, as in JAX's definition.
  last = d * k - 1 - jnp.argmax(inside[:, ::-1], axis=1).astype(jnp.int32)
  found = jnp.any(inside, axis=1)
  held_by = last if not plan.whole else last // k  # the unit holding it
  source = held_by * plan.window + shifts[last] + rows[:, 0] - lands[last]
  source = jnp.clip(source, 0, d * plan.units * plan.window - 1)
  found = found.reshape(found.shape + (1,) * len(trailing))
  return jnp.where(found, staging[source], output)


# -- the conditional schedule (TPU) -------------------------------------------


def _chunk(in_off, size, out_off, valid, b: int, n: int):
  """Whether chunk ``b`` of a slice carries rows, and its source and
  destination row starts (an invalid slice reads from row ``n``: out of
  bounds, see the module docstring)."""
  has = ((size >> b) & 1) == 1
  prefix = (size >> (b + 1)) << (b + 1)
  src = jnp.where(valid, in_off + prefix, jnp.int32(n))
  return has, src, out_off + prefix


def _conditional_body(groups: Groups, k: int, n: int, m: int):
  """The kernel: each slice as the binary chunks its size has set, sent
  straight into the receiver's ``output``; then the waits for the chunks
  announced."""
  d = groups.size
  bits = min(n, m).bit_length()

  def body(operand, output, meta_hbm, out, meta, send_sem, recv_sem):
    del output  # aliased to ``out``
    pltpu.sync_copy(meta_hbm, meta)
    peers = peers_lib.Peers(groups)
    peers_lib.handshake(peers)

    def fields(i):
      in_off, size, out_off = (meta[f, i] for f in (_IN_OFF, _SEND, _OUT_OFF))
      return in_off, size, out_off, contract.valid(in_off, size, out_off, n, m)

    def remote(src, dst, rows, o):
      return pltpu.make_async_remote_copy(
        operand.at[pl.ds(src, rows)],
        out.at[pl.ds(dst, rows)],
        send_sem,
        recv_sem,
        device_id=peers.ids[o],
      )

    for o in range(1, d):
      target = peers.position_at(o)
      for s in range(k):
        slice_fields = fields(target * k + s)
        for b in range(bits):
          has, src, dst = _chunk(*slice_fields, b, n)

          @pl.when(has | ~slice_fields[3])
          def _(src=src, dst=dst, b=b, o=o):
            remote(src, dst, 1 << b, o).start()

    # Slices to itself: local copies of the chunks that carry rows.
    me = peers.position
    for s in range(k):
      slice_fields = fields(me * k + s)
      for b in range(bits):
        has, src, dst = _chunk(*slice_fields, b, n)

        @pl.when(has | ~slice_fields[3])
        def _(src=src, dst=dst, b=b):
          pltpu.sync_copy(
            operand.at[pl.ds(src, 1 << b)], out.at[pl.ds(dst, 1 << b)]
          )

    # Wait for the chunks this device's ``recv_sizes`` announce, and for
    # its own sends to leave.
    for o in range(1, d):
      source = peers.position_at(d - o)
      target = peers.position_at(o)
      for s in range(k):
        recv_size = meta[_RECV, source * k + s]
        send_size = meta[_SEND, target * k + s]
        for b in range(bits):
          like = remote(0, 0, 1 << b, o)

          @pl.when(((recv_size >> b) & 1) == 1)
          def _(like=like):
            like.wait_recv()

          @pl.when(((send_size >> b) & 1) == 1)
          def _(like=like):
            like.wait_send()

  return body


def _conditional_exchange(config: Config, operand, output, meta) -> jax.Array:
  groups = config.groups
  d = groups.size
  n, m = operand.shape[0], output.shape[0]
  k = meta.shape[1] // d
  varying = peers_lib.varying(config.groups, operand, output, meta)
  if varying:
    output = _common.vary(output, varying)
  row_bytes = math.prod(output.shape[1:]) * jnp.dtype(output.dtype).itemsize
  (out,) = peers_lib.launch(
    groups,
    config.interpret,
    _conditional_body(groups, k, n, m),
    (_common.out_type(output.shape, output.dtype, varying),),
    (
      pltpu.SMEM(meta.shape, jnp.int32),
      pltpu.SemaphoreType.DMA,
      pltpu.SemaphoreType.DMA,
    ),
    input_output_aliases={1: 0},
    cost_estimate=pl.CostEstimate(
      flops=0, transcendentals=0, bytes_accessed=2 * (n + m) * row_bytes
    ),
    name=_FN,
  )(operand, output, meta)
  return out


def exchange(config: Config, operand, output, meta) -> jax.Array:
  """The exchange: ``meta`` is (4, k * D) int32 (input offsets, send sizes,
  output offsets, recv sizes); returns the updated ``output``."""
  n, m = operand.shape[0], output.shape[0]
  if n == 0 or m == 0 or math.prod(output.shape[1:]) == 0:
    return output  # no row can move
  if config.implementation == "window":
    return _window_exchange(config, operand, output, meta)
  return _conditional_exchange(config, operand, output, meta)


def _written_rows(m: int, offsets: jax.Array, sizes: jax.Array) -> jax.Array:
  """(m,) bool: rows in any ``[offsets[i], offsets[i] + sizes[i])``."""
  rows = jnp.arange(m, dtype=jnp.int32)[:, None]
  ends = (offsets + sizes)[None, :]
  inside = (rows >= offsets[None, :]) & (rows < ends)
  return jnp.any(inside, axis=1)


class _Static(NamedTuple):
  """The non-differentiable arguments of :func:`_ragged` (hashable)."""

  config: Config
  operand_rows: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(static: _Static, operand, output, meta):
  return exchange(static.config, operand, output, meta)


def _ragged_fwd(static, operand, output, meta):
  return exchange(static.config, operand, output, meta), meta


def _ragged_bwd(static, meta, d_result):
  # result = output with rows [recv_off, recv_off + recv_size) of every
  # received slice replaced by the sender's operand rows. The operand's
  # cotangent is the reverse exchange (each receiver sends the rows it
  # received back to where they came from); the output's is the incoming
  # one with the written rows zeroed (an empty slot writes nothing, even
  # where its offset is a non-empty slot's).
  config = static.config
  received = peers_lib.exchange_metadata(
    config.groups, meta[_IN_OFF : _OUT_OFF + 1], config.interpret
  )
  recv_in_off, recv_out_off = received[0], received[_OUT_OFF]
  reverse = jnp.stack([recv_out_off, meta[_RECV], recv_in_off, meta[_SEND]])
  zeros = jnp.zeros((static.operand_rows, *d_result.shape[1:]), d_result.dtype)
  d_operand = exchange(config, d_result, zeros, reverse)
  written = _written_rows(d_result.shape[0], recv_out_off, meta[_RECV])
  written = written.reshape(written.shape + (1,) * (d_result.ndim - 1))
  d_output = jnp.where(written, jnp.zeros_like(d_result), d_result)
  return d_operand, d_output, np.zeros(meta.shape, jax.dtypes.float0)


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_all_to_all(
  operand: jax.Array,
  output: jax.Array,
  input_offsets: jax.Array,
  send_sizes: jax.Array,
  output_offsets: jax.Array,
  recv_sizes: jax.Array,
  *,
  axis_name: str | tuple[str, ...],
  axis_index_groups: Sequence[Sequence[int]] | None = None,
  implementation: Literal["conditional", "window"] | None = None,
) -> jax.Array:
  """``jax.lax.ragged_all_to_all`` as remote DMAs, on every platform.

  Call inside ``jax.shard_map`` over ``axis_name``. Each device sends ``k``
  slices of rows of its ``operand`` to every device of its group (``D``
  devices: the whole axis, or its group in ``axis_index_groups``): slice
  ``i`` (rows ``input_offsets[i]`` to ``input_offsets[i] + send_sizes[i]``)
  goes to group position ``i // k``, where it overwrites rows starting at
  ``output_offsets[i]`` of that device's ``output``. The result is
  ``output`` with every slice this device received written in; rows that
  nothing writes keep their values. ``recv_sizes[i]`` is the size of the
  slice this device receives from position ``i // k`` (its ``i % k``-th),
  and must equal that sender's ``send_sizes`` entry, as in JAX. Where it
  does not, on CPU, an ``mpmd.DeadlockError`` (more announced than sent:
  a TPU would wait forever) or ``mpmd.LeftoverError`` (fewer: rows nobody
  waits for) names both sizes before any row moves.

  Unlike XLA's op this runs on CPU (the CPU fallback's lockstep path) as
  well as on TPU (a Mosaic kernel); slice windows outside ``operand`` or
  ``output`` raise ``mpmd.OutOfBoundsError`` on CPU at run time. It is
  differentiable: the ``operand`` cotangent is the reverse exchange (slices
  of ``operand`` are assumed not to overlap, as in JAX's rule), the
  ``output`` cotangent is the incoming one with the written rows zeroed.

  Slices that overlap in a receiver's ``output``: JAX leaves the result
  undefined. ``"window"`` writes the later slice (in sender, then slot
  order) over the earlier ones; ``"conditional"``'s DMAs race, which the
  CPU fallback reports as an ``mpmd.RaceError``. The gradients assume
  slices that do not overlap.

  These errors are raised as such by an eager call. Under ``jax.jit`` XLA
  reports them as its own ``JaxRuntimeError`` quoting ours, unless the
  call and the wait for its results run inside ``with
  mpmd.typed_errors():`` (see ``mpmd.typed_errors``).

  Args:
    operand: (N, ...) array: the rows to send, of any dtype.
    output: (M, ...) array of ``operand``'s dtype and trailing dimensions:
      what the result holds where nothing is received.
    input_offsets: (k * D,) integer array: where each slice starts in
      ``operand``.
    send_sizes: (k * D,) integer array: the rows of each slice sent.
    output_offsets: (k * D,) integer array: where each slice sent lands in
      its receiver's ``output``.
    recv_sizes: (k * D,) integer array: the rows of each slice received.
    axis_name: the ``shard_map`` mesh axis to exchange along, or a tuple of
      axes (their flattened index, in the order given).
    axis_index_groups: optional groups of axis indices that exchange
      separately (each a list of ``D`` indices; together they cover the
      axis once), as in JAX.
    implementation: how slices of run-time sizes move (see the module
      docstring); both lower for TPU and run on the CPU fallback, with the
      same result where slices do not overlap. ``"conditional"``: each
      slice as binary chunks sent only when they carry rows, straight into
      ``output``: what a TPU runs.
      ``"window"``: each slice as one window of ``min(N, M)`` rows into a
      staging slot, every device's DMAs the same and unconditional, so the
      CPU fallback runs them as a few XLA collectives (a remote DMA under
      a condition would send the launch to the much slower threaded
      simulator). None (the default): ``"conditional"`` when building for
      TPU (on a TPU, inside ``mpmd.tpu_target``), else ``"window"``: so a
      plain CPU run tests the window exchange; pass
      ``implementation="conditional"`` to run on CPU what a TPU runs.

  Returns:
    (M, ...) array of ``output``'s dtype: ``output`` with the received
    slices written.

  Raises:
    TypeError: an argument is not an array, ``operand`` and ``output``
      differ in dtype, or an offset / size array is not of an integer dtype.
    ValueError: trailing dimensions differ, the offsets and sizes differ in
      length or are not ``k * D`` long, the call is not inside
      ``shard_map`` over ``axis_name``, the groups are not a partition,
      ``implementation`` is unknown, or neither implementation lowers for
      the platform (CUDA).

  Example:
    >>> import numpy as np
    >>> mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    >>> def f(operand, output, in_off, send, out_off, recv):
    ...   return mpmd.kernels.ragged_all_to_all(
    ...     operand, output, in_off, send, out_off, recv, axis_name="x")
    >>> # Device 0 sends [1] to itself and [2, 2] to device 1;
    >>> # device 1 sends [3] to device 0 and [4] to itself.
    >>> args = [
    ...   jax.device_put(jnp.array(a, jnp.int32), NamedSharding(mesh, P("x")))
    ...   for a in ([1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1],
    ...             [0, 0, 1, 2], [1, 1, 2, 1])]
    >>> g = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    >>> np.asarray(jax.jit(g)(*args)).reshape(2, 4)
    array([[1, 3, 0, 0],
           [2, 2, 4, 0]], dtype=int32)
  """
  groups = check_groups(_FN, axis_name, axis_index_groups)
  offsets = {
    "input_offsets": input_offsets,
    "send_sizes": send_sizes,
    "output_offsets": output_offsets,
    "recv_sizes": recv_sizes,
  }
  check_arguments(_FN, operand, output, offsets, groups)
  return checked_call(
    groups,
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    implementation=implementation,
  )


def checked_call(
  groups: Groups,
  operand,
  output,
  input_offsets,
  send_sizes,
  output_offsets,
  recv_sizes,
  *,
  implementation: str | None = None,
  interpret: Interpret = None,
  checked: bool = True,
) -> jax.Array:
  """The ragged all-to-all over resolved ``groups``, its arguments checked:
  what ``ragged_all_to_all`` and the MoE layer call. ``implementation`` /
  ``interpret`` as for ``mpmd_map``: force an implementation or a CPU
  path. ``checked=False``: metadata consistent by construction (the MoE
  layer's), so no ``_contract`` check on CPU."""
  resolved = IMPLEMENTATIONS.resolve(_FN, implementation, interpret)
  config = Config(groups, resolved, interpret)
  metadata = (input_offsets, send_sizes, output_offsets, recv_sizes)
  meta = jnp.stack([_as_int32(jnp.asarray(x)) for x in metadata])
  # Under shard_map(check_vma=True) the result varies along the exchange's
  # axes: so do the arguments of the custom VJP, whose cotangents have the
  # result's type (pcast here transposes to a psum for invariant ones).
  varying = _common.varying_axes(operand, output, meta)
  if varying:
    varying |= frozenset(groups.axes)
    operand, output, meta = (
      _common.vary(a, varying) for a in (operand, output, meta)
    )
  if checked:
    n, m = operand.shape[0], output.shape[0]
    meta = meta + contract.check(_FN, groups, meta, n, m)
  static = _Static(config, operand.shape[0])
  return _ragged(static, operand, output, meta)


def _as_int32(x: jax.Array) -> jax.Array:
  """Offsets or sizes as int32, where values outside int32 (no buffer has
  that many rows) become -1, out of bounds, rather than wrap into range."""
  info, i32 = jnp.iinfo(x.dtype), jnp.iinfo(jnp.int32)
  if info.min >= i32.min and info.max <= i32.max:
    return x.astype(jnp.int32)
  outside = x > i32.max
  if info.min < i32.min:
    outside |= x < i32.min
  return jnp.where(outside, -1, x.astype(jnp.int32))
