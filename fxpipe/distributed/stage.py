"""`DistributedStage`: this rank's stage of a plan, walking its row of each step.

A call or step starts with the front in-process runs use (`runtime.front`): each replica's
stage-0 rank splits its batch (into `chunks` micro-batches, or one per row where it has fewer
rows) and draws the seeds, and every rank of the replica learns them and their count, so each
builds the same timetable and the last merges the outputs. Each replica's stage-0 rank feeds
its inputs (moved onto its stage's device); each rank walks its row with the runtime's
`StageRow`, driven by the runtime's `Driver`, along `Wiring.with_inputs_at_last`; the last
stage returns the output or the loss. `train_step` is `fxpipe.runtime.step`'s contract with
the totals learnt by one all-reduce over every rank (the loss of every replica, the count of a
(loss_sum, count) step), each replica's loss weighted by its rows' share. After the backward a tied weight's gradient is summed over its holders, then each stage's
replicas' gradients summed; the gradients of graph inputs go back to the stage-0 rank. `last_run`
is this rank's row, timed.

`save_weights`: replica 0's ranks each write their stage's shards, rank 0 the index, then a
barrier. `close`: the groups `load` made are destroyed (and the default one if `load` started it),
and every handle on them dropped (torch's own in torch.distributed.nn.functional's defaults too),
so their gloo threads end there and not while the interpreter exits (a SIGABRT).
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
import torch.fx as fx

from fxpipe.passes.errors import StageError
from fxpipe.passes.graph_values import tensors

from ..runtime import microbatch
from ..runtime.executor import StageExecutor
from ..runtime.front import Front, merged, split, timetable
from ..runtime.orchestrator import Driver, Run, StageRow, row_executor, send_inputs
from ..plans.saved import save_stage_weights
from ..runtime.step import DeferredScale, StepLoss, check_reduction, step_inputs
from ..runtime.schedules import Phase
from ..runtime.wiring import DRIVER
from .transport import DistributedError, DistributedTransport, PeerFailedError


class DistributedStage:
    """This process's stage of a plan; every rank calls it alike (see the module docstring).

    `module` is the stage's GraphModule: its parameters, named as in the model, are what this
    rank's optimizer steps.
    """

    def __init__(self, plan: Any, stage: Any, rank: int, group: Any, timeout: float,
                 owns_group: bool = False, *, replica: int = 0, replicas: int = 1,
                 pipeline_group: Any = None, gradient_group: Any = None,
                 tied: list[tuple[Any, list[torch.nn.Parameter]]] | None = None,
                 tensor_group: Any = None,
                 stored_names: dict[tuple[int, str], str] | None = None,
                 made_groups: list[Any] | None = None):
        self.plan = plan
        self.stage = stage
        self.rank = rank
        self.group = group
        self.timeout = timeout
        self.owns_group = owns_group
        # The process groups `load` made for this stage (every rank makes every group), which
        # `close` destroys: the gloo group beside another backend, the replicas' and the tied
        # weights' groups.
        self.made_groups = made_groups if made_groups is not None else []
        self.closed = False
        self.num_stages = len(plan.stages)
        self.last = self.num_stages - 1
        self.replica = replica
        self.replicas = replicas
        self.pipeline_group = group if pipeline_group is None else pipeline_group
        self.gradient_group = gradient_group
        self.tied = tied or []      # (group of the ranks holding them, parameters) per holders
        self.base = replica * self.num_stages       # the rank of this replica's stage 0
        self.stored_names = stored_names or {}      # tied tensors: see saved.stored_names
        # The training wiring in both modes (graph outputs go to the last stage, which rebuilds
        # the model's output), with the graph inputs the model returns as they are.
        placeholders = set(plan.signature.placeholders)
        self.flow = plan.wiring.with_inputs_at_last(
            self.last,
            [leaf for leaf in plan.signature.out_leaves
             if isinstance(leaf, str) and leaf in placeholders])
        self.transport = DistributedTransport(
            rank, stage.device, group=group, tensor_group=tensor_group, timeout=timeout,
            base=self.base,
            peers=list(range(self.base, self.base + self.num_stages)))
        # This rank's actions in the latest call or train_step, seconds from its own start
        # (each rank's clock: compare a stage's times with the plan's, not ranks' starts).
        self.last_run: Run | None = None
        self._rows_mean_checked = False     # see runtime.step: the first step checks loss_fn

    @property
    def index(self) -> int:
        """This rank's stage: `rank % stages`."""
        return self.stage.index

    @property
    def module(self) -> fx.GraphModule:
        return self.stage.module

    def parameters(self):
        return self.stage.module.parameters()

    def named_parameters(self):
        return self.stage.module.named_parameters()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output (on stage `last`; None elsewhere) for the inputs given on stage 0
        (those given elsewhere are not read), in the plan's micro-batches, GPipe order; each
        replica runs its own inputs; a batch of fewer rows than `chunks` runs one micro-batch per
        row, as in process."""
        def prepare() -> Front:
            signature = self.plan.signature
            return split(self.plan, dict(zip(signature.placeholders,
                                             signature.flatten_inputs(args, kwargs))))
        outputs = self._forwards(prepare)
        return None if outputs is None else merged(self.plan, outputs)

    def microbatches(self, chunks: list[dict[str, Any]] | None = None) -> list[Any] | None:
        """A call of the micro-batches given on stage 0 (each its graph inputs by placeholder;
        not read elsewhere), in order, GPipe order: each one's output on stage `last` (None
        elsewhere). So stage 1 runs micro-batch m while stage 0 runs m + 1, and each stage runs
        them in the order given (`fxpipe.generate_ranks` feeds a prompt's chunks so)."""
        return self._forwards(lambda: Front(list(chunks or [])))

    def _forwards(self, prepare: Callable[[], Front]) -> list[Any] | None:
        """The forwards of the micro-batches `prepare()` makes on stage 0: their outputs, in
        order, on stage `last`; None elsewhere."""
        chunks, seeds, _ = self._start(prepare)
        outputs: dict[int, Any] = {}

        def collect(m: int, received: dict[str, Any], out: dict[str, Any]) -> None:
            outputs[m] = self.plan.signature.rebuild_outputs({**received, **out})

        self._run(timetable(self.plan, len(seeds), training=False), chunks, seeds, None,
                  collect if self.index == self.last else None)
        if self.index != self.last:
            return None
        return [outputs[m] for m in range(len(seeds))]

    def train_step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Any], *,
                   reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor | None:
        """Forward and backward of every micro-batch in the plan's schedule, as
        `Pipeline.train_step` does: `inputs` on stage 0, `target` on stage `last` (each not read
        elsewhere, and moved to its stage's device), each replica its own shard of the batch
        (shards may differ in size).

        Returns, on stage `last` of every replica (None elsewhere), the loss of the whole batch,
        every replica's shard together: with `reduction="mean"` the replicas' shard losses
        weighted by their shares of the rows, with `"sum"` their sum. This step's gradients are
        those of that loss: a parameter several stages share (a tied weight) gets the sum over
        the ranks of its replica holding it, and each stage's replicas add theirs up, each
        replica's weighted by its share of the rows (`"mean"`); then they are added to what
        `.grad` held. An input given with `requires_grad` on stage 0 gets its gradient there too
        (its rows' share of the whole batch's loss), from every stage reading it. The optimizer
        step is the caller's, on each rank.

        A `loss_fn` returning `(loss_sum, count)` (a loss averaged over something other than
        rows, as for `Pipeline.train_step`) makes the step's loss `sum(loss_sums) / sum(counts)`
        over every micro-batch of every replica, and the gradients (parameters and inputs)
        those of that mean; `reduction` is then not used. Every rank learns the whole count in
        one all-reduce at the end of each step.
        """
        check_reduction(reduction)
        leaves: list[torch.Tensor] = []      # the caller's inputs that take a gradient

        def prepare() -> Front:
            values = step_inputs(self.plan.signature, inputs)
            leaves.extend(t for t in tensors(values) if t.requires_grad and t.is_leaf)
            front = split(self.plan, values)
            microbatch.batch_size(values, self.plan.placeholder_dims)   # no batch: refused
            return front

        chunks, seeds, rows_in = self._start(prepare)
        microbatches = len(seeds)
        # This replica's share of the whole batch's loss, so that every gradient (parameters and
        # inputs alike) is already its part of the whole batch's, and replicas add theirs up.
        share = 1.0
        if self.replicas > 1 and reduction == "mean":
            rows = torch.tensor([float(rows_in)], dtype=torch.float64)
            self._all_reduce([rows], self.gradient_group, "count the rows with its replicas")
            share = rows_in / rows.item()
        # Only this step's gradients are added up across ranks and scaled: what `.grad` held
        # is taken aside until `step.finish`.
        step = StepLoss(loss_fn, self.plan.signature, reduction,
                        DeferredScale([*self.parameters(), *leaves]), share,
                        check_rows_mean=not self._rows_mean_checked,
                        output_dims=self.plan.output_dims)
        step.grads.start()
        self._agree(self.last, lambda: step.split_targets(target, microbatches,
                                                          self.stage.device, rows_in))
        executor = self._run(timetable(self.plan, microbatches, training=True), chunks, seeds,
                             step, None, training=True)
        self._reduce_gradients()
        losses = [executor.losses[m] for m in range(microbatches)] \
            if self.index == self.last else []
        # Every rank learns the whole count (and the last stages the loss of every replica) in
        # one all-reduce; this step's gradients are scaled by one over the count. The first
        # step's check of loss_fn (see runtime.step) refuses it on every rank alike.
        loss = step.finish(losses, self._learn_totals)
        self._rows_mean_checked = True
        return loss

    def save_weights(self, directory: str | os.PathLike, *,
                     max_shard_bytes: int | None = None) -> Path:
        """Write this rank's stage's parameters and persistent buffers into `directory`, its
        own shards of the model's checkpoint (Hugging Face sharded safetensors, the model's
        names, a tied weight once), as `Pipeline.save_weights` writes them all: every rank
        calls it, each one of replica 0 writes its stage's shards (the other replicas hold the
        same values) and rank 0 the index, laid out from the plan's names, shapes and dtypes,
        so no rank gathers another's tensors. Returns once every rank has written."""
        self._check_open()
        if self.replica == 0:
            save_stage_weights(self.plan, directory, [self.index], tied=self.stored_names,
                               write_index=self.rank == 0, max_shard_bytes=max_shard_bytes)
        try:
            dist.barrier(group=self.group)
        except RuntimeError as e:
            raise DistributedError(f"rank {self.rank} waited {self.timeout:g} s for every rank to "
                                   f"write its weights\nit could not hear that every rank wrote "
                                   f"them ({e}); see the other ranks' output") from None
        return Path(directory)

    def close(self) -> None:
        """After a failed step, take the other ranks' news of it (see `DistributedTransport.close`);
        then destroy the process groups `load` made, and the default group if `load` started
        it, and let go of every handle on them, so that their gloo threads end here, not in the
        interpreter's exit (see `release_groups`). The stage cannot run after it; closing
        again does nothing."""
        if self.closed:
            return
        self.closed = True
        try:
            self.transport.close()
        finally:
            self.transport.release()
            self.group = self.pipeline_group = self.gradient_group = None
            self.tied = [(None, parameters) for _, parameters in self.tied]
            release_groups(self.made_groups, self.owns_group)

    def __enter__(self) -> "DistributedStage":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- one step

    def _reduce_gradients(self) -> None:
        """Add this step's gradients up across ranks: first each tied parameter's over the
        ranks of this replica holding it (a stage that held it but got no gradient adds zeros),
        then each parameter's over this stage's replicas (their losses were weighted by their
        shares, so the sum is the whole batch's)."""
        for group, parameters in self.tied:
            for p in parameters:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._all_reduce([p.grad for p in parameters], group,
                             "add up the gradients of weights it shares with other stages")
        if self.replicas > 1:
            grads = [p.grad for _, p in sorted(self.named_parameters()) if p.grad is not None]
            self._all_reduce(grads, self.gradient_group,
                             f"add up stage {self.index}'s gradients with its "
                             f"{self.replicas - 1} other replicas")

    def _learn_totals(self, totals: torch.Tensor, counted: bool) -> tuple[torch.Tensor, bool]:
        """The step's totals (see `runtime.step.Totals`) summed over every rank, whether any
        rank's losses were counted with them."""
        both = torch.cat([totals.detach().to("cpu", torch.float64),
                          torch.tensor([float(counted)], dtype=torch.float64)])
        self._all_reduce([both], None, "learn the whole batch's loss and count")
        return both[:-1].to(totals.device), bool(both[-1] > 0)

    def _all_reduce(self, tensors: list[torch.Tensor], group: Any, what: str) -> None:
        """Sum `tensors` in place over `group`'s ranks: one all-reduce of them all, flattened
        on the CPU as gloo needs."""
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])
        try:
            dist.all_reduce(flat, group=group)
        except RuntimeError as e:
            raise DistributedError(
                f"rank {self.rank} could not {what} within {self.timeout:g} s\n{e}: a rank "
                f"went silent or failed; see the other ranks' output") from None
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def _check_open(self) -> None:
        if self.closed:
            raise DistributedError(f"rank {self.rank}'s stage is closed\nload the plan again "
                                   f"(fxpipe.distributed.load) to run it")

    def _start(self, prepare: Callable[[], Front]
               ) -> tuple[list[dict[str, Any]], list[int], int | None]:
        """The run's front (`runtime.front`): the replica's stage-0 rank splits the step's inputs
        (`prepare()`) and draws each micro-batch's seed; every rank of the replica gets the seeds
        (one per micro-batch: their count) and the batch's rows, or raises if `prepare` failed.
        Returns the micro-batches (on the stage-0 rank; none elsewhere), seeds and rows."""
        self._check_open()
        fronts: list[Front] = []

        def start() -> tuple[list[int], int | None]:
            fronts.append(prepare())
            return fronts[0].seeds(), fronts[0].rows
        seeds, rows = self._agree(0, start)
        return (fronts[0].chunks if fronts else []), seeds, rows

    def _agree(self, source: int, prepare: Callable[[], Any]) -> Any:
        """`prepare()` on stage `source` of this replica, its result on every rank of the
        replica; its error raised on each (on the others as a `DistributedError` naming it), so
        none waits for a step that will not start."""
        box: list[Any] = [None]
        error: BaseException | None = None
        source = self.base + source
        if self.rank == source:
            try:
                box[0] = ("ok", prepare())
            except Exception as e:
                error = e
                box[0] = ("error", f"{type(e).__name__}: {e}")
        try:
            dist.broadcast_object_list(box, src=source, group=self.pipeline_group)
        except RuntimeError as e:
            raise DistributedError(
                f"rank {self.rank} could not start the step within {self.timeout:g} s\n"
                f"with the ranks of replica {self.replica} ({e}): one went silent or failed; "
                f"see their output") from None
        if error is not None:
            raise error
        status, value = box[0]
        if status == "error":
            raise DistributedError(f"rank {source} could not start the step\n{value}")
        return value

    def _run(self, timetable: list, chunks: list[dict[str, Any]], seeds: list[int],
             loss_of: Callable[[int, dict[str, Any]], torch.Tensor] | None,
             forwarded: Callable[[int, dict[str, Any], dict[str, Any]], None] | None, *,
             training: bool = False) -> StageExecutor:
        """Feed the graph inputs (stage 0), walk this stage's row, in `training` return the
        gradients of the graph inputs to stage 0, then finish the step with the pipeline's
        peers. A failure of the stage is raised as a `StageError` naming this rank; a failure
        here or a peer's is told to every peer (`DistributedTransport.abort`)."""
        index = self.index
        executor = row_executor(self.stage, self.flow, timetable[index],
                                loss_of=loss_of if index == self.last else None,
                                seeds=seeds, recompute=self.plan.stage_recompute[index])
        inputs: dict[int, dict[str, Any]] = {}      # micro-batch -> graph inputs received

        def received(m: int, values: dict[str, Any], out: dict[str, Any]) -> None:
            if training:
                inputs[m] = {n: values[n] for n in self.flow.reads.get(index, {}).get(DRIVER, [])}
            if forwarded is not None:
                forwarded(m, values, out)

        row = StageRow(executor, timetable[index], self.flow, self.transport)
        rank, record = _RankRun(self, executor), Run(num_stages=self.num_stages,
                                                      microbatches=len(seeds))
        with rank.driving(record, None, failure=self._named):
            if index == 0:
                for m, values in enumerate(chunks):
                    send_inputs(self.flow, self.transport, m, values)
            rank.walk(row, forwarded=received, clock=record.clock, done=record.done)
            if not rank.errors:
                if training and index != 0:
                    self._send_input_grads(inputs)
                if training and index == 0:
                    self._take_input_grads(chunks)
                self.transport.finish_step()
        return executor

    # The graph inputs a stage on another rank reads arrive there as leaves of its autograd
    # graph; after its backwards, their gradients go back to stage 0's rank, which passes them
    # on to the caller's tensors. A stage reading only inputs that need no gradient sends
    # nothing, and stage 0's rank, knowing what it sent, expects nothing.

    def _send_input_grads(self, inputs: dict[int, dict[str, Any]]) -> None:
        """Send stage 0's rank the gradients of the graph inputs this stage received, per
        micro-batch, where any of them needs one."""
        for m, values in sorted(inputs.items()):
            if any(t.requires_grad for t in tensors(values)):
                self.transport.send(Phase.BACKWARD, self.index, DRIVER, m,
                                    {n: [t.grad for t in tensors(v)] for n, v in values.items()})

    def _take_input_grads(self, chunks: list[dict[str, Any]]) -> None:
        """Receive the gradients of the graph inputs sent to stages on other ranks and
        backpropagate them into the caller's inputs (stage 0's own reached them already)."""
        for dst, names in self.flow.sends.get(DRIVER, {}).items():
            if self.transport.rank_of(dst) == self.rank:
                continue
            for m, values in enumerate(chunks):
                sent = {n: values[n] for n in names}
                if not any(t.requires_grad for t in tensors(sent)):
                    continue
                grads = self.transport.receive(Phase.BACKWARD, dst, DRIVER, m)
                pairs = [(t, g.to(t.device)) for n in names
                         for t, g in zip(tensors(sent[n]), grads[n])
                         if g is not None and t.requires_grad]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _named(self, error: StageError) -> StageError:
        """The runtime's `StageError` of this rank's stage, naming this rank and replica too."""
        where = f"rank {self.rank}" + (f" (replica {self.replica})" if self.replicas > 1 else "")
        named = StageError(f"{where}: {error}", stage=error.stage, microbatch=error.microbatch)
        named.__cause__ = error.__cause__
        return named


