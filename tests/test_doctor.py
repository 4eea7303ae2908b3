"""hvdtrain doctor: real checks on this host, one report per host under horovodrun."""
import json
import socket

import pytest

from conftest import ROOT, launch
from hvdtrain import doctor


def _doctor(*flags, np_=1, launcher=None, env=None):
    proc = launch(np_, launcher, ["-m", "hvdtrain", "doctor", "--json", *flags], timeout=180, env=env)
    payload = proc.stdout[proc.stdout.index("{"):] if launcher is None else \
        "\n".join(l.split("<stdout>:", 1)[1] for l in proc.stdout.splitlines() if "<stdout>:" in l)
    return proc.returncode, json.loads(payload)


def _results(report, host=0):
    return {r["check"]: r for r in report["hosts"][host]["results"]}


def test_doctor_reports_horovod_build_mpi_and_cpu_budget():
    rc, report = _doctor()
    assert rc == 0 and report["ok"] is True
    r = _results(report)
    assert set(r["horovod"]["controllers"]) == {"MPI", "Gloo"}
    assert "TensorFlow yes" in r["horovod"]["detail"]
    assert "Open MPI" in r["mpi"]["detail"]
    assert r["cpu"]["workers"] == 1 and r["cpu"]["status"] == "ok"


def test_doctor_under_horovodrun_reports_once_per_host_with_its_local_size():
    rc, report = _doctor(np_=2, launcher="gloo")
    assert rc == 0 and len(report["hosts"]) == 1
    assert _results(report)["cpu"]["workers"] == 2


def test_doctor_warns_when_cpu_workers_oversubscribe_the_cores():
    import os

    cores = len(os.sched_getaffinity(0))
    rc, report = _doctor("--slots", "2", "--threads", str(cores))
    cpu = _results(report)["cpu"]
    assert rc == 0 and cpu["status"] == "warn" and "oversubscribe" in cpu["detail"]


def test_doctor_fails_with_the_reinstall_command_when_horovod_lacks_tensorflow():
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'fixtures' / 'no_tf_horovod'}:{ROOT}"}
    rc, report = _doctor(env=env)
    assert rc == 1 and report["ok"] is False
    horovod = _results(report)["horovod"]
    assert horovod["status"] == "error"
    assert "HOROVOD_WITH_TENSORFLOW=1" in horovod["detail"] and "pip install" in horovod["detail"]


def test_doctor_fails_when_a_host_is_not_reachable_over_ssh():
    with socket.socket() as s:  # a loopback port with nothing listening: ssh is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, report = _doctor("-H", "127.0.0.2:1", "--ssh-port", str(port))
    assert rc == 1
    assert _results(report)["ssh 127.0.0.2"]["status"] == "error"


TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV1\tSYS\tSYS\t0-19\t0
GPU1\tNV1\t X \tSYS\tSYS\t0-19\t0
GPU2\tSYS\tSYS\t X \tNV1\t20-39\t1
GPU3\tSYS\tSYS\tNV1\t X \t20-39\t1
"""


def test_topology_groups_gpus_by_direct_links_and_flags_cross_socket_pairs():
    matrix = doctor.parse_topology(TOPO)
    assert matrix["GPU0"] == {"GPU1": "NV1", "GPU2": "SYS", "GPU3": "SYS"}
    assert doctor.group_by_fast_links(matrix) == [["GPU0", "GPU1"], ["GPU2", "GPU3"]]


def test_placement_log_parsing_reports_model_ops_left_on_the_cpu():
    log = ("Executing op MatMul in device /job:localhost/replica:0/task:0/device:GPU:0\n"
           "Executing op Unique in device /job:localhost/replica:0/task:0/device:CPU:0\n"
           "sequential/dense/MatMul/ReadVariableOp: (ReadVariableOp): /job:localhost/replica:0/task:0/device:CPU:0\n"
           "gradient_tape/Cumsum: (Cumsum): /job:localhost/replica:0/task:0/device:CPU:0\n")
    assert doctor.cpu_placed_ops(log) == ["Cumsum", "Unique"]


@pytest.mark.gpu
def test_doctor_on_a_gpu_host_pins_checks_nccl_and_placement():
    tf = pytest.importorskip("tensorflow")
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("no GPU on this machine")
    rc, report = _doctor()
    r = _results(report)
    assert r["gpus"]["status"] == "ok" and r["gpus"]["count"] >= 1
    assert "nccl" in r and "topology" in r
    assert r["placement"]["status"] in ("ok", "warn") and isinstance(r["placement"]["cpu_ops"], list)
