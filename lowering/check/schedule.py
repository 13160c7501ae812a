"""Schedules: who runs next, and when each DMA lands.

At every decision point the executor offers the *options*: each program
whose next synchronisation operation can go ahead (``("p", program)``) and
each DMA in flight (``("d", dma)``, landing it; a remote DMA reads its
source first, a step of its own). The *default* choice lands
DMAs at once (oldest first), then keeps the current program running while
it can, else runs the first program that can. A strategy picks an option;
every pick that differs from the default is a *preemption*, recorded as
``(step, option)``, and a schedule string lists them: replaying the string
makes the same picks, so the same run, byte for byte.

Schedule strings:

* ``"default"``: no preemption.
* ``"random:SEED"``: a seeded random walk (each option equally likely).
* ``"pct3:SEED"`` or ``"pct3:SEED:STEPS"``: PCT with depth 3 (random
  program priorities, two priority changes at random steps among the first
  STEPS, 100 by default: finds a depth-d bug with probability at least
  1 / (n k^(d-1)) per run, n programs, k steps).
* ``"steps:L/S:pP,L/S:dD,..."``: explicit preemptions, launch ``L`` (of
  the function's launches, in the order they ran) at step ``S`` runs
  program ``P`` / lands DMA ``D`` (or has it read its source); what
  ``explore`` reports after shrinking.
"""

import dataclasses
import enum
import hashlib

import numpy as np

Option = tuple[str, int]

# PCT's change points fall among the first this many steps, unless the
# schedule string says how many steps the launch takes.
DEFAULT_STEPS = 100


class Kind(enum.Enum):
  """The strategy a schedule string names."""

  DEFAULT = "default"  # no preemption
  STEPS = "steps"  # explicit preemptions (a shrunk schedule)
  RANDOM = "random"  # a random walk
  PCT = "pct"  # probabilistic concurrency testing, of some depth


def parse(schedule: str) -> "Spec":
  """Checks a schedule string (see the module docstring)."""
  if not isinstance(schedule, str):
    raise TypeError(f"mpmd: expected a schedule string, got {schedule!r}")
  if schedule == "default":
    return Spec(Kind.DEFAULT)
  kind, _, rest = schedule.partition(":")
  if kind == "steps":
    picks: dict[int, dict[int, Option]] = {}
    for item in filter(None, rest.split(",")):
      try:
        where, option = item.split(":")
        launch, step = (int(x) for x in where.split("/"))
        picks.setdefault(launch, {})[step] = (option[0], int(option[1:]))
        if option[0] not in "pd":
          raise ValueError
      except ValueError:
        raise ValueError(
          f"mpmd: bad schedule item {item!r} in {schedule!r}; expected "
          "LAUNCH/STEP:pPROGRAM or LAUNCH/STEP:dDMA"
        ) from None
    return Spec(Kind.STEPS, picks=picks)
  if kind == "random" or kind.startswith("pct"):
    depth = 0
    if kind.startswith("pct"):
      try:
        depth = int(kind[3:] or 3)
      except ValueError:
        depth = -1
      if depth < 1:
        raise ValueError(f"mpmd: bad PCT depth in schedule {schedule!r}")
    seed_text, _, steps_text = rest.partition(":")
    try:
      seed = int(seed_text)
      steps = int(steps_text) if steps_text and depth else DEFAULT_STEPS
    except ValueError:
      raise ValueError(
        f"mpmd: bad seed in schedule {schedule!r}; expected e.g. "
        "'random:7' or 'pct3:7:400'"
      ) from None
    return Spec(
      Kind.PCT if depth else Kind.RANDOM, seed=seed, depth=depth, steps=steps
    )
  raise ValueError(
    f"mpmd: unknown schedule {schedule!r}; expected 'default', "
    "'random:SEED', 'pctD:SEED' or 'steps:...'"
  )


@dataclasses.dataclass(frozen=True)
class Spec:
  """A parsed schedule string."""

  kind: Kind
  seed: int = 0
  depth: int = 0
  steps: int = 0
  picks: dict[int, dict[int, Option]] = dataclasses.field(
    default_factory=dict, hash=False, compare=False
  )

  def strategy(self, launch: int) -> "Strategy":
    """The strategy for the ``launch``-th launch of a run."""
    if self.kind is Kind.DEFAULT:
      return Strategy()
    if self.kind is Kind.STEPS:
      return Fixed(self.picks.get(launch, {}))
    rng = np.random.default_rng(mix(self.seed, launch))
    if self.kind is Kind.RANDOM:
      return RandomWalk(rng)
    return Pct(rng, self.depth, self.steps)


