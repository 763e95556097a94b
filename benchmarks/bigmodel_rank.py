"""One rank of `python -m benchmarks.bigmodel --run`, started by torchrun:

    torchrun --nproc-per-node 4 -m benchmarks.bigmodel_rank NAME DIR

Loads its stage of the plan at DIR/plan with its weights read from the checkpoint DIR/ckpt
(`fxpipe.distributed.load(weights=)`, the model built on meta as the structure non-persistent
buffers are computed from; on the plain CPU, which safetensors reads onto) and runs the example once, measuring the load's time and the peak
resident memory growth of load and call. Writes DIR/rank<r>.json: those, its stage's weights,
and on the last stage the output's largest difference from the model's (DIR/reference.pt).
"""

import json
import sys
from pathlib import Path

import torch

import fxpipe.distributed
from benchmarks.bigmodel import build, largest_difference, measured, nbytes


def main(name: str, directory: str) -> None:
    torch.set_num_threads(1)          # the ranks share the machine's cores
    directory = Path(directory)
    structure = build(name, on_meta=True)
    found = measured(lambda: fxpipe.distributed.load(
        directory / "plan", weights=directory / "ckpt", model=structure, device="cpu"), name)
    with found["loaded"] as stage:
        last = stage.index == stage.last
        figures = {"load_s": found["load_s"], "grew": found["grew"],
                   "weights": nbytes(stage.module), "difference":
                   largest_difference(found["output"], directory) if last else None}
        Path(directory, f"rank{stage.rank}.json").write_text(json.dumps(figures))


if __name__ == "__main__":
    main(*sys.argv[1:3])
