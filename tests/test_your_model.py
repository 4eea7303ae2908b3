"""Your own Keras model, trained as you compiled it: regression, binary, one-hot, keras.applications,
named inputs, your optimizer, your train_step, BatchNorm; at 2 workers under horovodrun and mpirun.
The models and data are written as users write them (tests/user_models.py, tests/user_data.py).

Most of them train in one job per launcher, one model after another (tests/workers/many_fits.py, as a
script calling hvdtrain.fit for each would), each in its own output dir that its test reads."""
import json

import numpy as np
import pytest

from jobs import KERAS3, ROOT, launch, run_worker_script, train

# The user model contract. The second stack's pass (marker `stacks`) runs the models of the one job
# (`fits`) and the checks in-process: what Keras 2 does otherwise is the model's step, not its size

# hvdtrain.fit's keys of each run, by launcher: one job each
RUNS = {
    "mpirun": {
        "xla": dict(model="user_models:xla_regression", data="user_data:diabetes", epochs=2),
        "regression": dict(model="user_models:regression", data="user_data:diabetes", epochs=30),
        "class-flag": dict(model="user_models:binary", data="user_data:breast_cancer", epochs=2, seed=3,
                           class_weight={0: 3, 1: 0.5}),
        "class-samples": dict(model="user_models:binary", data="user_data:breast_cancer_weighted", epochs=2, seed=3),
        "class-none": dict(model="user_models:binary", data="user_data:breast_cancer", epochs=2, seed=3),
        "one-hot": dict(model="user_models:mnist_convnet", data="user_data:digits_onehot", epochs=4),
        "sgd": dict(model="user_models:sgd_momentum", data="digits", epochs=2, steps_per_epoch=5),
        "sgd-adam": dict(model="user_models:sgd_momentum", data="digits", epochs=1, steps_per_epoch=5,
                         optimizer="adam"),
        "batchnorm": dict(model="user_models:small_bn_cnn", data="user_data:digits", epochs=2),
        "multi-label": dict(model="user_models:multi_label", data="user_data:digits_multi_label", epochs=8),
    },
    "gloo": {
        "binary": dict(model="user_models:binary", data="user_data:breast_cancer", epochs=6),
        "mobilenet-softmax": dict(model="user_models:mobilenet_softmax", data="user_data:digits_rgb32", epochs=2,
                                  steps_per_epoch=6),
        "mobilenet-logits": dict(model="user_models:mobilenet_logits", data="user_data:digits_rgb32", epochs=2,
                                 steps_per_epoch=6),
        "named-inputs": dict(model="user_models:structured", data="user_data:structured", epochs=25),
        "custom-step": dict(model="user_models:custom_train_step", data="user_data:digits", epochs=5),
        "two-heads": dict(model="user_models:two_heads", data="user_data:digits_two_heads", epochs=8),
        "text_vectorized": dict(model="user_models:text_vectorized", data="user_data:reviews", epochs=6, batch_size=16),
        "text_tf_idf": dict(model="user_models:text_tf_idf", data="user_data:reviews", epochs=6, batch_size=16),
    },
}


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Every run of RUNS, one job per launcher: {run: (its output dir, the job's output)}."""
    done = {}
    for launcher, runs in RUNS.items():
        base = tmp_path_factory.mktemp(f"fits-{launcher}")
        spec = {str(base / name): keys for name, keys in runs.items()}
        (base / "spec.json").write_text(json.dumps(spec))
        proc = launch(2, launcher, [str(ROOT / "tests" / "workers" / "many_fits.py"), str(base / "spec.json")],
                      timeout=1500)
        assert proc.returncode == 0, proc.stdout[-4000:]
        done.update({name: (base / name, proc.stdout) for name in runs})
    return done


def _summary(fits, name) -> dict:
    return json.loads((fits[name][0] / "summary.json").read_text())


def _saved(out):
    import tensorflow as tf

    return tf.keras.models.load_model(out / "model.keras")


def _val(name):
    import user_data

    _, val = getattr(user_data, name)()
    x, y = zip(*val.as_numpy_iterator())
    return np.stack(x), np.stack(y)


def _same_weights_on_every_rank(summary):
    return len(summary["weights_sha256_by_rank"]) == 2 and len(set(summary["weights_sha256_by_rank"])) == 1


@pytest.mark.full
@pytest.mark.stacks
def test_a_model_compiled_for_xla_trains_on_cpu_workers_with_xla_off_and_says_so(fits):
    s, out = _summary(fits, "xla"), fits["xla"][0]
    assert "compiled with jit_compile=True: XLA is off" in (out / "logs" / "rank0.log").read_text()
    assert s["model"]["loss"] == "mse (model.compile)" and _same_weights_on_every_rank(s)


@pytest.mark.full
def test_a_model_compiled_with_steps_per_execution_auto_trains_with_the_default_count_on_every_rank_and_says_so():
    """Keras' "auto" retunes the count on each process's own clock, so ranks would call back (a checkpoint
    inside an epoch gathers from all) at different steps; and Keras' compile leaves the tuner on."""
    res = run_worker_script(2, "gloo", "steps_per_execution_check.py")
    assert "compiled with steps_per_execution='auto': it trains with 10 steps per call" in res["log"]
    # on both stacks, though no count from 2 to 10 divides the epoch's 11 steps (its last call is shorter)
    assert res["ranks"] == [{"steps_per_execution": 10, "tuning": False}] * 2
    assert "per call, not 10" not in res["log"]


@pytest.mark.parametrize("flag, compiled, elastic, trains_with", [
    (None, None, False, 10), (None, None, True, 1), (None, 3, False, 3), (None, 1, False, 1), (5, 3, False, 5),
    (None, 3, True, 3)], ids=["default", "elastic", "compiled", "compiled-one", "flag-wins", "elastic-compiled"])
# Keras 3's compile writes its default, 1, which cannot be told from asking for 1: hvdtrain's default wins
@pytest.mark.stacks
def test_steps_per_execution_is_the_flag_else_the_users_compile_else_ten_or_one_under_elastic(
        flag, compiled, elastic, trains_with):
    import user_models
    from hvdtrain import config, models

    model = user_models.regression()
    if compiled:
        model.compile("adam", "mse", steps_per_execution=compiled)
    plan = models.compile_plan(model, config.Config(steps_per_execution=flag, elastic=elastic))
    if KERAS3 and compiled == 1 and not flag:
        trains_with = 1 if elastic else 10
    assert plan.steps_per_execution == trains_with
    # what model.compile keeps and saves (Keras 3 takes no None, and reads the count once per fit)
    assert plan.kwargs["steps_per_execution"] == (trains_with if KERAS3 else flag or compiled)


@pytest.mark.full
@pytest.mark.stacks
def test_a_model_whose_loss_keras_cannot_rebuild_is_saved_uncompiled_and_says_so(out):
    train(1, None, out, "--model", "user_models:lambda_loss", "--data", "user_data:diabetes", "--epochs", "1")
    assert "model.keras is saved without its compile state" in (out / "logs" / "rank0.log").read_text()
    assert getattr(_saved(out), "optimizer", None) is None  # Keras 3 has no attribute until compiled


@pytest.mark.full
@pytest.mark.stacks
def test_regression_on_diabetes_beats_predicting_the_mean(fits):
    s = _summary(fits, "regression")
    import user_data

    train_y = np.concatenate([y for _, y in user_data.diabetes()[0].batch(512).as_numpy_iterator()])
    _, val_y = _val("diabetes")
    mean_guess = float(np.mean((val_y - train_y.mean()) ** 2))
    assert s["model"]["loss"] == "mse (model.compile)" and set(s["metrics"]) >= {"mae", "val_mae"}
    assert s["metrics"]["val_loss"] < 0.7 * mean_guess, (s["metrics"], mean_guess)
    assert _same_weights_on_every_rank(s)


@pytest.mark.full
@pytest.mark.stacks
def test_binary_classifier_keeps_the_users_auc_combined_exactly_over_workers(fits):
    import tensorflow as tf

    s, out = _summary(fits, "binary"), fits["binary"][0]
    assert s["model"]["loss"] == "binary_crossentropy (model.compile)"
    assert s["metrics"]["val_auc"] > 0.95
    # The AUC of the whole validation set, not a mean of the two workers' AUCs: a 1-worker evaluation
    # of the saved model, loaded as compiled (loss, metrics, the user's Adam and its slots), agrees
    model = _saved(out)
    assert type(model.optimizer) is tf.keras.optimizers.Adam and model.optimizer.iterations.numpy() == 6 * s["steps_per_epoch"]
    assert model.optimizer.get_config()["learning_rate"] == pytest.approx(2e-3)  # as it ended: 1e-3 x 2 workers
    # trained 10 steps per call, hvdtrain's default; saved with the count the user compiled (none: Keras' 1)
    if KERAS3:  # on the epoch's 7 steps too (a call of 7); Keras 3 saves what it ran
        assert s["steps_per_execution"] == 10 and model.steps_per_execution == 10
    else:
        assert s["steps_per_execution"] == 10 and model.get_compile_config()["steps_per_execution"] is None
        assert int(model.steps_per_execution.numpy()) == 1
    x, y = _val("breast_cancer")
    one = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    assert one["auc"] == pytest.approx(s["metrics"]["val_auc"], abs=1e-6)
    assert one["loss"] == pytest.approx(s["metrics"]["val_loss"], rel=1e-5)


@pytest.mark.full
@pytest.mark.stacks
def test_class_weight_trains_exactly_as_the_same_weights_given_per_sample(fits):
    """keras.io's imbalanced classification passes fit(class_weight=...): class_weight trains as the
    data's own per-sample weights do, at 2 workers, and not as unweighted training."""
    assert _summary(fits, "class-flag")["config"]["class_weight"] == {"0": 3.0, "1": 0.5}
    weights = {run: _saved(fits[f"class-{run}"][0]).get_weights() for run in ("flag", "samples", "none")}

    def max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(weights[a], weights[b]))

    assert max_diff("flag", "samples") < 1e-6
    assert max_diff("flag", "none") > 1e-3


@pytest.mark.full
@pytest.mark.stacks
def test_one_hot_labels_train_with_categorical_crossentropy(fits):
    s = _summary(fits, "one-hot")
    assert s["model"]["loss"] == "categorical_crossentropy (model.compile)"
    assert s["metrics"]["val_accuracy"] > 0.9 and _same_weights_on_every_rank(s)


@pytest.mark.full
@pytest.mark.stacks
def test_keras_applications_softmax_head_trains_as_its_logits_variant_without_a_warning(fits):
    runs = {head: _summary(fits, f"mobilenet-{head}") for head in ("softmax", "logits")}
    output = fits["mobilenet-softmax"][1]  # the job's: no run in it had Keras' warning, which names it
    assert "from_logits" not in output, output[-3000:]
    assert runs["softmax"]["model"]["loss"] == "sparse categorical crossentropy on softmax output"
    assert runs["logits"]["model"]["loss"].startswith("sparse categorical crossentropy on logits")
    for k in ("loss", "accuracy", "val_accuracy"):
        assert runs["softmax"]["metrics"][k] == pytest.approx(runs["logits"]["metrics"][k], abs=1e-4), k


@pytest.mark.full
@pytest.mark.stacks
def test_named_inputs_are_fed_from_a_dict_of_features(fits):
    s = _summary(fits, "named-inputs")
    assert s["metrics"]["val_accuracy"] > 0.85 and _same_weights_on_every_rank(s)


@pytest.mark.full
@pytest.mark.stacks
def test_the_compiled_optimizer_runs_scaled_and_a_flag_that_replaces_it_says_so(fits):
    s = _summary(fits, "sgd")
    opt = s["optimizer"]
    assert (opt["class"], opt["source"], opt["config"]["momentum"]) == ("SGD", "model.compile", 0.9)
    assert opt["lr"] == pytest.approx(0.05) and opt["lr_scaled"] == pytest.approx(0.1)
    assert s["metrics"]["lr"] == pytest.approx(0.1)  # after the 1-epoch warm-up, what the steps ran with
    assert "--optimizer adam replaces the model's compiled SGD" in (fits["sgd-adam"][0] / "logs" / "rank0.log").read_text()
    assert _summary(fits, "sgd-adam")["optimizer"]["class"] == "Adam"


@pytest.mark.full
@pytest.mark.stacks
def test_a_custom_train_step_that_applies_its_own_gradients_keeps_every_rank_identical(fits):
    """Horovod's DistributedOptimizer allreduces in compute_gradients only: without hvdtrain's fix
    this train_step would update each rank with its own gradients."""
    s = _summary(fits, "custom-step")
    assert _same_weights_on_every_rank(s)
    assert s["metrics"]["val_accuracy"] > 0.85


@pytest.mark.full
@pytest.mark.stacks
def test_batchnorm_statistics_agree_across_ranks(fits):
    s = _summary(fits, "batchnorm")
    assert _same_weights_on_every_rank(s)  # moving mean and variance included


@pytest.mark.full
@pytest.mark.parametrize("builder", ["frozen_mobilenet", "fine_tuned_mobilenet"])
def test_what_a_pretrained_base_holds_that_no_step_changes_comes_back_bit_identical_at_three_workers(
        builder, tmp_path):
    """keras.io's transfer learning at 3 workers: all of a frozen base, and a fine-tuned base's BatchNorm
    statistics (called in inference mode), end exactly as built. Horovod's float32 average over 3
    ranks moved about a third of such values by one ulp at each epoch end; and a step checkpoint held
    one float64 copy of a frozen base per rank."""
    import user_models

    # the frozen base's step checkpoint is checked below; the fine-tuned base needs an epoch's end alone
    steps = ("--steps-per-epoch", "6", "--checkpoint-every-steps", "4", "--steps-per-execution", "2") \
        if builder == "frozen_mobilenet" else ("--steps-per-epoch", "2", "--checkpoint-every-steps", "0")
    s = train(3, "mpirun", tmp_path, "--model", f"user_models:{builder}", "--data", "user_data:digits_rgb32",
              "--epochs", "1", *steps, timeout=600)  # Keras 3 saves at a call's end: 2 divides 4
    assert len(s["weights_sha256_by_rank"]) == 3 and len(set(s["weights_sha256_by_rank"])) == 1
    built, trained = getattr(user_models, builder)().layers[1], _saved(tmp_path).layers[1]
    assert len(built.non_trainable_weights) >= 100  # 104 BatchNorm statistics, or the whole base
    # Keras 3 trains a base called with training=False in training mode once it is trainable (its
    # functional call passes fit's training=True down): plain Keras 3 moves those statistics too
    same = [before.name == after.name and np.array_equal(before.numpy(), after.numpy())
            for before, after in zip(built.non_trainable_weights, trained.non_trainable_weights)]
    assert not all(same) if KERAS3 and builder == "fine_tuned_mobilenet" else all(same)
    if builder == "frozen_mobilenet":
        size = {p.name.split(".")[0]: p.stat().st_size for p in (tmp_path / "checkpoints").glob("*.data-*")}
        step = [n for n in size if "-step-" in n]
        assert step and max(size[n] for n in step) < 1.2 * size["ckpt-1"], size


def test_a_step_checkpoint_that_held_frozen_layers_per_rank_still_resumes_each_ranks_statistics():
    """Step checkpoints written before frozen layers were left out of each rank's own state hold them
    too: a resume reads the statistics that train at their old place."""
    from tensorflow import keras

    from hvdtrain.checkpoint import Checkpoints, per_rank_variables
    from hvdtrain.config import Config

    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()])
    base.trainable = False
    model = keras.Sequential([keras.Input((4,)), base, keras.layers.BatchNormalization()])
    model.compile("adam", "mse")
    before = per_rank_variables(model, frozen=True)
    assert len(per_rank_variables(model)) == 2 < len(before)  # the head's moving mean and variance
    row = np.arange(sum(v.shape.num_elements() for v in before), dtype=np.float64)
    ckpts = Checkpoints(Config(), model)
    ckpts.ranks = row[None]
    ckpts.take_own_state()
    assert np.array_equal(np.concatenate([v.numpy().ravel() for v in before]), row)


