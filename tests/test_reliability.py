"""When things go wrong: a worker dies or hangs, a checkpoint write is torn, input is hostile."""
import os
import re
import signal
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import KERAS3, launch, pid_of_rank, processes_of, start, train
from hvdtrain import config, hosts
from hvdtrain.config import UserError


LONG = ("--model", "mlp", "--data", "digits", "--epochs", "500", "--steps-per-epoch", "20", "--verbose", "0",
        "--no-tensorboard")


def _start(launcher, out, *extra):
    return start(2, launcher, ["-m", "hvdtrain", "--output-dir", str(out), *LONG, *extra], start_new_session=True)


@pytest.mark.parametrize("launcher", [pytest.param("gloo", marks=pytest.mark.full), "mpi",
                                      pytest.param("mpirun", marks=pytest.mark.full)])
def test_a_killed_worker_ends_the_whole_job_naming_it_and_leaves_no_process(launcher, tmp_path):
    proc = _start(launcher, tmp_path)
    try:
        os.kill(pid_of_rank(tmp_path, 1, proc), signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)  # within 60 s, or the test fails
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    if launcher == "gloo":  # horovodrun names the rank; a survivor names every rank's host, unless
        # horovodrun's SIGTERM (it ends the others as soon as one exits) reaches it first
        assert "Process name: 1\nExit code: 137" in output, output[-3000:]
        if "lost its peers" in output:
            assert re.search(r"lost its peers during training .*Workers were: rank 0 on \S+ \(pid \d+\), "
                             r"rank 1 on \S+", output), output[-3000:]
    else:  # OpenMPI names rank, host and signal itself
        assert re.search(r"process rank 1 with PID \d+ on node \S+ exited on signal 9", output), output[-3000:]
    assert processes_of(tmp_path, settle=2) == []


@pytest.mark.full
def test_a_hung_worker_is_named_by_horovods_stall_check_with_the_tensors_it_waits_on(tmp_path):
    """Rank 1 blocks in its forward pass (a worker stuck in I/O) from its 4th step. Under MPI, Horovod's
    stall check names it and the gradients rank 0 waits for, then shuts the job down. (Under Gloo,
    Horovod 0.28.1's stall check never reports: see docs/reliability.md.)"""
    t0 = time.monotonic()
    proc = launch(2, "mpi", ["-m", "hvdtrain", "--model", "userdata:hangs_on_rank_1", "--data", "userdata:blobs",
                             "--epochs", "3", "--verbose", "0", "--no-tensorboard", "--output-dir", str(tmp_path),
                             "--stall-check-seconds", "2", "--stall-shutdown-seconds", "6"], timeout=180)
    assert proc.returncode != 0
    out = re.sub(r"\[1,\d+\]<std(out|err)>:", "", proc.stdout)  # horovodrun --mpi prefixes every line
    # Keras 3: the gradients' own names (the layer's op), as Horovod's allreduce takes them
    grads = "HorovodAllreduce_gradient_tape_" if KERAS3 else "HorovodAllreduce_grads_0"
    assert re.search(r"Missing ranks:\n1: \[[^\]]*" + grads, out), out[-3000:]
    assert re.search(r"Missing ranks:\n1!: \[", out) and "stalled for longer than 6 seconds. Will shutdown" in out
    assert time.monotonic() - t0 < 150
    assert processes_of(tmp_path, settle=2) == []


# ---------------------------------------------------------------- checkpoints under fire

@pytest.mark.full
def test_a_torn_checkpoint_write_leaves_the_previous_checkpoint_as_the_latest(tmp_path):
    train(1, None, tmp_path, "--model", "mlp", "--data", "digits", "--epochs", "2", "--steps-per-epoch", "3")
    ckpts = tmp_path / "checkpoints"
    # rank 0 killed while writing ckpt-3: its data file is half there, the index never got updated
    (ckpts / "ckpt-3.data-00000-of-00001").write_bytes(os.urandom(1000))
    resumed = train(1, None, tmp_path, "--model", "mlp", "--data", "digits", "--epochs", "4",
                    "--steps-per-epoch", "3")
    assert resumed["first_epoch"] == 2 and resumed["epochs_run"] == 2