def release_groups(made: list[Any], owned: bool) -> None:
    """Destroy the process groups `load` made (`made`, emptied) and, if `owned`, the default
    group it started, so that no gloo thread of theirs outlives them: a gloo group alive when
    the interpreter exits lets its worker thread free a finished collective's tensors during
    finalization, and the process aborts ("terminate called without an active exception").
    A group's threads end only when nothing refers to it any more, so its holders drop their
    handles too (`DistributedStage.close`). Groups the caller destroyed already are skipped;
    the caller's default group is left to the caller."""
    forget_captured_default_group()
    registered = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    while made:
        group = made.pop()
        if group in registered:
            dist.destroy_process_group(group)
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def forget_captured_default_group() -> None:
    """Import `torch.distributed.nn.functional` if it is not yet, and let go of the default
    group it holds, if it does.

    That module reads the default group into its functions' default arguments
    (`group=group.WORLD`) when first imported, and `torch._dynamo` imports it, as does
    `torch.distributed.pipelining`; `torch.utils.checkpoint` imports `torch._dynamo` on its
    first call (a recomputing stage's first backward). Imported while a group exists, that group
    outlives `destroy_process_group` into the interpreter's exit, where its gloo threads, still
    running, abort the process ("terminate called without an active exception"). `load` and
    `close` call this: the defaults become None, what the functions read as the default group
    at call time (the same group while it lives), and no later import can bind one."""
    import torch.distributed.nn.functional as functional

    for fn in vars(functional).values():
        defaults = fn.__defaults__ if isinstance(fn, types.FunctionType) else None
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d
                                    for d in defaults)


class _RankRun(Driver):
    """This rank's part of one step, driven as every run is (`runtime.orchestrator.Driver`):
    its stage's one row walked on the caller's thread against its peers, whom a failure here
    (the stage's, named by rank, or the caller's) or a peer's news of one is told."""

    transport_errors = (DistributedError,)

    def __init__(self, owner: DistributedStage, executor: StageExecutor):
        super().__init__(owner.transport)
        self.owner = owner
        self.executors = [executor]

    def recorded(self, record: Run) -> None:
        self.owner.last_run = record

    def abort(self) -> None:
        self.stopping.set()
        self.transport.abort(f"rank {self.owner.rank} failed: "
                             f"{self.owner._named(self.errors[0])}")

    def caller_failed(self, error: BaseException, record: Run) -> None:
        self.stopping.set()
        record.error = str(error)
        if isinstance(error, PeerFailedError):      # a peer's news: passed on to the others
            self.transport.abort(error.note, origin=error.origin)
        elif isinstance(error, DistributedError):
            self.transport.abort(f"rank {self.owner.rank} stopped: {error}")
        else:
            self.transport.abort(f"rank {self.owner.rank} failed: {type(error).__name__}: "
                                 f"{error}")