def mix(seed: int, launch: int) -> int:
  digest = hashlib.sha256(f"{seed}/{launch}".encode()).digest()
  return int.from_bytes(digest[:8], "little")


def encode(preemptions: dict[int, list[tuple[int, Option]]]) -> str:
  """The ``steps:`` string of recorded preemptions, per launch."""
  items = [
    f"{launch}/{step}:{kind}{index}"
    for launch, picks in sorted(preemptions.items())
    for step, (kind, index) in picks
  ]
  return "steps:" + ",".join(items)


def default_choice(options: list[Option], current: int | None) -> Option:
  dmas = [o for o in options if o[0] == "d"]
  if dmas:
    return min(dmas)
  if current is not None and ("p", current) in options:
    return ("p", current)
  return min(options)


class Strategy:
  """The default schedule: no preemption."""

  def choose(self, step: int, options: list[Option], default: Option) -> Option:
    del step, options
    return default

  def new_dma(self, dma: int) -> None:
    del dma


class Fixed(Strategy):
  """Explicit preemptions (a ``steps:`` string); default elsewhere, and
  where the recorded pick is not an option (while ``explore`` shrinks a
  schedule), which ``unapplied`` tells."""

  def __init__(self, picks: dict[int, Option]):
    self.picks = picks
    self.applied: set[int] = set()
    self.offered: dict[int, list[Option]] = {}  # where a pick was not

  def choose(self, step, options, default):
    pick = self.picks.get(step)
    if pick is None:
      return default
    if pick in options:
      self.applied.add(step)
      return pick
    self.offered[step] = sorted(options)
    return default

  def unapplied(self) -> dict[int, list[Option] | None]:
    """The steps whose pick did not happen: what they offered instead, or
    None where the launch ended before them."""
    return {
      step: self.offered.get(step)
      for step in sorted(self.picks)
      if step not in self.applied
    }


class RandomWalk(Strategy):
  """Each option equally likely: the pick ``rng.integers(len(options))``
  makes, drawn as numpy draws it (``Draws``) at a fraction of its cost
  per call."""

  def __init__(self, rng: np.random.Generator):
    self.draws = Draws(rng)

  def choose(self, step, options, default):
    return options[self.draws.below(len(options))]


class Draws:
  """``int(rng.integers(n))`` for ``n`` in ``[1, 2**32]``, the same numbers
  in the same order, from 32-bit words that numpy draws in blocks.

  numpy draws such an integer from the bit generator's stream of 32-bit
  words (``next_uint32``) by Lemire's method: a word ``u`` gives ``m = u *
  n``; ``m >> 32`` is the pick unless ``m``'s low half falls below ``(2**32
  - n) % n`` (then it takes the next word); ``n == 1`` takes no word. A
  block of ``rng.integers(2**32, size=k, dtype=np.uint32)`` is the next
  ``k`` words of that stream, so the picks are numpy's; only the generator
  runs ahead (nothing else draws from it). One call of ``rng.integers``
  costs microseconds; a random schedule draws at every step."""

  BLOCK = 256

  def __init__(self, rng: np.random.Generator):
    self.rng = rng
    self.words: list[int] = []
    self.next = 0

  def _word(self) -> int:
    if self.next == len(self.words):
      block = self.rng.integers(1 << 32, size=self.BLOCK, dtype=np.uint32)
      self.words = block.tolist()
      self.next = 0
    word = self.words[self.next]
    self.next += 1
    return word

  def below(self, n: int) -> int:
    if n == 1:
      return 0
    m = self._word() * n
    if m & 0xFFFFFFFF < n:
      threshold = ((1 << 32) - n) % n
      while m & 0xFFFFFFFF < threshold:
        m = self._word() * n
    return m >> 32


class Pct(Strategy):
  """Probabilistic concurrency testing: every program and DMA gets a random
  priority, the highest enabled one runs; at ``depth - 1`` random steps the
  running one drops below all others."""

  def __init__(self, rng: np.random.Generator, depth: int, steps: int):
    self.rng = rng
    self.priority: dict[Option, float] = {}
    self.change_points = set(
      int(s) for s in rng.integers(0, max(steps, 1), size=depth - 1)
    )
    self.lowered = 0

  def _priority(self, option: Option) -> float:
    if option not in self.priority:
      self.priority[option] = 1.0 + float(self.rng.random())
    return self.priority[option]

  def choose(self, step, options, default):
    best = max(options, key=self._priority)
    if step in self.change_points:
      self.lowered += 1
      self.priority[best] = -float(self.lowered)
      best = max(options, key=self._priority)
    return best
