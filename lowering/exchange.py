"""The lockstep path's exchanges between devices: remote operations issued
in a row batched into one XLA collective (an all_gather of packed words;
large data by ppermute), and where each arriving DMA or signal lands. A wait
on the semaphore of a pending operation waits for the exchange that lands it
instead of forcing one. Semaphores count as in ``counts``."""

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from mpmd import _pallas_ops
from mpmd._jax import (
  core,
  state_primitives,
  tree_util,
)
from mpmd._lowering import packing, xla_cpu
from mpmd._lowering.counts import (
  Once,
  dma_amount,
  signal,
  with_transforms,
)
from mpmd._lowering.devices import Devices
from mpmd._pallas_ops import Sync


def _row(stacked: jax.Array, j: jax.Array) -> jax.Array:
  """``stacked[j]`` for a traced ``j`` in range: one dynamic slice (jnp
  indexing would also mask out-of-range rows, costing a pass over them)."""
  return lax.dynamic_index_in_dim(stacked, j, keepdims=False)


def _pick(
  leaves: list[Any], gathered: list[Any], j: int | jax.Array
) -> list[Any]:
  return [
    x if g is None else (g[j] if isinstance(j, int) else _row(g, j))
    for x, g in zip(leaves, gathered, strict=True)
  ]


def _nbytes(x: ArrayLike) -> int:
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
    if any(_among(r, [sem for sem, _ in frame.waits]) for r in send.refs):
      # A wait before it must not count it.
      self.flush()
    frame.sends.append(send)

  def wait(self, sem: Any, take: Callable[[], None]) -> None:
    """Runs ``take``, a wait on the semaphore ``sem``, now, or in the next
    exchange if a pending operation writes ``sem``."""
    root = _pallas_ops.split_ref(sem)[0]
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
    written = [r for send in pending for r in send.refs]
    if any(
      _among(_pallas_ops.split_ref(x)[0], written)
      for x in _touched(eqn, invals)
    ):
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
    routes = _routes(devices, sends)
    carried = [route.carried() for route in routes]
    if any(packing.traced(x) for x in tree_util.tree_leaves(carried)):
      # The gather waits for the shifted data too, as the device would:
      # XLA runs a collective as soon as its operands are ready, and one
      # that waits for the other devices holds a thread of XLA's pool (one
      # per device), starving the devices still at work (a matmul) of it.
      carried = [
        c._replace(data=xla_cpu.witness(r.send.data))
        if r.by_shift and r.send.data is not None
        else c
        for r, c in zip(routes, carried, strict=True)
      ]
    batch = _Batch(devices.axes, carried)
    me = devices.me()
    # Shifts known when traced run unconditionally, before any landing.
    shifted = {
      n: devices.shift(route.shift, route.send.data)
      for n, route in enumerate(routes)
      if route.by_shift and isinstance(route.shift, int)
    }
    # What lands where no collective decides it still counts on its
    # semaphores only once the collective that carries it (a signal: one of
    # this exchange's) has run (``xla_cpu.arrival``).
    collective = batch.gathered.words
    if collective is None:
      collective = next(iter(shifted.values()), None)
    arrived = None if collective is None else xla_cpu.arrival(collective)
    crowded = []  # gathered DMAs that several devices may have sent here
    for n, route in enumerate(routes):
      found = _land(devices, me, batch, n, route, shifted.get(n), arrived)
      if found is not None:
        crowded.append(found)
    if crowded:
      _land_crowded(devices.count, batch, crowded)


class _Route(NamedTuple):
  """How one pending operation travels in an exchange."""

  send: _Send
  by_shift: bool  # its data by ring shift (``ppermute``), not gathered
  # The ring shift its device id makes: an int if known when traced, a
  # traced one found in an earlier exchange, or None.
  shift: Any

  def carried(self) -> "_Carried":
    """What it puts in the exchange's ``all_gather``."""
    send = self.send
    return _Carried(
      None if self.shift is not None else send.target,
      send.moving,
      None if self.by_shift else send.data,
    )


class _Carried(NamedTuple):
  """What one operation puts in an exchange's ``all_gather`` (None:
  nothing): its target (unless its ring shift is known), its moving values,
  and its data (unless a ring shift carries it)."""

  target: Any
  moving: list[Any]
  data: Any