@pytest.mark.full
def test_rank0_killed_at_any_moment_leaves_a_loadable_checkpoint(tmp_path):
    import tensorflow as tf

    seen = set()
    for delay in (0.0, 0.7, 1.9):  # different moments of the epoch/checkpoint cycle
        proc = _start("gloo", tmp_path, "--checkpoint-every", "1")
        try:
            pid = pid_of_rank(tmp_path, 0, proc, seen=seen)
            seen.add(pid)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        latest = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
        assert latest and tf.train.load_checkpoint(latest).get_variable_to_shape_map()
    resumed = train(2, "gloo", tmp_path, *LONG[:4], "--epochs", str(int(latest.rsplit("-", 1)[1]) + 1),
                    "--steps-per-epoch", "20")
    assert resumed["first_epoch"] == int(latest.rsplit("-", 1)[1]) and resumed["epochs_run"] == 1


@pytest.mark.full
def test_a_corrupt_checkpoint_is_a_clear_error_and_is_left_as_it_was(tmp_path):
    train(1, None, tmp_path, "--model", "mlp", "--data", "digits", "--epochs", "1", "--steps-per-epoch", "2")
    data = tmp_path / "checkpoints" / "ckpt-1.data-00000-of-00001"
    data.write_bytes(b"\0" * 100)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    proc = launch(1, None, ["-m", "hvdtrain", "--output-dir", str(tmp_path), "--epochs", "2"], timeout=120)
    assert proc.returncode == 2
    assert "hvdtrain: error: cannot restore checkpoint" in proc.stdout and "Traceback" not in proc.stdout
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()} == before


# ---------------------------------------------------------------- hostile data

def _fails_with(tmp_path, data, message):
    proc = launch(1, None, ["-m", "hvdtrain", "--data", data, "--output-dir", str(tmp_path / "run")], timeout=120)
    assert proc.returncode == 2 and message in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.full
def test_a_truncated_tfrecord_is_a_clear_error(tmp_path):
    from hvdtrain.data import write_tfrecords

    (path,) = write_tfrecords(np.zeros((50, 4), np.float32), np.zeros(50, np.int64), str(tmp_path / "t"), 1)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 7)
    _fails_with(tmp_path, f"tfrecord:{path}", "cannot read TFRecords")


@pytest.mark.parametrize("y, message", [
    (np.arange(99), "x has 100 samples but y has 99"),
    (np.r_[np.zeros(99), -1], "labels must be >= 0, got -1"),
    (np.r_[np.zeros(99), 2.5], "labels must be class indices (integers), got e.g. [2.5]"),
], ids=["length-mismatch", "negative-label", "fractional-label"])
@pytest.mark.full
def test_bad_npz_arrays_are_clear_errors(tmp_path, y, message):
    np.savez(tmp_path / "d.npz", x=np.zeros((100, 4), np.float32), y=y)
    _fails_with(tmp_path, f"npz:{tmp_path / 'd.npz'}", message)


# ---------------------------------------------------------------- hostile config and host lists

VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=20), st.lists(st.integers(-3, 100), max_size=4))
KEYS = st.one_of(st.sampled_from([f.replace("_", "-") for f in config.Config.__dataclass_fields__]),
                 st.text(max_size=12))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, VALUES, max_size=6))
def test_any_config_mapping_parses_or_gets_a_clear_error(values):
    values.pop("config", None)
    try:
        config.from_dict(values).validate()
    except UserError as e:
        assert str(e) and "\n" not in str(e)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_host_list_parses_or_gets_a_clear_error(spec):
    try:
        entries = hosts.parse_spec(spec)
        assert all(isinstance(h, str) and n >= 1 for h, n in entries)
        assert len({h for h, _ in entries}) == len(entries)
    except UserError as e:
        assert str(e)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30), max_size=6))
def test_any_hostfile_parses_or_gets_one_error_per_bad_line(tmp_path, lines):
    path = tmp_path / "hostfile"
    path.write_text("\n".join(l.replace("\n", " ").replace("\r", " ") for l in lines))
    try:
        assert all(n >= 1 for _, n in hosts.parse_hostfile(str(path)))
    except UserError as e:
        for line in str(e).splitlines():
            assert line.startswith(str(path))


def test_hostfile_errors_name_each_bad_line(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=2\nnode2 slots=zero\n# a comment\nnode1 slots=4\nbad host line\n")
    with pytest.raises(UserError) as e:
        hosts.parse_hostfile(str(path))
    assert str(e.value).splitlines() == [
        f"{path}:2: slots must be a positive integer, got 'zero'",
        f"{path}:4: host 'node1' is listed twice; give it one line with all its slots",
        f"{path}:5: 'bad host line': expected 'host slots=N'",
    ]
