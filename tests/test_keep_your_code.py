"""A user's code past fit(), kept as written: keras.io's GAN (its own compile, two optimizers, no
call()), Horovod's TF2 loop with hvdtrain's building blocks, Keras' mixed-precision guide (the policy
set before hvdtrain.init()), a cosine schedule and Keras' validation_split. Each script runs beside
itself in plain Keras (tests/workers/*_script.py), at 2 workers under horovodrun; what needs no second
process is checked in this one."""
import json
import os
import re
import signal

import numpy as np
import pytest

from jobs import ROOT, error_lines, launch, run_worker_script, start

LOOP = str(ROOT / "tests" / "workers" / "custom_loop_script.py")


def _weights_alike(out, ranks=2) -> bool:
    first, *others = [np.load(out / f"weights-{r}.npz") for r in range(ranks)]
    return all(all(np.array_equal(first[k], other[k]) for k in first) for other in others)


# ---------------------------------------------------------------- launched jobs

@pytest.mark.full(stack="second")
@pytest.mark.stacks
def test_the_keras_io_gan_with_its_own_compile_and_two_optimizers_trains_every_rank_alike(tmp_path):
    plain = run_worker_script(1, None, "gan_script.py", "plain", tmp_path / "plain")
    ours = run_worker_script(2, "gloo", "gan_script.py", "hvdtrain", tmp_path / "ours", timeout=200)
    assert _weights_alike(tmp_path / "ours")  # both optimizers averaged their gradients
    assert ours["d_steps"] == 4 * 20 == plain["d_steps"]  # 4 epochs of 1280 / 64: the step ran as written
    assert ours["optimizers"][0].endswith(plain["optimizers"][0])  # its own class, under our wrapper
    assert all(np.isfinite(ours["d_loss"] + ours["g_loss"]))
    assert abs(ours["d_loss"][-1] - plain["d_loss"][-1]) < 0.15, (ours, plain)
    assert (tmp_path / "ours" / "runs" / "model.weights.h5").is_file()  # saved, though it has no call()


@pytest.mark.full
@pytest.mark.stacks
def test_a_gan_whose_optimizers_hvdtrain_cannot_find_is_refused_in_one_line_before_its_first_update(tmp_path):
    proc = launch(2, "gloo", [str(ROOT / "tests" / "workers" / "gan_script.py"), "hidden", str(tmp_path)],
                  timeout=200)
    assert proc.returncode != 0
    errors = error_lines(proc.stdout)
    assert errors and "training step applies gradients through an optimizer hvdtrain did not find (Adam)" in errors[0], proc.stdout[-3000:]
    assert "(optimizer (RMSprop))" in errors[0]  # what it found
    assert "epoch 1/4" not in proc.stdout and "checkpoint /" not in proc.stdout  # refused as its step was traced
    assert not (tmp_path / "runs" / "summary.json").exists()


@pytest.mark.full
@pytest.mark.stacks
def test_horovods_tf2_loop_with_hvdtrains_building_blocks_trains_two_ranks_alike_as_well_as_one(tmp_path):
    one = run_worker_script(1, None, "custom_loop_script.py", tmp_path / "one")
    two = run_worker_script(2, "gloo", "custom_loop_script.py", tmp_path / "two", timeout=200)
    assert (one["workers"], one["steps"], two["workers"], two["steps"]) == (1, 600, 2, 300)
    assert _weights_alike(tmp_path / "two")
    assert two["accuracy"] > one["accuracy"] - 0.03 and one["accuracy"] > 0.85, (one, two)
    assert (tmp_path / "two" / "checkpoints" / "checkpoint").is_file()  # rank 0 saved it


