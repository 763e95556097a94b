"""The old name of `fxpipe.passes.capture`, kept for plans pickled before capture became a
package (their `Capture` is `fxpipe.passes.trace.Capture`); code imports
`fxpipe.passes.capture`."""

from .capture import Capture

__all__ = ["Capture"]
