"""Every command of the README and docs/ runs as written on this machine, at small sizes. The commands
are read from the files (tests/doc_commands.py), so an edited command is the command tested; those
naming host1/host2 run on the netns hosts in tests/test_multihost.py, the bench's in tests/test_bench.py."""
import pytest

from jobs import run
from doc_commands import NOT_RUN, all_commands, is_bench, names_hosts, shell, small

# Not run alone: each command's output dir, hosts file and YAML are this test's own (doc_commands.small)

LOCAL = [(where, cmd) for where, cmd in all_commands()
         if not names_hosts(cmd) and "hostfiles/" not in cmd and cmd not in NOT_RUN and not is_bench(cmd)]


def test_the_docs_have_the_commands_this_test_expects():
    found = [cmd for _, cmd in all_commands()]
    assert "scripts/run.sh" in found and "python examples/train_script.py" in found
    assert all(cmd in found for cmd in NOT_RUN), "NOT_RUN names a command the docs no longer have"
    assert len(LOCAL) >= 10
    assert not [c for c in found if "..." in c or "[" in c.replace("--binding-args", "")], \
        "a command with elisions or optional-flag brackets cannot be run as written"


@pytest.mark.full
def test_every_local_command_of_the_readme_and_docs_runs_as_written(tmp_path):
    """In the docs' order (a printf that writes hosts.txt comes before the job that reads it)."""
    yaml = tmp_path / "my.yaml"
    yaml.write_text("model: mlp\ndata: digits\nbatch_size: 16\nepochs: 1\nsteps_per_epoch: 3\n"
                    f"output_dir: {tmp_path / 'yaml-run'}\nverbose: 0\ntensorboard: false\n")
    failures = []
    for i, (where, cmd) in enumerate(LOCAL):
        ran = small(cmd, tmp_path / f"c{i}", yaml, tmp_path / "hostfile", tmp_path / "hosts.txt")
        proc = run(shell(ran), timeout=600)
        if proc.returncode != 0:
            failures.append(f"{where}: {cmd}\n  ran: {ran}\n  exit {proc.returncode}: {proc.stdout[-1500:]}")
    assert not failures, "\n".join(failures)
