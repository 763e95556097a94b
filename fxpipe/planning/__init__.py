"""Planning: from a model and its options to a `Plan`, before any Pipeline exists.

The parts: `options` (every option, checked once), `prepare` (capture once per mode, prepare,
weigh, realize), `measure` (node costs as stages run them, the race), `search` (choosing stages,
micro-batches and schedule), `checks/` (the model's reference runs, `verify`), `reference`
(what a pipeline equals) and `progress`. Planning imports the plans and the runtime below it,
never the Pipeline façade above it (`tests/test_layers.py`).
"""
