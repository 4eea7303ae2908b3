"""hvdtrain bench: every bench command of the README and docs/ runs as written, at small sizes
(HVDTRAIN_BENCH_SMALL), and each section it names reports what it measured, checked against the
command's own flags (bench.json keeps them); two rounds of the sections that pair figures round by
round; the bench from an installed wheel; a command refused before anything runs. Timings are not
asserted: they belong to the benchmark, not to a test."""
import hashlib
import importlib.util
import json
import re
import statistics
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobs import KERAS3, PYTHON, ROOT, job_env, run
from doc_commands import all_commands, is_bench, shell, small
from hvdtrain.bench import cli, launch, sections

# Not run alone: at HVDTRAIN_BENCH_SMALL's sizes the figures measure nothing (the report says so), and
# what the tests check is what each section reports, not its figures.

THIS_STACK = "keras3" if KERAS3 else "keras2"
MLP_STEPS = sections.MODEL_SIZES["mlp"][1]  # the MLP's epoch in the sections that compare whole runs, x --steps


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _controller(a) -> str:  # the sections that compare at a fixed set-up run MPI's where it is asked for
    return launch.controller(SimpleNamespace(controllers=a["controllers"]))


def _plotted(png: Path, text: str):
    """Drawn where matplotlib is installed (the keras2 stack's venv, and the installed wheel's test), and
    said otherwise: the plots are an extra."""
    if importlib.util.find_spec("matplotlib"):
        assert png.stat().st_size > 1000 and png.name in text
    else:
        assert not png.exists() and "bench: no plots: matplotlib is not installed here" in text


def _median(values):
    return pytest.approx(statistics.median(values))


# ---------------------------------------------------------------- what each section reports

def allreduce(res, text, out):
    a, n = res["args"], max(res["args"]["workers"])
    sizes = list(sections.allreduce_sizes(a["min_bytes"], a["max_bytes"]))
    assert [r["controller"] for r in res["allreduce"]] == a["controllers"]
    for r in res["allreduce"]:
        assert r["workers"] == n and [row["bytes"] for row in r["rows"]] == sizes
        for row in r["rows"]:
            assert row["horovod_busbw_GBps"] == pytest.approx(2 * (n - 1) / n * row["horovod_algbw_GBps"])
            assert row["memcpy_busbw_GBps"] == row["memcpy_algbw_GBps"] > 0  # one pass: no bus factor
            # mpi4py beside Horovod under MPI's controller, where it shares MPI with Horovod; not under Gloo
            assert ("mpi4py_s" in row) == (r["controller"] == "mpi")
            assert row.get("mpi4py_busbw_GBps", 1) > 0
        assert f"== allreduce busbw GB/s ({n} workers, {r['controller']})" in text


def scaling(res, text, out):
    a, sc = res["args"], res["scaling"]
    rows = sc["rows"]
    assert [(r["controller"], r["workers"]) for r in rows] == [(c, n) for c in a["controllers"] for n in a["workers"]]
    assert a["model"] == "mlp" and sc["image_size"] == a["image_size"]  # the MLP: Flatten, Dense 128, 64, 10
    size = a["image_size"]
    assert sc["gradient_bytes"] == 4 * (size * size * 3 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10)
    for r in rows:
        one = next(o for o in rows if o["controller"] == r["controller"] and o["workers"] == 1)
        assert len(r["samples_per_sec_runs"]) == a["repeats"] and r["samples_per_sec_total"] == _median(r["samples_per_sec_runs"])
        # each round's efficiency against the same round's one worker
        assert r["efficiency_runs"] == [t / (r["workers"] * o) for t, o in zip(r["samples_per_sec_runs"], one["samples_per_sec_runs"])]
        assert r["efficiency"] == _median(r["efficiency_runs"]) and r["efficiency"] > 0
        assert f"bench: scaling {r['controller']} {r['workers']} worker(s)" in text
        if r["workers"] > 1 and "allreduce" in res:
            # the limit: one worker's step against the gradient bytes over the bandwidth measured at the size
            # nearest them (every size below the MLP's 134 KB: the largest)
            (measured,) = [m for m in res["allreduce"] if m["controller"] == r["controller"]]
            assert r["allreduce_GBps"] == measured["rows"][-1]["horovod_algbw_GBps"]
            assert r["compute_s"] == pytest.approx(a["batch_size"] / statistics.median(one["samples_per_sec_runs"]))
            assert r["allreduce_s"] == pytest.approx(sc["gradient_bytes"] / r["allreduce_GBps"] / 1e9)
            assert 0 < r["limit_no_overlap"] < 1
    _plotted(out / "scaling.png", text)
    assert "efficiency" in text and text.index("bench: scaling") < text.index("== throughput")


