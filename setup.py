"""Package discovery, the one thing pyproject.toml cannot say: the top-level folder passes/
installs as fxpipe.passes, so a distribution named fxpipe owns no generic top-level name.
Everything else about the package is in pyproject.toml."""

from setuptools import find_packages, setup

passes = ["fxpipe.passes"] + [f"fxpipe.passes.{p}" for p in find_packages("passes")]
setup(packages=find_packages(include=["fxpipe", "fxpipe.*"]) + passes,
      package_dir={"fxpipe.passes": "passes"})
