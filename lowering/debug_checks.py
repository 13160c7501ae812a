"""A kernel's own ``pl.debug_check`` on the CPU fallback: its meaning and
its message.

Mosaic lowers ``pl.debug_check(condition, message)`` to an assertion when
``pl.enable_debug_checks`` is on at lowering time, and to nothing when it
is off. The CPU paths do the same: the fast and lockstep paths add the
check to their run-time checks (``bounds.Checks.user_check``), the
checking executor evaluates it in its program; a failure is an
``mpmd.DebugCheckError`` whose message starts with ``DEBUG_CHECK`` and
names the kernel, the program and the line before the user's message.
"""

import string
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DEBUG_CHECK = "mpmd_map: pl.debug_check failed"


def escape(text: str) -> str:
  """``text`` as a format string's literal (braces doubled)."""
  return text.replace("{", "{{").replace("}", "}}")


def shift_fields(fmt: str, by: int) -> str:
  """``fmt`` with its positional fields numbered ``by`` later (``{}`` and
  ``{0}`` become ``{1}`` for ``by=1``; named fields stay): the user's
  message of a check, after arguments of ours."""
  parts, auto = [], 0
  for literal, field, spec, conversion in string.Formatter().parse(fmt):
    parts.append(escape(literal))
    if field is None:
      continue
    digits = len(field) - len(field.lstrip("0123456789"))
    index, rest = field[:digits], field[digits:]
    if index or not rest[:1].isidentifier():
      if not index:
        index, auto = str(auto), auto + 1
      field = f"{int(index) + by}{rest}"
    parts.append(
      "{"
      + field
      + (f"!{conversion}" if conversion else "")
      + (f":{spec}" if spec else "")
      + "}"
    )
  return "".join(parts)


def user_message(fmt: str, args: Sequence[Any], kwargs: Mapping) -> str:
  """A kernel's check's message: ``pl.debug_check``'s is plain text (Mosaic
  prints it as is), a ``checkify.debug_check``'s formats its values (or,
  where it asks for values that are not there, comes with them)."""
  if not args and not kwargs:
    return fmt
  return formatted(fmt, args, kwargs)


def formatted(fmt: str, args: Sequence[Any], kwargs: Mapping) -> str:
  """``fmt.format(*args, **kwargs)``, or ``fmt`` and the values where it
  asks for values that are not there."""
  try:
    return fmt.format(*args, **kwargs)
  except (IndexError, KeyError, ValueError):
    values = [*map(np.asarray, args), *map(np.asarray, kwargs.values())]
    return f"{fmt} (with values {[v.tolist() for v in values]})"
