"""Planning: from a model and its options to a `Plan`, before any Pipeline exists.

The parts: `recipe` (what planning takes: the model, the example, the options checked once, the
one capture per mode), `build` (planning conducted; `Planner`, the way back a pipeline keeps),
`options` (every option), `prepare` (prepare, weigh, realize), `measure` (node costs as stages
run them, the race), `host` (what a call costs the process besides its stages: hand-offs, the
interpreter lock), `whole` (the graph run whole as a stage runs it, timed), `search` (choosing
stages, micro-batches and schedule), `checks/` (the
model's reference runs, `verify`), `reference` (what a pipeline equals), `generation` (a
generation plan's lanes, chosen on decode costs) and `progress`.
Planning imports the plans and the runtime below it, never the Pipeline façade above it
(`tests/test_layers.py`).
"""