def test_a_user_compiled_model_at_two_workers_equals_one_worker_with_twice_the_batch(tmp_path):
    common = ("--model", "user_models:plain_sgd", "--data", "user_data:digits", "--warmup-epochs", "0",
              "--epochs", "2", "--steps-per-epoch", "6", "--seed", "7")
    train(2, "gloo", tmp_path / "two", *common, "--batch-size", "16")  # the compiled lr, 0.05, x 2
    train(1, None, tmp_path / "one", *common, "--batch-size", "32", "--lr", "0.1")
    train(1, None, tmp_path / "unscaled", *common, "--batch-size", "32")
    weights = {run: _saved(tmp_path / run).get_weights() for run in ("two", "one", "unscaled")}

    def max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(weights[a], weights[b]))

    assert max_diff("two", "one") < 1e-5
    assert max_diff("two", "unscaled") > 1e-3  # the comparison can tell a different update apart


@pytest.mark.parametrize("launcher", ["gloo", pytest.param(None, marks=[pytest.mark.stacks, pytest.mark.full])])
def test_the_python_api_script_trains_under_horovodrun_and_plain_python(launcher, tmp_path):
    import json

    np_ = 2 if launcher else 1
    proc = launch(np_, launcher, [str(ROOT / "examples" / "train_script.py"), "3", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world_size"] == np_ and s["data"]["sharding"] == "yours"
    assert s["metrics"]["val_accuracy"] > 0.8
    assert f"validation accuracy {s['metrics']['val_accuracy']:.3f} with {np_} worker(s)" in proc.stdout
    assert (tmp_path / "checkpoints" / "checkpoint").exists() and (tmp_path / "model.keras").exists()


@pytest.mark.full
@pytest.mark.stacks
def test_several_outputs_keep_their_dict_losses_weights_and_metrics(fits):
    s = _summary(fits, "two-heads")
    m = s["metrics"]
    assert {"digit_loss", "odd_loss", "digit_accuracy", "odd_auc", "val_digit_accuracy", "val_odd_auc"} <= set(m)
    assert m["loss"] == pytest.approx(m["digit_loss"] + 0.5 * m["odd_loss"], rel=1e-3)  # the user's loss_weights
    assert m["val_digit_accuracy"] > 0.85 and m["val_odd_auc"] > 0.9, m
    assert _same_weights_on_every_rank(s)


@pytest.mark.full
@pytest.mark.stacks
def test_multi_label_targets_train_with_the_users_binary_crossentropy(fits):
    s = _summary(fits, "multi-label")
    assert s["model"]["loss"] == "binary_crossentropy (model.compile)"
    assert s["metrics"]["val_bin_acc"] > 0.85, s["metrics"]
    assert _same_weights_on_every_rank(s)


@pytest.mark.full
@pytest.mark.stacks
@pytest.mark.parametrize("model", ["text_vectorized", "text_tf_idf"])
def test_a_text_model_with_textvectorization_trains_with_rank0s_vocabulary_on_every_rank(fits, model):
    """keras.io's text classifiers: a lookup table is not a variable (the broadcast, BatchNorm averaging
    and checkpoints used to stop at it), each rank's adapt() may order ties differently, and in "tf_idf"
    mode the vocabulary comes with its IDF weights (Keras refuses it without them)."""
    s, out = _summary(fits, model), fits[model][0]
    assert _same_weights_on_every_rank(s)  # the vocabulary is among the weights
    assert s["metrics"]["val_accuracy"] > 0.9, s["metrics"]
    assert (out / "model.keras").is_file()


@pytest.mark.full
@pytest.mark.stacks
def test_runtime_settings_given_to_fit_after_init_are_refused_and_the_rest_apply(tmp_path):
    """hvd.init() reads the threads and Horovod's knobs once: fit(threads=...) after hvdtrain.init() says
    so in one line instead of dropping them; the same value, or a training setting, goes through."""
    script = (
        "import hvdtrain\n"
        "hvdtrain.init(threads=1)\n"
        "try:\n"
        f"    hvdtrain.fit('mlp', 'digits', epochs=1, threads=2, fusion_threshold_mb=8, output_dir={str(tmp_path / 'a')!r})\n"
        "except hvdtrain.UserError as e:\n"
        "    print('REFUSED', e)\n"
        f"s = hvdtrain.fit('mlp', 'digits', epochs=1, threads=1, seed=7, output_dir={str(tmp_path / 'b')!r}, verbose=0)\n"
        "print('TRAINED', s['config']['seed'])\n")
    proc = launch(1, None, ["-c", script])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert ("REFUSED hvdtrain.fit: threads=2, HOROVOD_FUSION_THRESHOLD=8388608 cannot apply: the runtime (hvd.init, "
            "this worker's threads, Horovod's knobs) started in hvdtrain.init(), or an earlier fit, without them; "
            "give runtime settings to hvdtrain.init()") in proc.stdout, proc.stdout[-3000:]
    assert "TRAINED 7" in proc.stdout and not (tmp_path / "a").exists()
