"""Do torchrun jobs that finished exit 0? A loop of launches, counting the ranks' aborts at exit.

    python -m benchmarks.torchrun_exit [--launches 8] [--case recompute|regions|docs|alive]
                                       [--cores DIR] [--load N]

Each launch is `python -m torch.distributed.run --nproc-per-node 2` on 127.0.0.1 (gloo):
- `recompute` (the default): tests/distributed_worker.py on the plan of
  tests/test_distributed.py's recomputing 1F1B case (Branchy, 2 stages, `recompute="always"`):
  `fxpipe.distributed.load` starts the process group, a call and a `train_step`, `close`;
- `regions`: the same with the test's other recomputing plan, its ReLUs checkpointed
  (`torch.utils.checkpoint` regions, `recompute_relus`);
- `docs`: docs/distributed.md's script on torch's pipelining (`pipeline_stages`,
  `ScheduleInterleaved1F1B`), where the script starts and ends the process group itself.
- `alive`: the abort itself, without fxpipe: torch alone, two gloo groups left alive at exit
  right after their collectives (most launches abort: a group's worker thread frees a finished
  all-reduce's tensors while the interpreter finalizes, its GIL taken then ends the thread, and
  the C++ destructor it unwinds through calls std::terminate).
Each rank also says, as its interpreter starts to exit, how many gloo threads still run (they
run into the finalization, the abort's cause): counted as launches with threads running at exit.
A launch is counted as an abort when torchrun fails and a rank said "terminate called without
an active exception" (what a rank aborting in its interpreter's finalization prints), as another
failure when it fails otherwise. Prints each launch's outcome, then `aborts A/N launches`;
exits 1 when any launch failed. With `--cores DIR`, each rank may dump a core (ulimit -c),
kept in DIR/launch<i>/ for `gdb python core`. With `--load N`, N processes spin beside the
launches, as the rest of a test suite does. Run it under `nice -n 10` on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_worker.py"
ABORT = "terminate called without an active exception"


def _test_module():
    """tests/test_distributed.py, for its model and its `planned` (the tests' own case)."""
    spec = importlib.util.spec_from_file_location("test_distributed",
                                                  ROOT / "tests" / "test_distributed.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "tests"))
    spec.loader.exec_module(module)
    return module


def prepare(case: str, where: Path) -> list[str]:
    """Save what the case's launches read under `where`; the script and its arguments."""
    if case in ("recompute", "regions"):
        tests = _test_module()
        recompute = (dict(recompute="always") if case == "recompute" else
                     dict(edit=tests.recompute_relus))
        tests.planned(where, 2, "1f1b", **recompute)
        return [str(WORKER), str(where / "plan"), str(where / "data.pt"), "OUT", "run"]
    if case == "alive":
        script = where / "alive.py"
        script.write_text(
            "import torch\nimport torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "group = dist.new_group([0, 1], backend='gloo')\n"
            "for _ in range(20):\n"
            "    dist.all_reduce(torch.ones(1 << 16), group=group)\n"
            "    dist.all_reduce(torch.ones(1 << 16))\n"
            "# no destroy_process_group: both groups' threads live into the interpreter's exit\n")
        return [str(script)]
    import fxpipe
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)))
    x = torch.randn(8, 16)
    fxpipe.plan(model, ["cpu"] * 4, (x,), chunks=4, training=True,
                verify=False).save(where / "plans" / "chain-4")
    torch.save((x, torch.randn(8, 16)), where / "batch.pt")
    script = where / "pipelined.py"
    script.write_text(
        "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"
        "from torch.distributed.pipelining import ScheduleInterleaved1F1B\n"
        "import fxpipe.torch_pipelining\n"
        f"x, target = torch.load({str(where / 'batch.pt')!r})\nlosses = []\n"
        "dist.init_process_group('gloo')\n"
        f"stages = fxpipe.torch_pipelining.pipeline_stages({str(where / 'plans' / 'chain-4')!r})\n"
        "schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=F.mse_loss)\n"
        "schedule.step(x) if dist.get_rank() == 0 else "
        "schedule.step(target=target, losses=losses)\n"
        "dist.destroy_process_group()\n")
    return [str(script)]


