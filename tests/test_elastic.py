"""Elastic training with Horovod's elastic driver: workers die and hosts join, training goes on.

Three "hosts" on this one machine: localhost, 127.0.0.1 and this machine's name all resolve to a
local address, so horovodrun starts their workers without ssh, yet its elastic driver counts them as
three hosts, each of which can be added to the discovery hostfile or blacklisted on its own.
"""
import json
import os
import signal
import socket
import subprocess
import time

import psutil
import pytest

from jobs import BIN, PYTHON, ROOT, job_env, processes_of, run, run_worker_script, spawn


EPOCHS = 60


def _local_alias():
    """A third name for this machine that horovodrun will treat as a local host (no ssh)."""
    name = socket.gethostname()
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET}
    try:
        ok = socket.gethostbyname(name) in local and name not in ("localhost", "127.0.0.1")
    except OSError:
        ok = False
    assert ok, f"this machine's name {name!r} must resolve to one of its addresses {local}"
    return name


def _elastic_job(out, hostfile, *flags):
    discover = f"{PYTHON} -m hvdtrain hosts --discover --hostfile {hostfile}"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "2", "--max-np", "3", "--elastic-timeout", "60",
           "--host-discovery-script", discover,
           PYTHON, "-m", "hvdtrain", "--elastic", "--output-dir", str(out), "--model", "mlp",
           "--data", "digits", "--epochs", str(EPOCHS), "--batch-size", "16", "--steps-per-epoch", "10",
           "--threads", "1", "--verbose", "0", "--no-tensorboard", "--checkpoint-every", "5",
           "--commit-every", "5", *flags]
    log = open(out / "job.log", "w")
    # A survivor blocked in a receive from the dead worker notices at Gloo's timeout (default 30 s)
    return spawn(cmd, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "10"}, stdout=log, start_new_session=True)


def _wait_for(what, check, proc, out, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"waited for {what}: {(out / 'job.log').read_text()[-4000:]}")


def _workers_launched_as(rank, out):
    """Worker processes (python -m hvdtrain ... this output dir) that horovodrun started as `rank`.

    Ranks stay put while hosts are only added, so this is still the worker of that rank."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        cmd, env = p.info["cmdline"] or [], p.info["environ"] or {}
        if cmd[:1] == [PYTHON] and str(out) in cmd and env.get("HOROVOD_RANK") == str(rank):
            found.append(p)
    return found


@pytest.mark.alone  # hosts join and leave on a clock
def test_elastic_job_takes_in_a_new_host_loses_a_worker_and_still_finishes_every_epoch(tmp_path):
    third = _local_alias()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    rank0_log, ckpt = tmp_path / "logs" / "rank0.log", tmp_path / "checkpoints"
    proc = _elastic_job(tmp_path, hostfile)
    try:
        _wait_for("the first checkpoint", lambda: (ckpt / "checkpoint").exists(), proc, tmp_path)
        with open(hostfile, "a") as fh:  # a host appears in the discovery script's output
            fh.write(f"{third} slots=1\n")
        _wait_for("the new host to join", lambda: "elastic round 2: 3 workers" in rank0_log.read_text(),
                  proc, tmp_path)
        grown = len(list(ckpt.glob("*.index")))
        _wait_for("a checkpoint by 3 workers", lambda: len(list(ckpt.glob("*.index"))) > grown
                  or "ckpt-60" in (ckpt / "checkpoint").read_text(), proc, tmp_path)
        # kill -9 one of the 3 workers mid-training. Rank 1: when rank 0 (Horovod's coordinator) dies,
        # a survivor sometimes aborts inside Gloo instead of recovering (docs/reliability.md)
        victims = _workers_launched_as(int(os.environ.get("HVDTRAIN_TEST_VICTIM", "1")), tmp_path)
        assert len(victims) == 1, victims
        victims[0].send_signal(signal.SIGKILL)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0, output[-4000:]

    summary = json.loads((tmp_path / "summary.json").read_text())
    rounds = summary["elastic_rounds"]
    assert [r["world_size"] for r in rounds] == [2, 3, 2], rounds
    assert [r["lr"] for r in rounds] == pytest.approx([2e-3, 3e-3, 2e-3])  # lr follows the world size
    assert rounds[1]["from_epoch"] >= 1 and rounds[2]["from_epoch"] >= rounds[1]["from_epoch"]
    assert summary["world_size"] == 2
    assert "elastic round 3: 2 workers" in output
    assert summary["metrics"]["lr"] == pytest.approx(2e-3)
    assert len(set(summary["weights_sha256_by_rank"])) == 1
    assert summary["metrics"]["val_accuracy"] > 0.9
    assert f"ckpt-{EPOCHS}" in (ckpt / "checkpoint").read_text()  # every requested epoch ran
    assert processes_of(tmp_path, settle=2) == []


@pytest.mark.full
@pytest.mark.stacks
def test_elastic_commits_every_commit_every_steps_also_with_several_steps_per_call():
    """Horovod's CommitStateCallback counts Keras' calls of the step; with 4 steps per call it used to
    commit every 40 steps for --commit-every 10 (and lose up to 40 steps to a dead worker)."""
    committed = run_worker_script(1, None, "elastic_commits_check.py")
    assert committed["1"] == [10, 20, 30, 40, 40]  # and at the epoch's end
    assert committed["4"] == [12, 24, 36, 40]  # at the end of the call that reaches every 10 steps


@pytest.mark.full
def test_elastic_flag_outside_an_elastic_launch_is_a_clear_error(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "hvdtrain", "--elastic", "--output-dir", str(tmp_path)], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "hvdtrain: error: --elastic needs an elastic launch: horovodrun" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.full
def test_discover_prints_a_hostfile_as_the_host_slots_lines_horovodrun_reads(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# available now\nnode1 slots=4\nnode2 slots=two\nnode3\n")
    discover = lambda: subprocess.run([PYTHON, "-m", "hvdtrain", "hosts", "--discover", "--hostfile", str(hostfile)],
                                      cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=60)
    proc = discover()
    assert proc.returncode != 0 and "hosts:3: slots must be a positive integer, got 'two'" in proc.stderr
    assert proc.stdout == ""  # a bad line: say where, print nothing
    hostfile.write_text("# available now, in either format\nnode1 slots=4\nnode2:2\nnode3\n")
    proc = discover()
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["node1:4", "node2:2", "node3:1"]
    hostfile.write_text("# none yet\n")  # a normal state of an elastic job, not an error
    proc = discover()
    assert proc.returncode == 0 and proc.stdout.strip() == ""


@pytest.mark.full
def test_a_bad_discovery_hostfile_reaches_the_user_through_horovodrun(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=two\n")
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2", "--network-interface", "lo",
           "--host-discovery-script", f"{PYTHON} -m hvdtrain hosts --discover --hostfile {hostfile}",
           PYTHON, "-m", "hvdtrain", "--elastic", "--output-dir", str(tmp_path / "run")]
    proc = run(cmd, timeout=120)
    assert proc.returncode != 0
    assert f"hvdtrain: error: {hostfile}:1: slots must be a positive integer, got 'two'" in proc.stdout