def baseline(res, text, out):
    b, a = res["baseline"], res["args"]
    assert len(b["hvdtrain_1_worker"]) == len(b["plain_keras_fit"]) == a["repeats"]
    assert b["ratios"] == [x / y for x, y in zip(b["hvdtrain_1_worker"], b["plain_keras_fit"])]
    assert b["ratio"] == _median(b["ratios"]) and b["ratio"] > 0 and "plain Keras" in text


def levers(res, text, out):
    a, lv = res["args"], res["levers"]
    n = max(a["workers"])
    assert lv["workers"] == n and lv["controller"] == _controller(a)
    names = a["levers"] or sections.LEVER_SETS["mlp"]  # the MLP's own set: the per-step overhead's levers
    names = names if "defaults" in names else ["defaults", *names]
    rows = lv["rows"]
    assert [(r["model"], r["lever"]) for r in rows] == [(m, name) for m in a["lever_models"] for name in names]
    for r in rows:
        defaults = next(d for d in rows if d["model"] == r["model"] and d["lever"] == "defaults")
        assert len(r["samples_per_sec"]) == len(r["one_worker"]) == a["repeats"]
        assert r["one_worker"] == defaults["one_worker"]  # one one-worker run per round, for every lever
        # each round's figure against the same round's one worker and the same round's defaults
        assert r["efficiency"] == [t / (n * o) for t, o in zip(r["samples_per_sec"], r["one_worker"])]
        assert r["vs_defaults"] == [t / d for t, d in zip(r["samples_per_sec"], defaults["samples_per_sec"])]
        assert f"bench: levers {r['model']} {r['lever']}" in text
    assert all(v == 1.0 for r in rows if r["lever"] == "defaults" for v in r["vs_defaults"])
    assert f"== levers at {n} workers" in text
    for rep in range(a["repeats"] if "side-by-side" in names else 0):
        # one timed worker, its copies trained beside it the whole time, then ended
        side = out / f"levers-mlp-side-by-side-{rep}"
        assert _summary(side)["world_size"] == 1
        copy = (side / "copy-0.out").read_text()
        assert "hvdtrain: epoch 3/100000" in copy and not (side / "copy-0" / "summary.json").exists(), copy


def _mlp_epoch(a) -> int:
    """The MLP's steps an epoch: --epoch-steps mlp=N (at most 11 at the smallest sizes), else its size x --steps."""
    return (a.get("epoch_steps") or {}).get("mlp") or MLP_STEPS * a["steps"]


def recipe(res, text, out):
    a, r = res["args"], res["recipe"]
    assert r["workers"] == max(a["workers"]) and r["controller"] == _controller(a)
    assert [row["model"] for row in r["rows"]] == a["checkpoint_models"] == ["mlp"]
    for row in r["rows"]:
        assert row["steps_per_epoch"] == _mlp_epoch(a)
        runs, first = row["samples_per_sec"], row["first_epoch_s"]
        assert all(len(v) == a["repeats"] and min(v) > 0 for v in (*runs.values(), *first.values()))
        assert row["ratios"] == [x / y for x, y in zip(runs["hvdtrain"], runs["recipe"])]
        assert row["first_epoch_ratios"] == [y / x for x, y in zip(first["hvdtrain"], first["recipe"])]
        assert f"bench: recipe {row['model']} {r['workers']} workers" in text
    assert "== hvdtrain / Horovod's recipe by hand" in text and "first epoch: recipe / hvdtrain" in text


