"""Rank 0's progress reads well under horovodrun and mpirun (plain lines) and on a terminal (a bar)."""
import os
import pty
import re
import subprocess

import pytest

from jobs import PYTHON, ROOT, job_env, launch

# about 60 steps of a small cnn per epoch: long enough for several progress lines 0.1 s apart
JOB = ("--model", "cnn", "--data", "synthetic", "--synthetic-shape", "16", "16", "3", "--synthetic-samples",
       "4800", "--batch-size", "32", "--epochs", "2", "--log-every", "0.1", "--no-tensorboard",
       "--checkpoint-every", "0")


@pytest.mark.full
@pytest.mark.parametrize("launcher", ["gloo", "mpirun"])
def test_progress_under_a_launcher_is_clean_lines_from_rank0_with_rate_eta_and_metrics(launcher, tmp_path):
    proc = launch(2, launcher, ["-m", "hvdtrain", "--output-dir", str(tmp_path), *JOB], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    text = proc.stdout
    assert "\r" not in text  # no carriage-return fragments for the launcher to prefix
    steps = re.findall(r"hvdtrain: epoch 1/2 step (\d+)/(\d+) loss [\d.]+ accuracy [\d.]+ \| [\d,]+ samples/s "
                       r"\| epoch ETA \d+:\d\d:\d\d", text)
    assert len(steps) >= 2, text[-3000:]
    epochs = re.findall(r"hvdtrain: epoch (\d)/2 loss [\d.]+ accuracy [\d.]+ val_loss [\d.]+ val_accuracy "
                        r"[\d.]+ lr [\d.e-]+ \| [\d,]+ samples/s \| [\d.]+ s \| ETA \d+:\d\d:\d\d", text)
    assert epochs == ["1", "2"], text[-3000:]
    # rank 0 only: under horovodrun every line carries its rank's prefix
    if launcher == "gloo":
        assert not re.search(r"\[1\]<stdout>:hvdtrain: epoch", text)
    assert "is slow compared to the batch time" not in text  # Keras' slow-callback warning


@pytest.mark.full
def test_progress_on_a_terminal_is_a_bar_redrawn_in_place(tmp_path):
    argv = [PYTHON, "-m", "hvdtrain", "--output-dir", str(tmp_path), *JOB]
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, cwd=ROOT, env=job_env(), stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert re.search(r"\repoch 1/2 step \d+/\d+ \[=*>?\.*\] ", text), text[-2000:]
    assert re.search(r"hvdtrain: epoch 2/2 loss", text)
