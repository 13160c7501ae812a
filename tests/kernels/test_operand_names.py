"""Every shipped kernel names its operands as its code does, so that an
error or a checker report about one of them names ``x_tile`` or
``scratch['out_smem']``, not ``refs[14]`` (kernels written as
``kernel(*refs)`` declare their names: ``_common.operand_names``)."""

import re

import pytest
from launches import launch_eqns

from mpmd import demos

POSITIONAL = re.compile(r"^(refs|args)\[\d+\]$")


@pytest.mark.parametrize("name", sorted(demos.registered()))
def test_every_operand_of_a_shipped_kernel_has_a_name(name):
  demo = demos.registered()[name]()
  launches = launch_eqns(demo.fn, *demo.args)
  assert launches
  for launch in launches:
    for jaxpr in launch.params["jaxprs"]:
      names = jaxpr.debug_info.arg_names
      assert len(names) == len(jaxpr.invars), names
      assert all(n and not POSITIONAL.match(n) for n in names), names
