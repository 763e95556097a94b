"""The old name of `fxpipe.passes.capture`, kept for plans pickled before capture became a
package (their `Capture` is `fxpipe.passes.trace.Capture`); code imports
`fxpipe.passes.capture`.

Example (the old name is the new class):

>>> from fxpipe.passes import capture, trace
>>> trace.Capture is capture.Capture
True
"""

from .capture import Capture

__all__ = ["Capture"]
