"""The CPU fallback's checking executor (``interpret=mpmd.CheckParams()``).

A plan in (``launch.plan_of``: the launch's kernels merged into one kernel
over all programs, its devices), outputs and an event log out:

* ``records``: Pallas' synchronisation equations read into named records
  (from a template per equation and scalar operands);
* ``interp``: one program as a generator that stops at each
  synchronisation point;
* ``memory``: simulated buffers and the race / uninitialised-read checks;
  ``shadow``: who accessed each element last, as runs of elements;
* ``machine``: one launch's whole state; ``sync``: the scheduling loop and
  the synchronisation operations; ``schedule``: strategies and schedule
  strings;
* ``launch``: the CPU lowering and host callback; ``params``: how a launch
  asks for the executor; ``timeline``: the event log as a Chrome trace.
"""
