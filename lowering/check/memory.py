"""The launch's simulated memory, and the accesses it checks.

Every buffer (an operand, a scratch buffer, a ``run_scoped`` allocation, a
semaphore array) keeps, next to its data, per element: whether anything
wrote it (reads of what nothing wrote are errors, as on hardware they read
garbage), and the last write and read as *epochs* (who, at which of its
clock ticks). An access races with an earlier one by someone else that its
vector clock does not cover: no chain of signal -> wait or DMA start ->
land -> wait orders them. The epochs live in ``shadow.Shadow`` (runs of
elements while accesses are windows of consecutive elements, which views
with a ``slab`` also read and write by slicing).
"""

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Hashable

import numpy as np

from mpmd._lowering import errors
from mpmd._lowering.check.pool import POOL
from mpmd._lowering.check.shadow import NOBODY, Shadow

Clock = dict[int, int]


def join(a: Clock, b: Clock) -> Clock:
  """The least clock above both."""
  if not a:  # (a semaphore's first signal)
    return {k: t for k, t in b.items() if t > 0}
  out = a.copy()
  get = out.get
  for k, t in b.items():
    if t > get(k, 0):
      out[k] = t
  return out


def garbage(shape, dtype) -> np.ndarray:
  """What uninitialised memory reads as: NaN for floats, the most negative
  value for integers (hardware gives whatever was there)."""
  out = np.empty(shape, dtype)
  out.fill(_garbage_value(out.dtype))
  return out


@functools.cache
def _garbage_value(dtype: np.dtype):
  if np.issubdtype(dtype, np.inexact):
    return np.nan
  if np.issubdtype(dtype, np.integer):
    return np.iinfo(dtype).min
  if dtype == np.bool_:
    return True
  return 0  # 16-bit floats from ml_dtypes come above


# Snapshots a buffer keeps (``Buffer.snapshot``): a kernel's weights, say,
# one window per expert.
_SNAPSHOTS = 8


class Aranges:
  """``arange(size).reshape(shape)`` per shape, made once per kernel and
  shared by every buffer of that shape in all its launches (views only
  read them)."""

  def __init__(self):
    self.cache: dict[tuple[int, ...], np.ndarray] = {}

  def __call__(self, shape) -> np.ndarray:
    shape = tuple(shape)
    if shape not in self.cache:
      size = int(np.prod(shape, dtype=np.int64))
      ids = np.arange(size, dtype=np.int64)
      ids.flags.writeable = False  # shared by launches: nobody writes it
      self.cache[shape] = ids.reshape(shape)
    return self.cache[shape]


class Deferred:
  """Text for a message, made only when one needs it (``str()`` makes it):
  accesses are many, errors few."""

  __slots__ = ()

  def __format__(self, spec: str) -> str:
    return format(str(self), spec)


# What names an operation in a message: text, or text made on demand.
Text = str | Deferred

# Windows a buffer remembers (``index_view``; past them, it makes new ones).
MAX_WINDOWS = 1024

# Which buffer of a program's memory: ("operand", k), ("barrier",),
# ("scoped", ...): the programs that share a buffer share its key.
Key = tuple[Hashable, ...]


class Lazy(Deferred):
  """Text made by ``fn()`` only when a message needs it, once (a label
  names its buffer in every event that touches it)."""

  __slots__ = ("fn", "text")

  def __init__(self, fn: Callable[[], object]):
    self.fn = fn
    self.text: str | None = None

  def __str__(self):
    if self.text is None:
      self.text = str(self.fn())
    return self.text


