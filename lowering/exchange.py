"""The lockstep path's exchanges between devices: semaphores as int32 counts
that a short wait poisons, remote operations issued in a row batched into one
XLA collective (an all_gather of packed words; large data by ppermute), and
where each arriving DMA or signal lands. A wait on the semaphore of a pending
operation waits for the exchange that lands it instead of forcing one."""

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd import _jax
from mpmd._jax import (
  core,
  pallas_core,
  state_primitives,
  state_types,
  tpu,
  tree_util,
)
from mpmd.lowering import device_ids

# Far below any count a kernel reaches, and far from wrapping around.
_POISON = -(1 << 30)


def signal(sem: Any, inc: Any) -> None:
  """Adds ``inc`` to a semaphore, unless it is poisoned (negative)."""
  before = state_primitives.ref_get(sem, None)
  inc = jnp.asarray(inc, jnp.int32)
  state_primitives.ref_set(
    sem, None, jnp.where(before < 0, before, before + inc)
  )


def wait(sem: Any, value: Any, decrement: bool = True) -> Any:
  """Takes ``value`` from a semaphore, or poisons it if it holds less;
  returns whether it held enough."""
  before = state_primitives.ref_get(sem, None)
  value = jnp.asarray(value, jnp.int32)
  after = before - value if decrement else before
  state_primitives.ref_set(sem, None, jnp.where(before < value, _POISON, after))
  return jnp.all(before >= value)


def ref_bytes(ref: Any) -> int:
  """What a DMA of ``ref``'s shape adds to its semaphores (bytes, as on
  hardware and in the simulator)."""
  return math.prod(ref.shape) * np.dtype(ref.dtype).itemsize


def widen(aval: Any) -> Any:
  """Semaphore counts as int32 (Pallas' interpreters use int16)."""
  if (
    is_count(aval)
    and aval.inner_aval.dtype == pallas_core.SEMAPHORE_INTERPRET_DTYPE
  ):
    return aval.update(inner_aval=aval.inner_aval.update(dtype=jnp.int32))
  return aval


def is_count(aval: Any) -> bool:
  """A Ref in semaphore memory (of physical integer counts)."""
  if not isinstance(aval, state_types.AbstractRef):
    return False
  space = aval.memory_space
  # Scratch placed on one mesh's cores (`SEMAPHORE @ mesh`) wraps the space.
  if isinstance(space, pallas_core.CoreMemorySpace):
    space = space.memory_space
  return space == tpu().core.MemorySpace.SEMAPHORE


def with_transforms(ref: Any, transforms: Any) -> Any:
  if not transforms:
    return ref
  return state_types.TransformedRef(ref, tuple(transforms))


def _split(ref: Any) -> tuple[Any, tuple[Any, ...]]:
  if isinstance(ref, state_types.TransformedRef):
    return ref.ref, ref.transforms
  return ref, ()


