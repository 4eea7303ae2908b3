"""Real multi-process training: horovodrun (Gloo and MPI controllers), mpirun, and plain python."""
import re

import numpy as np
import pytest

from jobs import KERAS3, LAUNCHERS, PYTHON, run, run_worker_script, train

DIGITS_FAST = ("--model", "mlp", "--data", "digits", "--epochs", "2", "--steps-per-epoch", "5")
# on the second stack, one launcher: what differs between the Keras generations is not the launcher's
ON_BOTH_STACKS = [pytest.param(launcher, marks=[pytest.mark.stacks, pytest.mark.full]) if launcher == "gloo" else
                  pytest.param(launcher, marks=[] if launcher == "mpi" else [pytest.mark.full]) for launcher in LAUNCHERS]


@pytest.mark.parametrize("launcher", ON_BOTH_STACKS)
def test_every_rank_ends_with_identical_weights_under_the_measured_cpu_defaults(launcher, out):
    summary = train(2, launcher, out, *DIGITS_FAST)
    assert summary["world_size"] == 2
    hashes = summary["weights_sha256_by_rank"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert (out / "model.keras").is_file()
    # docs/benchmarks.md: Open MPI yields when idle, TensorFlow's BFC allocator and oneDNN kernels on
    # CPU, and Horovod's cycle at 5 ms under Gloo and 0.2 ms under MPI, said alike by every rank
    env = summary["runtime_env"]
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1" and env["TF_CPU_ALLOCATOR_USE_BFC"] == "true"
    assert env["OMPI_MCA_ess_singleton_isolated"] == "1"
    assert env["TF_ENABLE_ONEDNN_OPTS"] == "1"
    cycle = "5" if launcher == "gloo" else "0.2"
    assert env["HOROVOD_CYCLE_TIME"] == cycle
    said = [re.search(r"Horovod cycle .*", (out / "logs" / f"rank{r}.log").read_text()) for r in range(2)]
    assert said[0] and said[1] and said[0].group(0) == said[1].group(0)
    assert said[0].group(0).startswith(f"Horovod cycle {cycle} ms (hvdtrain's default for CPU workers under "
                                       f"{'Gloo' if launcher == 'gloo' else 'MPI'}; --cycle-time-ms)")


ORTED_CHILDREN = """
import psutil, hvdtrain
hvdtrain.init()
print("children:", sorted(p.name() for p in psutil.Process().children(recursive=True)))
"""


def test_a_worker_started_without_a_launcher_starts_no_mpi_daemon_unless_the_user_asks():
    """An Open MPI singleton's MPI_Init starts orted and waits for it (2.3 s of each plain `python -m
    hvdtrain`); hvdtrain isolates it, and a user's own setting wins."""
    for env, daemon in (({}, False), ({"OMPI_MCA_ess_singleton_isolated": "0"}, True)):
        proc = run([PYTHON, "-c", ORTED_CHILDREN], env=env, timeout=120)
        (line,) = [l for l in proc.stdout.splitlines() if l.startswith("children:")] or [proc.stdout[-3000:]]
        assert ("orted" in line) == daemon, line


@pytest.mark.full
def test_seed_zero_trains_like_any_other_seed(out):
    """TensorFlow's shuffle(seed=tensor) cannot be traced under the global seed 0; the data order
    is drawn statelessly instead, so --seed 0 works (it crashed at the first step)."""
    summary = train(1, None, out, *DIGITS_FAST, "--seed", "0")
    assert summary["config"]["seed"] == 0 and summary["epochs_run"] == 2


@pytest.mark.full(stack="second")
@pytest.mark.stacks
def test_two_workers_equal_one_worker_with_twice_the_batch(tmp_path):
    """Synchronous data parallelism is exact: same samples per step, gradients averaged, same update."""
    import tensorflow as tf

    common = ("--model", "mlp", "--data", "digits", "--optimizer", "sgd", "--warmup-epochs", "0",
              "--epochs", "2", "--steps-per-epoch", "6", "--seed", "7")
    train(2, "gloo", tmp_path / "two", *common, "--batch-size", "16", "--lr", "0.05")
    train(1, None, tmp_path / "one", *common, "--batch-size", "32", "--lr", "0.1")
    train(1, None, tmp_path / "unscaled", *common, "--batch-size", "32", "--lr", "0.05")
    weights = {run: tf.keras.models.load_model(tmp_path / run / "model.keras").get_weights()
               for run in ("two", "one", "unscaled")}

    def max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(weights[a], weights[b]))

    assert max_diff("two", "one") < 1e-5
    assert max_diff("two", "unscaled") > 1e-3  # the comparison can tell a different update apart