def _loop_stepping(tmp_path, *init):
    """A long loop at 2 workers, returned once rank 0 has printed its 200th step (every rank is past
    broadcast, so the watch is on, and the step is traced): (the job, rank 1's pid, the output so far)."""
    proc = start(2, "gloo", [LOOP, str(tmp_path), "2000000", *init], start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Step #200" in line:
            return proc, int((tmp_path / "pid-1").read_text()), "".join(seen)
    pytest.fail("the loop never stepped:\n" + "".join(seen)[-3000:])


def _end_of(proc, timeout) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.full
def test_a_worker_frozen_in_a_loop_of_ones_own_is_named_and_every_rank_ends(tmp_path):
    proc, pid, before = _loop_stepping(tmp_path, json.dumps({"hang_frozen_seconds": 10}))
    os.kill(pid, signal.SIGSTOP)
    output = before + _end_of(proc, timeout=90)
    assert proc.returncode != 0
    assert "rank 1 on " in output and f"(pid {pid}) has not answered for" in output, output[-3000:]
    assert "your script starts again from what it saved" in output


@pytest.mark.full
def test_a_worker_killed_in_a_loop_of_ones_own_is_named_and_the_job_ends(tmp_path):
    """horovodrun names the dead rank and ends the others at once; a survivor that gets to its failed
    step first names every worker too (a race with horovodrun's SIGTERM that it wins most times)."""
    proc, pid, before = _loop_stepping(tmp_path)
    os.kill(pid, signal.SIGKILL)
    output = before + _end_of(proc, timeout=90)
    assert proc.returncode != 0
    assert "Process name: 1\nExit code: 137" in output, output[-3000:]
    if "lost its peers during training" in output:
        assert re.search(r"lost its peers during training .*Workers were: rank 0 on \S+ \(pid \d+\), rank 1 on",
                         output), output[-3000:]


@pytest.mark.full
@pytest.mark.stacks
def test_a_cosine_schedule_counts_one_workers_steps_and_validation_split_holds_out_the_last_tenth(tmp_path):
    plain = run_worker_script(1, None, "convnet_script.py", "plain", tmp_path / "plain")
    ours = run_worker_script(2, "gloo", "convnet_script.py", "hvdtrain", tmp_path / "ours", timeout=200)
    # the rule: the schedule at the step one worker would be at, times 2 workers; plain Keras ends at 0
    assert plain["rates"][-1] < 1e-6
    for mine, theirs in zip(ours["rates"], plain["rates"], strict=True):
        assert abs(mine / 2 - theirs) < 0.05 * 3e-3, (ours["rates"], plain["rates"])
    # the same 160 validation samples as Keras': the last tenth, so the metrics compare
    summary = json.loads((tmp_path / "ours" / "runs" / "summary.json").read_text())
    assert summary["data"]["samples"] == 1440
    assert abs(ours["val_accuracy"][-1] - plain["val_accuracy"][-1]) < 0.08, (ours, plain)
    assert summary["optimizer"]["schedule"]["class_name"] == "CosineDecay"
    assert len(set(summary["weights_sha256_by_rank"])) == 1


@pytest.mark.full
@pytest.mark.stacks
def test_the_mixed_precision_guides_policy_set_before_init_is_kept_with_loss_scaling(tmp_path):
    plain = run_worker_script(1, None, "precision_script.py", "plain", tmp_path / "plain")
    ours = run_worker_script(2, "gloo", "precision_script.py", "hvdtrain", tmp_path / "ours", timeout=200)
    assert (ours["policy"], ours["dense_1"], ours["loss_scale_optimizer"]) == ("mixed_float16", "float16", True)
    assert (ours["policy"], ours["dense_1"], ours["loss_scale_optimizer"]) == \
           (plain["policy"], plain["dense_1"], plain["loss_scale_optimizer"])
    assert ours["summary"] == {"policy": "mixed_float16", "loss_scaling": True}
    summary = json.loads((tmp_path / "ours" / "runs" / "summary.json").read_text())
    assert len(set(summary["weights_sha256_by_rank"])) == 1  # the loss-scaled updates were averaged
    assert abs(ours["val_accuracy"][-1] - plain["val_accuracy"][-1]) < 0.08, (ours, plain)


# ---------------------------------------------------------------- in-process

@pytest.mark.stacks
@pytest.mark.parametrize("keyword", ["sample_weight", "initial_epoch", "validation_steps", "validation_freq",
                                     "validation_batch_size", "workers"])
def test_a_keras_fit_keyword_without_keras_meaning_here_is_refused_in_one_line(keyword):
    import hvdtrain

    with pytest.raises(hvdtrain.UserError) as e:
        hvdtrain.fit("mlp", "digits", **{keyword: 1})
    assert str(e.value).startswith(keyword) and "\n" not in str(e.value)


@pytest.mark.stacks
def test_validation_split_holds_out_the_last_fraction_as_keras_does_and_only_of_arrays():
    import tensorflow as tf

    import hvdtrain
    from hvdtrain.data import last_fraction

    x, y = np.arange(20).reshape(10, 2), np.arange(10)
    (xt, yt), (xv, yv) = last_fraction((x, y), 0.25)
    assert yt.tolist() == list(range(7)) and yv.tolist() == [7, 8, 9]  # Keras splits at floor(10 x 0.75)
    assert xv.tolist() == [[14, 15], [16, 17], [18, 19]]
    with pytest.raises(hvdtrain.UserError, match="arrays only"):
        hvdtrain.fit("mlp", tf.data.Dataset.from_tensor_slices((x, y)), validation_split=0.1)


def test_a_precision_flag_that_conflicts_with_the_scripts_policy_is_refused():
    import tensorflow as tf

    import hvdtrain
    from hvdtrain.train import set_precision

    before = tf.keras.mixed_precision.global_policy().name
    tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")  # the script's own, as Keras' guide sets it
    try:
        assert set_precision(None, for_one_fit=True) == "mixed_bfloat16"
        with pytest.raises(hvdtrain.UserError, match="the script set Keras' global policy mixed_bfloat16"):
            set_precision("float32", for_one_fit=True)
        assert tf.keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        tf.keras.mixed_precision.set_global_policy(before)


def test_a_schedule_under_n_workers_is_its_value_at_one_workers_step_scaled_after_the_warm_up():
    import dataclasses

    import tensorflow as tf

    from hvdtrain.config import Config
    from hvdtrain.optimizer import LearningRate

    schedule = tf.keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=400)
    rate = LearningRate(dataclasses.replace(Config(), warmup_epochs=1.0), 1e-2, schedule)
    rate.start(multiplier=4.0, epoch=0, step=0, steps_per_epoch=25, workers=4)  # an epoch: 100 one-worker steps
    at = lambda step: float(rate(tf.constant(step, tf.int64)))
    assert at(0) == pytest.approx(1e-2)  # the warm-up starts at the one-worker rate
    for step in (25, 50, 99, 100):  # after the warm-up: 4 x the schedule at 4 x the step
        assert at(step) == pytest.approx(4 * float(schedule(4 * step)), rel=1e-6)
    assert at(100) == pytest.approx(0.0, abs=1e-9)  # it ends where one worker's does


