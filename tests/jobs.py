"""Launching real hvdtrain jobs from the tests: plain python, horovodrun (Gloo or MPI controller) and
mpirun, the environment their workers get, and reading what they leave. A module of its own, imported
by the test files (`from jobs import ...`), so conftest.py keeps only pytest's fixtures and hooks."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable  # the project's .venv python: horovodrun and mpirun start workers with it
BIN = Path(PYTHON).parent
LAUNCHERS = ("gloo", "mpi", "mpirun")
# Asked of the venv's own Python once: the stack under test, Keras 3 (tf.keras has keras.ops) or Keras 2,
# and what Horovod was built with (horovodrun_checked_once.py answers horovodrun's build check with it)
_ASKED = json.loads(subprocess.run(
    [PYTHON, "-c", "import json, horovod.tensorflow as hvd, tensorflow as tf; print(json.dumps({'keras3': "
                   "hasattr(tf.keras, 'ops'), 'mpi': hvd.mpi_built(), 'gloo': hvd.gloo_built()}))"],
    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
KERAS3 = _ASKED["keras3"]
HOROVOD_BUILT = json.dumps({"mpi": _ASKED["mpi"], "gloo": _ASKED["gloo"]})


def job_env(extra=None):
    env = dict(os.environ)
    env.update({
        "PATH": f"{BIN}:{env.get('PATH', '')}",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        # Debian's PMIx (libpmix2 depends on libmunge2) tries munge first: with no munged running, as
        # here outside the Slurm tests, every mpirun waits 2.3 s for it (hvdtrain doctor says so)
        "PMIX_MCA_psec": "native",
        "HVDTRAIN_TEST_HOROVOD_BUILT": HOROVOD_BUILT,
    })
    env.update(extra or {})
    return env


def command(np_, launcher, argv):
    """The command line a user would type for np_ workers on this host (horovodrun's build check asked
    once per test session: horovodrun_checked_once.py)."""
    worker = [PYTHON] + list(argv)
    if launcher is None:
        assert np_ == 1
        return worker
    if launcher == "mpirun":
        return ["mpirun", "-np", str(np_), "--bind-to", "none",
                "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "PYTHONUNBUFFERED"] + worker
    return [PYTHON, str(ROOT / "tests" / "horovodrun_checked_once.py"), "-np", str(np_), "-H", f"localhost:{np_}",
            f"--{launcher}"] + worker


def run(cmd, timeout=300, env=None):
    """Run a command line to the end (a launcher, ssh, the workers under it), stdout and stderr together
    as a user would see them; past `timeout`, its whole process group is ended and the test fails."""
    proc = spawn(cmd, env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} did not finish in {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def spawn(cmd, env=None, **popen):
    """Start a command line and return at once (a test that signals, kills or watches it)."""
    return subprocess.Popen(cmd, cwd=ROOT, env=job_env(env), text=True,
                            **{"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, **popen})


def launch(np_, launcher, argv, timeout=300, env=None):
    """Run a job of np_ workers on this host to the end (run)."""
    return run(command(np_, launcher, argv), timeout, env)


def start(np_, launcher, argv, env=None, **popen):
    """Start a job of np_ workers on this host and return at once (spawn)."""
    return spawn(command(np_, launcher, argv), env, **popen)


def error_lines(output: str) -> list:
    """hvdtrain's one-line errors in a job's output (under horovodrun, with its rank prefix)."""
    return [l for l in output.splitlines() if "hvdtrain: error:" in l]


def train(np_, launcher, out_dir, *flags, timeout=300):
    """Train with hvdtrain and return its summary.json."""
    argv = ["-m", "hvdtrain", "--output-dir", str(out_dir), "--verbose", "0", "--no-tensorboard", *flags]
    proc = launch(np_, launcher, argv, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads((Path(out_dir) / "summary.json").read_text())


def run_worker_script(np_, launcher, script, *args, timeout=300):
    """Run tests/workers/<script> on np_ ranks; rank 0 prints one JSON line starting with RESULT."""
    proc = launch(np_, launcher, [str(ROOT / "tests" / "workers" / script), *map(str, args)], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [l.split("RESULT ", 1)[1] for l in proc.stdout.splitlines() if "RESULT " in l]
    assert len(lines) == 1, proc.stdout[-4000:]  # horovodrun prefixes lines with [rank]<stdout>:
    return json.loads(lines[0])


def processes_of(path, settle=0.0):
    """pids of processes whose command line names `path` (a job's output dir), after `settle` seconds."""
    import time

    import psutil

    time.sleep(settle)
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if str(path) in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid()]


def pid_of_rank(out, rank, proc, timeout=120, seen=()):
    """Wait until the job trains (a checkpoint) and return the pid that rank logged (logs append
    across runs in one output dir: the newest pid not in `seen`)."""
    import re
    import time

    log, ckpt = out / "logs" / f"rank{rank}.log", out / "checkpoints" / "checkpoint"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ckpt.exists() and log.exists():
            pids = [int(p) for p in re.findall(r"pid (\d+)", log.read_text()) if int(p) not in seen]
            if pids:
                return pids[-1]
        time.sleep(0.1)
    raise AssertionError(f"the job did not start training: {proc.stdout.read()[-3000:] if proc.poll() is not None else ''}")
