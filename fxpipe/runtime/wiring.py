"""Who sends what to whom: the stage wiring, plain data computed once from codegen's stages.

Each stage reads its inputs (by node name) from the stage that produces them, or from the driver
(the caller's thread, which holds the graph inputs); a backward sends gradients the other way.
Graph outputs go back to the driver in inference, and to the last stage, which computes the loss,
in training; across processes the last stage also reads the graph inputs the model returns as
they are (`with_inputs_at_last`). The runtime moves values along this wiring, the simulator
takes its dependencies from it (`reads_from`), and a saved plan stores it.

The driver is the participant that feeds graph inputs and collects outputs (the caller's thread;
across processes, each replica's stage-0 rank): `DRIVER` (-1) among the stage indices
(`schedules.INPUTS`, the same -1, in `message_orders`); its device in the cost model is
`cost_model.DRIVER_DEVICE`, the host. Placeholders belong to no stage: each stage reading an input
receives it straight from the driver, and graph outputs go straight back. A target or input moves
to the device of the stage reading it (the last stage's for targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from .schedules import Phase

DRIVER = -1

Reads = Mapping[int, Mapping[int, Sequence[str]]]   # reads[receiver][sender]: the names sent


class _StageLike(Protocol):
    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Flow:
    """One mode's wiring: who reads what from whom in a forward, and the same by sender."""

    reads: Reads    # reads[receiver][sender]: names
    sends: Reads    # sends[sender][receiver]: names

    def channels(self) -> list[tuple[Phase, int, int]]:
        """Every (phase, sender, receiver): forwards as read, and gradients back between stages."""
        channels = []
        for receiver, senders in self.reads.items():
            for sender in senders:
                channels.append((Phase.FORWARD, sender, receiver))
                if sender != DRIVER:
                    channels.append((Phase.BACKWARD, receiver, sender))
        return channels

    @staticmethod
    def of_reads(reads: Reads) -> "Flow":
        """The flow of `reads` (reads[receiver][sender]: names), with the same by sender."""
        sends: dict[int, dict[int, list[str]]] = {}
        for receiver, senders in reads.items():
            for sender, names in senders.items():
                sends.setdefault(sender, {})[receiver] = list(names)
        return Flow(reads, sends)

    def reads_from(self) -> dict[int, list[int]]:
        """Which stages each stage reads from (the driver left out): a timetable's dependencies."""
        return {dst: [src for src in srcs if src != DRIVER]
                for dst, srcs in self.reads.items() if dst != DRIVER}


@dataclass(frozen=True)
class Wiring:
    """The wiring of a pipeline's stages: each value's producer, and each mode's `Flow`."""

    producer: Mapping[str, int]      # value name -> the stage that sends it
    output_names: tuple[str, ...]    # the graph outputs stages produce
    inference: Flow
    training: Flow

    @staticmethod
    def of(stages: Sequence[_StageLike], output_names: Sequence[str]) -> "Wiring":
        """The wiring of `stages` (each with its `index`, `inputs` and `outputs`); graph inputs
        come from the driver, and `output_names` are the graph outputs the stages produce."""
        producer: dict[str, int] = {}
        for stage in stages:
            for name in stage.outputs:
                assert producer.setdefault(name, stage.index) == stage.index, (
                    f"{name!r} is sent by stages {producer[name]} and {stage.index}")
        for stage in stages:
            for name in stage.inputs:
                assert producer.get(name, DRIVER) < stage.index, (
                    f"stage {stage.index} reads {name!r} from stage {producer[name]}, not earlier")
        return Wiring(producer, tuple(output_names),
                      _flow(stages, producer, output_names, DRIVER),
                      _flow(stages, producer, output_names, len(stages) - 1))

    def flow(self, training: bool) -> Flow:
        return self.training if training else self.inference

    def reads_from(self, training: bool) -> dict[int, list[int]]:
        return self.flow(training).reads_from()

    def with_inputs_at_last(self, last: int, returned: Sequence[str]) -> Flow:
        """The training flow, the last stage (`last`) also reading from the driver the graph
        inputs in `returned` (those the model returns as they are): what a last stage reads to
        rebuild the model's output where the driver's values are not at hand (another process)."""
        reads = {receiver: {sender: list(names) for sender, names in senders.items()}
                 for receiver, senders in self.training.reads.items()}
        if returned:
            from_driver = reads.setdefault(last, {}).setdefault(DRIVER, [])
            from_driver.extend(n for n in dict.fromkeys(returned) if n not in from_driver)
        return Flow.of_reads(reads)


def _flow(stages: Sequence[_StageLike], producer: Mapping[str, int], output_names: Sequence[str],
          outputs_to: int) -> Flow:
    """Stages read their inputs from their producers (or the driver), and `outputs_to` reads the
    graph outputs it does not produce itself."""
    reads: dict[int, dict[int, list[str]]] = {}
    for stage in stages:
        for name in stage.inputs:
            reads.setdefault(stage.index, {}).setdefault(producer.get(name, DRIVER),
                                                         []).append(name)
    for name in output_names:
        if producer[name] != outputs_to:
            reads.setdefault(outputs_to, {}).setdefault(producer[name], []).append(name)
    return Flow.of_reads(reads)
