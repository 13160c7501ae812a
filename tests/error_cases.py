"""The error tables' row type and how a row is checked (``test_errors*``)."""

from collections.abc import Callable
from typing import NamedTuple

import pytest


class Case(NamedTuple):
  id: str
  call: Callable[[], object]
  error: type[Exception]
  match: str


def params(cases):
  return [pytest.param(c, id=c.id) for c in cases]


def raises(case: Case) -> str:
  with pytest.raises(case.error, match=case.match) as info:
    case.call()
  message = str(info.value)
  # Internal names (the merged programs' axis) never reach the user.
  assert "_mpmd_programs" not in message, message
  return message