ALIVE = "fxpipe exit check: gloo threads running"


def _exit_report(where: Path) -> Path:
    """A script that runs the script given after it, and says, as the interpreter starts to
    exit (atexit), how many gloo threads still run: any of them runs into the finalization,
    where one that takes the GIL aborts the process."""
    script = where / "exit_report.py"
    script.write_text(
        "import atexit, os, runpy, sys\n"
        "def report():\n"
        "    names = []\n"
        "    for task in os.listdir('/proc/self/task'):\n"
        "        try:\n"
        "            names.append(open(f'/proc/self/task/{task}/comm').read().strip())\n"
        "        except OSError:\n"
        "            pass\n"
        "    gloo = sum(n in ('pt_gloo_runloop', 'gloo_tcp_loop') for n in names)\n"
        f"    print({ALIVE!r}, gloo, file=sys.stderr, flush=True)\n"
        "atexit.register(report)\n"
        "sys.argv = sys.argv[1:]\n"
        "sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return script


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allow_cores() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def launch(arguments: list[str], cwd: Path, timeout_s: float, cores: bool) -> tuple[int, str]:
    """One torchrun launch of 2 ranks in `cwd`: its exit status (None past `timeout_s`, when
    everything it started is killed) and its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *arguments]
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, "PYTHONPATH": path,
                                                   "FXPIPE_TIMEOUT": "30"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_allow_cores if cores else None)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return None, text.decode(errors="replace")
    return proc.returncode, text.decode(errors="replace")


@contextlib.contextmanager
def _busy(processes: int) -> Iterator[None]:
    """`processes` processes spinning on a core each while the block runs."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(processes)]
    try:
        yield
    finally:
        for p in spinning:
            p.kill()
            p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=8)
    parser.add_argument("--case", choices=["recompute", "regions", "docs", "alive"],
                        default="recompute")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per launch")
    parser.add_argument("--cores", type=Path, help="keep each rank's core dump here")
    parser.add_argument("--quiet", action="store_true", help="print the counts alone")
    parser.add_argument("--load", type=int, default=0,
                        help="busy processes running beside the launches, as a test suite's")
    args = parser.parse_args()
    aborts = others = alive = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, _busy(args.load):
        where = Path(tmp)
        arguments = [str(_exit_report(where)), *prepare(args.case, where)]
        for i in range(args.launches):
            cwd = (args.cores / f"launch{i}") if args.cores else where / f"launch{i}"
            cwd.mkdir(parents=True, exist_ok=True)
            out = cwd / "out"
            out.mkdir(exist_ok=True)
            code, text = launch([a.replace("OUT", str(out)) for a in arguments], cwd,
                                args.timeout, args.cores is not None)
            failed = [p.name for p in out.glob("*.err")]
            running = [int(n) for n in re.findall(rf"{ALIVE} (\d+)", text)]
            alive += any(running)
            if code == 0:
                outcome = "ok" + (f", gloo threads running at exit: {running}" if any(running)
                                  else "")
            elif ABORT in text and not failed:
                aborts += 1
                outcome = "ABORT at exit"
                (cwd / "torchrun.txt").write_text(text)
            else:
                others += 1
                outcome = f"FAILED (exit {code}, {failed or 'no .err'})"
                (cwd / "torchrun.txt").write_text(text)
            if not args.quiet:
                print(f"launch {i + 1}/{args.launches}: {outcome}", flush=True)
    print(f"aborts {aborts}/{args.launches} launches, gloo threads running into the exit in "
          f"{alive}/{args.launches}, other failures {others} "
          f"({args.case}, {time.monotonic() - start:.0f} s)", flush=True)
    return 1 if aborts or others else 0


if __name__ == "__main__":
    sys.exit(main())