class Devices:
  """The devices a kernel exchanges with: those differing along the axes
  its device ids name (``exchange_axes``)."""

  def __init__(self, axes, sizes: dict[Any, int], all_axes):
    self.axes = axes  # those the kernel exchanges along
    self.all_axes = all_axes  # every axis of the shard_map
    self.sizes = tuple(sizes[a] for a in axes)
    self._patterns: dict[tuple[Any, ...], Any] = {}
    self.top_trace: Any = None  # set when the kernel's rewrite starts
    # What the kernel computes from the device's coordinates alone, on
    # every device (set before the rewrite where ``axes`` are all the
    # shard_map's: a device id names a device of ``axes`` only).
    self.known: device_ids.Known | None = None

  @property
  def count(self) -> int:
    return math.prod(self.sizes)

  def _by_axis(self, device_id: Any) -> dict[Any, Any]:
    """``device_id`` as a dict (an index alone is along the first axis)."""
    if isinstance(device_id, dict):
      return device_id
    return {self.axes[0]: device_id}

  def flat(self, device_id: Any) -> Any:
    """The flat index of ``device_id`` (a dict, or an index along the only
    axis); axes a dict leaves out keep this device's coordinate."""
    device_id = self._by_axis(device_id)
    index = jnp.int32(0)
    for a, size in zip(self.axes, self.sizes, strict=True):
      coord = device_id.get(a)
      coord = lax.axis_index(a) if coord is None else coord
      index = index * size + jnp.asarray(coord, jnp.int32)
    return index

  def me(self) -> Any:
    return self.flat({})

  def static_shift(self, device_id: Any) -> int | None:
    """``k`` if ``device_id`` (the kernel's Vars and Literals) is known
    when traced and names, on every device, the device ``k`` flat
    positions on (a ring shift); None otherwise."""
    known = self.known
    if known is None:
      return None
    device_id = self._by_axis(device_id)
    index = np.zeros(self.count, np.int64)
    for a, size in zip(self.axes, self.sizes, strict=True):
      coord = device_id.get(a)
      coord = known.coords(a) if coord is None else known.value(coord)
      if coord is None or np.any((coord < 0) | (coord >= size)):
        return None
      index = index * size + coord
    shifts = (index - np.arange(self.count)) % self.count
    return int(shifts[0]) if np.all(shifts == shifts[0]) else None

  def _key(self, device_id: Any) -> tuple[Any, ...] | None:
    """The pattern cache's key of ``device_id``, if it may be remembered:
    only values of the top-level trace are, and forgotten before it ends,
    so that no tracer outlives its trace."""
    leaves, treedef = tree_util.tree_flatten(device_id)
    if not all(
      isinstance(x, core.Tracer) and _jax.tracer_trace(x) is self.top_trace
      for x in leaves
    ):
      return None
    return (treedef, *map(id, leaves))

  def known_pattern(self, device_id: Any) -> Any | None:
    """The ``pattern`` found before for this device-id value, if any (the
    same traced value targets the same devices)."""
    key = self._key(device_id)
    return None if key is None else self._patterns.get(key, (None, None))[1]

  def pattern(self, device_id: Any, target_all: Any) -> Any:
    """``k`` if every device sends to the device ``k`` flat positions on (a
    ring shift), ``count`` otherwise, from every device's target (flat
    indices, gathered); remembered for ``device_id``."""
    offsets = lax.rem(
      target_all - jnp.arange(self.count, dtype=jnp.int32) + self.count,
      self.count,
    )
    # Out-of-range ids take the gathered path, where they reach nobody.
    in_range = jnp.logical_and(target_all >= 0, target_all < self.count)
    uniform = jnp.all(jnp.logical_and(offsets == offsets[0], in_range))
    branch = jnp.where(uniform, offsets[0], self.count)
    key = self._key(device_id)
    if key is not None:
      # The leaves stay referenced so that their ids stay theirs.
      self._patterns[key] = (tree_util.tree_leaves(device_id), branch)
    return branch

  def forget(self) -> None:
    """Drops the remembered patterns and their tracers (trace ending)."""
    self._patterns.clear()
    self.top_trace = None

  def shift(self, k: int, tree: Any) -> Any:
    """``tree`` of the device ``k`` flat positions back (a ring shift)."""
    if k == 0:
      return tree
    perm = [(i, (i + k) % self.count) for i in range(self.count)]
    return tree_util.tree_map(lambda x: lax.ppermute(x, self.axes, perm), tree)

  def gather(self, tree: Any) -> Any:
    """Every device's ``tree``, stacked (None for static leaves, which every
    device shares), in one collective (``_Gathered``)."""
    leaves, treedef = tree_util.tree_flatten(tree)
    gathered = _Gathered(self.axes, leaves)
    return tree_util.tree_unflatten(
      treedef, [gathered.stacked(i) for i in range(len(leaves))]
    )


class _Gathered:
  """Every device's ``leaves``, gathered in one collective: each collective
  is a rendezvous of every device. Static leaves (Python ints, the same on
  every device) stay behind."""

  def __init__(self, axes: Any, leaves: list[Any]):
    self._leaves = leaves
    self._where: dict[int, int] = {}  # leaf -> offset in the words
    self.words: jax.Array | None = None  # every device's, once gathered
    traced = [i for i, x in enumerate(leaves) if _traced(x)]
    if not traced:
      return
    arrays = {i: jnp.asarray(leaves[i]) for i in traced}
    # Packed in words of the widest payload's width: a bitcast between
    # types of one width is free, between widths it is not (XLA shifts and
    # adds every byte), so only the small leaves change width.
    widest = max(arrays.values(), key=lambda x: x.size * _byte_width(x.dtype))
    self._word = _WORDS[_byte_width(widest.dtype)]
    offset = 0
    for i, x in arrays.items():
      self._where[i] = offset
      offset += _num_words(x, self._word)
    self._arrays = arrays
    self.words = lax.all_gather(
      jnp.concatenate([_to_words(x, self._word) for x in arrays.values()]),
      axes,
    )

  def _slice(self, i: int, rows: jax.Array) -> jax.Array:
    start = self._where[i]
    return rows[:, start : start + _num_words(self._arrays[i], self._word)]

  def stacked(self, i: int) -> Any:
    """Leaf ``i`` of every device, stacked (None if static)."""
    if i not in self._where:
      return None
    return _from_words(self._slice(i, self.words), self._arrays[i])

  def row(self, i: int, j: Any) -> Any:
    """Leaf ``i`` of device ``j`` (traced): picked while still in words,
    so that XLA copies one row only (a pick after the bitcast to bf16 it
    upcasts whole, and splits across threads)."""
    if i not in self._where:
      return self._leaves[i]
    rows = lax.dynamic_slice_in_dim(self._slice(i, self.words), j, 1)
    return _from_words(rows, self._arrays[i])[0]


