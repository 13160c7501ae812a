"""The lockstep path: SPMD collective kernels as XLA collectives.

A TPU kernel under ``jax.shard_map`` whose devices synchronise only through
remote DMAs, remote semaphore signals and the barrier semaphore, and issue
those unconditionally (straight-line code and loops of static trip count),
runs on every device as plain XLA: the kernel is discharged like on the
fast path, and remote operations become exchanges over the mesh axes the
kernel's device ids name, every device issuing them at the same point.
Operations issued in a row share one exchange (``_Exchanges``: one
``all_gather``, large data by ring shift), since each exchange is a
rendezvous of every device. No Python runs per operation, unlike in the
threaded TPU simulator.

Faithfulness. A DMA lands when it starts, or later but before its receiver
can tell (before the receiver next touches what it writes): a valid order
of events for a race-free kernel (races are the simulator's job:
``interpret=pltpu.InterpretParams(detect_races=True)``). Semaphores count
bytes (DMA) and signals as int32, as on hardware. A wait that finds its
semaphore short would block on hardware; here the devices run in step, so
the semaphore is poisoned (set far below zero, and no later signal lifts
it) and the launch fails at the end with a ``DeadlockError`` naming device
and semaphore, instead of running on with missing data. A DMA whose window
leaves its buffer, or a wait that finds a ``pl.run_scoped`` semaphore
short, fails the launch too (``mpmd.lowering.bounds``).
"""

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpmd import _jax
from mpmd._jax import (
  callback,
  core,
  hlo_interpreter,
  mlir,
  pallas_core,
  pallas_primitives,
  sharding_impls,
  state_primitives,
  state_types,
  tpu,
  tree_util,
)
from mpmd.lowering import bounds, common, jaxpr_util, paths, watchdog
from mpmd.primitives import mpmd_map as prim

# Far below any count a kernel reaches, and far from wrapping around.
_POISON = -(1 << 30)
# Nesting under which devices may disagree on whether (or how often) an
# operation runs: an exchange there would leave the others waiting.
_DIVERGENT = ("cond", "while")
_MESH = pallas_primitives.DeviceIdType.MESH


def manual_axes(axis_context: Any) -> tuple[Any, ...]:
  """``paths.fully_manual_axes`` of the shard_map being lowered."""
  if not isinstance(axis_context, sharding_impls.SPMDAxisContext):
    return ()
  return paths.fully_manual_axes(
    axis_context.mesh.axis_names, axis_context.manual_axes
  )


def _remote_target(eqn) -> Any:
  """The device_id of a remote DMA start / signal (None if local)."""
  name = eqn.primitive.name
  if name == "dma_start":
    return eqn.params["tree"].unflatten(eqn.invars)[-1]
  if name == "semaphore_signal":
    *_, device_id, _ = eqn.params["args_tree"].unflatten(eqn.invars)
    return device_id
  return None


def exchange_axes(jaxpr: core.Jaxpr, axes: tuple[Any, ...]) -> tuple[Any, ...]:
  """The mesh axes the kernel's remote operations name, in mesh order.

  Devices that differ along other axes never exchange, so they need not
  reach the same exchanges (a launch under a condition on another axis).
  """
  named = set()
  for eqn in jaxpr_util.iter_eqns(jaxpr):
    target = _remote_target(eqn)
    if isinstance(target, dict):
      named |= set(target)
    elif target is not None:
      named |= set(axes)
  return tuple(a for a in axes if a in named) or axes