def startup(res, text, out):
    a, st = res["args"], res["startup"]
    assert st["records"] == a["records"] and st["workers"] == max(a["workers"])
    assert set(st["startup_s"]) == {"own_pipeline", "tfrecord"}
    assert all(len(v) == a["repeats"] and min(v) > 0 for v in st["startup_s"].values())
    assert st["ratio"] == pytest.approx(statistics.median(st["startup_s"]["own_pipeline"])
                                        / statistics.median(st["startup_s"]["tfrecord"]))
    run_dir = out / "startup-own_pipeline-0"  # the user's own pipeline, as hvdtrain ran it
    assert _summary(run_dir)["config"]["data"] == "hvdtrain.bench.own_records:dataset"
    assert "bench: startup own_pipeline" in text and f"== start-up, {a['records']} records" in text


def checkpoint(res, text, out):
    a, c = res["args"], res["checkpoint"]
    assert c["every"] == 1000 and c["workers"] == max(a["workers"]) and 0 <= c["hook_s"] < 0.01
    assert [row["model"] for row in c["rows"]] == a["checkpoint_models"] == ["mlp"]
    for row in c["rows"]:
        assert row["image_size"] == 8 and row["steps_per_epoch"] == _mlp_epoch(a)
        assert row["on_off_ratios"] == [x / y for x, y in zip(row["samples_per_sec"]["on"], row["samples_per_sec"]["off"])]
        assert len(row["on_off_ratios"]) == a["repeats"] and min(row["on_off_ratios"]) > 0
        assert len(row["save_s"]) == 2 * 2 * a["repeats"] and min(row["save_s"]) > 0  # each run: 2 epoch ends
        assert row["cost_at_default"] == row["hook_cost"] + row["save_cost"]
        assert row["save_cost"] == row["save_s_median"] / 1000 / row["step_s"]
    assert "bench: checkpoint mlp hook on" in text and "== checkpoint every 1000 steps" in text


def callbacks(res, text, out):
    a = res["args"]
    (row,) = res["callbacks"]["rows"]
    assert row["model"] == "mlp" and set(row["samples_per_sec"]) == {"default", "spe-1", "per-batch"}
    runs = row["samples_per_sec"]
    assert row["hook_alone"] == [x / y for x, y in zip(runs["per-batch"], runs["spe-1"])]
    assert len(row["hook_alone"]) == a["repeats"] and row["ratios_to_default"]["per-batch"][0] > 0
    steps = {k: _summary(out / f"callbacks-mlp-{k}-0")["steps_per_execution"] for k in runs}
    assert steps == {"default": 10, "spe-1": 1, "per-batch": 1}  # the callback brings 1 step per call
    assert "bench: callbacks mlp per-batch" in text and "== a no-op per-batch callback" in text


def preemption(res, text, out):
    a = res["args"]
    (row,) = res["preemption"]["rows"]
    runs = row["samples_per_sec"]
    assert set(runs) == {"default", "off"} and len(runs["off"]) == a["repeats"]
    assert row["ratios_to_default"]["off"] == [x / y for x, y in zip(runs["off"], runs["default"])]
    assert _summary(out / "preemption-mlp-off-0")["config"]["preemption_signals"] == []
    assert _summary(out / "preemption-mlp-default-0")["config"]["preemption_signals"]
    assert "== SIGTERM handled / not" in text


def stacks(res, text, out):
    """The docs name .venv-keras2's python; a fresh clone has it only after this stack's tests, and the
    command then runs with this venv's, twice (what the section does is under test, not the ratio)."""
    a = res["args"]
    other = "keras2" if a["other_python"].endswith(".venv-keras2/bin/python") else THIS_STACK
    for row in res["stacks"]["rows"]:
        assert row["model"] == "mlp" and len(row["ratios"]) == a["repeats"] and min(row["ratios"]) > 0
        assert row["ratios"] == [x / y for x, y in zip(row["samples_per_sec"]["this"], row["samples_per_sec"]["other"])]
        assert (row["stacks"]["this"]["stack"], row["stacks"]["other"]["stack"]) == (THIS_STACK, other)
        assert f"== {THIS_STACK} (TensorFlow" in text


