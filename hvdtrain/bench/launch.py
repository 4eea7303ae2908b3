"""How the bench starts what it measures: hvdtrain (or a worker of the bench's own) on n ranks, from
scratch, with this venv's launchers first on the PATH."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..config import UserError

PY = sys.executable
BIN = Path(PY).parent


def env(extra=None) -> dict:
    merged = dict(os.environ)
    merged.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    merged.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    merged.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    merged["PATH"] = f"{BIN}:{merged.get('PATH', '')}"
    merged.update(extra or {})
    return merged


def say(line: str):
    """One line per measurement as it lands: a full bench takes minutes."""
    print(f"bench: {line}", flush=True)


def run(cmd, timeout, extra_env=None) -> str:
    """Its output, stdout and stderr together; a failure is the bench's error, with the output's end."""
    proc = subprocess.run(cmd, env=env(extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise UserError(f"bench: {' '.join(map(str, cmd[:8]))} ... failed:\n{proc.stdout[-2000:]}")
    return proc.stdout


def python(n: int, controller: str, hosts: str | None, binding: str | None = None, py: str = PY) -> list:
    """The command that starts this python (or `py`, another venv's) on n workers (itself, for one).
    binding: MPI's process binding (horovodrun's --binding-args; its default and ours binds nothing)."""
    if n == 1:
        return [py]
    if controller == "mpirun":
        return ["mpirun", "-np", str(n), *(binding or "--bind-to none").split(), "-x", "TF_CPP_MIN_LOG_LEVEL",
                "-x", "PATH", py]
    return [str(Path(py).parent / "horovodrun"), "-np", str(n), "-H", hosts or f"localhost:{n}", f"--{controller}",
            *(["--binding-args", binding] if binding else []), py]


def controller(args) -> str:
    """The one controller of the sections that compare at a fixed set-up: MPI where it is asked for."""
    return "mpi" if "mpi" in args.controllers else args.controllers[0]


def train(launcher: list, run_dir: Path, flags, timeout, extra_env=None) -> dict:
    """One hvdtrain run from scratch; its summary.json."""
    run(launcher + ["-m", "hvdtrain", "--output-dir", str(run_dir), "--no-auto-resume", *flags], timeout, extra_env)
    return json.loads((run_dir / "summary.json").read_text())