def why_not(
  jaxprs: Sequence[core.Jaxpr], meshes: Sequence[Any], axes: tuple[Any, ...]
) -> str | None:
  """Why a synchronising kernel cannot run in lockstep (None if it can).

  ``axes``: the mesh axes of the enclosing shard_map (``manual_axes``).
  """
  if not axes:
    return (
      "it is not inside a jax.shard_map manual over every mesh axis (no "
      "devices to exchange with)"
    )
  if len(meshes) != 1 or math.prod(meshes[0].shape.values()) != 1:
    return "it runs several programs per device"

  def walk(jaxpr, enclosing, scoped_semaphores):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == "get_barrier_semaphore" and enclosing:
        return f"it takes the barrier semaphore inside {enclosing[-1]}"
      if name == "semaphore_read" and "while" in enclosing:
        return "it reads a semaphore inside a while loop (it may spin)"
      if name == "semaphore_signal":
        *_, core_index = eqn.params["args_tree"].unflatten(eqn.invars)
        if core_index is not None:
          return "it signals another core's semaphore"
      target = _remote_target(eqn)
      if target is not None:
        if eqn.params["device_id_type"] is not _MESH:
          return f"a remote {name} names its device by a LOGICAL id"
        if name == "dma_start" and eqn.params["add"]:
          return "it issues an accumulating remote DMA"
        divergent = [e for e in enclosing if e in _DIVERGENT]
        if divergent:
          return f"it issues a remote {name} inside {divergent[-1]}"
        if scoped_semaphores:
          return (
            f"it issues a remote {name} inside pl.run_scoped with "
            "semaphores (their counts are not checked at the end)"
          )
        if isinstance(target, dict):
          foreign = [a for a in target if a not in axes]
          if foreign:
            return (
              f"a remote {name} names axes {foreign} that are not axes "
              f"{axes} of the enclosing shard_map"
            )
        elif len(axes) != 1:
          return f"a remote {name} names its device by a flat id"
      scoped = scoped_semaphores or (
        name == "run_scoped"
        and any(paths.is_semaphore(v.aval) for v in eqn.params["jaxpr"].invars)
      )
      for sub in jaxpr_util.sub_jaxprs(eqn.params):
        reason = walk(sub, (*enclosing, name), scoped)
        if reason is not None:
          return reason
    return None

  return walk(jaxprs[0], (), False)


# -- semaphores (int32 refs) that stay poisoned once a wait found them short --


def _signal(sem: Any, inc: Any) -> None:
  """Adds ``inc`` to a semaphore, unless it is poisoned (negative)."""
  before = state_primitives.ref_get(sem, None)
  inc = jnp.asarray(inc, jnp.int32)
  state_primitives.ref_set(
    sem, None, jnp.where(before < 0, before, before + inc)
  )


def _wait(sem: Any, value: Any, decrement: bool = True) -> Any:
  """Takes ``value`` from a semaphore, or poisons it if it holds less;
  returns whether it held enough."""
  before = state_primitives.ref_get(sem, None)
  value = jnp.asarray(value, jnp.int32)
  after = before - value if decrement else before
  state_primitives.ref_set(sem, None, jnp.where(before < value, _POISON, after))
  return jnp.all(before >= value)


def _bytes(ref: Any) -> int:
  """What a DMA of ``ref``'s shape adds to its semaphores (bytes, as on
  hardware and in the simulator)."""
  return math.prod(ref.shape) * np.dtype(ref.dtype).itemsize


def widen(aval: Any) -> Any:
  """Semaphore counts as int32 (Pallas' interpreters use int16)."""
  if (
    _is_count(aval)
    and aval.inner_aval.dtype == pallas_core.SEMAPHORE_INTERPRET_DTYPE
  ):
    return aval.update(inner_aval=aval.inner_aval.update(dtype=jnp.int32))
  return aval


def _is_count(aval: Any) -> bool:
  """A Ref in semaphore memory (of physical integer counts)."""
  if not isinstance(aval, state_types.AbstractRef):
    return False
  space = aval.memory_space
  # Scratch placed on one mesh's cores (`SEMAPHORE @ mesh`) wraps the space.
  if isinstance(space, pallas_core.CoreMemorySpace):
    space = space.memory_space
  return space == tpu().core.MemorySpace.SEMAPHORE


def _with_transforms(ref: Any, transforms: Any) -> Any:
  if not transforms:
    return ref
  return state_types.TransformedRef(ref, tuple(transforms))