def scale(res, text, out):
    a, sc = res["args"], res["scale"]
    rows = sc["rows"]
    assert [(r["controller"], r["ranks"]) for r in rows] == [(c, n) for c in a["controllers"] for n in a["ranks"]]
    assert sc["gradient_bytes"] > 0
    for r in rows:
        assert 0 < r["broadcast_s_median"] < r["startup_s_median"] and r["allreduce_s_median"] > 0
        s = _summary(out / f"scale-{r['controller']}-{r['ranks']}-0")
        assert s["world_size"] == r["ranks"] and s["training_started_at"] > 0
        # the ring moves the bytes once at 2 ranks, 2(N-1)/N times at N: the bound at N from the 2-rank time
        two = next(t for t in rows if t["controller"] == r["controller"] and t["ranks"] == 2)
        assert r["ring_bound_s"] == pytest.approx((2 * (r["ranks"] - 1) / r["ranks"]) * two["allreduce_s_median"])
        assert r["allreduce_over_ring_bound"] == pytest.approx(r["allreduce_s_median"] / r["ring_bound_s"])
        assert f"bench: scale {r['controller']} {r['ranks']} ranks: start-up" in text
    assert "== scale: mlp 8px" in text


def sync_vs_async(res, text, out):
    a = res["args"]
    if KERAS3:  # tf.distribute's strategies do not train Keras 3 models (tensorflow#72388)
        assert "sync_vs_async" not in res and "bench: sync-vs-async left out" in text
        return
    (task,), (n,) = a["study_tasks"], a["study_workers"]
    runs = res["sync_vs_async"]["runs"]
    assert [r["peer"] for r in runs] == ["horovod", "mwms", "ps1", "ps2", "ps1-lrxN"]
    epochs = range(1, a["study_epochs"] + 1)
    for r in runs:
        (curve,) = r["curves"]  # one seed
        assert curve["samples"] == [1408 * e for e in epochs]  # every peer: the same samples, whole global batches
        assert len(curve["seconds"]) == len(epochs) and 0 < curve["seconds"][0] < curve["seconds"][-1]
        assert all(0 <= v <= 1 for v in curve["val_accuracy"]) and all(v > 0 for v in curve["val_loss"])
        assert r["samples_per_sec"] > 0
        if r["peer"].startswith("ps"):  # every applied gradient counted once, with its staleness
            assert sum(r["staleness"]["histogram"]) == 44 * len(epochs) and r["staleness"]["max"] >= 0
        else:
            assert r["staleness"] is None
    _plotted(out / f"sync-vs-async-{task}-{n}w.png", text)
    table = (out / "sync-vs-async.txt").read_text().splitlines()
    assert table[0].startswith("== sync vs async") and len(table) == 2 + 5
    assert "ps1-lrxN" in text


def step(res, text, out):
    """Four runs a round, in order; each round's ratios and step parts from that round's own figures."""
    a, st = res["args"], res["step"]
    n = max(a["workers"])
    assert st["workers"] == n and st["controller"] == _controller(a) and st["batch_size_per_worker"] == a["batch_size"]
    assert [r["model"] for r in st["rows"]] == a["checkpoint_models"]
    for r in st["rows"]:
        runs, ms = r["samples_per_sec"], r["step_ms"]
        assert all(len(v) == a["repeats"] and all(x > 0 for x in v) for v in runs.values())
        for rep in range(a["repeats"]):
            assert _summary(out / f"step-{r['model']}-one-{rep}")["world_size"] == 1
            assert _summary(out / f"step-{r['model']}-{n}-{rep}")["world_size"] == n
        plain, one, side, many = (runs[k] for k in ("plain", "hvdtrain_1", "plain_side_by_side", "hvdtrain_n"))
        assert r["ratios"]["1_worker_vs_plain"] == [o / p for o, p in zip(one, plain)]
        assert r["ratios"]["n_workers_vs_1_worker"] == [m / o for m, o in zip(many, one)]
        step_of = lambda rate, k=1: 1000 * a["batch_size"] * k / rate  # noqa: E731
        assert ms["compute"] == pytest.approx([step_of(p) for p in plain])
        assert ms["allreduce"] == pytest.approx([step_of(m, n) - step_of(s, n) for m, s in zip(many, side)])
        for name, values in {**r["ratios"], **ms}.items():
            assert r["median"][name] == _median(values)
        assert f"bench: step {r['model']}: plain Keras" in text
    assert "== the step's cost" in text and "the allreduce" in text


