"""A checked launch's event log as Chrome trace-event JSON.

Perfetto and chrome://tracing open it: a process per device, a thread per
program (and one for each device's DMAs); compute spans between a
program's synchronisation points, blocked waits as spans, DMA spans from
start to landing, and flow arrows from each signal (or landing) to the
wait it released. The time axis counts scheduler steps (one per
microsecond of the trace): it orders events, it is not hardware time.
"""

import json
from typing import Any

# Trace time units per scheduler step.
_UNIT = 1


def events(machines) -> list[dict[str, Any]]:
  """The trace events of ``machines`` (launches run one after another)."""
  out: list[dict[str, Any]] = []
  offset = 0
  for launch, m in enumerate(machines):
    out += _launch_events(m, launch, offset)
    offset += (m.step + 2) * _UNIT
  return out


def _meta(m, launch: int) -> list[dict[str, Any]]:
  plan = m.plan
  meta = []
  for d in range(plan.num_devices):
    pid = launch * plan.num_devices + d
    name = plan.device_name(d).strip() or "device 0"
    meta.append(
      {
        "name": "process_name",
        "ph": "M",
        "pid": pid,
        "args": {"name": f"launch {launch}: {plan.kernel}: {name}"},
      }
    )
    for g, program in enumerate(plan.program_names):
      meta.append(
        {
          "name": "thread_name",
          "ph": "M",
          "pid": pid,
          "tid": g,
          "args": {"name": program},
        }
      )
    meta.append(
      {
        "name": "thread_name",
        "ph": "M",
        "pid": pid,
        "tid": plan.num_programs,
        "args": {"name": "DMAs"},
      }
    )
  return meta


def _launch_events(m, launch: int, offset: int) -> list[dict[str, Any]]:
  plan = m.plan
  out = _meta(m, launch)

  def pid(d):
    return launch * plan.num_devices + d

  last: dict[tuple[int, int], int] = {}
  starts: dict[int, Any] = {}
  for k, e in enumerate(m.events):
    ts = offset + e.step * _UNIT
    if e.kind == "dma_start":
      starts[e.dma] = e
    if e.program < 0:  # a DMA lands
      start = starts.get(e.dma)
      begin = offset + (start.step if start else e.step) * _UNIT
      out.append(
        {
          "name": e.what,
          "cat": "dma",
          "ph": "X",
          "pid": pid(e.device),
          "tid": plan.num_programs,
          "ts": begin,
          "dur": max(ts - begin, 1),
          "args": {"where": e.where},
        }
      )
      continue
    where = (e.device, e.program)
    begin = last.get(where, offset)
    ts = max(ts, begin)  # events of one step (a last wait, then the exit)
    if ts > begin:
      name = (
        "blocked" if e.kind == "wait" and e.after is not None else ("compute")
      )
      out.append(
        {
          "name": name,
          "cat": "program",
          "ph": "X",
          "pid": pid(e.device),
          "tid": e.program,
          "ts": begin,
          "dur": ts - begin,
        }
      )
    out.append(
      {
        "name": e.what,
        "cat": e.kind,
        "ph": "X",
        "pid": pid(e.device),
        "tid": e.program,
        "ts": ts,
        "dur": _UNIT,
        "args": {"where": e.where},
      }
    )
    last[where] = ts + _UNIT
    if e.kind == "wait" and e.after is not None:
      source = m.events[e.after]
      tid = source.program if source.program >= 0 else plan.num_programs
      flow = launch * 1_000_000 + k
      out.append(
        {
          "name": "releases",
          "cat": "sync",
          "ph": "s",
          "id": flow,
          "pid": pid(source.device),
          "tid": tid,
          "ts": offset + source.step * _UNIT,
        }
      )
      out.append(
        {
          "name": "releases",
          "cat": "sync",
          "ph": "f",
          "bp": "e",
          "id": flow,
          "pid": pid(e.device),
          "tid": e.program,
          "ts": ts,
        }
      )
  return out


def write(path: str, machines) -> None:
  """Writes the trace of ``machines`` to ``path``."""
  trace = {
    "traceEvents": events(machines),
    "displayTimeUnit": "ns",
    "otherData": {
      "time": "scheduler steps of the mpmd checking executor (1 us each), "
      "not a model of hardware time",
    },
  }
  with open(path, "w") as f:
    json.dump(trace, f)