# Unsigned words of each width: collectives move them bit-exactly.
_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _byte_width(dtype: Any) -> int:
  return 1 if dtype == jnp.bool_ else np.dtype(dtype).itemsize


def _num_words(x: jax.Array, word: Any) -> int:
  width = np.dtype(word).itemsize
  return -(-x.size * _byte_width(x.dtype) // width)


def _to_words(x: jax.Array, word: Any) -> jax.Array:
  """``x`` as a flat vector of ``word`` (zero-padded)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  width = np.dtype(word).itemsize
  if x.dtype.itemsize == width:
    return lax.bitcast_convert_type(x, word).reshape(-1)
  flat = lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)
  flat = jnp.pad(flat, (0, _num_words(x, word) * width - flat.size))
  if width == 1:
    return flat
  return lax.bitcast_convert_type(flat.reshape(-1, width), word)


def _from_words(rows: jax.Array, like: jax.Array) -> jax.Array:
  """Rows of ``_to_words`` of arrays like ``like``, stacked, as they were."""
  count, width = rows.shape[0], rows.dtype.itemsize
  byte_width = _byte_width(like.dtype)
  if byte_width != width:
    rows = lax.bitcast_convert_type(rows, jnp.uint8).reshape(count, -1)
    rows = rows[:, : like.size * byte_width]
    if byte_width > 1:
      rows = rows.reshape(count, -1, byte_width)
  rows = rows.reshape(count, *like.shape, *rows.shape[2:])
  if like.dtype == jnp.bool_:
    return rows != 0
  return lax.bitcast_convert_type(rows, like.dtype)


def _witness(x: jax.Array) -> jax.Array:
  """One element of ``x``, computed only once all of ``x`` is: XLA would
  otherwise compute just that element from ``x``'s operands."""
  return jnp.ravel(lax.optimization_barrier(x))[:1]


def _traced(x: Any) -> bool:
  # Python ints (static indices) are the same on every device.
  return not isinstance(x, int)


def _row(stacked: jax.Array, j: Any) -> jax.Array:
  """``stacked[j]`` for a traced ``j`` in range: one dynamic slice (jnp
  indexing would also mask out-of-range rows, costing a pass over them)."""
  return lax.dynamic_index_in_dim(stacked, j, keepdims=False)


def _pick(leaves: list[Any], gathered: list[Any], j: Any) -> list[Any]:
  return [
    x if g is None else (g[j] if isinstance(j, int) else _row(g, j))
    for x, g in zip(leaves, gathered, strict=True)
  ]


def _nbytes(x: Any) -> int:
  return math.prod(jnp.shape(x)) * np.dtype(jnp.result_type(x)).itemsize


class _Send(NamedTuple):
  """A remote DMA or signal a device has issued, waiting for its exchange.

  ``moving``: what travels with it (the sender's dynamic indices into the
  receiver's buffer and semaphore, a signal's increment); ``land(data,
  moved, found, counted=None)`` writes it on the receiver if ``found``,
  counting it on its semaphore only where ``counted`` (a value that says
  the collective carrying it has run) is not False; ``refs``: the
  receiver's Refs it writes.
  """

  device_id: Any
  target: Any  # flat index of the receiving device
  data: Any  # a DMA's data; None for a signal
  moving: list[Any]
  land: Callable[..., None]
  refs: tuple[Any, ...]
  # The ring shift its device id makes on every device, if known when
  # traced (``Devices.static_shift``).
  shift: int | None = None


class _Frame:
  """One jaxpr's pending operations, and the waits on their semaphores
  (each with its semaphore Ref), in the order they were issued."""

  def __init__(self):
    self.sends: list[_Send] = []
    self.waits: list[tuple[Any, Callable[[], None]]] = []


class Exchanges:
  """Remote operations, batched: each exchange is one rendezvous of every
  device (a fixed cost that grows with the number of devices), and kernels
  issue them in runs (both neighbours' handshake signals, both ring
  directions' transfers and capacity signals).

  An issued operation lands on its receiver at the latest when the
  receiver's next equation touches a Ref it writes (a read of its buffer, a
  signal of its semaphore), or the jaxpr being rewritten (kernel, loop
  body) ends: until then its receiver cannot tell, so the kernel's results
  and semaphore counts are those of landing at once. Everything pending
  then travels in one exchange: small data and every device's indices and
  increments in one ``all_gather``; data large enough that gathering it
  everywhere would cost more than a rendezvous by a ring shift
  (``ppermute``), one per DMA. What every device knows when the kernel is
  traced does not travel: a target that is a known ring shift
  (``Devices.static_shift``), a literal increment; a signal with both lands
  with no collective at all.

  A wait on a semaphore that a pending operation writes (a handshake's, a
  reception's) does not force the exchange: it waits for it (``wait``),
  and runs in it after the pending operations have landed, so
  that a handshake travels with the first transfers. Its semaphore stays
  written by a pending operation until then, so that whatever touches it
  next exchanges first, and an operation issued later that writes it
  exchanges first too: the wait counts what was issued before it, on every
  device (they all run the same program, in step).
  """

  def __init__(self, devices: Devices):
    self.devices = devices
    self._frames: list[_Frame] = []

  @contextlib.contextmanager
  def frame(self):
    """Operations issued in one jaxpr are exchanged before it ends."""
    self._frames.append(_Frame())
    try:
      yield
      self.flush()
    finally:
      self._frames.pop()

  def issue(self, send: _Send) -> None:
    frame = self._frames[-1]
    waited = {id(sem) for sem, _ in frame.waits}
    if any(id(r) in waited for r in send.refs):
      # A wait before it must not count it.
      self.flush()
    frame.sends.append(send)

  def wait(self, sem: Any, take: Callable[[], None]) -> None:
    """Runs ``take``, a wait on the semaphore ``sem``, now, or in the next
    exchange if a pending operation writes ``sem``."""
    root = _split(sem)[0]
    frame = self._frames[-1]
    if any(r is root for send in frame.sends for r in send.refs):
      frame.waits.append((root, take))
    else:
      take()

  def flush_if_touched(self, eqn: core.JaxprEqn, invals: list[Any]) -> None:
    """Exchanges first if ``eqn`` touches a Ref of this device that a
    pending operation writes (as it writes the semaphore of every wait
    waiting for the exchange)."""
    pending = self._frames[-1].sends if self._frames else ()
    if not pending:
      return
    written = {id(r) for send in pending for r in send.refs}
    if any(id(_split(x)[0]) in written for x in _touched(eqn, invals)):
      self.flush()

  def flush(self) -> None:
    frame = self._frames[-1]
    sends, waits = frame.sends, frame.waits
    frame.sends, frame.waits = [], []
    if sends:
      self._exchange(sends)
    for _, take in waits:
      take()

  def _exchange(self, sends: list[_Send]) -> None:
    devices = self.devices
    count = devices.count
    # A collective permute waits for every device of the mesh, but only the
    # devices of this ring are sure to be here.
    may_shift = devices.axes == devices.all_axes
    budget = _GATHER_BYTES
    permuted, known = [], []
    for send in sends:
      cost = 0 if send.data is None else (count - 1) * _nbytes(send.data)
      by_shift = may_shift and cost > budget
      if not by_shift:
        budget -= cost
      permuted.append(by_shift)
      if send.shift is not None:
        known.append(send.shift)
      else:
        known.append(
          devices.known_pattern(send.device_id) if by_shift else None
        )
    # Every send's target (unless its ring shift is known), its moving
    # values, and its data unless a ring shift carries it: leaf 3 * n + f.
    leaves = []
    for send, p, k in zip(sends, permuted, known, strict=True):
      leaves += [
        None if k is not None else send.target,
        send.moving,
        None if p else send.data,
      ]
    if any(map(_traced, tree_util.tree_leaves(leaves))):
      # The gather waits for the shifted data too, as the device would:
      # XLA runs a collective as soon as its operands are ready, and one
      # that waits for the other devices holds a thread of XLA's pool (one
      # per device), starving the devices still at work (a matmul) of it.
      for n, (send, p) in enumerate(zip(sends, permuted, strict=True)):
        if p and send.data is not None:
          leaves[3 * n + 2] = _witness(send.data)
    flat, treedef = tree_util.tree_flatten(leaves)
    gathered = _Gathered(devices.axes, flat)
    # Where each of the 3 * n fields starts among the flat leaves.
    starts = np.cumsum(
      [0] + [t.num_leaves for t in treedef.children()]
    ).tolist()

    def field(n, f):
      lo, hi = starts[3 * n + f], starts[3 * n + f + 1]
      return [gathered.stacked(i) for i in range(lo, hi)]

    me = devices.me()
    # Shifts known when traced run unconditionally, before any landing.
    shifted = {
      n: devices.shift(k, send.data)
      for n, (send, p, k) in enumerate(zip(sends, permuted, known, strict=True))
      if p and isinstance(k, int)
    }
    # What lands where no collective decides it still counts on its
    # semaphores only once the collective that carries it (a signal: one of
    # this exchange's) has run: counts every device knows when traced would
    # fold to constants, and the failure report, which reads them, could
    # then run first; a device whose report raises stops there, and the
    # others would wait for it in the collective forever.
    collective = gathered.words
    if collective is None:
      collective = next(iter(shifted.values()), None)
    arrived = None if collective is None else _arrival(collective)
    crowded = []  # gathered DMAs and whether several devices sent them here
    for n, (send, p, k) in enumerate(zip(sends, permuted, known, strict=True)):
      moving_all = field(n, 1)
      if isinstance(k, int):  # a ring shift known when traced
        # Every device hears from the one k positions back.
        sender = lax.rem(me - k + count, count)
        moved = _pick(send.moving, moving_all, sender)
        if send.data is None:
          send.land(None, moved, moved[0], arrived)  # the sender's increment
          continue
        value = shifted.get(n)
        if value is None:
          value = gathered.row(starts[3 * n + 2], sender)
        send.land(value, moved, True, _arrival(value))
        continue
      if p:
        [target_all] = field(n, 0) or [None]
        branch = (
          k if k is not None else devices.pattern(send.device_id, target_all)
        )
        _land_shifted(devices, send, branch, moving_all)
        continue
      [target_all] = field(n, 0)
      if devices.known_pattern(send.device_id) is None:
        # For a later ring shift to the same devices (XLA drops it if none).
        devices.pattern(send.device_id, target_all)
      mine = target_all == me
      if send.data is None:
        _land_signal(send, mine, moving_all)
        continue
      first = jnp.argmax(mine)
      moved = _pick(send.moving, moving_all, first)
      data_leaf = starts[3 * n + 2]
      send.land(gathered.row(data_leaf, first), moved, mine[first])
      crowded.append((send, mine, first, data_leaf, moving_all))
    if crowded:
      # Rarely, several devices target one in the same exchange. (The data
      # unpacks inside, where it is needed: a conditional's operands are
      # materialised whether or not its branch runs.)
      def others():
        for send, mine, first, data_leaf, moving_all in crowded:
          data_all = gathered.stacked(data_leaf)
          for j in range(count):
            send.land(
              data_all[j],
              _pick(send.moving, moving_all, j),
              jnp.logical_and(mine[j], j != first),
            )

      several = [jnp.sum(mine.astype(jnp.int32)) > 1 for _, mine, *_ in crowded]
      lax.cond(functools.reduce(jnp.logical_or, several), others, lambda: None)


def _touched(eqn: core.JaxprEqn, invals: list[Any]) -> list[Any]:
  """What ``eqn`` reads or writes on this device (its Refs among them)."""
  name = eqn.primitive.name
  if name == "dma_start":
    src, dst, dst_sem, src_sem, device_id = eqn.params["tree"].unflatten(invals)
    if device_id is not None:  # its destination is another device's
      return [src, src_sem]
    return [src, dst, dst_sem, src_sem]
  if name == "semaphore_signal":
    sem, *_, device_id, _ = eqn.params["args_tree"].unflatten(invals)
    return [] if device_id is not None else [sem]
  return invals


# Data of a DMA travels in the batched all_gather while every other device
# receiving a copy costs less than this many bytes (per exchange): about
# what copying costs in the time of one rendezvous on a busy CPU.
_GATHER_BYTES = 1 << 20


def _land_signal(send: _Send, mine: Any, moving_all: list[Any]) -> None:
  inc, *_ = send.moving
  inc_all, *indices_all = moving_all
  if all(g is None for g in indices_all):
    # Static semaphore indices: one update with every sender's increment.
    received = jnp.where(mine, inc if inc_all is None else inc_all, 0)
    send.land(None, send.moving, jnp.sum(received))
    return
  for j in range(len(mine)):
    received = inc if inc_all is None else inc_all[j]
    moved = _pick(send.moving, moving_all, j)
    send.land(None, moved, jnp.where(mine[j], received, 0))


def _land_shifted(devices: Devices, send: _Send, branch, moving_all) -> None:
  """A DMA's data by ring shift (``ppermute``) when every device sends the
  same number of positions on (``branch``), else gathered. Each way lands
  it in its own branch of one two-way conditional (which updates the
  buffer in place): the shift lands unconditionally, with no pass over the
  buffer to keep what it held."""
  count, me, data = devices.count, devices.me(), send.data

  def by_shift():
    value = lax.switch(
      branch, [functools.partial(devices.shift, k, data) for k in range(count)]
    )
    # The sender is branch positions back.
    sender = lax.rem(me - branch + count, count)
    send.land(value, _pick(send.moving, moving_all, sender), True)

  def gathered():
    # Rarely: the devices send different numbers of positions on, or
    # several target this one (each lands, in device order).
    data_all, target_all = devices.gather((data, send.target))
    mine = target_all == me
    for j in range(count):
      send.land(data_all[j], _pick(send.moving, moving_all, j), mine[j])

  lax.cond(branch == count, gathered, by_shift)


def remote_copy(
  exchanges: Exchanges, src, dst, dst_sem, src_sem, device_id, shift=None
):
  """A remote DMA: its data leaves now, and lands on its target in step
  with every device, at the next exchange (``Exchanges``). Buffers are
  written outside any conditional where they can be (a conditional that
  threads a buffer costs XLA a copy of it). ``shift``: the ring shift
  ``device_id`` makes, if known when traced (``Devices.static_shift``)."""
  data = state_primitives.ref_get(src, None)
  signal(src_sem, ref_bytes(src))
  dst_ref, dst_transforms = _split(dst)
  sem_ref, sem_transforms = _split(dst_sem)
  leaves, tree = tree_util.tree_flatten((dst_transforms, sem_transforms))

  def land(value, moved, found, counted=None):
    dst_t, sem_t = tree_util.tree_unflatten(tree, moved)
    dst_j = with_transforms(dst_ref, dst_t)
    if found is not True:  # keeps what it held where nothing arrives
      old = state_primitives.ref_get(dst_j, None)
      value = jnp.where(found, value, old)
    state_primitives.ref_set(dst_j, None, value)
    inc = jnp.where(found, ref_bytes(dst), 0)
    signal(with_transforms(sem_ref, sem_t), _counted(counted, inc))

  exchanges.issue(
    _Send(
      device_id,
      exchanges.devices.flat(device_id),
      data,
      leaves,
      land,
      (dst_ref, sem_ref),
      shift,
    )
  )


def remote_signal(
  exchanges: Exchanges, sem, transforms, inc, device_id, shift=None
):
  leaves, tree = tree_util.tree_flatten(tuple(transforms))

  def land(_, moved, received, counted=None):
    _, *indices = moved
    signal(
      with_transforms(sem, tree_util.tree_unflatten(tree, indices)),
      _counted(counted, received),
    )

  exchanges.issue(
    _Send(
      device_id,
      exchanges.devices.flat(device_id),
      None,
      [_static_int(inc), *leaves],
      land,
      (sem,),
      shift,
    )
  )


def _static_int(x: Any) -> Any:
  """``x`` as a Python int if it is a literal (the same on every device, it
  need not travel), else as a traced int32."""
  if isinstance(x, (int, np.integer)) or (
    isinstance(x, np.ndarray) and x.ndim == 0
  ):
    return int(x)
  return jnp.asarray(x, jnp.int32)


def _arrival(value: jax.Array) -> jax.Array | None:
  """True, computed from ``value``'s first element in a way XLA does not
  fold: it exists only once the collective that produced ``value`` has
  run (None for an empty ``value``)."""
  if value.size == 0:
    return None
  first = jnp.ravel(value)[:1]
  if first.dtype == jnp.bool_:
    first = first.astype(jnp.uint8)
  bits = lax.bitcast_convert_type(first, _WORDS[_byte_width(first.dtype)])
  return (bits[0] | 1) != 0


def _counted(counted: Any, inc: Any) -> Any:
  """``inc``, or 0 where ``counted`` is False (None: always ``inc``)."""
  if counted is None:
    return inc
  return jnp.where(counted, inc, 0)
