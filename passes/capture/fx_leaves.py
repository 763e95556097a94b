"""The `fx+leaves` front-end: fx again, with every submodule whose forward broke tracing made a
leaf (called whole, as one node), found one at a time from where tracing failed. `choose` tries
it where plain fx failed inside a submodule (`CaptureFailed.culprit`)."""

from __future__ import annotations

from torch import nn

from .frontend import Captured, CaptureFailed, Method, Request
from .fx import FIX, traced

MAX_AUTO_LEAVES = 64


class FxLeaves:
    """torch.fx, keeping whole (besides the modules given or hooked) each submodule whose
    forward breaks tracing, up to `MAX_AUTO_LEAVES` of them."""

    method = Method.FX_LEAVES
    label = "torch.fx with automatic leaf modules"
    fix = FIX

    def capture(self, model: nn.Module, request: Request) -> Captured:
        leaves = list(request.leaves)
        auto: list[str] = []
        failed: CaptureFailed | None = None
        for _ in range(MAX_AUTO_LEAVES):
            try:
                return Captured(traced(model, request, leaves), (*request.named_leaves, *auto))
            except CaptureFailed as failure:
                failed = failure
                if not failure.culprit or failure.culprit in leaves:
                    break
                leaves.append(failure.culprit)
                auto.append(failure.culprit)
        raise CaptureFailed(str(failed)) from failed


FX_LEAVES = FxLeaves()