def _split(ref: Any) -> tuple[Any, tuple[Any, ...]]:
  if isinstance(ref, state_types.TransformedRef):
    return ref.ref, ref.transforms
  return ref, ()


class _Devices:
  """The devices a kernel exchanges with: those differing along the axes
  its device ids name (``exchange_axes``)."""

  def __init__(self, axes, sizes: dict[Any, int], all_axes):
    self.axes = axes  # those the kernel exchanges along
    self.all_axes = all_axes  # every axis of the shard_map
    self.sizes = tuple(sizes[a] for a in axes)
    self._patterns: dict[tuple[Any, ...], Any] = {}
    self.top_trace: Any = None  # set when the kernel's rewrite starts

  @property
  def count(self) -> int:
    return math.prod(self.sizes)

  def flat(self, device_id: Any) -> Any:
    """The flat index of ``device_id`` (a dict, or an index along the only
    axis); axes a dict leaves out keep this device's coordinate."""
    if not isinstance(device_id, dict):
      device_id = {self.axes[0]: device_id}
    index = jnp.int32(0)
    for a, size in zip(self.axes, self.sizes, strict=True):
      coord = device_id.get(a)
      coord = lax.axis_index(a) if coord is None else coord
      index = index * size + jnp.asarray(coord, jnp.int32)
    return index

  def me(self) -> Any:
    return self.flat({})

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
    self._words = lax.all_gather(
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
    return _from_words(self._slice(i, self._words), self._arrays[i])

  def row(self, i: int, j: Any) -> Any:
    """Leaf ``i`` of device ``j`` (traced): picked while still in words,
    so that XLA copies one row only (a pick after the bitcast to bf16 it
    upcasts whole, and splits across threads)."""
    if i not in self._where:
      return self._leaves[i]
    rows = lax.dynamic_slice_in_dim(self._slice(i, self._words), j, 1)
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
  moved, found)`` writes it on the receiver if ``found``; ``refs``: the
  receiver's Refs it writes.
  """

  device_id: Any
  target: Any  # flat index of the receiving device
  data: Any  # a DMA's data; None for a signal
  moving: list[Any]
  land: Callable[[Any, list[Any], Any], None]
  refs: tuple[Any, ...]


class _Exchanges:
  """Remote operations, batched: each exchange is one rendezvous of every
  device (about 0.1 ms with 4 simulated devices on 2 cores, 0.3 ms with
  8), and kernels issue them in runs (both neighbours' handshake signals,
  both ring directions' transfers and capacity signals).

  An issued operation lands on its receiver at the latest when the
  receiver's next equation touches a Ref it writes (a wait on its
  semaphore, a read of its buffer), or the jaxpr being rewritten (kernel,
  loop body) ends: until then its receiver cannot tell, so the kernel's
  results and semaphore counts are those of landing at once. Everything
  pending then travels in one exchange: small data and every device's
  indices and increments in one ``all_gather``; data large enough that
  gathering it everywhere would cost more than a rendezvous by a ring shift
  (``ppermute``), one per DMA.
  """

  def __init__(self, devices: _Devices):
    self.devices = devices
    self._frames: list[list[_Send]] = []

  @contextlib.contextmanager
  def frame(self):
    """Operations issued in one jaxpr are exchanged before it ends."""
    self._frames.append([])
    try:
      yield
      self.flush()
    finally:
      self._frames.pop()

  def issue(self, send: _Send) -> None:
    self._frames[-1].append(send)

  def flush_if_touched(self, eqn: core.JaxprEqn, invals: list[Any]) -> None:
    """Exchanges first if ``eqn`` touches a Ref of this device that a
    pending operation writes."""
    pending = self._frames[-1] if self._frames else ()
    if not pending:
      return
    written = {id(r) for send in pending for r in send.refs}
    if any(id(_split(x)[0]) in written for x in _touched(eqn, invals)):
      self.flush()

  def flush(self) -> None:
    sends, self._frames[-1] = self._frames[-1], []
    if not sends:
      return
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
      known.append(devices.known_pattern(send.device_id) if by_shift else None)
    # Every send's target (unless its ring shift is known), its moving
    # values, and its data unless a ring shift carries it: leaf 3 * n + f.
    leaves = []
    for send, p, k in zip(sends, permuted, known, strict=True):
      leaves += [
        None if k is not None else send.target,
        send.moving,
        None if p else send.data,
      ]
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
    crowded = []  # gathered DMAs and whether several devices sent them here
    for n, (send, p, k) in enumerate(zip(sends, permuted, known, strict=True)):
      moving_all = field(n, 1)
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
  if name == "dma_wait":
    # Only the semaphore: the buffers give the byte count (their shape).
    return [eqn.params["tree"].unflatten(invals)[2]]
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


def _land_shifted(devices: _Devices, send: _Send, branch, moving_all) -> None:
  """A DMA's data by ring shift (``ppermute``) when every device sends the
  same number of positions on (``branch``), else gathered."""
  count, me, data = devices.count, devices.me(), send.data

  def shifted(k):
    # The sender is k positions back.
    sender = lax.rem(me - k + count, count)
    return lambda: (devices.shift(k, data), sender, jnp.bool_(True))

  def gathered():
    data_all, target_all = devices.gather((data, send.target))
    return data_all, target_all == me

  def first_sender():
    data_all, mine = gathered()
    j = jnp.argmax(mine)
    return _row(data_all, j), j, mine[j]

  value, sender, found = lax.switch(
    branch, [*map(shifted, range(count)), first_sender]
  )
  send.land(value, _pick(send.moving, moving_all, sender), found)

  # Rarely, several devices target this one in the same step.
  def other_senders():
    data_all, mine = gathered()
    first = jnp.argmax(mine)
    for j in range(count):
      others = jnp.logical_and(mine[j], j != first)
      send.land(data_all[j], _pick(send.moving, moving_all, j), others)

  lax.cond(branch == count, other_senders, lambda: None)


def _remote_copy(exchanges: _Exchanges, src, dst, dst_sem, src_sem, device_id):
  """A remote DMA: its data leaves now, and lands on its target in step
  with every device, at the next exchange (``_Exchanges``). Buffers are
  written outside any conditional where they can be (a conditional that
  threads a buffer costs XLA a copy of it)."""
  data = state_primitives.ref_get(src, None)
  _signal(src_sem, _bytes(src))
  dst_ref, dst_transforms = _split(dst)
  sem_ref, sem_transforms = _split(dst_sem)
  leaves, tree = tree_util.tree_flatten((dst_transforms, sem_transforms))

  def land(value, moved, found):
    dst_t, sem_t = tree_util.tree_unflatten(tree, moved)
    dst_j = _with_transforms(dst_ref, dst_t)
    old = state_primitives.ref_get(dst_j, None)
    state_primitives.ref_set(dst_j, None, jnp.where(found, value, old))
    _signal(_with_transforms(sem_ref, sem_t), jnp.where(found, _bytes(dst), 0))

  exchanges.issue(
    _Send(
      device_id,
      exchanges.devices.flat(device_id),
      data,
      leaves,
      land,
      (dst_ref, sem_ref),
    )
  )


def _remote_signal(exchanges: _Exchanges, sem, transforms, inc, device_id):
  leaves, tree = tree_util.tree_flatten(tuple(transforms))

  def land(_, moved, received):
    _, *indices = moved
    _signal(
      _with_transforms(sem, tree_util.tree_unflatten(tree, indices)), received
    )

  exchanges.issue(
    _Send(
      device_id,
      exchanges.devices.flat(device_id),
      None,
      [inc if isinstance(inc, int) else jnp.asarray(inc, jnp.int32), *leaves],
      land,
      (sem,),
    )
  )


def sync_rule(
  checks: bounds.Checks,
  devices: _Devices | None = None,
  barrier: tuple[Any, ...] = (),
  first: jaxpr_util.EqnRule | None = None,
) -> jaxpr_util.EqnRule:
  """The rewrite of every synchronising operation (see module docstring),
  with ``checks`` of DMA windows and scoped waits; ``first`` (say an axis
  index rule) goes before it on every equation, nested ones included.

  The fast path uses it too, for its local DMAs and semaphores (no
  ``devices``): the same int32 byte counts, the same poisoned waits.
  """

  exchanges = None if devices is None else _Exchanges(devices)

  def rule(eqn, invals):
    if first is not None:
      outs = first(eqn, invals)
      if outs is not None:
        return outs
    if exchanges is not None:
      exchanges.flush_if_touched(eqn, invals)
    name = eqn.primitive.name
    if name == "get_barrier_semaphore":
      return list(barrier)
    if name == "dma_start":
      checks.dma(eqn, invals)
      src, dst, dst_sem, src_sem, device_id = eqn.params["tree"].unflatten(
        invals
      )
      if device_id is not None:
        _remote_copy(exchanges, src, dst, dst_sem, src_sem, device_id)
        return []
      data = state_primitives.ref_get(src, None)
      if eqn.params["add"]:
        data = data + state_primitives.ref_get(dst, None)
      state_primitives.ref_set(dst, None, data)
      if dst_sem is not None:
        _signal(dst_sem, _bytes(dst))
      return []
    if name == "dma_wait":
      # wait_send binds this with source and destination swapped, so the
      # semaphore and the buffer it counts are always the 2nd and 3rd.
      _, dst, dst_sem, _, _ = eqn.params["tree"].unflatten(invals)
      sem = eqn.params["tree"].unflatten(eqn.invars)[2]
      checks.wait(eqn, sem, _wait(dst_sem, _bytes(dst)))
      return []
    if name == "semaphore_signal":
      sem, transforms, inc, device_id, _ = eqn.params["args_tree"].unflatten(
        invals
      )
      if device_id is not None:
        _remote_signal(exchanges, sem, transforms, inc, device_id)
      else:
        _signal(_with_transforms(sem, transforms), inc)
      return []
    if name == "semaphore_wait":
      sem, transforms, value, decrement = eqn.params["args_tree"].unflatten(
        invals
      )
      ok = _wait(_with_transforms(sem, transforms), value, decrement)
      checks.wait(eqn, eqn.params["args_tree"].unflatten(eqn.invars)[0], ok)
      return []
    if name == "semaphore_read":
      sem, transforms = eqn.params["args_tree"].unflatten(invals)
      value = state_primitives.ref_get(_with_transforms(sem, transforms), None)
      return [value.astype(eqn.outvars[0].aval.dtype)]
    if name == "run_scoped":
      return _inline_scope(eqn, invals, rule)
    return None

  if exchanges is not None:
    rule.frame = exchanges.frame
  return rule


def _inline_scope(eqn, invals, rule) -> list[Any]:
  """A ``pl.run_scoped`` rewritten with ``rule`` and run in place, its
  allocations discharged to values.

  Discharging the kernel would keep the ``run_scoped`` (with its scoped
  Refs), into which ``checkify`` cannot see: the checks in it would be lost.
  """
  scope = eqn.params["jaxpr"]
  num_closed = len(scope.constvars)
  # Under jax.enable_checks, 0.10's convert_constvars_jaxpr typechecks the
  # scope, whose semaphores already count in int32 (``widen``), which
  # Pallas' dma_wait rejects.
  with jax.enable_checks(False):
    scope = _jax.pe.convert_constvars_jaxpr(scope)
  body = jaxpr_util.rewrite(scope, rule)
  allocated = [v.aval for v in body.invars[num_closed:]]
  pure, consts = _jax.open_jaxpr(
    _jax.discharge_state(
      _jax.closed_jaxpr(body),
      should_discharge=[False] * num_closed + [True] * len(allocated),
    )
  )
  # Scoped semaphores start at zero (Pallas' uninitialised int32 is a
  # sentinel); other allocations as Pallas leaves them.
  initial = [
    jnp.zeros(a.shape, jnp.int32)
    if _is_count(a)
    else pallas_primitives.uninitialized_value(a.shape, a.dtype)
    for a in allocated
  ]
  outs = core.eval_jaxpr(pure, consts, *invals, *initial)
  return outs[: len(body.outvars)]


def _barrier_avals(jaxpr: core.Jaxpr) -> list[Any]:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "get_barrier_semaphore":
      return [eqn.outvars[0].aval]
  return []


def _physical(aval: Any) -> Any:
  return _jax.interpret_mode_aval(aval)


def _describe(aval: Any) -> str:
  kind = aval.inner_aval.dtype.name
  shape = aval.inner_aval.shape
  return f"{kind}{list(shape)}" if shape else kind


def lower(
  ctx: mlir.LoweringRuleContext, *in_nodes, kernel, axes, **params
) -> Sequence[Any]:
  """Lowers the launch for every device in step.

  ``kernel``: the launch's only jaxpr, aliased inputs already resolved to
  their outputs; ``axes``: the enclosing shard_map's manual axes.
  """
  [mesh] = params["meshes"]
  num_in, num_out = len(in_nodes), len(params["out_avals"])
  sizes = dict(ctx.module_context.axis_context.mesh.shape)
  devices = _Devices(exchange_axes(kernel, axes), sizes, axes)
  barrier_avals = _barrier_avals(kernel)
  traced = params["jaxprs"][0]  # as the user wrote it: names, arguments
  with prim.tracing_context(mesh, params["meshes"]):
    values = jaxpr_util.literal_axis_values(dict(mesh.shape), 0)
    jaxpr = jaxpr_util.rewrite_axis_indices(kernel, values.get, mesh.shape)
    # Semaphores as plain integer refs (int16), then widened to int32.
    jaxpr, consts = hlo_interpreter.resolve_physical_types(jaxpr, ())
    if consts:
      raise NotImplementedError("mpmd_map: kernel captured constants")
    jaxpr = jaxpr_util.map_avals(jaxpr, widen)
    checks = bounds.Checks(
      traced.debug_info.func_src_info,
      bounds.trace_refs(jaxpr, bounds.operand_names(traced, num_in, num_out)),
      bounds.prove(jaxpr, {**mesh.shape, **sizes}),
      path="lockstep path (devices run in step)",
      where=functools.partial(_where, devices.all_axes),
    )

    def make_rule(barrier):
      devices.top_trace = core.unsafe_get_current_trace()
      return sync_rule(checks, devices, barrier)

    jaxpr = jaxpr_util.rewrite_with_inputs(
      jaxpr,
      [widen(_physical(a)) for a in barrier_avals],
      make_rule,
      finish=devices.forget,
    )
    program = _jax.discharge_state(_jax.closed_jaxpr(jaxpr))
  kernel_avals = [v.aval for v in traced.invars] + barrier_avals
  semaphores = [k for k, a in enumerate(kernel_avals) if paths.is_semaphore(a)]
  names = [
    _operand_name(k, num_in, num_out, len(traced.invars), kernel_avals[k])
    for k in semaphores
  ]
  run = functools.partial(
    _run,
    program=program,
    is_ref=[isinstance(v.aval, state_types.AbstractRef) for v in jaxpr.invars],
    num_in=num_in,
    num_out=num_out,
    out_sources={o: i for i, o in params["input_output_aliases"].items()},
    semaphores=semaphores,
    names=names,
    devices=devices,
    num_checks=checks.count,
  )
  # The kernel's values carry no varying-axes types: check none here.
  with _jax.no_vma_check():
    outs = mlir.lower_fun(run, multiple_results=True)(
      ctx.replace(avals_in=common.plain_avals(ctx.avals_in)), *in_nodes
    )
  if ctx.tokens_out is None and ctx.tokens_in is not None:
    ctx.set_tokens_out(ctx.tokens_in)
  return outs


def _operand_name(k, num_in, num_out, num_operands, aval) -> str:
  """How a deadlock report names semaphore ``k`` of the launch (its
  operands, then the barrier semaphore)."""
  if k >= num_operands:
    return "the barrier semaphore"
  if k < num_in:
    return f"input {k} ({_describe(aval)})"
  if k < num_in + num_out:
    return f"output {k - num_in} ({_describe(aval)})"
  return f"scratch {k - num_in - num_out} ({_describe(aval)})"


def _where(axes, args: list[Any]) -> str:
  """``bounds.Checks``' ``where``: the device a check runs on."""
  coords = []
  for a in axes:
    args.append(lax.axis_index(a))
    coords.append(f"{a}={{0[{len(args) - 1}]}}")
  return f", device ({', '.join(coords)})"


