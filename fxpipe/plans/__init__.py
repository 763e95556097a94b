"""Plans: what planning makes and the runtime runs, as plain data.

The parts: `plan_data` (the `Plan`, `make_plan`), `prediction` (the configurations a plan records
as weighed, and its predicted timeline), `saved` (a plan on disk, `load_plan`), `plan_format`
and `graph_data` (a plan and its stage graphs as data, no pickle), `report` (`print(plan)`),
`explain` (why the cuts are where they are) and `pictures` (SVG, DOT). Nothing here imports
planning: a plan is read, saved and run without the planner.
"""
