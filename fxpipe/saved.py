"""`fxpipe.saved`: the path docs/saved-plans.md showed (`load_stage`, `convert`)
before the module moved to `fxpipe.plans.saved`. It is that module, one object and not a
copy, so code written against the old path keeps working; new code imports the new path."""

import sys

from .plans import saved

sys.modules[__name__] = saved