class Buffer:
  """One simulated buffer, with its per-element bookkeeping."""

  def __init__(
    self,
    label: Text,
    key: Key,
    shape,
    dtype,
    ids,
    *,
    data: np.ndarray | None = None,
    semaphore: bool = False,
    adopt: bool = False,
  ):
    self.label = label
    self.key = key
    self.semaphore = semaphore
    shape = tuple(map(int, shape))
    size = math.prod(shape)  # (np.prod costs microseconds per buffer)
    if semaphore:
      self.data = np.zeros(shape, np.int64)
      # Per element, oldest first: the units it counts, as (amount, clock of
      # the signal, its event) entries (``sync._add``, ``sync._take``).
      self.units: list[collections.deque[list]] = [
        collections.deque() for _ in range(size)
      ]
      # Per element: the event that last signalled it (for the timeline).
      self.signals: list[int | None] = [None] * size
    elif data is None:
      self.data = POOL.take(shape, dtype)
      self.data.fill(_garbage_value(self.data.dtype))
    elif adopt and _adoptable(data, shape, dtype):
      # The array itself where it has the shape (so that the pool gets it
      # back, and a later deposit in it can be taken again), else a view.
      self.data = data if data.shape == shape else data.reshape(shape)
    else:
      self.data = POOL.take(shape, dtype)
      self.data[...] = np.asarray(data).reshape(shape)
    self.flat = self.data.reshape(-1)
    # Read-only copies of windows, by slab, until the buffer is next
    # written (``View.read``, ``writable``).
    self.snapshots: dict[tuple[int, int, tuple[int, ...]], np.ndarray] = {}
    self.ids = ids(shape)
    # The flat arange that ``ids`` and the windows cut from it view.
    self.root = self.ids if self.ids.base is None else self.ids.base
    self.init = POOL.take((size,), np.bool_)
    self.init.fill(data is not None or semaphore)
    # Windows of the whole buffer taken so far (``index_view``).
    self.windows: dict[tuple[Hashable, ...], View] = {}
    # Views of the whole buffer by the id of a remembered tuple of views
    # taken of it (``records.Views``, kept alive in the entry).
    self.viewed: dict[int, tuple[tuple, View]] = {}
    # comp -> a description of its latest access (for race reports).
    self.who: dict[int, Text] = {}
    # Last write and last read per element (semaphores have no data
    # accesses: signals and waits order themselves).
    self.writes = self.reads = None
    if not semaphore:
      self.writes, self.reads = Shadow(size), Shadow(size)

  def __repr__(self):
    return f"Buffer({self.label})"

  def forget_views(self) -> None:
    """Drops the views it keeps of itself (``whole``, ``windows``,
    ``viewed``): they refer back to it, a cycle that only the cyclic
    collector frees. Views taken later are made anew."""
    self.windows.clear()
    self.viewed.clear()
    self.__dict__.pop("whole", None)

  def snapshot(self, s: slice, shape) -> np.ndarray:
    """A read-only copy of the flat elements ``s``, shaped ``shape``:
    the same array for every read of that window until the buffer is next
    written (a kernel's weights, read by every tile, are copied once, not
    once per tile). Copies, not views: what a kernel loaded never changes,
    whatever views of it JAX or numpy make."""
    key = (s.start, s.stop, tuple(shape))
    copy = self.snapshots.get(key)
    if copy is None:
      if len(self.snapshots) >= _SNAPSHOTS:
        del self.snapshots[next(iter(self.snapshots))]  # the oldest
      copy = self.snapshots[key] = self.flat[s].reshape(shape).copy()
      copy.flags.writeable = False
    return copy

  def writable(self) -> None:
    """Called before ``data`` is written in place: the snapshots are
    stale."""
    if self.snapshots:
      self.snapshots.clear()

  def recycle(self, output: bool = False) -> None:
    """Gives its arrays to ``POOL`` once its launch has ended and nothing
    reads it any more; an output's data leaves the launch, so it is only
    lent. It keeps none (a use after this fails rather than reads
    another's data)."""
    self.forget_views()
    self.snapshots.clear()
    if output:
      POOL.give((self.init,))
      POOL.lend((self.data,))
    elif not self.semaphore:
      POOL.give((self.data, self.init))
    self.data = self.flat = self.init = None  # type: ignore[assignment]

  @functools.cached_property
  def whole(self) -> "View":
    """The view of all its elements (one, shared: a View is immutable)."""
    return View(self, self.ids)


def _adoptable(data, shape, dtype) -> bool:
  """Whether a buffer can take ``data`` as its array: a whole array of
  its own memory, in C order, of the buffer's size and dtype."""
  return (
    type(data) is np.ndarray
    and data.base is None
    and data.flags.c_contiguous
    and data.flags.writeable
    and data.dtype == dtype
    and data.size == math.prod(shape)
  )


def copy_of(x) -> np.ndarray:
  """A copy of ``x`` in an array of ``POOL``'s (written in place: no page
  faults where the pool has one of its shape)."""
  x = np.asarray(x)
  if x.dtype.hasobject:
    return np.array(x)
  out = POOL.take(x.shape, x.dtype)
  np.copyto(out, x)
  return out


