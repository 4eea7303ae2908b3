"""The config: defaults < YAML < flags, every field documented, every bad value one clear error."""
import dataclasses
import os
import re

import pytest

from hvdtrain import config
from hvdtrain.config import Config, UserError



def test_flags_win_over_yaml_and_yaml_over_defaults(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: cnn\nepochs: 3\nbatch-size: 8\nsynthetic_shape: [4, 4, 1]\n")
    cfg = config.load(["--config", str(f), "--epochs", "5"])
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.synthetic_shape) == ("cnn", 5, 8, (4, 4, 1))
    assert cfg.lr == Config().lr


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        config.build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(Config):
        assert f"--{f.name.replace('_', '-')}" in text


def test_boolean_flags_have_a_negative_form():
    assert config.load(["--no-shuffle"]).shuffle is False
    assert config.load([]).shuffle is True


@pytest.mark.parametrize("yaml_text, message", [
    ("epochs: ten\n", "config key 'epochs': expected int, got 'ten'"),
    ("lr: [1]\n", "config key 'lr': expected float"),
    ("shuffle: 3\n", "config key 'shuffle': expected bool"),
    ("- a\n- b\n", "expected a mapping of config keys, got list"),
    ("config: other.yaml\n", "cannot name another config file"),
])
def test_yaml_values_of_the_wrong_type_are_rejected(tmp_path, yaml_text, message):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(UserError, match=message.replace("[", r"\[")):
        config.load(["--config", str(f)])


def test_default_output_dir_is_deterministic_so_every_rank_agrees():
    assert Config(model="cnn", data="npz:/data/train.npz").run_dir == "runs/cnn-train.npz"
    assert Config(output_dir="/tmp/x").run_dir == "/tmp/x"


def test_every_flag_reaches_the_workers_through_horovodrun_argument_parsing(monkeypatch):
    """horovodrun's argparse matches option prefixes anywhere on its command line: a flag of ours that
    is an ambiguous prefix of two of its options (as --timeline once was) kills the launch."""
    import sys

    from horovod.runner import launch

    for f in dataclasses.fields(Config):
        flag = f"--{f.name.replace('_', '-')}"
        argv = ["horovodrun", "-np", "2", "python", "-m", "hvdtrain", flag, "1"]
        monkeypatch.setattr(sys, "argv", argv)
        args = launch.parse_args()
        assert args.command == argv[3:], flag


def test_class_weight_is_the_same_mapping_from_flags_yaml_and_the_python_api(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("class_weight: {0: 1, 1: 5}\n")
    assert config.load(["--config", str(f)]).class_weights() == {0: 1.0, 1: 5.0}
    assert config.load(["--class-weight", "0=1", "1=5"]).class_weights() == {0: 1.0, 1: 5.0}
    assert config.from_dict({"class_weight": {0: 1, 1: 5.0}}).validate().class_weights() == {0: 1.0, 1: 5.0}
    assert config.load([]).class_weights() is None  # Keras' default: every class weighs 1
    for bad in (["0=1", "1=x"], ["0:1"], ["0=-1"], ["0=1", "0=2"], ["0=nan"], {-1: 2}, {"a": 1}):
        with pytest.raises(UserError, match="--class-weight takes CLASS=WEIGHT pairs"):
            config.from_dict({"class_weight": bad}).validate()


def test_a_config_written_to_json_reads_back_as_the_same_config():
    """A checkpoint and summary.json keep the config as JSON (lists, class_weight as a mapping with its
    keys as strings): read back, every field has its type again."""
    import json

    cfg = config.load(["--class-weight", "0=1", "1=5", "--metrics", "accuracy", "auc", "--synthetic-shape", "4",
                       "4", "1", "--lr-schedule", "step", "--lr-decay-epochs", "3", "6", "--preemption-signals"])
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert saved["class_weight"] == {"0": 1.0, "1": 5.0} and saved["synthetic_shape"] == [4, 4, 1]
    assert config.from_dict(saved) == cfg and cfg.preemption_signals == () and cfg.metrics == ("accuracy", "auc")


def test_the_config_is_resolved_once_and_cannot_change_after():
    cfg = config.load(["--epochs", "3"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 4
    assert dataclasses.replace(cfg, epochs=4).epochs == 4 and cfg.epochs == 3


@pytest.mark.parametrize("values, message", [
    ({"synthetic_shape": [4, 4]}, "'synthetic_shape': expected 3 x int, got [4, 4]"),
    ({"lr_decay_epochs": ["a"]}, "'lr_decay_epochs': expected a list of int"),
    ({"metrics": [1]}, "'metrics': expected a list of str"),
    ({"epochs": 2.5}, "'epochs': expected int, got 2.5"),
    ({"lr": True}, "'lr': expected float, got True"),
])
def test_each_value_is_read_by_its_fields_type(values, message):
    with pytest.raises(UserError, match=re.escape(message)):
        config.from_dict(values)


@pytest.mark.full
@pytest.mark.stacks
@pytest.mark.alone  # it pip-installs into the venv every other test imports from
def test_a_users_pip_install_pandas_into_the_venv_keeps_the_stack_working():
    """keras.io's structured-data examples use pandas; pip resolves it against the venv's constraints
    (scripts/setup.sh writes them), so numpy and TensorFlow stay the stack's and still import."""
    import subprocess

    from jobs import PYTHON

    def versions():
        out = subprocess.run([PYTHON, "-c", "import numpy, tensorflow as tf; print(numpy.__version__, tf.__version__)"],
                             capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    before = versions()
    pip = subprocess.run([PYTHON, "-m", "pip", "install", "-q", "pandas"], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    assert versions() == before
    check = subprocess.run([PYTHON, "-c", "import pandas, tensorflow as tf; print(tf.constant(pandas.Series([1.5]).values))"],
                           capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert check.returncode == 0 and "1.5" in check.stdout, check.stderr[-2000:]


@pytest.mark.parametrize("version, stack, works", [("3.8", "", "python3.12"), ("3.12", "keras2", "python3.11")])
def test_setup_on_a_python_no_stack_supports_says_which_pythons_work_in_one_line(version, stack, works, tmp_path):
    import glob
    import subprocess

    from jobs import ROOT

    found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")))
    if not found:
        pytest.skip(f"no Python {version} on this machine")
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": found[0], "HVDTRAIN_STACK": stack,
                               "HVDTRAIN_VENV": str(tmp_path / "venv")})
    assert proc.returncode == 2 and not (tmp_path / "venv").exists()
    (line,) = proc.stderr.strip().splitlines()
    assert "keras3 needs Python 3.10-3.13, keras2 Python 3.9-3.11" in line and f"PYTHON={works} scripts/setup.sh" in line