def _routes(devices: Devices, sends: list[_Send]) -> list[_Route]:
  """How each operation travels: data by ring shift once gathering it
  would cost more than a rendezvous (``_GATHER_BYTES`` per exchange)."""
  count = devices.count
  # A collective permute waits for every device of the mesh, but only the
  # devices of this ring are sure to be here.
  may_shift = devices.axes == devices.all_axes
  budget = _GATHER_BYTES
  routes = []
  for send in sends:
    cost = 0 if send.data is None else (count - 1) * _nbytes(send.data)
    by_shift = may_shift and cost > budget
    if not by_shift:
      budget -= cost
    shift = send.shift
    if shift is None and by_shift:
      shift = devices.known_pattern(send.device_id)
    routes.append(_Route(send, by_shift, shift))
  return routes


class _Batch:
  """Every operation's ``_Carried`` values, gathered in one collective,
  read back by operation and field."""

  def __init__(self, axes: Any, carried: list[_Carried]):
    flat: list[Any] = []
    self._spans: list[dict[str, range]] = []
    for c in carried:
      spans = {}
      for name, value in zip(c._fields, c, strict=True):
        leaves = tree_util.tree_leaves(value)
        spans[name] = range(len(flat), len(flat) + len(leaves))
        flat += leaves
      self._spans.append(spans)
    self.gathered = packing.Gathered(axes, flat)

  def stacked(self, n: int, field: str) -> list[Any]:
    """Every device's leaves of field ``field`` of operation ``n``."""
    return [self.gathered.stacked(i) for i in self._spans[n][field]]

  def data_leaf(self, n: int) -> int:
    """Where operation ``n``'s data (gathered, not shifted) is."""
    return self._spans[n]["data"][0]


def _land(devices, me, batch, n, route, shifted, arrived):
  """Lands operation ``n`` of an exchange on this device; returns what
  ``_land_crowded`` needs if it is gathered data several devices may have
  sent here."""
  send, count = route.send, devices.count
  moving_all = batch.stacked(n, "moving")
  k = route.shift
  if isinstance(k, int):  # a ring shift known when traced
    # Every device hears from the one k positions back.
    sender = lax.rem(me - k + count, jnp.int32(count))
    moved = _pick(send.moving, moving_all, sender)
    if send.data is None:
      send.land(None, moved, moved[0], arrived)  # the sender's increment
      return None
    value = shifted
    if value is None:
      value = batch.gathered.row(batch.data_leaf(n), sender)
    send.land(value, moved, True, xla_cpu.arrival(value))
    return None
  if route.by_shift:
    [target_all] = batch.stacked(n, "target") or [None]
    branch = k if k is not None else devices.pattern(send.device_id, target_all)
    _land_shifted(devices, send, branch, moving_all)
    return None
  [target_all] = batch.stacked(n, "target")
  if devices.known_pattern(send.device_id) is None:
    # For a later ring shift to the same devices (XLA drops it if none).
    devices.pattern(send.device_id, target_all)
  mine = target_all == me
  if send.data is None:
    _land_signal(send, mine, moving_all)
    return None
  first = jnp.argmax(mine)
  moved = _pick(send.moving, moving_all, first)
  data_leaf = batch.data_leaf(n)
  send.land(batch.gathered.row(data_leaf, first), moved, mine[first])
  return _Crowded(send, mine, first, data_leaf, moving_all)


class _Crowded(NamedTuple):
  """Gathered data that landed from the first device that sent it here
  (``first``), for the others that may have (``mine``)."""

  send: _Send
  mine: jax.Array  # per device: whether it targets this one
  first: jax.Array
  data_leaf: int
  moving_all: list[Any]


def _land_crowded(count: int, batch: _Batch, crowded: list[_Crowded]):
  """Rarely, several devices target one in the same exchange. (The data
  unpacks inside, where it is needed: a conditional's operands are
  materialised whether or not its branch runs.)"""

  def others():
    for c in crowded:
      data_all = batch.gathered.stacked(c.data_leaf)
      assert data_all is not None  # crowded data travels gathered
      for j in range(count):
        c.send.land(
          data_all[j],
          _pick(c.send.moving, c.moving_all, j),
          jnp.logical_and(c.mine[j], j != c.first),
        )

  several = [jnp.sum(c.mine.astype(jnp.int32)) > 1 for c in crowded]
  lax.cond(functools.reduce(jnp.logical_or, several), others, lambda: None)


