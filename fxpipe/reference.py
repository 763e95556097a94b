"""`fxpipe.reference`: the path docs/guarantees.md showed (`run_per_microbatch`)
before the module moved to `fxpipe.planning.reference`. It is that module, one object and not a
copy, so code written against the old path keeps working; new code imports the new path."""

import sys

from .planning import reference

sys.modules[__name__] = reference
