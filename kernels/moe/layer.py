"""The expert-parallel mixture-of-experts layer: top-k routing, dispatch by
``ragged_all_to_all``, grouped matmuls over the local experts, combine by
the reverse exchange.

Per device (``D`` along ``axis_name``, ``El`` local experts, ``E = El * D``;
expert ``e`` lives on device ``e // El``)::

  top-k of the router logits      -> (T, K) experts and softmax weights
  sort the T * K (token, expert)  -> rows of x grouped by global expert
  all_gather of the per-expert counts (D, E): every device knows where
    every slice goes, so no device waits for another to learn its offsets
  dispatch: ragged_all_to_all, one slice per device pair (a device's rows
    for another device's experts are contiguous), landing by source
  regroup the arrivals by local expert (a row gather)
  gmm(rows, w_in) -> activation -> gmm(., w_out) over the El local experts
  regroup by source, combine: the reverse ragged_all_to_all, back to the
    sorted order
  unsort, weight, sum over the K choices -> (T, H)

Dropless by default: a device's receive buffer holds every row that could
come to it, ``D * T * K`` (rounded up to whole sublane tiles), so no token
is dropped whatever the routing. With a capacity factor each expert takes
its first rows (devices in order), the rest are dropped before the
dispatch and the buffer holds ``El`` capacities. Differentiable in ``x``,
``router_logits``, ``w_in`` and ``w_out`` (the exchanges' and ``gmm``'s
custom VJPs, the rest plain JAX).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd.kernels import _common
from mpmd.kernels.collective_matmul._ring import check_ring
from mpmd.kernels.grouped_matmul import gmm
from mpmd.kernels.moe import _fused as fused_lib
from mpmd.kernels.moe import ragged
from mpmd.types import Interpret

_FN = "moe"
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
# Receive buffers are rounded up to whole (8, 128) tiles' rows, so that
# gmm's TPU row tile divides them.
_SUBLANES = 8


def _check(
  x,
  router_logits,
  w_in,
  w_out,
  top_k,
  axis_name,
  activation,
  fused,
  capacity_factor,
  return_dropped,
):
  """Validates the arguments; returns (axes' ring, top_k, capacity
  factor or None, return_dropped)."""
  ring = check_ring(_FN, axis_name, None)
  experts = _check_arrays(x, router_logits, w_in, w_out, ring)
  top_k = _common.check_int(_FN, "top_k", top_k)
  if top_k > experts:
    raise ValueError(
      f"{_FN}: expected 'top_k' <= the expert count {experts}, got {top_k}"
    )
  _check_activation(activation, w_in.shape[2])
  _common.check_bool(_FN, "fused", fused)
  capacity_factor = _check_capacity_factor(capacity_factor)
  return_dropped = _common.check_bool(_FN, "return_dropped", return_dropped)
  return ring, top_k, capacity_factor, return_dropped


def _check_activation(activation, ffn: int) -> None:
  """A function that keeps the shape of the (rows, ffn) it is given."""
  if not callable(activation):
    raise TypeError(
      f"{_FN}: expected 'activation' to be a function, got {activation!r}"
    )
  h = jax.ShapeDtypeStruct((_SUBLANES, ffn), jnp.float32)
  shape = getattr(jax.eval_shape(activation, h), "shape", None)
  if shape != h.shape:
    raise ValueError(
      f"{_FN}: expected 'activation' to be elementwise, keeping the shape "
      f"(rows, ffn) of x @ w_in[e]; it maps {h.shape} to {shape}"
    )


def _check_arrays(x, router_logits, w_in, w_out, ring) -> int:
  """Validates the four arrays' kinds, dtypes and shapes against each other
  and ``ring``; returns the expert count."""
  _common.check_array(_FN, "x", x, rank=2, shape_doc="(tokens, hidden)")
  _common.check_array(
    _FN, "router_logits", router_logits, rank=2, shape_doc="(tokens, experts)"
  )
  _common.check_array(
    _FN, "w_in", w_in, rank=3, shape_doc="(experts_local, hidden, ffn)"
  )
  _common.check_array(
    _FN, "w_out", w_out, rank=3, shape_doc="(experts_local, ffn, hidden)"
  )
  dtype = _common.check_dtype(_FN, "x", x, _FLOATS)
  if not jnp.issubdtype(router_logits.dtype, jnp.floating):
    raise TypeError(
      f"{_FN}: expected 'router_logits' of a floating dtype, got "
      f"{jnp.dtype(router_logits.dtype).name}"
    )
  for arg, w in (("w_in", w_in), ("w_out", w_out)):
    if jnp.dtype(w.dtype) != dtype:
      raise TypeError(
        f"{_FN}: expected '{arg}' of x's dtype {dtype.name}, got "
        f"{jnp.dtype(w.dtype).name}"
      )
  tokens, hidden = x.shape
  if router_logits.shape[0] != tokens:
    raise ValueError(
      f"{_FN}: expected 'router_logits' (tokens, experts) with x's "
      f"tokens={tokens}, got shape {tuple(router_logits.shape)}"
    )
  experts_local, w_hidden, ffn = w_in.shape
  if w_hidden != hidden:
    raise ValueError(
      f"{_FN}: expected 'w_in' (experts_local, hidden, ffn) with x's "
      f"hidden={hidden}, got shape {tuple(w_in.shape)}"
    )
  if tuple(w_out.shape) != (experts_local, ffn, hidden):
    raise ValueError(
      f"{_FN}: expected 'w_out' (experts_local, ffn, hidden) = "
      f"{(experts_local, ffn, hidden)} (from w_in {tuple(w_in.shape)}), got "
      f"shape {tuple(w_out.shape)}"
    )
  experts = router_logits.shape[1]
  devices = ring.size
  if experts % devices:
    raise ValueError(
      f"{_FN}: expected the expert count (router_logits.shape[-1] = "
      f"{experts}) to be divisible by the {devices} devices along "
      f"{ring.axes!r}"
    )
  if experts != experts_local * devices:
    raise ValueError(
      f"{_FN}: expected the expert count (router_logits.shape[-1] = "
      f"{experts}) to equal experts_local x devices = {experts_local} x "
      f"{devices} (w_in holds {experts_local} experts per device)"
    )
  return experts


def _check_capacity_factor(capacity_factor) -> float | None:
  if capacity_factor is None:
    return None
  if isinstance(capacity_factor, bool) or not isinstance(
    capacity_factor, int | float | np.integer | np.floating
  ):
    raise TypeError(
      f"{_FN}: expected 'capacity_factor' to be None or a number, got "
      f"{capacity_factor!r}"
    )
  capacity_factor = float(capacity_factor)
  if not capacity_factor > 0:
    raise ValueError(
      f"{_FN}: expected 'capacity_factor' > 0, got {capacity_factor}"
    )
  return capacity_factor


def _check_tile_rows(tile_rows, fused: bool) -> int | None:
  if tile_rows is None:
    return None
  tile_rows = _common.check_int(
    _FN, "tile_rows", tile_rows, multiple_of=_SUBLANES, why="sublanes"
  )
  if not fused:
    raise ValueError(
      f"{_FN}: 'tile_rows' sets the fused kernel's tiles; pass fused=True "
      f"with it (got tile_rows={tile_rows}, fused=False)"
    )
  return tile_rows


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(x, axis=axis, dtype=x.dtype) - x


def moe(
  x: jax.Array,
  router_logits: jax.Array,
  w_in: jax.Array,
  w_out: jax.Array,
  *,
  top_k: int,
  axis_name: str | tuple[str, ...],
  activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
  fused: bool = False,
  capacity_factor: float | None = None,
  return_dropped: bool = False,
  tile_rows: int | None = None,
  interpret: Interpret = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """An expert-parallel mixture-of-experts layer (dropless by default).

  Call inside ``jax.shard_map`` over ``axis_name``: ``x`` and
  ``router_logits`` are this device's tokens, ``w_in`` / ``w_out`` its
  experts (expert ``e`` lives on device ``e // experts_local``). Per token,
  the result is the sum over its ``top_k`` experts (``jax.lax.top_k`` of
  the logits, ties to the lower index) of ``weight * (activation(x @
  w_in[e]) @ w_out[e])``, the weights being the softmax of the chosen
  logits. Tokens travel to their experts' devices by
  :func:`ragged_all_to_all` and back by the reverse exchange; each device
  runs ``gmm`` over its local experts. Both run their default
  ``implementation`` (what a TPU runs when building for or simulating one:
  ``"conditional"`` and ``"tiled"``; on the CPU fallback ``"window"`` and
  ``"windows"``). Differentiable in ``x``, ``router_logits``, ``w_in`` and
  ``w_out``.

  With ``fused=True`` the dispatch, the experts' matmuls and the return
  exchange are one ``mpmd_map`` launch of two meshes per device: a dispatch
  program sends token rows by remote DMA, tile by tile, and signals each
  tile's arrival to a compute program, which runs the experts' MLP on it at
  once and sends the result straight back, so communication overlaps
  compute (see ``mpmd/kernels/moe/_fused.py``). Same routing, same
  capacity drops, the same products summed in the same order: on the CPU
  fallback the same numbers, bit for bit (both run every dot on at least
  128 rows there, so that XLA:CPU rounds a row the same whatever rows
  surround it: ``kernels/_common.py``, ``rows_dot``). Its gradient is
  the unfused layer's (a custom VJP that recomputes the layer unfused: the
  fused kernel keeps no intermediates), computed inside another XLA graph:
  the router logits' gradient may differ from the unfused call's in its
  last bit (XLA:CPU sums the weights' cotangents in another order there).
  Its layout is the platform's where
  it is traced: on TPU, or inside ``mpmd.tpu_target()`` to cross-lower
  from a CPU host, 128-row tiles and the exchange's staging buffers as
  kernel outputs; on the CPU fallback larger tiles and the staging
  buffers as scratch (an output costs a copy back to XLA there).

  Args:
    x: (tokens, hidden) float32, bfloat16 or float16: this device's tokens.
    router_logits: (tokens, experts) of any floating dtype (say float32 with
      bfloat16 tokens); experts = experts_local x the axis size.
    w_in: (experts_local, hidden, ffn) of ``x``'s dtype.
    w_out: (experts_local, ffn, hidden) of ``x``'s dtype.
    top_k: experts per token, 1 <= top_k <= experts.
    axis_name: the ``shard_map`` mesh axis the experts are spread over (or a
      tuple of axes: their flattened index).
    activation: applied to ``x @ w_in[e]`` in float32.
    fused: run dispatch, experts and combine as one two-mesh launch that
      overlaps the exchanges with the experts' matmuls (see above).
    capacity_factor: None (dropless: a device can take every row sent to
      it), or each expert takes at most ``ceil(capacity_factor * tokens *
      top_k * D / experts)`` rows (that factor times its share of a
      uniform routing), first come first served in the order (device,
      token, choice); a dropped (token, expert) pair adds nothing to the
      token's sum (the other weights are not renormalized). Receive
      buffers shrink to ``experts_local`` capacities. A factor of at least
      the expert count (``math.inf`` included) drops nothing: as None.
    return_dropped: also return which (token, choice) pairs were dropped.
    tile_rows: with ``fused=True``, rows per tile moved and multiplied at
      once (a multiple of 8; default 128 on TPU, 512 on the CPU fallback;
      a tile larger than the rows one device can send another is cut to
      them). Only with ``fused``.
    interpret: passed to every ``mpmd_map`` launch of the layer: None runs
      natively on TPU and on the CPU fallback elsewhere;
      ``pltpu.InterpretParams(detect_races=True)`` runs them in Pallas'
      TPU simulator, ``mpmd.CheckParams(schedule=...)`` on the checking
      executor under a given schedule.

  Returns:
    (tokens, hidden) array of ``x``'s dtype; with ``return_dropped``, also
    a (tokens, top_k) bool array: True where the token's choice was dropped
    (never, when dropless).

  Raises:
    TypeError: an argument of the wrong kind or dtype.
    ValueError: shapes that disagree, an expert count that is not
      experts_local x the axis size, ``top_k`` out of range, a
      ``capacity_factor`` <= 0, a ``tile_rows`` that is not a positive
      multiple of 8 or comes without ``fused=True``, or a call outside
      ``shard_map`` over ``axis_name``.

  Example:
    >>> mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    >>> keys = jax.random.split(jax.random.key(0), 4)
    >>> x = jax.random.normal(keys[0], (2 * 6, 16))  # 6 tokens per device
    >>> logits = jax.random.normal(keys[1], (2 * 6, 4))  # 4 experts
    >>> w_in = jax.random.normal(keys[2], (4, 16, 32)) / 4
    >>> w_out = jax.random.normal(keys[3], (4, 32, 16)) / 6
    >>> layer = jax.jit(jax.shard_map(
    ...   functools.partial(mpmd.kernels.moe, top_k=2, axis_name="x"),
    ...   mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    >>> place = lambda a: jax.device_put(a, NamedSharding(mesh, P("x")))
    >>> y = layer(*map(place, (x, logits, w_in, w_out)))
    >>> y.shape, y.dtype
    ((12, 16), dtype('float32'))
    >>> fused = jax.jit(jax.shard_map(
    ...   functools.partial(mpmd.kernels.moe, top_k=2, axis_name="x",
    ...                     fused=True),
    ...   mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    >>> bool(jnp.all(fused(*map(place, (x, logits, w_in, w_out))) == y))
    True
  """
  _, top_k, capacity_factor, return_dropped = _check(
    x,
    router_logits,
    w_in,
    w_out,
    top_k,
    axis_name,
    activation,
    fused,
    capacity_factor,
    return_dropped,
  )
  if capacity_factor is not None and capacity_factor >= router_logits.shape[1]:
    # Each expert could take every row of every device: nothing drops.
    capacity_factor = None
  tile_rows = _check_tile_rows(tile_rows, fused)
  groups = ragged.check_groups(_FN, axis_name, None)
  static = _Static(
    groups, top_k, activation, capacity_factor, tile_rows, interpret
  )
  if not x.shape[0]:  # an empty batch: nothing to route
    varying = _common.varying_axes(x, router_logits, w_in, w_out)
    y = _common.vary(jnp.zeros(x.shape, x.dtype), varying)
    dropped = _common.vary(jnp.zeros((0, top_k), jnp.bool_), varying)
  elif fused:
    y, dropped = _fused_layer(static, x, router_logits, w_in, w_out)
  else:
    y, dropped = _layer(static, False, x, router_logits, w_in, w_out)
  if return_dropped:
    return y, dropped
  return y


class _Static(NamedTuple):
  """The layer's static arguments (the fused layer's custom_vjp's
  nondiff argument)."""

  groups: ragged.Groups
  top_k: int
  activation: Callable[[jax.Array], jax.Array]
  capacity_factor: float | None
  tile_rows: int | None
  interpret: Interpret


class Routing(NamedTuple):
  """Where each device's (token, choice) rows go, from the top-k routing.

  ``rows = tokens * top_k`` per device; rows sorted by global expert, the
  dropped ones (with a capacity) last."""

  weights: jax.Array  # (tokens, top_k) f32: softmax of the chosen logits
  order: jax.Array  # (rows,) int32: the (token, choice) of each sorted row
  dropped: jax.Array  # (rows,) bool, in (token, choice) order
  # (D, D, El) int32: rows device j sends local expert el of device t.
  counts: jax.Array
  capacity: int  # rows a device's receive buffer holds (static)
  per_source: int  # the most rows one device can send another (static)


def route(
  static: _Static, router_logits: jax.Array, experts_local: int
) -> Routing:
  """Top-k, softmax weights, the (capacity-clipped) counts every device
  sends every expert, and this device's rows sorted by expert."""
  devices, top_k = static.groups.size, static.top_k
  axis_name = static.groups.axes
  tokens = router_logits.shape[0]
  experts = experts_local * devices
  rows = tokens * top_k
  i32 = jnp.int32
  chosen, expert = lax.top_k(router_logits.astype(jnp.float32), top_k)
  weights = jax.nn.softmax(chosen, axis=-1)
  expert = expert.reshape(rows).astype(i32)
  counts = jnp.zeros((experts,), i32).at[expert].add(1)
  # all_counts[j, e]: rows device j routes to expert e.
  all_counts = lax.all_gather(counts, axis_name)
  if static.capacity_factor is None:
    dropped = jnp.zeros((rows,), jnp.bool_)
    capacity = _round_up(devices * rows, _SUBLANES)
    per_source = rows
  else:
    # Each expert takes its first per_expert rows, devices in order.
    per_expert = math.ceil(static.capacity_factor * rows * devices / experts)
    earlier = _exclusive_cumsum(all_counts, axis=0)
    all_counts = jnp.clip(per_expert - earlier, 0, all_counts)
    me = lax.axis_index(axis_name)
    room = lax.dynamic_index_in_dim(all_counts, me, axis=0, keepdims=False)
    by_expert_order = jnp.argsort(expert, stable=True)
    starts = _exclusive_cumsum(counts)[expert[by_expert_order]]
    rank = (
      jnp.zeros((rows,), i32)
      .at[by_expert_order]
      .set(jnp.arange(rows, dtype=i32) - starts)
    )
    dropped = rank >= room[expert]
    expert = jnp.where(dropped, experts, expert)  # sorted last, never sent
    per_source = min(rows, experts_local * per_expert)
    capacity = _round_up(
      min(devices * rows, experts_local * per_expert), _SUBLANES
    )
  order = jnp.argsort(expert, stable=True)
  return Routing(
    weights,
    order,
    dropped,
    all_counts.reshape(devices, devices, experts_local),
    capacity,
    per_source,
  )


def combine(returned: jax.Array, routing: Routing, dtype) -> jax.Array:
  """Rows back in sorted order (rows, H) -> (tokens, H): unsort, weight
  and sum the top-k choices in f32."""
  tokens, top_k = routing.weights.shape
  unsorted = jnp.zeros_like(returned).at[routing.order].set(returned)
  per_choice = unsorted.reshape(tokens, top_k, -1).astype(jnp.float32)
  y = jnp.einsum("tkh,tk->th", per_choice, routing.weights, precision="highest")
  return y.astype(dtype)


def _layer(static: _Static, fused: bool, x, router_logits, w_in, w_out):
  """The layer: (y, dropped (tokens, top_k) bool). (Not jitted of its own:
  under an outer jit, a nested one made its gradients' compiles about 15 %
  slower, measured; an eager call runs its ops one by one.)"""
  routing = route(static, router_logits, w_in.shape[0])
  rows_sorted = x[routing.order // static.top_k]
  if fused:
    returned = fused_lib.expert_rows(
      static.groups,
      routing,
      rows_sorted,
      w_in,
      w_out,
      static.activation,
      tile_rows=static.tile_rows,
      interpret=static.interpret,
    )
  else:
    returned = _unfused_rows(static, routing, rows_sorted, w_in, w_out)
  tokens = x.shape[0]
  dropped = routing.dropped.reshape(tokens, static.top_k)
  return combine(returned, routing, x.dtype), dropped


# The fused layer's backward pass is the unfused layer's: both compute the
# same function of the same arguments (the tests check their outputs agree),
# the unfused one from differentiable pieces (the exchanges' and gmm's
# custom VJPs). The forward pass is recomputed there (rematerialised), as
# a fused kernel keeps none of its intermediates.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_layer(static: _Static, x, router_logits, w_in, w_out):
  return _layer(static, True, x, router_logits, w_in, w_out)


def _fused_layer_fwd(static, x, router_logits, w_in, w_out):
  out = _layer(static, True, x, router_logits, w_in, w_out)
  return out, (x, router_logits, w_in, w_out)


def _fused_layer_bwd(static, residuals, cotangents):
  _, vjp = jax.vjp(functools.partial(_layer, static, False), *residuals)
  return vjp(cotangents)


_fused_layer.defvjp(_fused_layer_fwd, _fused_layer_bwd)


def _unfused_rows(static: _Static, routing: Routing, rows_sorted, w_in, w_out):
  """Dispatch (ragged all-to-all), gmm, activation, gmm, combine exchange:
  (rows, H) results in this device's sorted order."""
  groups, interpret = static.groups, static.interpret
  dtype = rows_sorted.dtype
  rows, hidden = rows_sorted.shape
  # routing.counts[j, t, el]: rows from device j to local expert el of
  # device t. A device's rows for another device are contiguous (sorted by
  # expert), so each pair exchanges one slice, and a receiver keeps its
  # arrivals by source device (source-major).
  counts = routing.counts
  me = lax.axis_index(groups.axes)
  pair = jnp.sum(counts, axis=2, dtype=counts.dtype)  # [j, t]: j to t
  send_sizes = lax.dynamic_index_in_dim(pair, me, axis=0, keepdims=False)
  recv_sizes = lax.dynamic_index_in_dim(pair, me, axis=1, keepdims=False)
  sender_offsets = _exclusive_cumsum(pair, axis=1)  # [j, t], in j's rows
  landing = _exclusive_cumsum(pair, axis=0)  # [j, t], in t's buffer
  mine = lax.dynamic_index_in_dim(counts, me, axis=1, keepdims=False)
  group_sizes = jnp.sum(mine, axis=0, dtype=mine.dtype)  # (experts_local,)
  by_expert, by_source = _regroupings(mine, routing.capacity)
  dispatched = ragged.checked_call(
    groups,
    rows_sorted,
    jnp.zeros((routing.capacity, hidden), dtype),
    _exclusive_cumsum(send_sizes),
    send_sizes,
    lax.dynamic_index_in_dim(landing, me, axis=0, keepdims=False),
    recv_sizes,
    interpret=interpret,
    checked=False,  # (consistent by construction)
  )
  h = gmm(
    dispatched[by_expert],
    w_in,
    group_sizes,
    preferred_element_type=jnp.float32,
    interpret=interpret,
  )
  a = _common.activated(static.activation, h, dtype)
  # f32 out, then cast: gmm's VJP with a bf16 output hands XLA:CPU (jax
  # 0.12) a bf16 x bf16 = f32 dot it cannot run ("DotThunk").
  out = gmm(
    a,
    w_out,
    group_sizes,
    preferred_element_type=jnp.float32,
    interpret=interpret,
  )
  out = out.astype(dtype)
  return ragged.checked_call(
    groups,
    out[by_source],
    jnp.zeros((rows, hidden), dtype),
    lax.dynamic_index_in_dim(landing, me, axis=1, keepdims=False),
    recv_sizes,
    lax.dynamic_index_in_dim(sender_offsets, me, axis=1, keepdims=False),
    send_sizes,
    interpret=interpret,
    checked=False,
  )


def _regroupings(mine: jax.Array, capacity: int):
  """Row maps between a receiver's two layouts of its ``capacity`` rows:
  by source device (as they arrive: source j's rows for each local expert
  in expert order) and by local expert (as ``gmm`` takes them: expert el's
  rows from each source in source order). ``mine[j, el]``: the rows source
  ``j`` sends local expert ``el``. Returns ``(by_expert, by_source)``:
  ``by_expert[p]`` is the source-major row of expert-major row ``p``, and
  ``by_source`` the inverse (rows past the arrivals map anywhere in range:
  ``gmm`` ignores them and nothing sends them back)."""
  devices, experts_local = mine.shape
  source_major = _exclusive_cumsum(mine.reshape(-1)).reshape(mine.shape)
  expert_major = _exclusive_cumsum(mine.T.reshape(-1)).reshape(mine.T.shape)

  def remap(starts, other_starts):
    # starts: segment starts in the layout being indexed (flattened in its
    # order); other_starts: the same segments' starts in the other layout.
    rows = jnp.arange(capacity, dtype=jnp.int32)
    # The last segment starting at or before each row (an empty segment
    # shares its start with the next one, which is the one that holds it).
    segment = jnp.searchsorted(starts, rows, side="right") - 1
    moved = other_starts[segment] + rows - starts[segment]
    return jnp.clip(moved, 0, capacity - 1).astype(jnp.int32)

  by_expert = remap(expert_major.reshape(-1), source_major.T.reshape(-1))
  by_source = remap(source_major.reshape(-1), expert_major.T.reshape(-1))
  return by_expert, by_source


def _round_up(n: int, multiple: int) -> int:
  return max(multiple, math.ceil(n / multiple) * multiple)
