"""The fused MoE kernel: dispatch, grouped matmul and combine in one launch.

One ``mpmd_map`` launch per device (inside ``jax.shard_map``), two meshes:

* the **dispatch** mesh (one program) pushes this device's sorted token rows
  to their experts' devices by remote DMA, one tile of ``tm`` rows at a
  time, then waits for the tiles other devices push here and, as each one
  lands, signals the compute program;
* the **compute** mesh (one program) runs the experts' MLP
  (``activation(x @ w_in[e]) @ w_out[e]``) on each tile as soon as it is
  signalled, starting with this device's own rows (read in place, they
  need no exchange), and pushes each result tile straight back to the
  device that sent it; last it waits for its own rows' results.

So the grouped matmul of the first tiles overlaps the transfer of the
later ones, and the return of each result tile overlaps the matmul of the
next: the communication the unfused layer does in two separate exchanges
(each a launch that ends before ``gmm`` starts) hides behind compute.

Layout. A receiver keeps one slot of ``slot`` rows (a multiple of ``tm``)
per source device; source ``s``'s rows land in slot ``s`` in the order the
source sorted them (by local expert), so a tile of a slot holds rows of one
or a few experts: the compute program multiplies, by each expert whose
rows the tile holds, the tile (TPU) or the smallest window of it around
those rows (CPU), and keeps, row by row, the product of the row's expert.
Results go back into slot ``t`` (the receiver's position) of the source's
``returned`` buffer, and the layer gathers them into sorted order. Tiles
are whole: the last tile of a slice carries rows past it (the sender's
next rows, or padding), which land inside the receiver's slot and are
masked out, so every DMA has a static shape and every row read was
written. The slots (``received``) and their results (``results``) are
staging buffers in HBM: kernel outputs on TPU, scratch on the CPU
fallback, where an output is copied back to XLA at every launch
(``_Plan.staging_in_scratch``).

Synchronisation. A remote DMA's receive semaphore is the issuing mesh's
semaphore on the receiving device (a DMA lands on the same program of the
other device): tile ``i`` from source ``s`` completes ``recv[s, i]`` of the
receiver's dispatch program, which waits for it and signals
``ready[s]`` of its compute program; a result tile completes ``back[t, i]``
of the source's compute program. One semaphore per (source, tile): no wait
can be satisfied by another tile's bytes. Before the first remote DMA the
dispatch programs meet on the barrier semaphore.

TPU: two TensorCore meshes, merged into one kernel. The dispatch program
never waits for the compute program (only the other way round), and its
mesh is listed first: where a device runs the two programs one after the
other rather than side by side, the launch still completes, without the
overlap. The natural SparseCore split (gather / scatter on
the SparseCores next to the TensorCore's matmul) is not lowerable yet:
``mpmd_map`` cannot launch a TensorCore kernel next to SparseCore kernels.
The compute program holds its experts' weights in VMEM
(``2 * El * H * F`` elements): sized for layers whose local experts fit.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mpmd import meshes, targets
from mpmd.kernels import _common
from mpmd.kernels.moe import _peers as peers_lib

_NAME = "moe_fused"
# Rows of a tile: a multiple of the 8 sublanes; 128 fills the MXU on TPU.
# On the CPU fallback every tile costs a few synchronisation steps of the
# executor, so tiles are larger there, and an expert multiplies only a
# window of the tile around its rows: the smallest of
# ``_common.STABLE_DOT_ROWS`` rows (every dot runs on at least that many
# rows there anyway), that plus ``_GRAIN``, plus twice ``_GRAIN``, ... or
# the whole tile that holds them, so a tile of two experts' rows is not
# multiplied twice whole. (Finer steps would compile more window sizes
# for little less padding.)
_TILE_ROWS = {"tpu": 128, "cpu": 512}
_GRAIN = 32
_SUBLANES = 8
# Rows of the metadata table (columns: group positions).
_SEND_OFF, _SEND, _RECV, _GROUP = range(4)
_DISPATCH, _COMPUTE = "moe_dispatch", "moe_compute"


class _Plan(NamedTuple):
  """Static shapes of one fused launch (hashable)."""

  groups: peers_lib.Groups
  experts_local: int
  tm: int  # rows per tile
  slot: int  # rows per source slot, a multiple of tm
  activation: Any
  least: int  # rows of the smallest window an expert multiplies; tm: none
  # Where the exchange's staging buffers (received, results) live: kernel
  # outputs in HBM on TPU (as upstream's distributed kernels hold remote
  # DMA targets), HBM scratch on the CPU fallback, where an output costs
  # a copy of all its rows back to XLA at every launch.
  staging_in_scratch: bool

  @property
  def tiles(self) -> int:
    """Tiles per slot."""
    return self.slot // self.tm

  @property
  def windows(self) -> tuple[int, ...]:
    """The window sizes an expert's rows in a tile may take: ``least``,
    then every ``_GRAIN`` more rows below ``tm``, then the whole tile."""
    return (*range(self.least, self.tm, _GRAIN), self.tm)

  def window_of(self, rows: jax.Array) -> jax.Array:
    """The index in ``windows`` of the smallest window of ``rows`` rows
    (at least one)."""
    more = jnp.maximum(rows - self.least + _GRAIN - 1, 0) // _GRAIN
    return jnp.minimum(more, len(self.windows) - 1)


def _plan(
  groups,
  experts_local: int,
  per_source: int,
  activation,
  tile_rows: int | None = None,
) -> _Plan:
  """Tile and slot sizes for slices of at most ``per_source`` rows;
  ``tile_rows`` (a multiple of 8) overrides the platform's tile."""
  tpu = targets.platform() == "tpu"
  if tile_rows is None:
    tile_rows = _TILE_ROWS["tpu" if tpu else "cpu"]
  rows = max(_SUBLANES, -(-per_source // _SUBLANES) * _SUBLANES)
  tm = min(tile_rows, rows)
  slot = -(-rows // tm) * tm
  least = tm if tpu else min(tm, _common.STABLE_DOT_ROWS)
  return _Plan(groups, experts_local, tm, slot, activation, least, not tpu)


def _tiles(rows: jax.Array, tm: int) -> jax.Array:
  return (rows + tm - 1) // tm


class _Refs(NamedTuple):
  """The launch's Refs, as both programs see them."""

  xs: Any  # (rows + tm, H) HBM: this device's sorted rows, padded
  meta_hbm: Any  # (_GROUP + El, D) int32
  w_in: Any  # (El, H, F) HBM
  w_out: Any  # (El, F, H) HBM
  # The staging buffers (``_Plan.staging_in_scratch``)
  received: Any  # (D * slot, H) HBM: slot s holds source s's rows
  results: Any  # (D * slot, H) HBM: their MLP outputs
  returned: Any  # (D * slot, H) HBM: slot t: this device's rows, from t
  # The dispatch program's
  d_meta: Any  # SMEM copy of the metadata
  d_send: Any  # DMA semaphore of its sends
  d_recv: Any  # (D, tiles) DMA semaphores: tile i from source s landed
  # The compute program's
  c_meta: Any
  ready: Any  # (D,) REGULAR: tiles of source s that landed
  c_send: Any  # DMA semaphore of the result tiles it sends
  back: Any  # (D, tiles) DMA semaphores: result tile i from device t
  x_tile: Any  # (tm, H) VMEM
  y_tile: Any  # (tm, H) VMEM
  w_in_v: Any  # (El, H, F) VMEM
  w_out_v: Any  # (El, F, H) VMEM


def _tile_copy(src, dst, send, recv, peers, o: int):
  """A tile's remote DMA to the peer ``o`` positions on."""
  return pltpu.make_async_remote_copy(
    src, dst, send, recv, device_id=peers.ids[o]
  )


def _dispatch(p: _Plan, r: _Refs) -> None:
  """Sends every tile of this device's slices, relays every arrival."""
  d, tm, slot = p.groups.size, p.tm, p.slot
  pltpu.sync_copy(r.meta_hbm, r.d_meta)
  peers = peers_lib.Peers(p.groups)
  me = peers.position
  peers_lib.handshake(peers)

  def tile_to(o, i):
    target = peers.position_at(o)
    return _tile_copy(
      r.xs.at[pl.ds(r.d_meta[_SEND_OFF, target] + i * tm, tm)],
      r.received.at[pl.ds(me * slot + i * tm, tm)],
      r.d_send,
      r.d_recv.at[me, i],
      peers,
      o,
    )

  for o in range(1, d):
    n = _tiles(r.d_meta[_SEND, peers.position_at(o)], tm)
    _loop(n, lambda i, o=o: tile_to(o, i).start())
  # Arrivals, sources in the order the compute program takes them.
  here = {_COMPUTE: 0, **peers.ids[0]}
  for o in range(1, d):
    source = peers.position_at(d - o)

    def relay(i, o=o, source=source):
      _tile_copy(
        r.xs.at[pl.ds(0, tm)],
        r.received.at[pl.ds(source * slot + i * tm, tm)],
        r.d_send,
        r.d_recv.at[source, i],
        peers,
        d - o,
      ).wait_recv()
      pl.semaphore_signal(r.ready.at[source], 1, device_id=here)

    _loop(_tiles(r.d_meta[_RECV, source], tm), relay)
  for o in range(1, d):
    n = _tiles(r.d_meta[_SEND, peers.position_at(o)], tm)
    _loop(n, lambda i, o=o: tile_to(o, i).wait_send())


def _loop(n: jax.Array, body) -> None:
  """``body(i)`` for ``i`` in ``range(n)``, ``n`` known at run time."""

  def step(i, carry):
    body(i)
    return carry

  lax.fori_loop(0, n, step, 0)


def _experts(p: _Plan, r: _Refs, source, i) -> None:
  """``y_tile`` = each row of ``x_tile`` (row ``i * tm + q`` of source
  ``source``'s slice) through its local expert's MLP; rows past the slice
  are zeros."""
  tm = p.tm
  r.y_tile[...] = jnp.zeros(r.y_tile.shape, r.y_tile.dtype)
  lo = jnp.int32(0)
  for e in range(p.experts_local):
    hi = lo + r.c_meta[_GROUP + e, source]
    window = functools.partial(_window, p, r, e, lo - i * tm, hi - i * tm)
    if len(p.windows) == 1:  # the whole tile
      pl.when((lo < (i + 1) * tm) & (hi > i * tm))(lambda w=window: w(0, tm))
    else:
      # The expert's rows in this tile: [first, end) of the tile's rows.
      first = jnp.clip(lo - i * tm, 0, tm)
      end = jnp.clip(hi - i * tm, 0, tm)
      size = p.window_of(end - first)
      branches = [functools.partial(window, first, w) for w in p.windows]
      pl.when(end > first)(lambda s=size, b=branches: lax.switch(s, b))
    lo = hi


def _window(p: _Plan, r: _Refs, e: int, lo, hi, first, rows: int) -> None:
  """Rows ``[lo, hi)`` of the tile (clipped to it; ``first`` is the first
  of them inside it) through expert ``e``'s MLP, in a window of ``rows``
  rows from ``first`` (moved back to end with the tile); the window's
  other rows keep ``y_tile``'s values."""
  start = 0 if rows == p.tm else jnp.minimum(first, p.tm - rows)
  window = pl.ds(start, rows)
  dtype = r.x_tile.dtype
  # Rows rounded as gmm's windows round them (``_common.rows_dot``).
  h = _common.rows_dot(r.x_tile[window], r.w_in_v[e], 0, jnp.float32)
  a = _common.activated(p.activation, h, dtype)
  y = _common.rows_dot(a, r.w_out_v[e], 0, jnp.float32)
  at = start + lax.broadcasted_iota(jnp.int32, y.shape, 0)
  mine = (at >= lo) & (at < hi)
  r.y_tile[window] = jnp.where(mine, y.astype(dtype), r.y_tile[window])


def _compute(p: _Plan, r: _Refs) -> None:
  """The MLP of every tile that lands here, its result sent back."""
  d, tm, slot = p.groups.size, p.tm, p.slot
  pltpu.sync_copy(r.meta_hbm, r.c_meta)
  pltpu.sync_copy(r.w_in, r.w_in_v)
  pltpu.sync_copy(r.w_out, r.w_out_v)
  peers = peers_lib.Peers(p.groups)
  me = peers.position

  def own(i):  # this device's own rows: read in place, kept in place
    start = r.c_meta[_SEND_OFF, me] + i * tm
    pltpu.sync_copy(r.xs.at[pl.ds(start, tm)], r.x_tile)
    _experts(p, r, me, i)
    pltpu.sync_copy(r.y_tile, r.returned.at[pl.ds(me * slot + i * tm, tm)])

  _loop(_tiles(r.c_meta[_RECV, me], tm), own)

  def result_to(o, source, i):
    return _tile_copy(
      r.results.at[pl.ds(source * slot + i * tm, tm)],
      r.returned.at[pl.ds(me * slot + i * tm, tm)],
      r.c_send,
      r.back.at[me, i],
      peers,
      d - o,
    )

  for o in range(1, d):
    source = peers.position_at(d - o)

    def tile(i, o=o, source=source):
      pl.semaphore_wait(r.ready.at[source], 1)
      rows = pl.ds(source * slot + i * tm, tm)
      pltpu.sync_copy(r.received.at[rows], r.x_tile)
      _experts(p, r, source, i)
      pltpu.sync_copy(r.y_tile, r.results.at[rows])
      result_to(o, source, i).start()

    _loop(_tiles(r.c_meta[_RECV, source], tm), tile)
  # This device's rows, back from each peer; then its sends have left.
  for o in range(1, d):
    target = peers.position_at(o)

    def back(i, o=o, target=target):
      _tile_copy(
        r.results.at[pl.ds(0, tm)],
        r.returned.at[pl.ds(target * slot + i * tm, tm)],
        r.c_send,
        r.back.at[target, i],
        peers,
        o,
      ).wait_recv()

    _loop(_tiles(r.c_meta[_SEND, target], tm), back)
  for o in range(1, d):
    source = peers.position_at(d - o)
    n = _tiles(r.c_meta[_RECV, source], tm)
    _loop(n, lambda i, o=o, source=source: result_to(o, source, i).wait_send())


def _scratch(p: _Plan, dispatch, compute, hidden: int, ffn: int, dtype):
  d, el, tiles = p.groups.size, p.experts_local, p.tiles
  meta = (_GROUP + el, d)
  staging = (pltpu.HBM((d * p.slot, hidden), dtype),) * 2
  return (
    *(staging if p.staging_in_scratch else ()),
    pltpu.SMEM(meta, jnp.int32) @ dispatch,
    pltpu.SemaphoreType.DMA(()) @ dispatch,
    pltpu.SemaphoreType.DMA((d, tiles)) @ dispatch,
    pltpu.SMEM(meta, jnp.int32) @ compute,
    pltpu.SemaphoreType.REGULAR((d,)) @ compute,
    pltpu.SemaphoreType.DMA(()) @ compute,
    pltpu.SemaphoreType.DMA((d, tiles)) @ compute,
    pltpu.VMEM((p.tm, hidden), dtype) @ compute,
    pltpu.VMEM((p.tm, hidden), dtype) @ compute,
    pltpu.VMEM((el, hidden, ffn), dtype) @ compute,
    pltpu.VMEM((el, ffn, hidden), dtype) @ compute,
  )


def _operands(p: _Plan) -> tuple[str, ...]:
  """The ``_Refs`` fields in the order of the kernel's operands: the
  inputs, the outputs (the staging buffers then ``returned``, or
  ``returned`` alone), the scratch (led by the staging buffers if they are
  scratch)."""
  names = _Refs._fields
  if not p.staging_in_scratch:
    return names
  i = names.index("received")  # (the inputs come before)
  return (*names[:i], "returned", *names[i : i + 2], *names[i + 3 :])


def _program(p: _Plan, body):
  """``body(p, refs)`` as a kernel whose operands carry the ``_Refs``
  names, so that errors name them."""
  names = _operands(p)

  @_common.operand_names(names)
  def kernel(*refs):
    body(p, _Refs(**dict(zip(names, refs, strict=True))))

  return kernel


def _launch(p: _Plan, xs, meta, w_in, w_out, *, interpret=None) -> jax.Array:
  """The fused launch on this device: ``returned`` (D * slot, H), slot
  ``t`` holding the MLP outputs of the rows this device sent device ``t``
  (in the order sent)."""
  d, el = p.groups.size, p.experts_local
  hidden, ffn = w_in.shape[1], w_in.shape[2]
  dtype = xs.dtype
  dispatch = meshes.tensorcore_mesh(_DISPATCH, num_cores=1)
  compute = meshes.tensorcore_mesh(_COMPUTE, num_cores=1)
  varying = peers_lib.varying(p.groups, xs, meta, w_in, w_out)
  buffer = _common.out_type((d * p.slot, hidden), dtype, varying)

  rows = d * p.slot
  itemsize = jnp.dtype(dtype).itemsize
  outs = peers_lib.launch(
    p.groups,
    interpret,
    None,
    (buffer,) * (1 if p.staging_in_scratch else 3),
    _scratch(p, dispatch, compute, hidden, ffn, dtype),
    meshes=[
      (dispatch, _program(p, _dispatch)),
      (compute, _program(p, _compute)),
    ],
    cost_estimate=pl.CostEstimate(
      flops=4 * rows * hidden * ffn * el,
      transcendentals=rows * ffn * el,
      bytes_accessed=(4 * rows * hidden + 2 * el * hidden * ffn) * itemsize,
    ),
    name=_NAME,
  )(xs, meta, w_in, w_out)
  return outs[-1]


def _metadata(groups, counts: jax.Array) -> jax.Array:
  """The kernel's (_GROUP + El, D) int32 table from ``counts`` (D, D, El):
  rows device j sends local expert el of device t."""
  me = lax.axis_index(groups.axes)
  pair = jnp.sum(counts, axis=2, dtype=counts.dtype)  # [j, t]: j to t
  send = lax.dynamic_index_in_dim(pair, me, axis=0, keepdims=False)
  recv = lax.dynamic_index_in_dim(pair, me, axis=1, keepdims=False)
  mine = lax.dynamic_index_in_dim(counts, me, axis=1, keepdims=False)
  send_off = jnp.cumsum(send, dtype=send.dtype) - send
  return jnp.concatenate([jnp.stack([send_off, send, recv]), mine.T]).astype(
    jnp.int32
  )


def expert_rows(
  groups,
  routing,
  rows_sorted,
  w_in,
  w_out,
  activation,
  *,
  tile_rows: int | None = None,
  interpret=None,
) -> jax.Array:
  """The fused launch for this device's sorted rows (inside
  ``shard_map``): what :func:`mpmd.kernels.moe` with ``fused=True`` runs
  between its routing and its weighted sum.

  Args:
    groups: the devices that exchange (``peers.check_groups``).
    routing: the layer's ``Routing`` (``layer.route``): its ``counts``
      (D, D, El) int32 say how many rows each device sends each expert.
    rows_sorted: (rows, H) float32 / bfloat16 / float16: this device's
      token rows sorted by global expert (dropped rows last).
    w_in: (El, H, F), w_out: (El, F, H) of ``rows_sorted``'s dtype.
    activation: applied to each row's ``x @ w_in[e]`` in float32.
    tile_rows: rows per tile (a multiple of 8), or None for the
      platform's.
    interpret: the ``mpmd_map`` ``interpret`` argument (e.g.
      ``mpmd.CheckParams(...)`` to pick a schedule).

  Returns:
    (rows, H) of ``rows_sorted``'s dtype: row ``r`` is its expert's
    ``activation(row @ w_in[e]) @ w_out[e]``; rows sent nowhere (dropped by
    a capacity) are zeros.

  Example: ``mpmd.kernels.moe(x, logits, w_in, w_out, top_k=2,
  axis_name="x", fused=True)`` inside ``jax.shard_map`` (its docstring
  runs one).
  """
  rows, hidden = rows_sorted.shape
  p = _plan(groups, w_in.shape[0], routing.per_source, activation, tile_rows)
  meta = _metadata(groups, routing.counts)
  pad = jnp.zeros((p.tm, hidden), rows_sorted.dtype)
  xs = jnp.concatenate([rows_sorted, pad])
  returned = _launch(p, xs, meta, w_in, w_out, interpret=interpret)
  send_off, send = meta[_SEND_OFF], meta[_SEND]
  r = jnp.arange(rows, dtype=jnp.int32)
  target = jnp.searchsorted(send_off + send, r, side="right").astype(jnp.int32)
  sent = r < jnp.sum(send, dtype=send.dtype)
  target = jnp.minimum(target, groups.size - 1)
  at = jnp.clip(
    target * p.slot + r - send_off[target], 0, returned.shape[0] - 1
  )
  return jnp.where(sent[:, None], returned[at], jnp.zeros_like(rows_sorted))
