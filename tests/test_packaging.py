"""The wheel a user installs holds every module of the source tree.

An editable install (what `make test` uses) reads the source folders directly and would hide a
package the wheel leaves out, so this test builds the wheel, installs it into a folder of its own
and imports every module from there, in a process started outside the repository.
"""

import os
import pathlib
import subprocess
import sys

import pytest

import fxpipe

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modules() -> list[str]:
    """Every module of the source tree, by the name it installs under."""
    names = []
    for folder, package in ((ROOT / "fxpipe", "fxpipe"), (ROOT / "passes", "fxpipe.passes")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join([package, *parts]))
    return names


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> pathlib.Path:
    """The wheel built from this checkout, installed (not editable) into a folder of its own."""
    wheels, target = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(ROOT)], check=True, capture_output=True)
    [wheel] = wheels.glob("fxpipe-*.whl")
    assert wheel.name.startswith(f"fxpipe-{fxpipe.__version__}-")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    return target


def _python(installed: pathlib.Path, code: str, cwd: pathlib.Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_wheel_holds_every_module_of_the_source_tree(installed, tmp_path):
    modules = _modules()
    assert "fxpipe.distributed" in modules and "fxpipe.passes.partition.search" in modules
    out = _python(installed, (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(installed)!r}), (name, module.__file__)\n"
        "print(len(sys.modules))\n"), cwd=tmp_path)
    assert int(out) > len(modules)


def test_the_installed_package_is_typed_licensed_and_versioned(installed, tmp_path):
    assert (installed / "fxpipe" / "py.typed").is_file()
    [info] = installed.glob("fxpipe-*.dist-info")
    metadata = (info / "METADATA").read_text()
    assert f"Version: {fxpipe.__version__}" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "Provides-Extra: hf" in metadata and "Provides-Extra: test" in metadata
    assert any(info.rglob("LICENSE*"))
    out = _python(installed, "import fxpipe.__main__ as m; m.main(['--version'])", cwd=tmp_path)
    assert out.strip() == f"fxpipe {fxpipe.__version__}"


def test_the_quickstart_runs_from_the_installed_package(installed, tmp_path):
    script = (ROOT / "examples" / "quickstart.py").read_text()
    (tmp_path / "quickstart.py").write_text(script)
    # A smaller batch and stream than `make demo`'s: the same code, in the old demo's time.
    _python(installed, "import runpy, sys; sys.argv = ['quickstart.py', '--batch', '16', "
            "'--items', '20']; runpy.run_path('quickstart.py', run_name='__main__')",
            cwd=tmp_path)
