"""hvdtrain bench runs end to end at small sizes and writes well-formed output (timings are not
asserted: they belong to the benchmark, not to a test)."""
import json
import subprocess
from pathlib import Path

import pytest

from conftest import KERAS3, PYTHON, ROOT, job_env, run


def _bench(out, *flags):
    proc = run([PYTHON, "-m", "hvdtrain", "bench", "--out", str(out), "--workers", "1,2", "--model", "mlp",
                "--image-size", "8", "--batch-size", "16", "--steps", "3", "--max-bytes", str(64 << 10), *flags],
               timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout, json.loads((out / "bench.json").read_text())


def test_bench_reports_scaling_allreduce_and_keras_baseline_round_by_round(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "gloo,mpi", "--sections", "scaling,allreduce,baseline",
                       "--repeats", "2")
    rows = res["scaling"]["rows"]
    assert [(r["controller"], r["workers"]) for r in rows] == [("gloo", 1), ("gloo", 2), ("mpi", 1), ("mpi", 2)]
    for r in rows:
        assert len(r["samples_per_sec_runs"]) == 2 and r["samples_per_sec_total"] > 0
        assert len(r["efficiency_runs"]) == 2 and r["efficiency"] > 0
    by_controller = {run["controller"]: run for run in res["allreduce"]}
    assert set(by_controller) == {"gloo", "mpi"}
    sizes = [r["bytes"] for r in by_controller["mpi"]["rows"]]
    assert sizes == [4096, 16384, 65536]
    mpi_row = by_controller["mpi"]["rows"][-1]
    assert mpi_row["horovod_busbw_GBps"] == mpi_row["horovod_algbw_GBps"]  # 2(n-1)/n = 1 at n = 2
    assert mpi_row["mpi4py_busbw_GBps"] > 0 and "mpi4py_s" not in by_controller["gloo"]["rows"][0]
    # the limit at 2 workers: one worker's step against the model's gradient bytes over the bandwidth
    # measured at the nearest size (the MLP's 4-byte gradients: nearest to 64 KiB of the three)
    two = rows[3]
    assert res["scaling"]["gradient_bytes"] == 4 * (8 * 8 * 3 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10)
    assert two["allreduce_GBps"] == by_controller["mpi"]["rows"][-1]["horovod_algbw_GBps"]
    assert 0 < two["limit_no_overlap"] < 1 and "limit" in text
    assert len(res["baseline"]["ratios"]) == 2 and res["baseline"]["ratio"] > 0
    assert (tmp_path / "scaling.png").stat().st_size > 1000
    assert "efficiency" in text and "plain Keras" in text
    progress = [l for l in text.splitlines() if l.startswith("bench: ")]  # one per measurement, as it lands
    assert len(progress) == 2 + 2 * 4 + 2, progress
    assert text.index("bench: scaling gloo 1 worker(s)") < text.index("== throughput")


def test_bench_measures_each_lever_alone_against_the_defaults_round_by_round(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "mpi", "--sections", "levers", "--steps", "1",
                       "--repeats", "2", "--lever-models", "mlp", "--levers", "bind-cores,spe-1,side-by-side")
    lv = res["levers"]
    assert lv["workers"] == 2 and lv["controller"] == "mpi"
    assert [r["lever"] for r in lv["rows"]] == ["defaults", "bind-cores", "spe-1", "side-by-side"]
    side = tmp_path / "levers-mlp-side-by-side-0"  # one timed worker, its copy trained beside it, then ended
    assert json.loads((side / "summary.json").read_text())["world_size"] == 1
    copy = (side / "copy-0.out").read_text()
    assert "hvdtrain: epoch 3/100000" in copy and not (side / "copy-0" / "summary.json").exists(), copy
    for r in lv["rows"]:
        assert r["model"] == "mlp" and len(r["samples_per_sec"]) == 2 and len(r["one_worker"]) == 2
        assert r["efficiency"] == [t / (2 * o) for t, o in zip(r["samples_per_sec"], r["one_worker"])]
    assert lv["rows"][0]["vs_defaults"] == [1.0, 1.0]
    assert "== levers at 2 workers" in text and "bench: levers mlp bind-cores" in text


@pytest.mark.stacks  # Keras 2's: run by the second stack's pass
@pytest.mark.skipif(KERAS3, reason="tf.distribute's strategies do not train Keras 3 models (tensorflow#72388)")
def test_sync_vs_async_runs_every_peer_and_writes_curves_table_and_plots(tmp_path):
    text, res = _bench(tmp_path, "--sections", "sync-vs-async", "--controllers", "gloo", "--study-tasks", "cnn",
                       "--study-workers", "2", "--study-seeds", "1", "--study-epochs", "2")
    runs = res["sync_vs_async"]["runs"]
    assert [r["peer"] for r in runs] == ["horovod", "mwms", "ps1", "ps2", "ps1-lrxN"]
    for r in runs:
        (curve,) = r["curves"]
        assert curve["samples"] == [1408, 2816]  # every peer: the same samples, 1438 // 64 batches of 64
        assert len(curve["seconds"]) == 2 and 0 < curve["seconds"][0] < curve["seconds"][1]
        assert all(0 <= a <= 1 for a in curve["val_accuracy"]) and all(l > 0 for l in curve["val_loss"])
        assert r["samples_per_sec"] > 0
        if r["peer"].startswith("ps"):  # every applied gradient counted once, with its staleness
            assert sum(r["staleness"]["histogram"]) == 2 * 44 and r["staleness"]["max"] >= 0
        else:
            assert r["staleness"] is None
    assert (tmp_path / "sync-vs-async-cnn-2w.png").stat().st_size > 10_000
    table = (tmp_path / "sync-vs-async.txt").read_text().splitlines()
    assert table[0].startswith("== sync vs async") and len(table) == 2 + 5
    assert "== sync vs async" in text and "ps1-lrxN" in text and "sync-vs-async-cnn-2w.png" in text


def test_bench_times_startup_on_a_users_own_files_against_the_tfrecord_source(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "gloo", "--sections", "startup", "--records", "4000",
                       "--repeats", "1")
    st = res["startup"]
    assert st["records"] == 4000 and st["workers"] == 2
    assert all(len(v) == 1 and v[0] > 0 for v in st["startup_s"].values()) and st["ratio"] > 0
    assert "bench: startup own_pipeline" in text and "== start-up, 4000 records" in text


def test_bench_compares_hvdtrain_with_horovods_recipe_by_hand_pair_by_pair(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "gloo", "--sections", "recipe", "--steps", "1",
                       "--repeats", "1", "--checkpoint-models", "mlp")
    r = res["recipe"]
    assert r["workers"] == 2 and r["controller"] == "gloo"
    (row,) = r["rows"]
    assert row["model"] == "mlp" and row["steps_per_epoch"] == 50
    assert all(len(v) == 1 and v[0] > 0 for v in row["samples_per_sec"].values())
    assert row["ratios"] == [row["samples_per_sec"]["hvdtrain"][0] / row["samples_per_sec"]["recipe"][0]]
    first = row["first_epoch_s"]
    assert all(len(v) == 1 and v[0] > 0 for v in first.values())
    assert row["first_epoch_ratios"] == [first["recipe"][0] / first["hvdtrain"][0]]
    assert "bench: recipe mlp 2 workers" in text and "== hvdtrain / Horovod's recipe by hand" in text
    assert "first epoch: recipe / hvdtrain" in text


def test_bench_prices_step_checkpoints_from_the_hook_and_the_save(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "gloo", "--sections", "checkpoint", "--steps", "1",
                       "--repeats", "1", "--checkpoint-models", "mlp")
    c = res["checkpoint"]
    assert c["every"] == 1000 and c["workers"] == 2 and 0 <= c["hook_s"] < 0.01
    (row,) = c["rows"]
    assert row["model"] == "mlp" and row["image_size"] == 8 and row["steps_per_epoch"] == 50
    assert len(row["on_off_ratios"]) == 1 and row["on_off_ratios"][0] > 0
    assert len(row["save_s"]) == 4 and all(s > 0 for s in row["save_s"])  # each run: 2 epoch ends
    assert row["cost_at_default"] == row["hook_cost"] + row["save_cost"]
    assert row["save_cost"] == row["save_s_median"] / 1000 / row["step_s"]
    assert "bench: checkpoint mlp hook on" in text and "== checkpoint every 1000 steps" in text


def test_bench_compares_this_stack_with_another_venvs_pair_by_pair(tmp_path):
    """--sections stacks: the same run on two venvs' stacks, interleaved (here the same venv twice:
    what the section does is under test, not the ratio)."""
    text, res = _bench(tmp_path, "--controllers", "gloo", "--sections", "stacks", "--steps", "1", "--repeats", "1",
                       "--checkpoint-models", "mlp", "--other-python", PYTHON)
    (row,) = res["stacks"]["rows"]
    assert row["model"] == "mlp" and len(row["ratios"]) == 1 and row["ratios"][0] > 0
    assert row["stacks"]["this"] == row["stacks"]["other"] and row["stacks"]["this"]["stack"] in ("keras2", "keras3")
    assert f"== {row['stacks']['this']['stack']} (TensorFlow" in text


def test_bench_prices_a_no_op_per_batch_callback_and_sigterm_handling_against_the_defaults(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "gloo", "--sections", "callbacks,preemption", "--steps", "1",
                       "--repeats", "1", "--checkpoint-models", "mlp")
    (pre,) = res["preemption"]["rows"]
    assert set(pre["samples_per_sec"]) == {"default", "off"} and pre["ratios_to_default"]["off"][0] > 0
    off = json.loads((tmp_path / "preemption-mlp-off-0" / "summary.json").read_text())
    assert off["config"]["preemption_signals"] == [] and "== SIGTERM handled / not" in text
    (row,) = res["callbacks"]["rows"]
    assert row["model"] == "mlp" and set(row["samples_per_sec"]) == {"default", "spe-1", "per-batch"}
    assert len(row["hook_alone"]) == 1 and row["ratios_to_default"]["per-batch"][0] > 0
    steps = {k: json.loads((tmp_path / f"callbacks-mlp-{k}-0" / "summary.json").read_text())["steps_per_execution"]
             for k in row["samples_per_sec"]}
    assert steps == {"default": 10, "spe-1": 1, "per-batch": 1}  # the callback brings 1 step per call
    assert "bench: callbacks mlp per-batch" in text and "== a no-op per-batch callback" in text


def test_bench_scale_reports_startup_broadcast_and_the_allreduce_against_the_ring_bound_per_rank_count(tmp_path):
    text, res = _bench(tmp_path, "--controllers", "gloo", "--sections", "scale", "--ranks", "2,4", "--repeats", "1")
    rows = {r["ranks"]: r for r in res["scale"]["rows"]}
    assert set(rows) == {2, 4} and res["scale"]["gradient_bytes"] > 0
    for n, r in rows.items():
        assert 0 < r["broadcast_s_median"] < r["startup_s_median"] and r["allreduce_s_median"] > 0
        s = json.loads((tmp_path / f"scale-gloo-{n}-0" / "summary.json").read_text())
        assert s["world_size"] == n and s["training_started_at"] > 0
    # the ring moves the bytes once at 2 ranks, 2(N-1)/N times at N: the bound at 4 is 1.5x the 2-rank time
    assert rows[2]["allreduce_over_ring_bound"] == pytest.approx(1.0)
    assert rows[4]["ring_bound_s"] == pytest.approx(1.5 * rows[2]["allreduce_s_median"])
    assert "== scale: mlp 8px" in text and "bench: scale gloo 4 ranks: start-up" in text


def test_an_installed_hvdtrain_runs_the_bench_without_the_repository(tmp_path):
    """`pip install .` (a wheel, not editable) into a fresh venv, run from elsewhere: the bench is part of
    the package, with its own user pipeline (the startup section), and nothing of examples/ or tests/.
    The venv sees this venv's TensorFlow and Horovod through a path file (after its own packages), not
    installs of its own: the wheel alone is under test."""
    import sysconfig

    import shutil

    wheels, venv, cwd, src = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere", tmp_path / "src"
    src.mkdir()  # what the build reads, copied: a build leaves build/ in the tree it builds
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "hvdtrain", src / "hvdtrain", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(src)], check=True, cwd=tmp_path, timeout=300)
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               stdout=subprocess.PIPE, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    (wheel,) = wheels.glob("hvdtrain-*.whl")
    subprocess.run([PYTHON, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--no-deps", "-q",
                    str(wheel)], check=True, timeout=300)
    cwd.mkdir()
    env = {k: v for k, v in job_env({"HVDTRAIN_BENCH_SMALL": "1"}).items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    where = subprocess.run([str(venv / "bin/python"), "-c", "import hvdtrain.bench.cli as m; print(m.__file__)"],
                           cwd=cwd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    assert where.startswith(str(site)), where
    proc = subprocess.run([str(venv / "bin/hvdtrain"), "bench", "--sections", "startup", "--workers", "1",
                           "--out", "b"], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    st = json.loads((cwd / "b" / "bench.json").read_text())["startup"]
    assert st["records"] == 400 and st["workers"] == 1 and "figures measure nothing" in proc.stdout
    run = json.loads((cwd / "b" / "startup-own_pipeline-0" / "summary.json").read_text())
    assert run["config"]["data"] == "hvdtrain.bench.own_records:dataset" and run["epochs_run"] == 1


def test_a_bench_command_that_a_section_would_refuse_is_refused_before_anything_runs(tmp_path):
    """A typo in --sections, an unknown lever, stacks without another venv: one line at once, not after
    the sections before it ran; HVDTRAIN_BENCH_DRY_RUN checks a command that way and runs nothing."""
    for flags, message in ((["--sections", "recipe,stack"], "unknown section(s) stack"),
                           (["--sections", "levers", "--levers", "fp8"], "unknown lever(s) fp8"),
                           (["--sections", "scaling,stacks"], "--sections stacks needs --other-python")):
        proc = run([PYTHON, "-m", "hvdtrain", "bench", *flags, "--out", str(tmp_path)], timeout=60)
        assert proc.returncode == 2 and f"hvdtrain: error: bench: {message}" in proc.stdout, proc.stdout[-2000:]
        assert not any(tmp_path.iterdir())
    proc = run([PYTHON, "-m", "hvdtrain", "bench", "--sections", "recipe,stacks", "--other-python", PYTHON,
                "--out", str(tmp_path / "b")], timeout=60, env={"HVDTRAIN_BENCH_DRY_RUN": "1"})
    assert proc.returncode == 0 and "valid for the sections recipe, stacks; nothing was run" in proc.stdout
    assert not (tmp_path / "b").exists()
