"""Pictures of a run: what each stage did when, measured (`pipe.last_run`) or predicted
(`pipe.predict()`), as a Chrome/Perfetto trace or an SVG Gantt chart.

    fxpipe.timeline.write_chrome_trace(pipe.last_run.slots, "run.trace.json")  # chrome://tracing
    fxpipe.timeline.write_svg(pipe.last_run.slots, "run.svg")                   # any browser
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence
from xml.sax.saxutils import escape

from .runtime.schedules import Phase, Slot

_COLOURS = {Phase.FORWARD: "#4e79a7", Phase.BACKWARD: "#f28e2b"}


def chrome_trace(slots: Sequence[Slot]) -> dict:
    """The Trace Event Format: one row ("thread") per stage, one complete event per action."""
    events = [{"name": str(s.action), "cat": s.action.phase.name.lower(), "ph": "X",
               "pid": 0, "tid": s.action.stage, "ts": s.start_s * 1e6,
               "dur": (s.end_s - s.start_s) * 1e6,
               "args": {"microbatch": s.action.microbatch}} for s in slots]
    stages = sorted({s.action.stage for s in slots})
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s,
                "args": {"name": f"stage {s}"}} for s in stages]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(slots: Sequence[Slot], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(slots)))
    return path


def svg(slots: Sequence[Slot], *, width: int = 900, row_height: int = 28,
        title: str = "") -> str:
    """A Gantt chart: one row per stage, one labelled box per action (blue forward, orange
    backward), time axis in milliseconds."""
    stages = max((s.action.stage for s in slots), default=-1) + 1
    end_s = max((s.end_s for s in slots), default=0.0) or 1.0
    left, top = 70, 30 if title else 10
    scale = (width - left - 10) / end_s
    height = top + stages * row_height + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>']
    if title:
        parts.append(f'<text x="{left}" y="18" font-size="13">{escape(title)}</text>')
    for stage in range(stages):
        y = top + stage * row_height
        parts.append(f'<text x="5" y="{y + row_height * 0.65:.1f}">stage {stage}</text>')
    for slot in slots:
        x = left + slot.start_s * scale
        w = max((slot.end_s - slot.start_s) * scale, 1.0)
        y = top + slot.action.stage * row_height + 2
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_height - 4}" '
                     f'fill="{_COLOURS[slot.action.phase]}" stroke="white">'
                     f'<title>{slot.action}: {slot.start_s * 1e3:.2f}-{slot.end_s * 1e3:.2f} ms'
                     f'</title></rect>')
        if w > 24:
            parts.append(f'<text x="{x + 3:.1f}" y="{y + row_height * 0.6:.1f}" fill="white">'
                         f'{slot.action}</text>')
    axis_y = top + stages * row_height + 15
    for tick in range(6):
        t = end_s * tick / 5
        parts.append(f'<text x="{left + t * scale - 10:.1f}" y="{axis_y}">{t * 1e3:.1f} ms</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_svg(slots: Sequence[Slot], path: str | Path, **options) -> Path:
    path = Path(path)
    path.write_text(svg(slots, **options))
    return path
