"""Slurm, for real: slurmctld here and one slurmd on each of two netns hosts (scripts/slurm_cluster.sh, from
Debian's slurm-wlm and munge), jobs submitted with sbatch as a user would: the example batch scripts
in examples/slurm/, both launch styles, and a preemption that the job survives by requeueing."""
import json
import re
import subprocess
import time

import pytest

from jobs import ROOT, job_env
from test_multihost import _why_no_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.alone]

SMALL = ["--epochs", "2", "--steps-per-epoch", "5", "--verbose", "0", "--no-tensorboard"]
LONG = ["--model", "mlp", "--data", "synthetic", "--synthetic-shape", "8", "8", "1", "--synthetic-samples", "20000",
        "--batch-size", "16", "--epochs", "3", "--val-split", "0.05", "--no-tensorboard", "--verbose", "0",
        "--checkpoint-every-steps", "0"]


@pytest.fixture(scope="module")
def slurm():
    why = _why_no_cluster()
    if why:
        pytest.skip(why)
    up = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "up", "2"], capture_output=True,
                        text=True, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield {"SLURM_CONF": up.stdout.strip().splitlines()[-1]}
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "down"], capture_output=True, timeout=120)


def slurm_cmd(env, *cmd, timeout=60):
    proc = subprocess.run(list(cmd), cwd=ROOT, env=job_env(env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def submit(env, script, out_file, *flags) -> str:
    return slurm_cmd(env, "sbatch", "--parsable", f"--output={out_file}", str(ROOT / "examples" / "slurm" / script),
                     *flags)


def wait_done(env, job, timeout=300, while_waiting=None):
    deadline = time.time() + timeout
    while slurm_cmd(env, "squeue", "-h", "-j", job, "-o", "%T"):
        if while_waiting:
            while_waiting()
        assert time.time() < deadline, f"job {job} still in the queue after {timeout} s"
        time.sleep(0.5)


def summary(out) -> dict:
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 4 and s["hosts"] == ["node1", "node2"], s["hosts"]
    assert len(set(s["weights_sha256_by_rank"])) == 1
    return s


@pytest.mark.full
def test_sbatch_of_the_example_script_trains_four_ranks_over_two_nodes_through_srun(slurm, tmp_path):
    """examples/slurm/train.sbatch: 2 nodes x 2 tasks, `srun --mpi=pmix python -m hvdtrain` (MPI through
    Slurm's PMIx, no horovodrun): the ranks agree, summary.json names both nodes."""
    job = submit(slurm, "train.sbatch", tmp_path / "job.out", *SMALL, "--output-dir", str(tmp_path / "run"))
    wait_done(slurm, job)
    s = summary(tmp_path / "run")
    assert s["epochs_run"] == 2, (tmp_path / "job.out").read_text()[-3000:]


@pytest.mark.full
def test_horovodrun_inside_the_allocation_takes_its_hosts_from_slurm(slurm, tmp_path):
    """examples/slurm/train_horovodrun.sbatch: `hvdtrain hosts --slurm` gives horovodrun node1:2,node2:2."""
    job = submit(slurm, "train_horovodrun.sbatch", tmp_path / "job.out", *SMALL, "--output-dir", str(tmp_path / "run"))
    wait_done(slurm, job)
    summary(tmp_path / "run")
    hosts = slurm_cmd(slurm, "srun", "-N2", "--ntasks-per-node=3", "-n6", "python", "-m", "hvdtrain", "hosts",
                      "--slurm")
    assert set(hosts.split()) == {"node1:3,node2:3"}, hosts  # every task prints the same line


@pytest.mark.full
def test_scancel_signal_term_preempts_and_the_requeued_job_resumes_bit_identical(slurm, tmp_path):
    """scancel --signal=TERM in epoch 2: every rank stops at one step after its checkpoint, srun exits
    75, the batch script requeues the job, and the requeued job resumes at that step and ends with
    the weights of the same job never signalled."""
    whole = submit(slurm, "train.sbatch", tmp_path / "whole.out", *LONG, "--output-dir", str(tmp_path / "whole"))
    wait_done(slurm, whole)
    uninterrupted = summary(tmp_path / "whole")

    run = tmp_path / "run"
    job = submit(slurm, "train.sbatch", tmp_path / "job.out", *LONG, "--output-dir", str(run))
    signalled = []

    def signal_once_epoch_1_is_saved():
        if not signalled and (run / "checkpoints" / "ckpt-1.index").exists():
            time.sleep(0.5)
            slurm_cmd(slurm, "scancel", "--signal=TERM", job)
            signalled.append(time.time())

    wait_done(slurm, job, timeout=400, while_waiting=signal_once_epoch_1_is_saved)
    log = (tmp_path / "job.out").read_text()
    assert signalled and log.count("hvdtrain: preempted (SIGTERM)") == 1, log[-3000:]
    assert "Exited with exit code 75" in log and not re.search(r"exit code (?!75\b)\d+", log), log[-3000:]
    s = summary(run)
    assert (s["first_epoch"], s["first_step"] > 0) in ((1, True), (2, True), (2, False)), (s["first_epoch"], s["first_step"])
    assert f"resumed from {run}/checkpoints/ckpt-{s['first_epoch']}" in log
    assert s["weights_sha256_by_rank"] == uninterrupted["weights_sha256_by_rank"]


@pytest.mark.full
def test_hosts_slurm_outside_an_allocation_says_where_to_run_it():
    env = {k: v for k, v in job_env().items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["python", "-m", "hvdtrain", "hosts", "--slurm"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "hosts --slurm: not inside a Slurm allocation" in proc.stderr


@pytest.mark.parametrize("value,counts", [("2(x2)", [2, 2]), ("4", [4]), ("3,2(x2),1", [3, 2, 2, 1])])
def test_slurm_tasks_per_node_is_read_as_slurm_writes_it(value, counts):
    from hvdtrain.hosts import slurm_tasks_per_node

    assert slurm_tasks_per_node(value) == counts


@pytest.mark.parametrize("slurm_env,expected", [
    # --gpus-per-task=1: each task sees its own GPU (CUDA_VISIBLE_DEVICES names it); SLURM_LOCALID is its local rank
    ({"CUDA_VISIBLE_DEVICES": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2", "visible": 1}, 0),
    ({"CUDA_VISIBLE_DEVICES": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2", "visible": 1}, 0),
    # --gres=gpu:2 without per-task binding: every task sees both, the local rank picks
    ({"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2", "visible": 2}, 1),
])
def test_gpu_pinning_follows_slurms_per_task_binding(slurm_env, expected):
    """Horovod's local rank under srun is SLURM_LOCALID (MPI gets it from Slurm's PMIx)."""
    from hvdtrain.runtime import choose_gpu

    index, why = choose_gpu(slurm_env["visible"], int(slurm_env["SLURM_LOCALID"]),
                            int(slurm_env["SLURM_NTASKS_PER_NODE"]), slurm_env["CUDA_VISIBLE_DEVICES"], "node1")
    assert index == expected
    assert ("CUDA_VISIBLE_DEVICES=" + slurm_env["CUDA_VISIBLE_DEVICES"]) in why or "local rank 1 of 2" in why



@pytest.mark.full
def test_the_sbatch_commands_of_the_docs_run_as_written(slurm, tmp_path):
    """docs/multinode.md's sbatch lines, as written, with my.yaml a small job's config."""
    lines = [l.strip() for l in (ROOT / "docs" / "multinode.md").read_text().splitlines() if l.startswith("    sbatch ")]
    assert len(lines) == 2, lines
    for i, line in enumerate(lines):
        out = tmp_path / f"run{i}"
        yaml = tmp_path / f"my{i}.yaml"
        yaml.write_text(f"epochs: 1\nsteps_per_epoch: 3\nverbose: 0\ntensorboard: false\noutput_dir: {out}\n")
        job = re.search(r"\d+", slurm_cmd(slurm, "bash", "-c", line.replace("my.yaml", str(yaml)))).group()
        try:
            wait_done(slurm, job)
            summary(out)
        finally:
            (ROOT / f"hvdtrain-{job}.out").unlink(missing_ok=True)


@pytest.mark.full
def test_a_signal_named_by_preemption_signals_preempts_as_slurms_time_limit_warning_would(slurm, tmp_path):
    """--preemption-signals TERM USR1, the signal `#SBATCH --signal=USR1@120` sends before a time limit
    (sent here by scancel --signal=USR1): every rank stops at one step after its checkpoint, exit 75."""
    run = tmp_path / "run"
    job = submit(slurm, "train.sbatch", tmp_path / "job.out", *LONG, "--preemption-signals", "TERM", "USR1",
                 "--output-dir", str(run))
    state = {}

    def signal_then_cancel_the_requeued_job():
        if "sent" not in state and (run / "checkpoints" / "ckpt-1.index").exists():
            slurm_cmd(slurm, "scancel", "--signal=USR1", job)
            state["sent"] = True
        log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
        if "sent" in state and "cancelled" not in state and "hvdtrain: preempted (SIGUSR1)" in log:
            slurm_cmd(slurm, "scancel", job)  # its requeued run is the other test's
            state["cancelled"] = True

    wait_done(slurm, job, timeout=400, while_waiting=signal_then_cancel_the_requeued_job)
    log = (tmp_path / "job.out").read_text()
    assert "hvdtrain: preempted (SIGUSR1): every rank stopped after epoch 1, step" in log, log[-3000:]
    assert "Exited with exit code 75" in log
    assert list((run / "checkpoints").glob("ckpt-1-step-*.index")), log[-3000:]
