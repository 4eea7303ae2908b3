"""hvdtrain doctor: real checks on this host, one report per host under horovodrun."""
import json
import socket

import pytest

from jobs import KERAS3, ROOT, launch
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
    import tensorflow as tf

    assert r["stack"]["stack"] == ("keras3" if KERAS3 else "keras2") and r["stack"]["tensorflow"] == tf.__version__


@pytest.mark.full
def test_doctor_warns_that_every_mpirun_waits_for_a_munged_that_is_not_running():
    """Debian's PMIx tries munge whenever libmunge is installed; the doctor says so where no munged
    answers, unless PMIX_MCA_psec picks another module (as the tests' own environment does)."""
    import ctypes.util

    assert doctor.pmix_munge(True, False, None)[0]["detail"].endswith("export PMIX_MCA_psec=native (or start munged)")
    assert doctor.pmix_munge(True, True, None) == doctor.pmix_munge(False, False, None) == []
    assert doctor.pmix_munge(True, False, "native") == []
    waits = bool(ctypes.util.find_library("munge")) and not doctor.munged_answers()
    for psec, warned in (("", waits), ("native", False)):
        rc, report = _doctor(env={"PMIX_MCA_psec": psec})
        assert rc == 0 and ("pmix" in _results(report)) == warned, report


def test_hosts_of_one_job_on_different_stacks_are_one_error_naming_each():
    ours = doctor.stack()
    other = ({**ours, "stack": "keras2", "tensorflow": "2.15.1", "keras": "2.15.0", "detail": "keras2: ..."}
             if ours["stack"] != "keras2" else
             {**ours, "stack": "keras3", "tensorflow": "2.18.1", "keras": "3.15.1", "detail": "keras3: ..."})
    assert doctor.same_stack([{"host": "a", "results": [ours]}, {"host": "b", "results": [ours]}]) == []
    (error,) = doctor.same_stack([{"host": "a", "results": [ours]}, {"host": "b", "results": [other]}])
    assert error["status"] == doctor.ERROR and "a: keras" in error["detail"] and f"b: {other['stack']}" in error["detail"]


def test_doctor_under_horovodrun_reports_once_per_host_with_its_local_size():
    rc, report = _doctor(np_=2, launcher="gloo")
    assert rc == 0 and len(report["hosts"]) == 1
    assert _results(report)["cpu"]["workers"] == 2


@pytest.mark.full
def test_doctor_warns_when_cpu_workers_oversubscribe_the_cores():
    import os

    cores = len(os.sched_getaffinity(0))
    rc, report = _doctor("--slots", "2", "--threads", str(cores))
    cpu = _results(report)["cpu"]
    assert rc == 0 and cpu["status"] == "warn" and "oversubscribe" in cpu["detail"]


@pytest.mark.full
def test_doctor_fails_with_the_reinstall_command_when_horovod_lacks_tensorflow():
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'fixtures' / 'no_tf_horovod'}:{ROOT}"}
    rc, report = _doctor(env=env)
    assert rc == 1 and report["ok"] is False
    horovod = _results(report)["horovod"]
    assert horovod["status"] == "error"
    assert "HOROVOD_WITH_TENSORFLOW=1" in horovod["detail"] and "pip install" in horovod["detail"]


@pytest.mark.full
def test_doctor_fails_when_a_host_is_not_reachable_over_ssh():
    with socket.socket() as s:  # a loopback port with nothing listening: ssh is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, report = _doctor("-H", "127.0.0.2:1", "--ssh-port", str(port))
    assert rc == 1
    assert _results(report)["ssh 127.0.0.2"]["status"] == "error"


SHARED = ROOT.parent / "shared" / "fixtures" / "nvidia-smi"  # real nvidia-smi output, byte for byte
FIXTURES = ROOT / "tests" / "fixtures" / "nvidia-smi"  # multi-GPU layouts, written in that same format


def _topology(topo_file, p2p_file=None, local_size=1):
    p2p = p2p_file.read_text() if p2p_file else ""
    return doctor.topology_check(topo_file.read_text(), p2p, local_size)


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/fixtures not in this checkout")
def test_real_h100_topology_with_escape_codes_keeps_gpu0_and_reads_its_affinity():
    text = (SHARED / "h100-x1" / "topo-m.txt").read_text()
    assert "\x1b[4mGPU0" in text  # the real header is underlined
    topo = doctor.parse_topology(text)
    assert topo["links"] == {"GPU0": {}}
    assert topo["affinity"] == {"GPU0": {"cpus": "0-15", "numa": "0", "gpu_numa_id": "N/A"}}
    r = _topology(SHARED / "h100-x1" / "topo-m.txt", SHARED / "h100-x1" / "p2p-r.txt")
    assert r["status"] == "ok" and r["groups"] == [["GPU0"]] and r["binding"]["advice"] == ""
    assert doctor.parse_p2p((SHARED / "h100-x1" / "p2p-r.txt").read_text()) == {"GPU0": {}}


