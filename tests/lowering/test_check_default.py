"""The default pick is one rule (``schedule.default_choice``): the TPU
scheduling loop reads it off its options as it lists them (``sync._options``,
for speed) and the GPU loop calls the rule. Here every option list the TPU
loop makes, on schedules that reach many states (DMAs in flight, the
current program blocked, programs done), is checked against the rule."""

import jax
import pytest
from checked_ring import ring_launch
from test_check import X, two_meshes

import mpmd
from mpmd._lowering.check import schedule, sync


@pytest.fixture
def compared(monkeypatch):
  """Wraps ``sync._options`` with the check; returns counts of the option
  lists checked and of the states among them."""
  seen = {"lists": 0, "with_dmas": 0, "current_blocked": 0}
  listed = sync._options

  def options(m, programs, current):
    options, default = listed(m, programs, current)
    if options:
      assert default == schedule.default_choice(options, current)
      seen["lists"] += 1
      seen["with_dmas"] += any(o[0] == "d" for o in options)
      seen["current_blocked"] += (
        current is not None and ("p", current) not in options
      )
    else:
      assert default is None
    return options, default

  monkeypatch.setattr(sync, "_options", options)
  return seen


@pytest.mark.parametrize("text", ["default", "random:3", "pct3:5"])
def test_tpu_loop_default_is_the_rule(compared, text):
  ring_launch(text)().block_until_ready()
  jax.block_until_ready(
    two_meshes(interpret=mpmd.CheckParams(schedule=text))(X)
  )
  # The states that tell the rule's branches apart were all reached.
  assert compared["lists"] > 100
  assert compared["with_dmas"] > 0
  assert compared["current_blocked"] > 0