CHECKS = {"allreduce": allreduce, "scaling": scaling, "baseline": baseline, "levers": levers, "recipe": recipe,
          "startup": startup, "checkpoint": checkpoint, "callbacks": callbacks, "preemption": preemption,
          "stacks": stacks, "scale": scale, "step": step, "sync-vs-async": sync_vs_async}


def _checked(out: Path, text: str, named: list) -> dict:
    """bench.json's results, every section the command named checked against the flags it ran with."""
    res = json.loads((out / "bench.json").read_text())
    ran = [s for s in named if not (KERAS3 and s == "sync-vs-async")]  # Keras 3: left out, with a line
    assert sorted(res["args"]["sections"]) == sorted(ran) and set(named) <= set(CHECKS)
    for section in named:
        CHECKS[section](res, text, out)
    return res


def _named(cmd: str) -> list:
    """The sections a command names; without --sections, every section but stacks, scale and step."""
    found = re.search(r"--sections (\S+)", cmd)
    return found.group(1).split(",") if found else [s for s in CHECKS if s not in cli.NOT_BY_DEFAULT]


# ---------------------------------------------------------------- the docs' commands, as written

WHERE = {}  # each bench command of the docs, with every place that writes it (the README repeats one)
for where, cmd in all_commands():
    if is_bench(cmd):
        WHERE.setdefault(cmd, []).append(where)
def _runs_again(cmd: str):
    """Another docs command that runs every section `cmd` names (or the same ones, later in the docs),
    with the same controller, which at HVDTRAIN_BENCH_SMALL's sizes (one round, the MLP, 2 workers) is
    the same run, or None: `cmd` is then checked as written by a dry run (every flag, as each section
    reads it), and not run twice."""
    def controller(c):
        found = re.search(r"--controllers (\S+)", c)
        return launch.controller(SimpleNamespace(controllers=found.group(1).split(",") if found else ["gloo", "mpi"]))

    order = list(WHERE)
    for other in order:
        mine, theirs = set(_named(cmd)), set(_named(other))
        later = order.index(other) > order.index(cmd)
        if other != cmd and (mine < theirs or mine == theirs and later) and controller(other) == controller(cmd):
            return other
    return None


def _id(cmd: str) -> str:
    """The pages that write a command, and a hash of the command: a line that moves on its page is the
    same test (tests/tiers.py records the full tier's tests by their ids)."""
    pages = dict.fromkeys(where.split(":")[0].split("/")[-1] for where in WHERE[cmd])
    return "+".join(pages) + "-" + hashlib.sha1(cmd.encode()).hexdigest()[:8]


def _tier(cmd: str) -> list:
    """The gate runs the command that runs the recipe section for real (hvdtrain against Horovod's own
    Keras recipe); the full tier the others."""
    return [] if "recipe" in _named(cmd) and _runs_again(cmd) is None else [pytest.mark.full]


DOCS = [pytest.param(cmd, id=_id(cmd), marks=([pytest.mark.stacks] if "sync-vs-async" in cmd else []) + _tier(cmd))
        for cmd in WHERE]


