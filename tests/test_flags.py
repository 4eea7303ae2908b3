"""A flag, a YAML file or a value that hvdtrain refuses before TensorFlow starts, checked in-process:
the same one line, from the same code, that test_bad_input.py's launched jobs print once from rank 0
(those run in the full tier, at 2 workers under horovodrun; this is the gate's check of each message)."""
import pytest

from hvdtrain import config
from test_bad_input import CASES

# the cases whose check is config.load's: the flags, the YAML file and the values
BEFORE_TENSORFLOW = ("malformed yaml", "missing yaml", "unknown config key", "unknown flag", "zero batch size",
                     "negative epochs", "zero learning rate")


@pytest.mark.parametrize("case", BEFORE_TENSORFLOW)
def test_a_bad_flag_or_config_is_refused_in_one_line_before_tensorflow_starts(case, tmp_path):
    flags, message = CASES[case]
    bad, unknown = tmp_path / "bad.yaml", tmp_path / "unknown.yaml"
    bad.write_text("model: mlp\nepochs: [1\n")  # as test_bad_input.py's yaml_files writes them
    unknown.write_text("model: mlp\nlearning_rate: 0.1\n")
    flags = [f.format(bad_yaml=bad, unknown_key=unknown) for f in flags]
    with pytest.raises(config.UserError) as refused:
        config.load(flags)
    assert message in str(refused.value) and "\n" not in str(refused.value).strip()

