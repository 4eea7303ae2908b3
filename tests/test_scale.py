"""32 ranks over 4 hosts (network namespaces node1..node4, 8 ranks each, 1 thread each) under the MPI
controller (mpirun's and Slurm's), and Gloo's rendezvous of 8 ranks over the same 4 hosts: the job
trains and every rank ends with the same weights. 2 cores cannot make 32 ranks fast: what is tested is
that nothing breaks (start-up, the broadcast, the allreduce, the gathers of hvdtrain's own set-up).
Gloo's 32-rank run cost 5 minutes of the suite, and 16 ranks 2.5, for the same paths at a higher count;
the bench's scale section runs it at 32 (docs/benchmarks.md)."""
import json
import shlex

import pytest

from jobs import BIN, PYTHON, ROOT, job_env, run
from test_multihost import ENV_NAMES, MPI_YIELD, netns_hosts

pytestmark = [pytest.mark.scale, pytest.mark.alone]

HOSTS = "node1:8,node2:8,node3:8,node4:8"
HOSTS_8 = "node1:2,node2:2,node3:2,node4:2"
TRAIN = ["-m", "hvdtrain", "--model", "mlp", "--data", "synthetic", "--synthetic-shape", "8", "8", "1",
         "--synthetic-samples", "4096", "--batch-size", "8", "--epochs", "1", "--steps-per-epoch", "3",
         "--threads", "1", "--verbose", "0", "--no-tensorboard", "--no-worker-logs"]


@pytest.fixture(scope="module")
def four_hosts():
    yield from netns_hosts(4)


def check(out, proc, ranks=32):
    assert proc.returncode == 0, proc.stdout[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == ranks and s["hosts"] == ["node1", "node2", "node3", "node4"]
    assert len(s["weights_sha256_by_rank"]) == ranks and len(set(s["weights_sha256_by_rank"])) == 1
    return s


def test_32_ranks_over_4_hosts_train_alike_under_mpi(four_hosts, tmp_path):
    cmd = [str(BIN / "horovodrun"), "-np", "32", "-H", HOSTS, "--mpi", "--network-interface", "eth0",
           PYTHON, *TRAIN, "--output-dir", str(tmp_path)]
    check(tmp_path, run(cmd, timeout=600, env=MPI_YIELD))


def test_8_ranks_over_4_hosts_train_alike_under_gloo(four_hosts, tmp_path):
    # many ranks on 2 cores reach hvd.init up to minutes apart; Gloo's rendezvous waits 30 s by default
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in job_env().items() if k in ENV_NAMES)
    env += " HOROVOD_GLOO_TIMEOUT_SECONDS=120"
    horovodrun = [str(BIN / "horovodrun"), "-np", "8", "-H", HOSTS_8, "--gloo", "--network-interface", "eth0",
                  PYTHON, *TRAIN, "--output-dir", str(tmp_path)]
    check(tmp_path, run(["ssh", "node1", f"cd {shlex.quote(str(ROOT))} && env {env} {shlex.join(horovodrun)}"],
                        timeout=600), ranks=8)