def _among(ref: Any, refs: list[Any]) -> bool:
  """Whether ``ref`` is one of ``refs`` (the same object: Refs are traced
  values, equal to no other)."""
  return any(ref is r for r in refs)


def _touched(eqn: core.JaxprEqn, invals: list[Any]) -> list[Any]:
  """What ``eqn`` reads or writes on this device (its Refs among them)."""
  kind = _pallas_ops.kind(eqn)
  if kind is Sync.DMA_START:
    dma = _pallas_ops.DmaOperands.of(eqn, invals)
    if dma.device_id is not None:  # its destination is another device's
      return [dma.src, dma.src_sem]
    return [dma.src, dma.dst, dma.dst_sem, dma.src_sem]
  if kind is Sync.SIGNAL:
    op = _pallas_ops.SignalOperands.of(eqn, invals)
    return [] if op.device_id is not None else [op.sem]
  return invals


# Data of a DMA travels in the batched all_gather while every other device
# receiving a copy costs less than this many bytes (per exchange): about
# what copying costs in the time of one rendezvous on a busy CPU.
_GATHER_BYTES = 1 << 20


def _land_signal(send: _Send, mine: jax.Array, moving_all: list[Any]) -> None:
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
    sender = lax.rem(me - branch + count, jnp.int32(count))
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
  exchanges: Exchanges,
  dma: _pallas_ops.DmaOperands,
  shift=None,
  once: Once = (False, False),
) -> None:
  """A remote DMA: its data leaves now, and lands on its target in step
  with every device, at the next exchange (``Exchanges``). Buffers are
  written outside any conditional where they can be (a conditional that
  threads a buffer costs XLA a copy of it). ``shift``: the ring shift
  ``dma.device_id`` makes, if known when traced
  (``Devices.static_shift``); ``once``: whether its receive and send
  semaphores count 1 rather than bytes (``counts.dma_amount``)."""
  data = state_primitives.ref_get(dma.src, None)
  signal(dma.src_sem, dma_amount(once[1], dma.src))
  dst_ref, dst_transforms = _pallas_ops.split_ref(dma.dst)
  sem_ref, sem_transforms = _pallas_ops.split_ref(dma.dst_sem)
  leaves, tree = tree_util.tree_flatten((dst_transforms, sem_transforms))
  size = dma_amount(once[0], dma.dst)

  def land(value, moved, found, counted=None):
    dst_t, sem_t = tree_util.tree_unflatten(tree, moved)
    dst_j = with_transforms(dst_ref, dst_t)
    if found is not True:  # keeps what it held where nothing arrives
      old = state_primitives.ref_get(dst_j, None)
      value = jnp.where(found, value, old)
    state_primitives.ref_set(dst_j, None, value)
    inc = jnp.where(found, size, 0)
    signal(with_transforms(sem_ref, sem_t), _counted(counted, inc))

  exchanges.issue(
    _Send(
      dma.device_id,
      exchanges.devices.flat(dma.device_id),
      data,
      leaves,
      land,
      (dst_ref, sem_ref),
      shift,
    )
  )


def remote_signal(
  exchanges: Exchanges, op: _pallas_ops.SignalOperands, shift=None
) -> None:
  """A remote signal: it lands on its target at the next exchange."""
  leaves, tree = tree_util.tree_flatten(tuple(op.transforms))

  def land(_, moved, received, counted=None):
    _, *indices = moved
    signal(
      with_transforms(op.sem, tree_util.tree_unflatten(tree, indices)),
      _counted(counted, received),
    )

  exchanges.issue(
    _Send(
      op.device_id,
      exchanges.devices.flat(op.device_id),
      None,
      [_static_int(op.inc), *leaves],
      land,
      (op.sem,),
      shift,
    )
  )


def _static_int(x: ArrayLike) -> int | jax.Array:
  """``x`` as a Python int if it is a literal (the same on every device, it
  need not travel), else as a traced int32."""
  if isinstance(x, (int, np.integer)) or (
    isinstance(x, np.ndarray) and x.ndim == 0
  ):
    return int(x)
  return jnp.asarray(x, jnp.int32)


def _counted(counted: Any, inc: Any) -> Any:
  """``inc``, or 0 where ``counted`` is False (None: always ``inc``)."""
  if counted is None:
    return inc
  return jnp.where(counted, inc, 0)