@pytest.mark.parametrize("launcher", [pytest.param("gloo", marks=[pytest.mark.stacks, pytest.mark.full]), "mpirun"])
def test_broadcast_gives_every_rank_rank0_initial_weights(launcher):
    r = run_worker_script(2, launcher, "broadcast_check.py")
    assert r["before"][0] != r["before"][1], "ranks should start different for this test to mean anything"
    assert r["after"] == [r["before"][0]] * 2


@pytest.mark.full
def test_digits_reaches_95_percent_validation_accuracy_at_two_workers(out):
    summary = train(2, "gloo", out, "--model", "mlp", "--data", "digits", "--epochs", "8")
    assert summary["metrics"]["val_accuracy"] >= 0.95, summary["metrics"]
    assert summary["samples_per_sec_total"] > 0
    assert len(summary["samples_per_sec_per_worker"]) == 2


@pytest.mark.full
def test_plain_python_trains_as_one_worker_with_no_allreduce_in_its_step(out):
    """One worker has no one to average with: its step applies its gradients as they are, and says so;
    Horovod's cycle is left at Horovod's default, as no allreduce waits for it."""
    summary = train(1, None, out, *DIGITS_FAST)
    assert summary["world_size"] == 1 and len(summary["weights_sha256_by_rank"]) == 1
    assert set(summary["metrics"]) >= {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert summary["config"]["model"] == "mlp"
    log = (out / "logs" / "rank0.log").read_text()
    assert "one worker: its gradients go to the update as they are, with no allreduce" in log
    assert "Horovod cycle 1 ms (Horovod's default)" in log and summary["runtime_env"].get("HOROVOD_CYCLE_TIME") is None


@pytest.fixture(scope="module")
def first_step():
    if KERAS3:
        pytest.skip("Keras 2's: Keras 3 builds the loss and metrics outside the step, and Horovod's "
                    "DistributedOptimizer, the peer of this comparison, does not run under Keras 3")
    return run_worker_script(2, "gloo", "first_step_check.py")


@pytest.mark.full
@pytest.mark.stacks  # Keras 2's: run by the second stack's pass
def test_the_first_step_is_traced_once_with_the_metrics_keras_itself_picks(first_step):
    """Keras builds the compiled loss and metrics inside the first step, which makes TensorFlow trace
    the whole step twice; hvdtrain builds them first, from the data's shapes, as Keras would."""
    assert first_step["size"] == 2
    for name, runs in first_step["models"].items():
        assert runs["hvdtrain"]["metrics"] == runs["keras"]["metrics"], name
        assert runs["keras"]["traces"] == 2, name  # what it costs in plain Keras
        assert runs["hvdtrain"]["traces"] == 1, name
    assert "accuracy:categorical_accuracy" in first_step["models"]["one_hot"]["hvdtrain"]["metrics"]
    assert "accuracy:binary_accuracy" in first_step["models"]["binary"]["hvdtrain"]["metrics"]


@pytest.mark.full
@pytest.mark.stacks
def test_horovods_gradient_allreduce_is_traced_without_autograph_into_horovods_own_ops(first_step):
    """Horovod's allreduce of the gradients, traced with AutoGraph on, converts Horovod's Python call by
    call (1.2 of the 2 s first epoch of a 2-worker cnn); hvdtrain traces it as written. It builds
    Horovod's ops for the 6 gradients, and for one tensor more (the preemption flag: preemption.py)
    as for each gradient; beyond them only the flag's and the hang watchdog's variable reads and writes."""
    for compression in ("none", "fp16"):
        horovod, ours = first_step["allreduce"][f"horovod-{compression}"], first_step["allreduce"][f"hvdtrain-{compression}"]
        assert horovod["autograph_converted"] > 0 and ours["autograph_converted"] == 0
        horovod, ours = horovod["ops"], ours["ops"]
        assert horovod["HorovodAllreduce"] == 6 and set(horovod) <= set(ours)
        more = {op: n - horovod.get(op, 0) for op, n in ours.items() if n != horovod.get(op, 0)}
        assert min(more.values()) > 0, more
        for op in ("HorovodAllreduce", "StatelessIf", "Cast"):  # what Horovod builds per tensor
            assert more.pop(op) == horovod[op] // 6, op
        assert set(more) <= {"Const", "Placeholder", "Identity", "NoOp",
                             "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp"}, more
