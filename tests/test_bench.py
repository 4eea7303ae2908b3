"""hvdtrain bench runs end to end at small sizes and writes well-formed output (timings are not
asserted: they belong to the benchmark, not to a test)."""
import json
import subprocess

from conftest import PYTHON, ROOT, job_env


def _bench(out, *flags):
    proc = subprocess.run([PYTHON, "-m", "hvdtrain", "bench", "--out", str(out), "--workers", "1,2",
                           "--model", "mlp", "--image-size", "8", "--batch-size", "16", "--steps", "3",
                           "--max-bytes", str(64 << 10), *flags],
                          cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout, json.loads((out / "bench.json").read_text())


def test_bench_reports_scaling_allreduce_and_keras_baseline(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "gloo,mpi", "--sections", "scaling,allreduce,baseline")
    rows = res["scaling"]["rows"]
    assert [(r["controller"], r["workers"]) for r in rows] == [("gloo", 1), ("gloo", 2), ("mpi", 1), ("mpi", 2)]
    for r in rows:
        assert r["samples_per_sec_total"] > 0 and len(r["samples_per_sec_per_worker"]) == r["workers"]
        assert r["efficiency"] > 0
    by_controller = {run["controller"]: run for run in res["allreduce"]}
    assert set(by_controller) == {"gloo", "mpi"}
    sizes = [r["bytes"] for r in by_controller["mpi"]["rows"]]
    assert sizes == [4096, 16384, 65536]
    mpi_row = by_controller["mpi"]["rows"][-1]
    assert mpi_row["horovod_busbw_GBps"] == mpi_row["horovod_algbw_GBps"]  # 2(n-1)/n = 1 at n = 2
    assert mpi_row["mpi4py_busbw_GBps"] > 0 and "mpi4py_s" not in by_controller["gloo"]["rows"][0]
    assert res["baseline"]["ratio"] > 0
    assert (tmp_path / "scaling.png").stat().st_size > 1000
    assert "efficiency" in text and "plain Keras" in text
    progress = [l for l in text.splitlines() if l.startswith("bench: ")]  # one per measurement, as it lands
    assert len(progress) == 4 + 2 + 1, progress
    assert text.index("bench: scaling gloo 1 worker(s)") < text.index("== throughput")


def test_bench_compares_horovod_with_tf_distribute_peers(tmp_path):
    _, res = _bench(tmp_path, "--controllers", "gloo", "--sections", "peers", "--peer-epochs", "1")
    for kind in ("horovod", "mwms", "ps"):
        assert res["peers"][kind].get("samples_per_sec", 0) > 0, res["peers"][kind]
        assert 0 <= res["peers"][kind]["val_accuracy"] <= 1


def test_bench_times_startup_on_a_users_own_files_against_the_tfrecord_source(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "gloo", "--sections", "startup", "--records", "4000",
                       "--repeats", "1")
    st = res["startup"]
    assert st["records"] == 4000 and st["workers"] == 2
    assert all(len(v) == 1 and v[0] > 0 for v in st["startup_s"].values()) and st["ratio"] > 0
    assert "bench: startup own_pipeline" in text and "== start-up, 4000 records" in text
