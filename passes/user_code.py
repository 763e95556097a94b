"""Where in the user's code something happened: the one extractor every error message uses.

An error about a model names the model's own line, not torch's or fxpipe's: the innermost frame
outside both, found in an exception's traceback, in the stack trace a node recorded while it was
traced (`node.meta["stack_trace"]`, fx and export alike), or on the current stack.

Example (torch raises inside a model's code; the frame shown is the model's line):

>>> import torch
>>> from fxpipe.passes.user_code import describe_frame, user_frame
>>> def forward(x):
...     return x @ x
>>> try:
...     forward(torch.ones(2, 3))
... except RuntimeError as e:
...     frame = user_frame(e)
>>> frame.name, frame.lineno
('forward', 2)
>>> print(describe_frame(frame, one_line=True))
  at <doctest ...>:2: return x @ x
"""

from __future__ import annotations

import linecache
import os
import re
import traceback

import torch
import torch.fx as fx

_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
_RECORDED_FRAME = re.compile(r'\s*File "(?P<file>.+)", line (?P<line>\d+), in (?P<name>.+)')


def user_frame(origin: BaseException | fx.Node | None = None) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code in `origin`: an exception's traceback, a node's
    recorded stack trace, or (None) the current stack. None when there is none to show."""
    if isinstance(origin, BaseException):
        frames = traceback.extract_tb(origin.__traceback__)
    elif isinstance(origin, fx.Node):
        frames = _recorded_frames(origin.meta.get("stack_trace") or "")
    else:
        frames = traceback.extract_stack()
    mine = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    return mine[-1] if mine else None


def describe_frame(frame: traceback.FrameSummary, indent: str = "  ", *,
                   one_line: bool = False) -> str:
    """`frame` as Python prints it in a traceback, `File "model.py", line 12, in forward` with
    the line's code below, or `one_line`: `at model.py:12: code`, to sit inside a sentence."""
    code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    if one_line:
        return f"{indent}at {frame.filename}:{frame.lineno}: {code}"
    text = f'{indent}File "{frame.filename}", line {frame.lineno}, in {frame.name}'
    return text + (f"\n{indent}  {code}" if code else "")


def _recorded_frames(stack_trace: str) -> list[traceback.FrameSummary]:
    """The frames of a stack trace in Python's printed form, outermost first."""
    lines = stack_trace.splitlines()
    frames = []
    for i, line in enumerate(lines):
        match = _RECORDED_FRAME.fullmatch(line)
        if match:
            below = lines[i + 1] if i + 1 < len(lines) else ""
            code = "" if _RECORDED_FRAME.fullmatch(below) else below.strip()
            frames.append(traceback.FrameSummary(match["file"], int(match["line"]),
                                                 match["name"], line=code or None))
    return frames
