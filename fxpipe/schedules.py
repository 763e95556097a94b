"""`fxpipe.schedules`: the path docs/training.md showed (`validate`, `one_f_one_b`)
before the module moved to `fxpipe.runtime.schedules`. It is that module, one object and not a
copy, so code written against the old path keeps working; new code imports the new path."""

import sys

from .runtime import schedules

sys.modules[__name__] = schedules