@dataclasses.dataclass(frozen=True)
class View:
  """Elements of a buffer: ``ids`` are flat indices, shaped as the view."""

  buffer: Buffer
  ids: np.ndarray

  @property
  def shape(self):
    return self.ids.shape

  @property
  def nbytes(self) -> int:
    return int(self.ids.size) * self.buffer.data.dtype.itemsize

  def on(self, buffer: Buffer) -> "View":
    """The same elements of another program's copy of the buffer."""
    view = View(buffer, self.ids)
    slab = self.__dict__.get("slab", view)  # (view: not worked out yet)
    if slab is not view and buffer.root is self.buffer.root:
      # The same ids of the same flat arange (copies share their shape's):
      # the same slab, without working it out again.
      view.__dict__["slab"] = slab
    return view

  @functools.cached_property
  def slab(self) -> slice | None:
    """``slice(start, stop)`` if the view's elements, in order, are the
    buffer's flat elements ``start..stop-1`` (most windows: a tile of whole
    rows, a slot), else None. Such a view reads and writes by slicing, and
    its race checks take runs (``shadow``) rather than elements."""
    ids = self.ids
    root = self.buffer.root
    if (ids.base is root or ids is root) and ids.flags.c_contiguous:
      start = int(ids.reshape(-1)[0]) if ids.size else 0
      return slice(start, start + ids.size)
    return None

  def read(self) -> np.ndarray:
    """The view's values (shaped as the view): a new array, or for a
    slab of a data buffer its read-only snapshot (``Buffer.snapshot``)."""
    b, s = self.buffer, self.slab
    if s is None:
      return b.flat[self.ids]
    if b.semaphore:  # (signals change it without ``writable``)
      return b.flat[s].reshape(self.ids.shape).copy()
    return b.snapshot(s, self.ids.shape)

  def write(self, values) -> None:
    """Stores ``values`` (broadcast to the view's shape) in its elements."""
    self.buffer.writable()
    s = self.slab
    if s is None:
      self.buffer.flat[self.ids] = values
    else:
      self.buffer.flat[s].reshape(self.ids.shape)[...] = values

  def init_of(self) -> np.ndarray:
    """Per element of the view: whether something wrote it (flat)."""
    s = self.slab
    return self.buffer.init[self.ids.reshape(-1) if s is None else s]

  def set_init(self, values) -> None:
    s = self.slab
    self.buffer.init[self.ids.reshape(-1) if s is None else s] = values


def _first(mask: np.ndarray, ids: np.ndarray, shape) -> tuple[int, ...]:
  flat = int(ids[np.argmax(mask)])
  return tuple(int(i) for i in np.unravel_index(flat, shape))


def check_access(
  view: View,
  comp: int,
  time: int,
  clock: Clock,
  write: bool,
  describe: Text,
  mask: np.ndarray | None = None,
  describe_comp=None,
  unchanged: Callable[[], bool] | None = None,
) -> None:
  """Raises ``RaceError`` if this access (of ``comp`` at ``time``) and an
  earlier one touch the same element unordered (at least one writing);
  records it. ``clock`` says which accesses happened before: a program's
  covers its own earlier ones (program order); a DMA's, only what its
  issuer knew when it started it, so that two DMAs of one lane race unless
  a wait orders them (an in-order lane passes its own time in ``clock``).
  ``unchanged()``, for a write, says whether it stores what is there
  already: two such writes do not race (``identical_writes_race``)."""
  b = view.buffer
  s = view.slab if mask is None else None
  writes, reads = b.writes, b.reads
  assert writes is not None and reads is not None  # not a semaphore
  if s is not None and writes.arrays is None:
    if s.start == s.stop:
      return
    if not (
      writes.unordered(s.start, s.stop, comp, time, clock)
      or (write and reads.unordered(s.start, s.stop, comp, time, clock))
    ):
      (writes if write else reads).set(s.start, s.stop, comp, time)
      b.who[comp] = describe
      return
    # A race: the element-wise pass below finds and reports it.
  _check_elements(
    view, comp, time, clock, write, describe, mask, describe_comp, unchanged
  )


def same_bytes(view: View, value: np.ndarray) -> bool:
  """Whether ``view`` holds ``value``'s bytes already (NaNs included)."""
  held = np.ascontiguousarray(view.read())
  value = np.ascontiguousarray(np.broadcast_to(value, held.shape))
  return held.dtype == value.dtype and held.tobytes() == value.tobytes()


