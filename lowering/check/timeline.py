"""A checked launch's event log as Chrome trace-event JSON.

Perfetto and chrome://tracing open it: a process per device, a thread per
program (and one for each device's DMAs); compute spans between a
program's synchronisation points, blocked waits as spans, DMA spans from
start to landing (a remote DMA's in two: start to source read, read to
landing), and flow arrows from each signal (or landing) to the
wait it released. The time axis counts scheduler steps (one per
microsecond of the trace): it orders events, it is not hardware time.
"""

import json
from typing import Any

# One Chrome trace event: JSON, its fields as the format names them.
TraceEvent = dict[str, object]

# Trace time units per scheduler step.
_UNIT = 1


def events(machines) -> list[TraceEvent]:
  """The trace events of ``machines`` (launches run one after another)."""
  out: list[TraceEvent] = []
  offset = 0
  for launch, m in enumerate(machines):
    out += _launch_events(m, launch, offset)
    offset += (m.step + 2) * _UNIT
  return out


def _meta(m, launch: int) -> list[TraceEvent]:
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


def _span(name, cat, pid, tid, ts, dur, where=None) -> TraceEvent:
  span = {
    "name": name,
    "cat": cat,
    "ph": "X",
    "pid": pid,
    "tid": tid,
    "ts": ts,
    "dur": dur,
  }
  if where is not None:
    span["args"] = {"where": where}
  return span


def _arrow(flow, source_pid, source_tid, source_ts, pid, tid, ts):
  """A flow arrow from a signal (or a DMA's landing) to the wait it let
  through."""
  common = {"name": "releases", "cat": "sync", "id": flow}
  return [
    {
      **common,
      "ph": "s",
      "pid": source_pid,
      "tid": source_tid,
      "ts": source_ts,
    },
    {**common, "ph": "f", "bp": "e", "pid": pid, "tid": tid, "ts": ts},
  ]


def _launch_events(m, launch: int, offset: int) -> list[TraceEvent]:
  plan = m.plan
  out = _meta(m, launch)
  dmas = plan.num_programs  # the DMA thread of each device

  def pid(d):
    return launch * plan.num_devices + d

  last: dict[tuple[int, int], int] = {}
  starts: dict[int, Any] = {}  # machine.Event (machine imports us, indirectly)
  for k, e in enumerate(m.events):
    ts = offset + e.step * _UNIT
    if e.kind == "dma_start":
      starts[e.dma] = e
    if e.program < 0:  # a DMA lands: its span from its start
      start = starts.get(e.dma)
      begin = offset + (start.step if start else e.step) * _UNIT
      out.append(
        _span(
          e.what, "dma", pid(e.device), dmas, begin, max(ts - begin, 1), e.where
        )
      )
      starts[e.dma] = e  # (a source read: its landing's span follows)
      continue
    where = (e.device, e.program)
    begin = last.get(where, offset)
    ts = max(ts, begin)  # events of one step (a last wait, then the exit)
    released = e.kind == "wait" and e.after is not None
    if ts > begin:
      name = "blocked" if released else "compute"
      out.append(
        _span(name, "program", pid(e.device), e.program, begin, ts - begin)
      )
    out.append(
      _span(e.what, e.kind, pid(e.device), e.program, ts, _UNIT, e.where)
    )
    last[where] = ts + _UNIT
    if released:
      source = m.events[e.after]
      tid = source.program if source.program >= 0 else dmas
      out += _arrow(
        launch * 1_000_000 + k,
        pid(source.device),
        tid,
        offset + source.step * _UNIT,
        pid(e.device),
        e.program,
        ts,
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