def _run(
  *args,
  program,
  is_ref,
  num_in,
  num_out,
  out_sources,
  semaphores,
  names,
  devices,
  num_checks,
):
  avals = [v.aval for v in program.jaxpr.invars]

  def fresh(k):
    if k in semaphores:
      return jnp.zeros(avals[k].shape, avals[k].dtype)
    return pallas_primitives.uninitialized_value(avals[k].shape, avals[k].dtype)

  def launch(*operands):
    # The discharged program returns the final value of each Ref operand.
    updated = iter(core.eval_jaxpr(program.jaxpr, program.consts, *operands))
    return [
      next(updated) if r else x for x, r in zip(operands, is_ref, strict=True)
    ]

  operands = [
    *args,
    *(
      args[out_sources[o]] if o in out_sources else fresh(num_in + o)
      for o in range(num_out)
    ),
    *map(fresh, range(num_in + num_out, len(avals))),
  ]
  error, final = bounds.checked(launch, num_checks)(*operands)
  if semaphores or error is not None:
    flags = [jnp.any(final[k] < 0) for k in semaphores]
    if error is not None:
      flags.append(bounds.failed(error))
    coords = [lax.axis_index(a) for a in devices.all_axes]
    report = jnp.stack([*coords, *(f.astype(jnp.int32) for f in flags)])
    reports = lax.all_gather(report, devices.axes)
    leaves, treedef = tree_util.tree_flatten(error)
    raise_error = functools.partial(
      _raise_for_reports, names, devices.all_axes, treedef if leaves else None
    )

    def report_on_device_zero():
      # Every device takes this branch (the reports are gathered), so the
      # failed checks' details travel only when something failed.
      gathered = [lax.all_gather(x, devices.axes) for x in leaves]
      lax.cond(
        devices.me() == 0,
        lambda: callback.io_callback(raise_error, None, reports, *gathered),
        lambda: None,
      )

    # Python runs only to raise (a callback per device and launch would
    # cost more than a ring step), and on one device: one error per launch.
    lax.cond(
      jnp.any(reports[:, len(coords) :] != 0),
      report_on_device_zero,
      lambda: None,
    )
  return final[num_in : num_in + num_out]


def _raise_for_reports(names, axes, treedef, reports, *gathered) -> None:
  for j in range(len(reports)):
    failure = bounds.first_failure(treedef, [x[j] for x in gathered])
    if failure is not None:
      raise failure
  _raise_if_short(names, axes, np.asarray(reports)[:, : len(axes) + len(names)])


def _raise_if_short(names, axes, reports) -> None:
  reports = np.asarray(reports)
  coords, short = reports[:, : len(axes)], reports[:, len(axes) :]
  lines = []
  for row, device in zip(short, coords, strict=True):
    where = ", ".join(
      f"{a}={int(c)}" for a, c in zip(axes, device, strict=True)
    )
    waited = [name for name, s in zip(names, row, strict=True) if s]
    if waited:
      lines.append(f"  device ({where}) waits on {', '.join(waited)}")
  raise watchdog.DeadlockError(
    "mpmd_map deadlock: on the CPU lockstep path (devices run in step) "
    "these waits asked for more than had been signalled when every device "
    "had reached them, so on hardware they would wait forever:\n"
    + "\n".join(lines)
    + "\n(unless the devices must run out of step, which this path cannot "
    "show: pass interpret=pltpu.InterpretParams() to run the threaded TPU "
    "simulator)"
  )