def test_the_docs_name_every_section_in_a_bench_command():
    named = {section for param in DOCS for section in _named(*param.values)}
    assert named == set(CHECKS) and len(DOCS) >= 9


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("cmd", DOCS)
def test_a_bench_command_of_the_docs_runs_as_written_and_each_section_reports_what_it_measured(cmd, tmp_path):
    """HVDTRAIN_BENCH_SMALL: every section the command names, at its smallest sizes (one round)."""
    ran = small(cmd, tmp_path, tmp_path / "my.yaml", tmp_path / "hostfile", tmp_path / "hosts.txt")
    assert ran.startswith("HVDTRAIN_BENCH_SMALL=1 ") and re.findall(r"--sections \S+", ran) == re.findall(r"--sections \S+", cmd)
    if _runs_again(cmd):
        proc = run(shell(ran), timeout=120, env={"HVDTRAIN_BENCH_DRY_RUN": "1"})
        assert proc.returncode == 0 and "nothing was run" in proc.stdout, f"{ran}\n{proc.stdout[-3000:]}"
        return
    proc = run(shell(ran), timeout=1100)
    assert proc.returncode == 0, f"{ran}\n{proc.stdout[-3000:]}"
    assert "these figures measure nothing" in proc.stdout
    _checked(tmp_path / "bench", proc.stdout, _named(cmd))


@pytest.mark.full
def test_each_round_is_kept_and_each_figure_is_paired_with_its_own_round(tmp_path):
    """Two rounds of the levers (the docs' commands run one at small sizes): each round's one worker and
    defaults against that round's levers; and the levers no docs command names for the MLP: its copies
    trained beside one worker, and MPI's core binding."""
    proc = run([PYTHON, "-m", "hvdtrain", "bench", "--out", str(tmp_path), "--workers", "1,2", "--controllers",
                "mpi", "--sections", "levers", "--steps", "1", "--repeats", "2", "--lever-models", "mlp",
                "--levers", "bind-cores,side-by-side"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    res = _checked(tmp_path, proc.stdout, ["levers"])
    assert res["args"]["repeats"] == 2 and [r["lever"] for r in res["levers"]["rows"]] == \
        ["defaults", "bind-cores", "side-by-side"]
    one = res["levers"]["rows"][0]["one_worker"]
    assert one[0] != one[1]  # each round measured its own one-worker run
    progress = [l for l in proc.stdout.splitlines() if l.startswith("bench: levers ")]  # one per measurement, as it lands
    assert len(progress) == 2 * 3, progress


# ---------------------------------------------------------------- installed, and refused

@pytest.mark.full
def test_an_installed_hvdtrain_runs_the_bench_without_the_repository(tmp_path):
    """`pip install .` (a wheel, not editable) into a fresh venv, run from elsewhere: the bench is part of
    the package, with its own user pipeline (the startup section), and nothing of examples/ or tests/;
    with matplotlib installed, it draws its plot.
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
    # the plots' extra, which this venv leaves out on Keras 3 (its own packages come first)
    subprocess.run([PYTHON, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q", "matplotlib>=3.6"],
                   check=True, timeout=300)
    cwd.mkdir()
    env = {k: v for k, v in job_env({"HVDTRAIN_BENCH_SMALL": "1"}).items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    where = subprocess.run([str(venv / "bin/python"), "-c", "import hvdtrain.bench.cli as m; print(m.__file__)"],
                           cwd=cwd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    assert where.startswith(str(site)), where
    proc = subprocess.run([str(venv / "bin/hvdtrain"), "bench", "--sections", "startup,scaling", "--workers", "1",
                           "--controllers", "gloo", "--out", "b"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (cwd / "b" / "scaling.png").stat().st_size > 1000 and "no plots" not in proc.stdout
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
    # without --sections: every section but stacks, scale and step, as docs/benchmarks.md says
    proc = run([PYTHON, "-m", "hvdtrain", "bench", "--workers", "1,2", "--out", str(tmp_path / "b")], timeout=60,
               env={"HVDTRAIN_BENCH_DRY_RUN": "1"})
    listed = re.search(r"valid for the sections (.*); nothing was run", proc.stdout)
    assert proc.returncode == 0 and listed, proc.stdout
    assert sorted(listed.group(1).split(", ")) == sorted(s for s in CHECKS if s not in ("stacks", "scale", "step"))
