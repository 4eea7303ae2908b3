"""Each worker reads only its own shard: disjoint shards that cover the data, equal steps everywhere."""
import numpy as np
import pytest

from jobs import run_worker_script


def _ids_npz(path, n):
    x = np.arange(n, dtype=np.float32).reshape(n, 1)
    np.savez(path, x=x, y=np.zeros(n, np.int64), x_val=x[:2], y_val=np.zeros(2, np.int64))
    return f"npz:{path}"


def _ids_tfrecords(prefix, n, files):
    from hvdtrain.data import write_tfrecords

    write_tfrecords(np.arange(n, dtype=np.float32).reshape(n, 1), np.zeros(n, np.int64), str(prefix), files)
    return f"tfrecord:{prefix}-*.tfrecord"


def _assert_disjoint_cover(report, n):
    a, b = (set(ids) for ids in report["ids"])
    assert len(a) == len(report["ids"][0]) and len(b) == len(report["ids"][1])  # no repeats within a shard
    assert not a & b
    assert a | b == set(range(n))
    assert report["num_samples"] == n


def test_element_shards_are_disjoint_and_cover_the_data(tmp_path):
    report = run_worker_script(2, "gloo", "shard_check.py", _ids_npz(tmp_path / "d.npz", 64), 8)
    assert report["sharding"] == "element" and report["steps"] == [4, 4]
    _assert_disjoint_cover(report, 64)


def test_file_shards_are_disjoint_and_cover_the_data(tmp_path):
    report = run_worker_script(2, "mpirun", "shard_check.py", _ids_tfrecords(tmp_path / "t", 64, 4), 8)
    assert report["sharding"] == "file" and report["steps"] == [4, 4]
    _assert_disjoint_cover(report, 64)


@pytest.mark.full
def test_fewer_files_than_workers_falls_back_to_element_sharding(tmp_path):
    report = run_worker_script(2, "gloo", "shard_check.py", _ids_tfrecords(tmp_path / "t", 64, 1), 8)
    assert report["sharding"] == "element"
    _assert_disjoint_cover(report, 64)


@pytest.mark.full
@pytest.mark.parametrize("source", ["npz", "tfrecord"])
def test_uneven_split_gives_every_worker_the_same_number_of_steps(tmp_path, source):
    """70 samples over 2 workers in batches of 8: the smaller shard decides, for every rank."""
    data = (_ids_npz(tmp_path / "d.npz", 70) if source == "npz"
            else _ids_tfrecords(tmp_path / "t", 70, 3))  # files of 24, 23, 23: shards of 47 and 23
    report = run_worker_script(2, "gloo", "shard_check.py", data, 8)
    steps = report["steps"][0]
    assert report["steps"] == [steps, steps] and steps == (35 if source == "npz" else 23) // 8
    assert [len(ids) for ids in report["ids"]] == [steps * 8] * 2
    assert not set(report["ids"][0]) & set(report["ids"][1])
