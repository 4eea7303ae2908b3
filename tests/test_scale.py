"""32 ranks over 4 hosts (network namespaces node1..node4, 8 ranks each, 1 thread each) under the MPI
controller (mpirun's and Slurm's): the job trains and every rank ends with the same weights. 2 cores
cannot make 32 ranks fast: what is tested is that nothing breaks (start-up, the broadcast, the
allreduce, the gathers of hvdtrain's own set-up). Gloo's rendezvous across hosts is
test_multihost.py's; Gloo at 32 ranks cost 5 minutes of the suite for the same paths, and the bench's
scale section runs it (docs/benchmarks.md)."""
import json

import pytest

from jobs import BIN, PYTHON, run
from test_multihost import MPI_YIELD, netns_hosts

pytestmark = [pytest.mark.scale, pytest.mark.alone, pytest.mark.full]

HOSTS = "node1:8,node2:8,node3:8,node4:8"
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
