"""Generation under torchrun: a saved generation (`fxpipe.generate.save_generation`) run by
`fxpipe.distributed` ranks, one stage of each of its plans per rank.

    # generate.py, launched with: torchrun --nproc-per-node 2 generate.py
    from fxpipe.generate_ranks import load_generation
    with load_generation("plans/generation") as generation:    # rank r: stage r of each plan
        out = generation.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10)
    # out: on rank 0, what model.generate returns; None on every other rank

Every rank calls `generate` at once; rank 0's arguments are the ones read. Rank 0 runs Hugging
Face's loop over the front a `Generation` runs in process (`Generation.step`: a cache that only
counts, each step's masks and slots), over the model's class built on meta from the saved
config. Before each step it tells every rank which plan runs it (two numbers broadcast over the
ranks' gloo group: decode, prefill, stop or failed, and how many micro-batches' logits to send
back); every rank calls its stage of that plan (`DistributedStage`: the step's sequences split
into the plan's lanes, run in GPipe order, so stage 1 runs lane 0 while stage 0 runs lane 1),
and the last rank sends the logits back to rank 0 (as float32 with their dtype: gloo's tensors
are the CPU's). The lanes keep step: one loop for the batch, the pipeline drained at every
token, what a `Generation` runs in lockstep. A prompt is one call of every chunk of every lane
(`DistributedStage.microbatches`), so stage 1 runs chunk c while stage 0 runs chunk c + 1, as in
process. One replica: a world of as many processes as stages.

Caches: each rank's decode stage's layers' keys and values are a `StageState` of this rank,
allocated zeroed at each generate and freed after it, bound into its prefill stage too where
that stage holds the same layers. Where the two plans were split differently (balanced on
different costs), some layer's cache would be needed on two ranks, so the prompt runs through
the decode plan, a token a step (the same tokens, more steps): `prefill_by_tokens` says so.

What equals what is what a `Generation` in lockstep gives: greedy tokens `model.generate`'s up
to a rounding tie, and samples those `model.generate` draws after the same seed on rank 0 (the
stages' own seeds are drawn away from the caller's generator).

Failures: a stage's failure ends the generate on every rank, as a failed call of
`fxpipe.distributed` does (close and load again). An error of rank 0's own (a generate over the
planned length, an argument refused) is raised there, and every other rank raises a
`DistributedError` saying rank 0 failed; all can generate again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .cached_lm import Counting
from .distributed import load as load_stage
from .distributed.transport import DistributedError
from .generate import Generation, read_saved
from .planning.generation import GenerationError, Prefixed
from .runtime.state import StageState, readers_of

# What rank 0 tells the other ranks before each step (with how many micro-batches' logits to
# send back, 0 for a step's): which plan runs it, or that the generate is over, or failed.
STOP, DECODE, PREFILL, FAILED = 0, 1, 2, 3
LOGITS_TAG = 1      # the logits' messages, apart from the stages' own (tag 0)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def load_generation(path: str | os.PathLike, *, weights: Any = None, device: Any = None,
                    timeout: float = 60.0) -> "RankGeneration":
    """This rank's stages of the generation saved at `path` (its decode stage, and its prefill
    stage where that holds the same layers), loaded by `fxpipe.distributed.load` with `weights`
    (the model's own checkpoint, for a generation planned on meta), `device` and `timeout`."""
    root = Path(path)
    document, model, planned = read_saved(root)
    weights = None if weights is None else Prefixed(weights)
    decode = load_stage(root / "decode", weights=weights, device=device, timeout=timeout)
    prefill = None
    try:
        if decode.replicas > 1:
            raise GenerationError(
                f"{decode.replicas * decode.num_stages} processes for {decode.num_stages} "
                f"stages: generation runs one replica\nFix: torchrun --nproc-per-node "
                f"{decode.num_stages}")
        if (root / "prefill").is_dir():
            prefill = load_stage(root / "prefill", weights=weights, device=device,
                                 timeout=timeout)
        return RankGeneration(model, decode, prefill, document, planned)
    except BaseException:
        for stage in (prefill, decode):
            if stage is not None:
                stage.close()
        raise


def same_caches(decode: Any, prefill: Any) -> bool:
    """Whether every stage of the `prefill` plan holds the caches of the same layers as the
    decode plan's stage of its index (read off the plans' skeletons, the same on every rank)."""
    def held(plan: Any) -> list[set[str]]:
        return [{n for n, _ in s.module.named_buffers() if n.startswith("kv_")}
                for s in plan.stages]
    return held(decode) == held(prefill)


class RankGeneration(Generation):
    """This rank's part of a saved generation under torchrun (see the module docstring)."""

    def __init__(self, model: Any, decode: Any, prefill: Any, document: dict[str, Any],
                 planned: dict[str, Any]):
        self.model, self.rows, self.length = model, document["rows"], document["length"]
        self.planned, self.lane_choice, self.as_is = planned, None, ""
        self.rank, self.index, self.last = decode.rank, decode.index, decode.last
        self.decode = decode.plan      # (the plan `Generation.step` names; run by `_run`)
        self.group = decode.group
        self.prefill_by_tokens = prefill is None or not same_caches(decode.plan, prefill.plan)
        if self.prefill_by_tokens and prefill is not None:
            prefill.close()
            prefill = None
        self.prompt = 1 if self.prefill_by_tokens else document["prompt"]
        self.stages = {DECODE: decode, **({PREFILL: prefill} if prefill is not None else {})}
        self.state = StageState(decode.index, decode.stage.device)
        for name, _ in decode.module.named_buffers():
            if name.startswith("kv_"):
                self.state.adopt(name, planned[name], [r for stage in self.stages.values()
                                                       for r in readers_of(stage.module, name)])
        self.state.free()
        self._failed = False     # a stage's call failed: no rank listens any more

    @property
    def lanes(self) -> int:
        return self.stages[DECODE].plan.chunks

    @property
    def states(self) -> list[StageState]:
        return [self.state]

    @property
    def last_run(self) -> Any:
        """This rank's row of the latest step (`DistributedStage.last_run`)."""
        return self.stages[DECODE].last_run

    def __str__(self) -> str:
        return (f"rank {self.rank}: stage {self.index} of a generation of up to {self.rows} "
                f"sequences of {self.length} tokens, {self.lanes} lanes in step, the caches of "
                f"{len(self.state.planned)} buffers ({self.state.nbytes / 1e6:.3f} MB); "
                + ("prompts through the decode plan, a token a chunk" if self.prefill_by_tokens
                   else f"prompts prefilled {self.prompt} tokens at a time"))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`model.generate(*args, **kwargs)`'s result on rank 0 (its arguments are the ones
        read), None on the other ranks, which serve the steps rank 0 asks for."""
        if self._failed or self.stages[DECODE].closed:
            raise DistributedError(f"rank {self.rank}'s stages failed in an earlier generate"
                                   f"\nFix: close the generation and load it again")
        with self.session():
            if self.rank != 0:
                return self._serve()
            try:
                out = super().generate(*args, **kwargs)
            except BaseException:
                if not self._failed:
                    self._tell(FAILED)
                raise
            self._tell(STOP)
            return out

    def run(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Hugging Face's loop on rank 0, its lanes in step (see the module docstring)."""
        self.last_lanes = "lockstep"
        return self.front().generate(*args, cache=Counting(), **kwargs)

    def close(self) -> None:
        """Close this rank's stages (and the process groups their loading started)."""
        for stage in reversed(list(self.stages.values())):
            stage.close()

    def __enter__(self) -> "RankGeneration":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        self.state.allocate()
        try:
            yield
        finally:
            self.state.free()

    # --- rank 0's steps, and the others' ---------------------------------------------------

    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor,
                 slot_mask: torch.Tensor) -> torch.Tensor:
        """The prompt left-padded to whole chunks, every chunk of every lane fed to the ranks
        in one call (`DistributedStage.microbatches`), in order: a stage runs a lane's chunks
        one after another (each reads the cache the one before wrote), and stage 1 runs chunk c
        while stage 0 runs chunk c + 1 (a token a chunk, through the decode plan, where
        `prefill_by_tokens`). The last chunk's logits."""
        kind = DECODE if self.prefill_by_tokens else PREFILL
        chunks, lanes = self.chunks(self.stages[kind].plan, ids, positions, slot_mask)
        return self._call(kind, chunks=chunks, keep=lanes)

    def _run(self, plan: Any, ids: torch.Tensor, positions: torch.Tensor,
             slot_mask: torch.Tensor, offset: int, lane: Any = None) -> torch.Tensor:
        return self._call(DECODE, inputs=self.inputs(ids, positions, slot_mask, offset))

    def _call(self, kind: int, *, inputs: dict[str, torch.Tensor] | None = None,
              chunks: list[dict[str, torch.Tensor]] | None = None, keep: int = 0
              ) -> torch.Tensor:
        """Rank 0: every rank runs `kind`'s stage, on the step's `inputs` (split into the
        plan's lanes) or on the micro-batches `chunks`; the logits back from the last rank:
        the step's, or the last `keep` micro-batches' together."""
        self._tell(kind, keep)
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                stage = self.stages[kind]
                logits = stage(**inputs) if chunks is None else stage.microbatches(chunks)
            return _kept(logits, keep) if self.last == 0 else self._receive()
        except BaseException:
            self._failed = True
            raise

    def _serve(self) -> None:
        """Another rank: run the steps rank 0 asks for until it says stop."""
        while True:
            kind, keep = self._hear()
            if kind == STOP:
                return None
            if kind == FAILED:
                raise DistributedError(f"rank 0's generate failed, so rank {self.rank} stops "
                                       f"too\nsee rank 0's output; the stages are ready for the "
                                       f"next generate")
            try:
                with torch.no_grad():
                    stage = self.stages[kind]
                    logits = stage.microbatches() if keep else stage()
                if self.index == self.last:
                    self._send(_kept(logits, keep))
            except BaseException:
                self._failed = True
                raise

    def _tell(self, kind: int, keep: int = 0) -> None:
        self._broadcast(torch.tensor([kind, keep]))

    def _hear(self) -> tuple[int, int]:
        kind, keep = self._broadcast(torch.zeros(2, dtype=torch.long)).tolist()
        return kind, keep

    def _broadcast(self, news: torch.Tensor) -> torch.Tensor:
        try:
            dist.broadcast(news, src=0, group=self.group)
        except RuntimeError as e:
            self._failed = True
            raise DistributedError(f"rank {self.rank} did not hear from rank 0 within the "
                                   f"timeout\n{e}\nevery rank calls generate at once; see "
                                   f"the other ranks' output") from None
        return news

    def _send(self, logits: torch.Tensor) -> None:
        """The last rank: the step's logits to rank 0, as float32 after their shape and dtype."""
        head = torch.tensor([*logits.shape, _DTYPES.index(logits.dtype)])
        with self._link("send the logits to rank 0"):
            dist.send(head, dst=0, group=self.group, tag=LOGITS_TAG)
            dist.send(logits.detach().float().cpu().contiguous(), dst=0, group=self.group,
                      tag=LOGITS_TAG)

    def _receive(self) -> torch.Tensor:
        head = torch.zeros(3, dtype=torch.long)
        with self._link(f"receive the logits from rank {self.last}"):
            dist.recv(head, src=self.last, group=self.group, tag=LOGITS_TAG)
            logits = torch.empty((int(head[0]), int(head[1])))
            dist.recv(logits, src=self.last, group=self.group, tag=LOGITS_TAG)
        return logits.to(_DTYPES[int(head[2])])

    @contextlib.contextmanager
    def _link(self, what: str) -> Iterator[None]:
        """Gloo's failure to `what` as a `DistributedError` naming it."""
        try:
            yield
        except RuntimeError as e:
            raise DistributedError(f"rank {self.rank} could not {what}\n{e}\nsee the other "
                                   f"ranks' output") from None


def _kept(logits: Any, keep: int) -> torch.Tensor:
    """A step's logits, or those of the last `keep` micro-batches of a call of micro-batches,
    together (`keep` 0: a step)."""
    return torch.cat(logits[-keep:]) if keep else logits