def _check_elements(
  view, comp, time, clock, write, describe, mask, describe_comp, unchanged
) -> None:
  """``check_access`` element by element, on the shadows' arrays."""
  b = view.buffer
  ids = view.ids.reshape(-1)
  if mask is not None:
    ids = ids[np.broadcast_to(mask, view.shape).reshape(-1)]
  if ids.size == 0:
    return
  where = _slab(ids)
  w_comp, w_time = b.writes.as_arrays()
  r_comp, r_time = b.reads.as_arrays()
  earlier = [(w_comp, w_time, "write")]
  if write:
    earlier.append((r_comp, r_time, "read"))
  for comps, times, kind in earlier:
    if kind == "write" and unchanged is not None and unchanged():
      continue  # both store the same bytes: either order leaves them
    c = comps[where]
    low, high = c.min(), c.max()
    if low == high == NOBODY:
      continue  # nobody accessed them
    t = times[where]
    if low == high and t.max() <= clock.get(int(low), 0):
      continue  # one accessor, all of whose accesses happened before
    others = (c != NOBODY) & ((c != comp) | (t != time))
    if not others.any():
      continue
    rest = c[others]
    while rest.size:  # few distinct accessors: cheaper than np.unique
      q = rest[0]
      rest = rest[rest != q]
      unordered = others & (c == q) & (t > clock.get(int(q), 0))
      if unordered.any():
        element = _first(unordered, _ids(where), b.data.shape)
        raise errors.RaceError(
          f"data race on {b.label} at element {element}: "
          f"{describe} ({'write' if write else 'read'}) and an earlier "
          f"{kind} by {b.who.get(int(q), describe_comp and describe_comp(q))}"
          ", with no synchronisation (signal -> wait, or DMA start -> land "
          "-> wait) ordering them"
        )
  if write:
    w_comp[where] = comp
    w_time[where] = time
  else:
    r_comp[where] = comp
    r_time[where] = time
  b.who[comp] = describe


def _slab(ids: np.ndarray):
  """A slice for flat indices that cover one contiguous range (the common
  window: the checks are about sets of elements, so their order does not
  matter), else the indices: slicing the shadows is far cheaper."""
  first, last = ids.min(), ids.max()
  if last - first + 1 == ids.size:
    return slice(int(first), int(last) + 1)
  return ids


def _ids(where) -> np.ndarray:
  if isinstance(where, slice):
    return np.arange(where.start, where.stop)
  return where


def check_initialized(view: View, describe: Text, mask=None) -> None:
  b = view.buffer
  if mask is None and view.slab is not None and view.init_of().all():
    return
  init = b.init[view.ids]
  if mask is not None:
    init = init | ~np.broadcast_to(mask, view.shape)
  if not init.all():
    element = _first(~init.reshape(-1), view.ids.reshape(-1), b.data.shape)
    raise errors.UninitializedError(
      f"{describe} reads {b.label} at element {element}, which nothing "
      "wrote (uninitialised memory, or a DMA into it that has not landed: "
      "wait for it first)"
    )


def index_view(view: View, indexer, describe: Text) -> View:
  """``view`` narrowed by an ``NDIndexer``; out-of-bounds windows raise
  ``OutOfBoundsError`` (hardware faults; JAX would clamp)."""
  b = view.buffer
  index: list[slice | int | np.ndarray] = []
  key: list[Hashable] = []
  for dim, (idx, size) in enumerate(
    zip(indexer.indices, view.shape, strict=True)
  ):
    if hasattr(idx, "stride") and hasattr(idx, "size"):  # a Slice
      start, length = int(np.asarray(idx.start)), int(np.asarray(idx.size))
      stride = int(idx.stride)
      stop = start + (length - 1) * stride
      if length and (start < 0 or stop >= size):
        raise errors.OutOfBoundsError(
          f"{describe}: window [{start}:{stop + 1}:{stride}] of dimension "
          f"{dim} of {b.label} (size {size}) is out of bounds"
        )
      index.append(slice(start, start + length * stride, stride))
      key.append((start, length, stride))
      continue
    i = np.asarray(idx)
    scalar = i.ndim == 0
    if (
      (int(i) < 0 or int(i) >= size)
      if scalar
      else (i.size and (i.min() < 0 or i.max() >= size))
    ):
      raise errors.OutOfBoundsError(
        f"{describe}: index {i.tolist()} of dimension {dim} of "
        f"{b.label} (size {size}) is out of bounds"
      )
    index.append(int(i) if scalar else i)
    key.append(int(i) if scalar else None)
  windows = getattr(b, "windows", None)  # the static checks' have none
  if windows is None or view.ids is not b.ids or None in key:
    return View(b, view.ids[tuple(index)])
  # A window of the whole buffer: kernels take the same few again and
  # again, and a View (with its slab) is immutable.
  window = tuple(key)
  found = windows.get(window)
  if found is None:
    found = View(b, b.ids[tuple(index)])
    if len(windows) < MAX_WINDOWS:
      windows[window] = found
  return found
