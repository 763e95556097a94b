"""The command line's parts (`python -m fxpipe`, whose `fxpipe/__main__.py` holds the parser and
`main`):

- `commands.py`: what each command does (`plan`, `explain`, `show`, `diff`, `convert`, `run`).
- `arguments.py`: reading its arguments (the model, shapes, dtypes, devices, sizes), each
  refused with a `UsageError` that names the flag.
"""
