"""Executes a timetable of (stage, micro-batch, F|B) actions on a pipeline's stages.

The ways of running are small drivers, each checking its own arguments, which the `Pipeline`
(`fxpipe.pipeline`, a façade) forwards to with its current mode (`front.Facade`):

- `calls`: a call (`pipe(...)`), and a plan's stages called or trained without a Pipeline
  (compile's check and race).
- `training`: `train_step`, and the step of each of `stream_train`'s exact windows.
- `streaming`: `stream`, and `stream_train`'s exact and asynchronous windows (`asynchronous`).
- `lanes`: steps fed from several threads, each waiting for its own (lanes that advance on
  their own); `fxpipe.generate` (above the runtime): generation, on the per-stage `state`.

Each splits its batch by one front (`front`: split -> timetable -> seeds -> run -> merge), which
torchrun ranks share (`fxpipe.distributed.stage`). `holding`: the pipeline's tensors under the
model's names. Below the drivers, parts each replaceable without the others (as torchgpipe and
torch.distributed.pipelining keep them apart):

- `executor`: `StageExecutor` runs one stage's forward or backward for one micro-batch on the
  calling thread: seeds, cutting autograd at the stage boundary, what the backward keeps, the
  loss on the last stage, the stage's CUDA stream.
- `transport`: `Transport` moves a stage's outputs and gradients to their readers, one message per
  (phase, sender, receiver, micro-batch), aborts with a reason and ends a step;
  `ThreadTransport` does it with a FIFO queue per link, CUDA events per message and an abort
  token (`fxpipe.distributed`'s `DistributedTransport` over gloo).
- `orchestrator`: `Runtime` runs a timetable with one worker thread per stage (or one stage on
  the caller's thread), joins them whatever happens, re-raises the first failure as a
  `StageError`, and records the run (`record.Run`). `stage_row`: `StageRow` walks one stage's
  row against a transport (a thread's, or a rank's); `driver`: `Driver` drives one run, written
  once for the threads and for `fxpipe.distributed`.
- `step`: the train-step contract both backends keep (`StepLoss`, `DeferredScale`).
- `state`: what each stage keeps across runs (`StageState`, `Runtime.state[s]`: a key/value
  cache), owned by the runtime and freed when it closes.

Inference and training differ only in the timetable (backward actions or none) and the loss
(`loss_of`).
"""

from .executor import LossFn, StageExecutor
from .orchestrator import DRIVER, Run, Runtime, StageRow, set_thread_count
from .transport import Aborted, ThreadTransport, Transport

__all__ = ["Aborted", "DRIVER", "LossFn", "Run", "Runtime", "StageExecutor", "StageRow", "ThreadTransport",
           "Transport", "set_thread_count"]
