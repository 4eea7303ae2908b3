"""Bad input: one clear line from rank 0 and a non-zero exit of the whole job within seconds."""
import re

import pytest

from jobs import error_lines, KERAS3, launch, ROOT



def worker_tracebacks(output: str) -> list:
    """Tracebacks printed by hvdtrain's workers. horovodrun prefixes worker lines with [rank]<stderr>:
    and, on any non-zero exit, prints its own traceback as a launcher: that one is not ours."""
    return [l for l in output.splitlines()
            if re.match(r"^(\[[\d,]+\]<std(err|out)>:)?Traceback", l) and not l.startswith("Traceback")
            or f'File "{ROOT / "hvdtrain"}' in l]

CASES = {
    "unknown model": (["--model", "vgg99"], "unknown model 'vgg99'"),
    "unknown data source": (["--data", "imagenet"], "unknown data source 'imagenet'"),
    "missing npz": (["--data", "npz:/nonexistent/d.npz"], "'npz:/nonexistent/d.npz': no such file"),
    "missing tfrecords": (["--data", "tfrecord:/nonexistent/*.tfrecord"], "no files match"),
    "malformed yaml": (["--config", "{bad_yaml}"], "malformed YAML at line 3"),
    "missing yaml": (["--config", "/nonexistent.yaml"], "/nonexistent.yaml: no such file"),
    "unknown config key": (["--config", "{unknown_key}"], "unknown config key 'learning_rate'"),
    "unknown flag": (["--learning-rate", "1"], "unrecognized arguments: --learning-rate"),
    "zero batch size": (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    "negative epochs": (["--epochs", "-1"], "--epochs must be a positive integer, got -1"),
    "zero learning rate": (["--lr", "0"], "--lr must be positive, got 0.0"),
    "data smaller than one global batch": (["--data", "digits", "--batch-size", "1000"],
                                           "is fewer than workers x batch size"),
    "XLA on CPU workers": (["--model", "mlp", "--jit-compile"],
                           "--jit-compile: XLA cannot compile Horovod's allreduce on CPU workers"),
    "model module that does not import": (["--model", "no_such_pkg.models:build"],
                                          "cannot import module 'no_such_pkg.models'"),
    "data function that does not exist": (["--data", "json:no_such_function"],
                                          "module 'json' has no function 'no_such_function'"),
    # Keras' own error, not the "'outputs' must be defined before the loop" that several steps per
    # call wrap it in
    "a compiled loss and data without targets": (["--model", "user_models:regression", "--data",
                                                  "user_data:diabetes_features_only"],
                                                 "Target data is missing: the data give inputs only, and the "
                                                 "model was compiled with loss=mse; return (x, y) pairs"),
    # a Keras layer's own message, not the arguments of the call that Keras lists after it
    "raw text into a numeric model": (["--model", "user_models:regression", "--data", "user_data:reviews"],
                                      "step 1: ValueError: Invalid input shape for input Tensor" if KERAS3 else
                                      'step 1: ValueError: Input 0 of layer "dense" is incompatible with the '
                                      'layer: expected min_ndim=2, found ndim=1'),
    # the user's function declares num_classes: not "the built-in models classify"
    "a model function taking num_classes over float targets": (
        ["--model", "user_models:regression_with_classes", "--data", "user_data:diabetes"],
        "--model user_models:regression_with_classes takes num_classes, which hvdtrain counts in the labels, but "
        "y is float32 (regression targets?): drop num_classes from the function's parameters, or give it with "
        "--num-classes N"),
    # plain Keras' words, at the step it fails, whichever op of the step met the label first (a gradient's
    # segment sum did, in some runs: "segment_ids[29] = 96 is out of range [0, 96)")
    "labels beyond the model's classes": (["--model", "user_models:three_class_head", "--data", "digits"],
                                          "at epoch 1, step 1: InvalidArgumentError: Received a label value of "),
    # it is evaluate that fails, after the first epoch trained: not "epoch 2, step 1"
    "validation data of another shape": (["--model", "user_models:regression", "--data",
                                          "user_data:diabetes_val_of_8_features"],
                                         "validation failed on rank 0 after epoch 1: ValueError: Input 0 with name "
                                         "'None' of layer 'dense' is incompatible with the layer: expected axis -1 "
                                         "of input shape to have value 10, but received input with shape (None, 8)"
                                         if KERAS3 else
                                         'validation failed on rank 0 after epoch 1: ValueError: Input 0 of layer '
                                         '"diabetes_regressor" is incompatible with the layer: expected '
                                         'shape=(None, 10), found shape=(None, 8)'),
}


@pytest.fixture
def yaml_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: mlp\nepochs: [1\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model: mlp\nlearning_rate: 0.1\n")
    return {"bad_yaml": str(bad), "unknown_key": str(unknown)}


# Keras' own messages, which differ between the generations: run on both stacks
KERAS_SAYS = ("a compiled loss and data without targets", "raw text into a numeric model",
              "validation data of another shape", "labels beyond the model's classes")


# plain `python -m hvdtrain` (one worker, no launcher) for the cases whose check runs after TensorFlow's
# start, where a traceback could slip out; the checks of flags and files are the same code at any size
ALSO_ALONE = ("unknown model", "malformed yaml", "data smaller than one global batch", "XLA on CPU workers",
              *KERAS_SAYS)


# the gate's case: a mistake met inside the traced step, said once by rank 0 (tests/tiers.py)
GATE_CASE = "labels beyond the model's classes"


@pytest.mark.parametrize("case,np_,launcher", [
    pytest.param(c, np_, launcher, id=f"{c}-{np_}-worker{'s' if np_ > 1 else ''}",
                 marks=([pytest.mark.stacks] if c in KERAS_SAYS and np_ == 2 else []) + [
                     pytest.mark.full(stack="second") if (c, np_) == (GATE_CASE, 2) else pytest.mark.full])
    for c in CASES for np_, launcher in ((1, None), (2, "gloo")) if np_ == 2 or c in ALSO_ALONE])
def test_bad_input_fails_fast_with_one_clear_line(case, np_, launcher, yaml_files, tmp_path):
    flags, message = CASES[case]
    flags = [f.format(**yaml_files) for f in flags]
    if case == "data smaller than one global batch" and np_ == 1:
        flags = ["--data", "digits", "--batch-size", "2000"]
    # a hang would run into the timeout and fail the test. Text into a numeric model: the step fails with
    # Keras' own words, after Keras 2's loss and metrics could not be built on zeros shaped as the data
    expected = {"HVDTRAIN_EXPECTED_FALLBACKS": "build-loss"} if case == "raw text into a numeric model" else {}
    proc = launch(np_, launcher, ["-m", "hvdtrain", "--output-dir", str(tmp_path / "run"), *flags], timeout=90,
                  env=expected)
    assert proc.returncode != 0
    ours = error_lines(proc.stdout)
    assert len(ours) == 1, proc.stdout[-3000:]  # rank 0 alone says it
    assert message in ours[0], ours[0]
    if case == "labels beyond the model's classes":
        assert re.search(r"Received a label value of [3-9] which is outside the valid range of \[0, 3\): the "
                         r"model's output has 3 classes", ours[0]), ours[0]
    if launcher is None:
        assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert not worker_tracebacks(proc.stdout), proc.stdout[-3000:]


@pytest.mark.full
@pytest.mark.parametrize("launcher", ["mpi", "mpirun"])
def test_bad_input_ends_the_job_under_mpi_too(launcher, tmp_path):
    proc = launch(2, launcher, ["-m", "hvdtrain", "--model", "vgg99"], timeout=120)
    assert proc.returncode != 0
    assert sum("hvdtrain: error: unknown model 'vgg99'" in l for l in proc.stdout.splitlines()) == 1


@pytest.mark.parametrize("launcher", ["gloo", pytest.param("mpirun", marks=pytest.mark.full)])
def test_failure_on_one_rank_only_ends_every_rank_with_rank0_naming_it(launcher, tmp_path):
    """Set-up that fails on rank 1 alone must not leave rank 0 waiting in its first allreduce."""
    proc = launch(2, launcher, ["-m", "hvdtrain", "--data", "userdata:fails_on_rank_1",
                                "--output-dir", str(tmp_path)], timeout=120)
    assert proc.returncode != 0
    ours = error_lines(proc.stdout)
    assert len(ours) == 1, proc.stdout[-3000:]
    assert "FileNotFoundError: /data/shard-1.tfrecord (on rank 1)" in ours[0]