def test_pcie_box_without_peer_access_between_pairs_is_two_groups_with_a_warning_and_numa_binding():
    assert "\x1b[4m" in (FIXTURES / "pcie-x4-topo-m.txt").read_text()
    topo = doctor.parse_topology((FIXTURES / "pcie-x4-topo-m.txt").read_text())
    assert topo["links"]["GPU0"] == {"GPU1": "PIX", "GPU2": "SYS", "GPU3": "SYS"}
    assert topo["affinity"]["GPU3"] == {"cpus": "12-23,36-47", "numa": "1", "gpu_numa_id": "N/A"}
    r = _topology(FIXTURES / "pcie-x4-topo-m.txt", FIXTURES / "pcie-x4-p2p-r.txt", local_size=4)
    assert r["status"] == "warn"
    assert r["groups"] == [["GPU0", "GPU1"], ["GPU2", "GPU3"]]
    for pair in ("GPU0-GPU2 (SYS, no peer access)", "GPU1-GPU3 (SYS, no peer access)"):
        assert pair in r["detail"]
    assert "GPU0-GPU1" not in r["detail"]
    assert r["binding"]["numa_by_local_rank"] == ["0", "0", "1", "1"]
    assert "--map-by ppr:2:numa --bind-to numa" in r["detail"]


def test_nvlink_machine_with_nics_is_one_group_and_binds_four_ranks_per_numa_node():
    topo = doctor.parse_topology((FIXTURES / "nvlink-x8-topo-m.txt").read_text())
    assert set(topo["links"]) == {*(f"GPU{i}" for i in range(8)), "NIC0", "NIC1"}
    assert topo["links"]["GPU5"]["GPU0"] == "NV18" and topo["links"]["GPU5"]["NIC1"] == "PXB"
    assert set(topo["affinity"]) == {f"GPU{i}" for i in range(8)}  # NIC rows have no affinity
    r = _topology(FIXTURES / "nvlink-x8-topo-m.txt", local_size=8)
    assert r["status"] == "ok" and r["groups"] == [[f"GPU{i}" for i in range(8)]]
    assert "--map-by ppr:4:numa --bind-to numa" in r["detail"]
    # two workers use GPU0 and GPU1, both on NUMA node 0: nothing to bind
    assert _topology(FIXTURES / "nvlink-x8-topo-m.txt", local_size=2)["binding"]["advice"] == ""


def test_gpus_alternating_between_numa_nodes_get_per_rank_cpu_lists():
    affinity = {f"GPU{i}": {"cpus": f"{i % 2 * 8}-{i % 2 * 8 + 7}", "numa": str(i % 2), "gpu_numa_id": "N/A"}
                for i in range(4)}
    advice = doctor.numa_binding(affinity, 4)["advice"]
    assert "rankfile" in advice and "local rank 1: 8-15" in advice


@pytest.mark.parametrize("visible, local_rank, local_size, cvd, expect", [
    (1, 3, 4, "3", 0),                   # Slurm --gpus-per-task=1 / a per-rank wrapper chose it
    (1, 0, 1, None, 0),                  # one GPU per container
    (4, 2, 4, None, 2),                  # several visible: the local rank's
    (2, 1, 2, "2,3", 1),                 # CUDA_VISIBLE_DEVICES lists this host's share
    (0, 0, 2, None, None),               # no GPU: CPU threads
    (0, 0, 1, "", None),                 # CUDA_VISIBLE_DEVICES="" hides them
])
def test_each_worker_takes_the_gpu_its_scheduler_or_local_rank_gives_it(visible, local_rank, local_size, cvd,
                                                                        expect):
    from hvdtrain import runtime

    index, why = runtime.choose_gpu(visible, local_rank, local_size, cvd, "node7")
    assert index == expect, why
    if cvd == "2,3":
        assert "physical GPU 3" in why
    if cvd == "3":
        assert "CUDA_VISIBLE_DEVICES=3" in why


@pytest.mark.parametrize("visible, local_rank, local_size, cvd", [
    (2, 3, 4, None),                     # more local ranks than GPUs
    (1, 1, 2, None),                     # one unassigned GPU, two workers would share it
    (2, 2, 4, "0,1"),
])
def test_more_workers_than_gpus_is_an_error_naming_the_host_and_counts(visible, local_rank, local_size, cvd):
    from hvdtrain import runtime
    from hvdtrain.config import UserError

    with pytest.raises(UserError, match=f"host node7 runs {local_size} workers but this process sees "
                                        f"{visible} GPU"):
        runtime.choose_gpu(visible, local_rank, local_size, cvd, "node7")


PLACEMENT_SCRIPT = """
from hvdtrain import doctor
print("LOG-START")
print(doctor.placement_log())
"""


@pytest.mark.full
def test_placement_parser_reads_tensorflows_own_log_of_a_training_step(tmp_path):
    """The log comes from TensorFlow itself, through the doctor's own capture (on the CPU here; the
    same switch and capture the doctor uses with a GPU pinned)."""
    proc = launch(1, None, ["-c", PLACEMENT_SCRIPT], timeout=120)  # TF_CPP_MIN_LOG_LEVEL=2, as in a run
    assert proc.returncode == 0, proc.stdout[-2000:]
    log = proc.stdout.split("LOG-START", 1)[1]
    assert "device:CPU:0" in log
    on_cpu = doctor.cpu_placed_ops(log)
    assert {"MatMul", "BiasAdd"} <= set(on_cpu), on_cpu  # the model's own ops, all on the CPU here
    assert not {"ReadVariableOp", "Identity", "NoOp", "_Arg", "_Retval"} & set(on_cpu)
    # the same log with the model's ops on a GPU: only what stayed on the CPU is reported
    moved = "\n".join(l.replace("device:CPU:0", "device:GPU:0") if "MatMul" in l or "BiasAdd" in l else l
                       for l in log.splitlines())
    after = doctor.cpu_placed_ops(moved)
    assert "MatMul" not in after and "BiasAdd" not in after and set(after) < set(on_cpu)


@pytest.mark.full
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