def test_the_building_blocks_of_a_loop_ask_for_init_first(monkeypatch):
    import hvdtrain
    from hvdtrain import runtime

    monkeypatch.setattr(runtime, "_world", runtime.World())  # as before hvdtrain.init()
    with pytest.raises(hvdtrain.UserError, match=r"call hvdtrain.init\(\) first"):
        hvdtrain.shard(None)


@pytest.mark.parametrize("drop", [False, True])
def test_a_batched_pipeline_is_counted_from_its_records_as_each_shard_batches_them(drop):
    import dataclasses

    import tensorflow as tf

    from hvdtrain.data.pipeline import records_under

    parsed = tf.Variable(0)

    def parse(x):
        parsed.assign_add(1)
        return x * 2

    ds = tf.data.Dataset.range(103).filter(lambda x: x >= 0).map(parse).shuffle(50).batch(10, drop_remainder=drop)
    countable = records_under(ds)
    assert countable.batch == 10 and countable.drop == drop
    for rank in (0, 1):
        theirs = int(ds.shard(2, rank).reduce(np.int64(0), lambda c, _: c + 1))
        parsed.assign(0)
        assert dataclasses.replace(countable, workers=2, rank=rank).count("range") == theirs
        assert int(parsed.numpy()) == 0  # the count ran no parse
