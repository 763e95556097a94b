"""Models bigger than one device: Llama-shaped decoders planned from the meta device.

    python -m benchmarks.bigmodel [--quick] [--models 1B 8B 70B 405B] [--training]
    python -m benchmarks.bigmodel --run [--quick]

Each model is built from a `LlamaConfig` under `torch.device("meta")` (1B, 8B, 70B and 405B
shapes; bf16 where the float32 model would not fit this machine; the 405B shape, Llama-3.1's:
126 layers, hidden 16384, MLP 53248, 128 heads, 8 key/value heads, 810 GB of bf16 weights,
6.4 GB a layer) and planned for inference (with `--training` also for training with Adam: a
row per mode) on CPU devices whose memory caps (`DeviceSpec("cpu", memory_bytes=...)`) are too
small for the whole model (what it holds: its weights, and in training their gradients and
Adam's state too), its weights drawn node by node as the model initialises them
(`weights=None`), never held whole. The output check is left out (`verify=False`): planning is
what is timed.

Each model is planned in a subprocess of its own, so that its peak resident memory
(`resource.getrusage` maxrss, a high-water mark) is its planning's alone. Per model: the plan's
time, its nodes measured, reused (repeated layers, `fxpipe.passes.blocks`) and estimated, the
peak RSS against the model's size and its largest block (a decoder layer, or the embedding or
output layer where larger), the stage balance (bottleneck over the mean stage time) and the
predicted time per batch.

For the 1B shape (and `--quick`'s), the same model materialised is planned too, every node
measured (`reuse_blocks=False`): each partition is priced on the other's costs, and the meta
plan's bottleneck must be within 3% of the materialised plan's on the same costs (block reuse
must not cost balance). Reuse's error, the layers' forward time reused against each layer
measured, is printed beside the measurement's own spread (the same layer code, timed again at
each depth).

Goals on a 2-core machine: the 70B shape in under 10 minutes with the planning process under
4 GB; the 8B shape in under 2 minutes; the 405B shape (16 devices), in inference and in
training, each in under 15 minutes with the planning process under 12 GB (a layer, its
activations and a fixed overhead) and its stages balanced within 2% (bottleneck over the mean
stage). `--quick` plans a tiny shape in about a minute. The big shapes take the whole machine:
run them alone (`--models 405B` is not in the default set).

`--run` runs what is planned so: a decoder of 1 GB float32 (the "1GB" shape; `--quick`: the tiny
one). Its checkpoint is written by this benchmark as Hugging Face sharded safetensors, block by
block (each block's tensors drawn by `fxpipe.weights.Init` from the model built on meta,
written, dropped: the writing process never holds the model whole); the model is planned from
meta on 4 CPU devices of 400 MB and the plan saved without weights; the plan then runs (a) in
one process, `load_plan(path, weights=ckpt)` and `Pipeline`, and (b) under torchrun, 4 ranks on
gloo, each loading its own stage (`fxpipe.distributed.load(path, weights=ckpt)`). Per process:
its weights, its peak RSS growth while loading and running the example once (goal: under 1.5 x
its weights + 200 MB), its load time against one read of the whole checkpoint, and the output's
largest difference from the model's logits (the model built on CPU with the checkpoint's
values, in a process of its own).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from tabulate import tabulate

import fxpipe
from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.blocks import block_of
from fxpipe.passes.cost_model import OPTIMIZER_STATE, DeviceSpec, cost_graph, format_bytes
from fxpipe.passes.partition import evaluate
from fxpipe.plans.report import cost_sources
from fxpipe.testing.memory import peak_bytes, return_freed_memory
from fxpipe.weights import Init, open_weights, save_weights, shard_layout

# hidden, layers, attention heads, key/value heads, MLP width, vocabulary, dtype, stages
SHAPES = {
    "quick": (256, 4, 4, 2, 512, 1024, torch.float32, 2),
    "1GB": (1024, 20, 16, 4, 2816, 32000, torch.float32, 4),
    "1B": (2048, 16, 32, 8, 8192, 128256, torch.float32, 4),
    "8B": (4096, 32, 32, 8, 14336, 128256, torch.bfloat16, 4),
    "70B": (8192, 80, 64, 8, 28672, 128256, torch.bfloat16, 8),
    "405B": (16384, 126, 128, 8, 53248, 128256, torch.bfloat16, 16),
}
BATCH, TOKENS = 4, 32         # one batch of 4 sequences of 32 tokens, one per micro-batch
COMPARED = ("quick", "1B")    # also planned materialised, every node measured
TIED = ("quick", "1B", "1GB")  # the output layer reads the embedding's weight
RUN_STAGES, RUN_CAP = 4, 400e6    # --run: 4 CPU devices of 400 MB (--quick: caps as planning's)


def build(name: str, on_meta: bool, training: bool = False):
    import transformers
    hidden, layers, heads, kv_heads, mlp, vocab, dtype, _ = SHAPES[name]
    config = transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=mlp, vocab_size=vocab,
        max_position_embeddings=4 * TOKENS, tie_word_embeddings=name in TIED,
        use_cache=False)
    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config).to(dtype).train(training)
    return transformers.LlamaForCausalLM(config).to(dtype).train(training)


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def example_ids(name: str) -> torch.Tensor:
    """The batch every plan and run of `name` is given: BATCH sequences of TOKENS token ids."""
    return torch.randint(0, SHAPES[name][5], (BATCH, TOKENS),
                         generator=torch.Generator().manual_seed(0))


def plan(name: str, model: torch.nn.Module, stages: int | None = None, cap: float | None = None,
         **options: Any) -> tuple[fxpipe.Plan, float]:
    """`model` planned in its mode (`model.training`; training with Adam) on `stages` CPU
    devices (the shape's count) of `cap` bytes each (by default 0.9 x twice what the model
    holds over the stages: no device holds it whole; in training its parameters, their
    gradients and Adam's state, `held_bytes`)."""
    stages = stages or SHAPES[name][-1]
    cap = cap or 0.9 * held_bytes(model) * 2 / stages
    ids = example_ids(name)
    start = time.perf_counter()
    devices = [DeviceSpec(f"cpu:{s}", memory_bytes=cap) for s in range(stages)]  # one cap each
    made = fxpipe.plan(model, devices,
                       example_kwargs={"input_ids": ids}, chunks=BATCH, verify=False,
                       training=model.training, optimizer="adam", **options)
    return made, time.perf_counter() - start


def held_bytes(model: torch.nn.Module) -> int:
    """What the model holds as planned: its weights, and in training also their gradients and
    Adam's state (`OPTIMIZER_STATE["adam"]` bytes per parameter byte)."""
    return round(nbytes(model) * (2 + OPTIMIZER_STATE["adam"] if model.training else 1))


def bottleneck_on(costs: fxpipe.Plan, partition: fxpipe.Plan) -> float:
    """`partition`'s stages priced on `costs`'s measured node costs, node by name. A node of one
    capture that the other lacks (the meta capture keeps a `contiguous` per attention) goes with
    the latest of its inputs."""
    devices = costs.partition.devices
    graph = cost_graph(costs.graph, kinds=list(dict.fromkeys(d.kind for d in devices)))
    stage_of: list[int] = []
    for i in range(len(graph.names)):
        given = partition.partition.stage_of.get(graph.node_names(i)[0])
        stage_of.append(given if given is not None else
                        max((stage_of[p] for p in graph.preds[i]), default=0))
    return evaluate(graph, stage_of, devices).bottleneck_s


def layer_times(gm: torch.fx.GraphModule, container: str = "model.layers") -> list[float]:
    """Each decoder layer's forward time, the sum of its nodes' costs."""
    times: dict[str, float] = {}
    for n in gm.graph.nodes:
        block = block_of(n)
        if block is not None and block.startswith(container + ".") and "cost" in n.meta:
            times[block] = times.get(block, 0.0) + n.meta["cost"].fwd_s
    return list(times.values())


def reuse_error(gm: torch.fx.GraphModule, name: str) -> tuple[float, float]:
    """The layers' times with reuse against each measured (the largest relative difference),
    and the spread of the layers measured (the same code timed at each depth), both on one
    micro-batch, uncalibrated."""
    ids = torch.randint(0, SHAPES[name][5], (1, TOKENS))
    reused = layer_times(annotate_costs(gm, (), {"input_ids": ids}, reuse_blocks=True))
    measured = layer_times(annotate_costs(gm, (), {"input_ids": ids}, reuse_blocks=False))
    return (max(abs(r - m) / m for r, m in zip(reused, measured)),
            (max(measured) - min(measured)) / statistics.median(measured))


def one(name: str, training: bool = False) -> dict[str, Any]:
    """Plan `name` from meta (and materialised, for the compared shapes, in inference), in
    inference or for training; the figures."""
    model = build(name, on_meta=True, training=training)
    blocks = [*model.model.layers, model.model.embed_tokens, model.lm_head]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    made, seconds = plan(name, model)        # weights drawn as the model initialises them
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stage_s = [c.time_s for c in made.partition.stages]
    found = {"model": name, "mode": "training" if training else "inference",
             "plan_s": seconds, **cost_sources(made),
             "peak_rss": peak, "before_rss": before, "model_bytes": nbytes(model),
             "largest_block": max(nbytes(b) for b in blocks),
             "balance": max(stage_s) / statistics.mean(stage_s),
             "predicted_s": made.record.predicted_step_s, "bottleneck_s": made.partition.bottleneck_s}
    if name in COMPARED and not training:
        whole, _ = plan(name, build(name, on_meta=False), reuse_blocks=False)
        error, spread = reuse_error(whole.graph, name)
        found.update(whole_bottleneck_s=whole.partition.bottleneck_s,
                     meta_on_whole_costs_s=bottleneck_on(whole, made),
                     whole_on_meta_costs_s=bottleneck_on(made, whole),
                     reuse_error=error, layer_spread=spread)
    return found


# ---- --run: the plan from meta run with each stage's weights read from a checkpoint --------
# Each step runs in a process of its own (`--step STEP NAME DIR`), printing its figures as JSON,
# so that each peak resident memory is that step's alone.

def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's blocks, in order: embedding, layers, final norm, output layer."""
    return [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]


def write_checkpoint(name: str, directory: Path) -> dict[str, Any]:
    """The model's checkpoint in `directory/ckpt` as Hugging Face sharded safetensors (one
    shard per block, the tied output layer stored once), written block by block: each block's
    tensors drawn as the model initialises them (`Init`, per module, seed 0) from the model
    built on meta, written, and dropped, so this process never holds the model whole."""
    model = build(name, on_meta=True)
    path = {module: prefix for prefix, module in model.named_modules()}
    groups = [{f"{path[b]}.{n}": t for n, t in b.state_dict(keep_vars=True).items()}
              for b in blocks_of(model)]         # keep_vars: the tied weight is one object
    assert {n for g in groups for n in g} == set(model.state_dict()), "a tensor in no block"
    layout = shard_layout(groups)
    init = Init(model, seed=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    for k, group in enumerate(groups):
        stored = {n: t for n, t in group.items() if n in layout.files}
        save_weights(init.read(stored, "cpu") if stored else {}, directory / "ckpt",
                     layout=layout, group=k, write_index=k == 0)
    return {"write_s": time.perf_counter() - start, "bytes": layout.total_size,
            "grew": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
            "largest_block": max(nbytes(b) for b in blocks_of(model))}


def plan_without_weights(name: str, directory: Path) -> dict[str, Any]:
    """The model built on meta planned on RUN_STAGES CPU devices (RUN_CAP each but for the
    quick shape), saved without weights to `directory/plan`. Planning draws the values the
    model initialises (`weights=None`: `Init` of seed 0, the checkpoint's own values); planning
    on `weights=` the checkpoint would ask it for the non-persistent rotary `inv_freq`, which
    no checkpoint holds."""
    model = build(name, on_meta=True)
    made, seconds = plan(name, model, RUN_STAGES, RUN_CAP if name != "quick" else None)
    made.save(directory / "plan")
    return {"plan_s": seconds, "planning_peak": made.record.planning_peak_rss_bytes,
            "cap": made.partition.devices[0].memory_bytes}


def reference(name: str, directory: Path) -> dict[str, Any]:
    """The model's logits on the example, the model built on CPU and given the checkpoint's
    values (saved to `directory/reference.pt`), and the time to read the whole checkpoint."""
    model = build(name, on_meta=False)
    start = time.perf_counter()
    state = open_weights(directory / "ckpt").read(model.state_dict(keep_vars=True), "cpu")
    touch(state.values())
    read_s = time.perf_counter() - start
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.save(model(input_ids=example_ids(name)).logits, directory / "reference.pt")
    return {"read_s": read_s}


def touch(tensors: Iterable[torch.Tensor]) -> None:
    """Read one value in each page of each tensor: safetensors maps a file lazily, so a read
    is timed with its pages brought in."""
    with torch.no_grad():
        for t in tensors:
            t.reshape(-1)[::max(1, 4096 // t.element_size())].sum()


def measured(load: Callable[[], Any], name: str) -> dict[str, Any]:
    """`load()` (returning something that runs the model's inputs), then one call, measured:
    the load's time (its parameters' pages brought in), the peak resident memory growth of
    both (freed memory returned to the system at once), and the loaded thing with its
    output."""
    return_freed_memory()
    ids, found = example_ids(name), {}

    def load_and_call():
        start = time.perf_counter()
        found["loaded"] = load()
        touch(found["loaded"].parameters())
        found["load_s"] = time.perf_counter() - start
        with torch.no_grad():
            found["output"] = found["loaded"](input_ids=ids)
    found["grew"] = peak_bytes(load_and_call)
    return found


def largest_difference(output: Any, directory: Path) -> float:
    """The largest absolute difference of `output`'s logits from the model's."""
    return (output.logits - torch.load(directory / "reference.pt")).abs().max().item()


def one_process(name: str, directory: Path) -> dict[str, Any]:
    """The saved plan loaded with the checkpoint's weights (`load_plan(weights=)`) and run by a
    `Pipeline` in this one process, measured. The stages run on the plain CPU (`devices=`):
    safetensors reads onto "cpu", not onto the planned "cpu:<s>"."""
    structure = build(name, on_meta=True)     # what Init computes non-persistent buffers from
    found = measured(lambda: fxpipe.Pipeline(fxpipe.load_plan(
        directory / "plan", structure, weights=directory / "ckpt",
        devices=["cpu"] * RUN_STAGES)), name)
    return {"load_s": found["load_s"], "grew": found["grew"],
            "weights": nbytes(torch.nn.ModuleList(found["loaded"].stages)),   # tied: once
            "difference": largest_difference(found["output"], directory)}


def one_rank(name: str, directory: Path) -> None:
    """What each torchrun rank runs (`--rank NAME DIR`): its stage of the saved plan loaded
    with its own weights from the checkpoint (`fxpipe.distributed.load(weights=)`, the model
    built on meta as the structure non-persistent buffers are computed from; on the plain CPU,
    which safetensors reads onto), measured; its figures written to DIR/rank<r>.json, the
    last stage's with its output's largest difference from the model's."""
    import fxpipe.distributed

    torch.set_num_threads(1)          # the ranks share the machine's cores
    structure = build(name, on_meta=True)
    found = measured(lambda: fxpipe.distributed.load(
        directory / "plan", weights=directory / "ckpt", model=structure, device="cpu"), name)
    with found["loaded"] as stage:
        last = stage.index == stage.last
        figures = {"load_s": found["load_s"], "grew": found["grew"],
                   "weights": nbytes(stage.module), "difference":
                   largest_difference(found["output"], directory) if last else None}
        (directory / f"rank{stage.rank}.json").write_text(json.dumps(figures))


def under_torchrun(name: str, directory: Path) -> list[dict[str, Any]]:
    """RUN_STAGES ranks under torchrun (gloo, 127.0.0.1), each loading its stage of the saved
    plan with the checkpoint's weights (`one_rank`); each rank's figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ran = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node",
                          str(RUN_STAGES), "--master-addr", "127.0.0.1", "--master-port",
                          str(port), "-m", "benchmarks.bigmodel", "--rank", name, str(directory)],
                         capture_output=True, text=True)
    if ran.returncode != 0:
        sys.exit(f"torchrun failed:\n{ran.stdout[-4000:]}{ran.stderr[-4000:]}")
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(RUN_STAGES)]


STEPS = {"write": write_checkpoint, "plan": plan_without_weights, "reference": reference,
         "one-process": one_process}


def run(name: str) -> None:
    """Write the checkpoint, plan from meta, compute the reference, run in one process and
    under torchrun; print the figures."""
    with tempfile.TemporaryDirectory(prefix="bigmodel-") as tmp:
        directory = Path(tmp)
        found = {}
        for step in STEPS:
            ran = subprocess.run([sys.executable, "-m", "benchmarks.bigmodel", "--step", step,
                                  name, str(directory)], capture_output=True, text=True)
            if ran.returncode != 0:
                sys.exit(f"{step}: failed\n{ran.stderr[-4000:]}")
            found[step] = json.loads(ran.stdout.strip().splitlines()[-1])
        ranks = under_torchrun(name, directory)
    written, planned, read_s = found["write"], found["plan"], found["reference"]["read_s"]
    print(f"{name}: {format_bytes(written['bytes'])} float32, checkpoint written block by block "
          f"in {written['write_s']:.1f} s growing the writer by {format_bytes(written['grew'])} "
          f"(largest block {format_bytes(written['largest_block'])}); planned from meta on "
          f"{RUN_STAGES} CPU devices of {format_bytes(planned['cap'])} in "
          f"{planned['plan_s']:.1f} s (planning peak RSS "
          f"{format_bytes(planned['planning_peak'])}); the whole checkpoint read once in "
          f"{read_s:.3f} s\n")
    rows = []
    for who, r in [("one process", found["one-process"]),
                   *((f"rank {k}", r) for k, r in enumerate(ranks))]:
        goal = 1.5 * r["weights"] + 200e6
        rows.append((who, format_bytes(r["weights"]), format_bytes(r["grew"]),
                     f"{r['grew'] / r['weights']:.2f}", "yes" if r["grew"] < goal else "NO",
                     f"{r['load_s']:.2f}", f"{r['load_s'] / read_s:.2f}",
                     "" if r["difference"] is None else
                     f"{r['difference']:.1e}"))
    print(tabulate(rows, headers=["", "weights held", "peak RSS growth", "x weights",
                                  "< 1.5 x + 200 MB", "load s", "x whole read",
                                  "max |output - model|"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape, in about a minute")
    parser.add_argument("--run", action="store_true", help=f"run the {RUN_STAGES}-stage plan of "
                        f"the 1GB shape with its weights from a checkpoint, in one process and "
                        f"under torchrun (--quick: the tiny shape)")
    parser.add_argument("--models", nargs="+", default=["1B", "8B", "70B"], choices=SHAPES)
    parser.add_argument("--training", action="store_true", help="plan each model for training "
                        "(Adam) too: a row per mode (the materialised comparison: inference only)")
    parser.add_argument("--one", help=argparse.SUPPRESS)     # in the subprocess: one model
    parser.add_argument("--mode", default="inference", help=argparse.SUPPRESS)   # with --one
    parser.add_argument("--step", nargs=3, help=argparse.SUPPRESS)   # STEP NAME DIR of --run
    parser.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)   # NAME DIR: a torchrun rank
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, training=args.mode == "training")))
        return
    if args.step:
        step, name, directory = args.step
        print(json.dumps(STEPS[step](name, Path(directory))))
        return
    if args.rank:
        one_rank(args.rank[0], Path(args.rank[1]))
        return
    if args.run:
        run("quick" if args.quick else "1GB")
        return
    rows, compared, reuse, failed = [], [], [], []
    modes = ["inference", "training"] if args.training else ["inference"]
    for name, mode in [(n, m) for n in (["quick"] if args.quick else args.models)
                       for m in modes]:
        ran = subprocess.run([sys.executable, "-m", "benchmarks.bigmodel", "--one", name,
                              "--mode", mode], capture_output=True, text=True)
        if ran.returncode != 0:
            print(f"{name} {mode}: failed\n{ran.stderr[-4000:]}", file=sys.stderr)
            failed.append(f"{name} {mode}")
            continue
        r = json.loads(ran.stdout.strip().splitlines()[-1])
        print(f"{name} {mode}: planned in {r['plan_s']:.1f} s", flush=True)   # tables come last
        rows.append((name, mode, f"{r['plan_s']:.1f}", r["measured"], r["reused"],
                     r["estimated"],
                     format_bytes(r["peak_rss"]), format_bytes(r["peak_rss"] - r["before_rss"]),
                     format_bytes(r["model_bytes"]), format_bytes(r["largest_block"]),
                     f"{r['balance']:.3f}", f"{r['predicted_s'] * 1e3:.1f}"))
        if "whole_bottleneck_s" in r:
            worse = r["meta_on_whole_costs_s"] / r["whole_bottleneck_s"] - 1
            compared.append((name, f"{r['whole_bottleneck_s'] * 1e3:.3f}",
                             f"{r['meta_on_whole_costs_s'] * 1e3:.3f}", f"{worse:+.1%}",
                             "yes" if worse <= 0.03 else "NO",
                             f"{r['bottleneck_s'] * 1e3:.3f}",
                             f"{r['whole_on_meta_costs_s'] * 1e3:.3f}"))
            reuse.append((name, f"{r['reuse_error']:.1%}", f"{r['layer_spread']:.1%}",
                          "yes" if r["reuse_error"] <= r["layer_spread"] else "NO"))
    print(tabulate(rows, headers=["model", "mode", "plan s", "measured", "reused", "estimated",
                                  "peak RSS", "grew while planning", "model", "largest block",
                                  "balance", "predicted ms"], disable_numparse=True))
    if compared:
        print("\nthe meta plan (layers reused) against the materialised one (every node "
              "measured), each partition priced on both plans' costs:")
        print(tabulate(compared, headers=[
            "model", "whole: bottleneck ms", "meta's partition on it", "worse by",
            "within 3%", "meta: bottleneck ms", "whole's partition on it"]))
        print("\nreuse against every node measured (one micro-batch, uncalibrated): each "
              "layer's forward time reused against measured, the largest difference, beside the "
              "layers' own spread measured ((max - min) / median: the same code at each depth):")
        print(tabulate(reuse, headers=["model", "reuse error", "layers' spread", "within"]))
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
