"""The kernels of examples/ as modules, for tests that check them further
than the script's own run (imported by module name: tests/ is on pytest's
pythonpath; examples/ is not a package)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).parent.parent / "examples"


def load(name: str) -> ModuleType:
  """``examples/<name>.py`` imported (once) as module ``examples_<name>``;
  its ``main()`` does not run."""
  module_name = f"examples_{name}"
  if module_name in sys.modules:
    return sys.modules[module_name]
  spec = importlib.util.spec_from_file_location(
    module_name, EXAMPLES / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module
  spec.loader.exec_module(module)
  return module
