"""Preemption: a scheduler's SIGTERM stops every worker at the same step after a step checkpoint, the job
exits with status 75, and the same command resumes there, ending with the uninterrupted run's weights."""
import json
import re
import signal
import subprocess
import time

import psutil
import pytest

from jobs import launch, PYTHON, start


SMALL = ["--model", "userdata:tiny_model", "--epochs", "3", "--batch-size", "16", "--lr", "0.05", "--verbose", "0",
         "--no-tensorboard", "--checkpoint-every-steps", "0", "--callbacks", "userdata:signal_self"]


def hvdtrain(out, launcher, flags, env=None, timeout=300):
    return launch(2, launcher, ["-m", "hvdtrain", "--output-dir", str(out), *flags], env=env, timeout=timeout)


def summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = hvdtrain(out, "gloo", [*SMALL, "--data", "userdata:blobs_signalling_in_validation"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    return summary(out)


def preempted_once(proc, launcher) -> str:
    """Rank 0's one line; no worker's traceback (horovodrun prints its own, as a launcher, on any exit but 0)."""
    lines = [l for l in proc.stdout.splitlines() if "hvdtrain: preempted (" in l]
    assert len(lines) == 1 and proc.returncode != 0, proc.stdout[-3000:]
    assert proc.stdout.count("Traceback") == (1 if launcher in ("gloo", "mpi") else 0), proc.stdout[-3000:]
    assert re.search(r"Exit code:\s+75", proc.stdout), proc.stdout[-3000:]
    return lines[0]


@pytest.mark.full
@pytest.mark.parametrize("at,launcher", [("train_begin", "gloo"), ("validation", "mpirun"), ("epoch_end", "gloo")])
def test_a_signal_on_one_worker_stops_both_at_one_step_and_the_relaunch_ends_bit_identical(at, launcher, uninterrupted,
                                                                                         tmp_path):
    """SIGTERM to rank 1 alone, before the first step, during validation, or just before an epoch's
    checkpoint is written: both ranks stop at the next step (it rides with the gradients), rank 0
    writes that step's checkpoint, both exit 75; the same command resumes at that step."""
    flags = [*SMALL, "--data", "userdata:blobs_signalling_in_validation"]
    proc = hvdtrain(tmp_path, launcher, flags, env={"SIGNAL_AT": at})
    line = preempted_once(proc, launcher)
    epoch, step = map(int, re.search(r"after epoch (\d+), step (\d+)", line).groups())
    assert (epoch, step > 0) == ({"train_begin": 0, "validation": 1, "epoch_end": 1}[at], True), line
    assert (tmp_path / "checkpoints" / f"ckpt-{epoch}-step-{step}.index").exists()
    assert "exit status 75" in line
    again = hvdtrain(tmp_path, launcher, flags)
    assert again.returncode == 0, again.stdout[-3000:]
    s = summary(tmp_path)
    assert (s["first_epoch"], s["first_step"]) == (epoch, step)
    assert s["weights_sha256_by_rank"] == uninterrupted["weights_sha256_by_rank"]


@pytest.mark.parametrize("launcher", ["gloo", pytest.param("mpirun", marks=pytest.mark.full)])
def test_sigterm_to_every_worker_mid_epoch_exits_75_with_a_checkpoint_of_that_step(launcher, tmp_path):
    """As scancel or a pod eviction does it: SIGTERM to every worker process (not the launcher) in the
    middle of epoch 2; each exits with status 75 and the step checkpoint they agreed on is written."""
    flags = ["--model", "mlp", "--data", "synthetic", "--synthetic-shape", "8", "8", "1", "--synthetic-samples",
             "40000", "--batch-size", "16", "--epochs", "3", "--val-split", "0.05", "--no-tensorboard",
             "--verbose", "0", "--checkpoint-every-steps", "0", "--output-dir", str(tmp_path)]
    job = start(2, launcher, ["-m", "hvdtrain", *flags])
    deadline = time.time() + 240
    while not (tmp_path / "checkpoints" / "ckpt-1.index").exists():
        assert time.time() < deadline and job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    workers = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[:3] == [PYTHON, "-m", "hvdtrain"]
               and str(tmp_path) in p.info["cmdline"]]  # the workers, not the launcher or its shells
    assert len(workers) == 2, [p.info["cmdline"] for p in workers]
    for p in workers:
        p.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    proc = subprocess.CompletedProcess(job.args, job.returncode, out)
    line = preempted_once(proc, launcher)
    epoch, step = map(int, re.search(r"after epoch (\d+), step (\d+)", line).groups())
    assert epoch == 1 and 0 < step < 1187, line
    assert (tmp_path / "checkpoints" / f"ckpt-1-step-{step}.index").exists()


@pytest.mark.full
def test_a_signal_that_cannot_be_handled_is_refused_in_one_line(tmp_path):
    bad = launch(1, None, ["-m", "hvdtrain", "--preemption-signals", "KILL", "--output-dir", str(tmp_path)])
    assert bad.returncode == 2 and "--preemption-signals: 'KILL' is not a signal a process can handle" in bad.stdout
