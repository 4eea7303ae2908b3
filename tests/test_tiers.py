"""The gate runs the full-tier tests that reach what changed since the full tier passed them, and no
other (tests/tiers.py): shown on a clone of this repository, changed as a developer would change it,
by the collection scripts/test.sh runs first."""
import os
import re
import subprocess
import sys

import pytest

import tiers
from doc_commands import commands
from jobs import ROOT

MODULE = "examples/small_cnn.py"  # a model module of the examples: only a full-tier test trains it


def _gate(clone) -> dict:
    """{nodeid: why} of the full-tier tests the gate adds in `clone`, as scripts/test.sh's first step
    lists them."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                           "--tier", "gate"], cwd=clone, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HVDTRAIN_GATE_EXTRA_SECONDS": "1e9", "HVDTRAIN_GATE_LISTED": "100000"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    head = re.search(r"^tiers: the gate: \d+ gate tests, and (\d+) full-tier tests", proc.stdout, re.M)
    assert head, proc.stdout[-3000:]
    added = dict(re.findall(r"^  (tests/[^:\s]+::[^\s\[]+(?:\[[^\]]*\])?): (.*)$", proc.stdout, re.M))  # ids: spaces
    assert len(added) == int(head.group(1))
    return added


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers") / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(path)], check=True)
    return path


def test_a_one_line_change_to_a_module_that_only_full_tier_tests_reach_makes_the_gate_run_them(clone):
    before = _gate(clone)
    record = tiers.load_record()  # a test not marked stacks counts where the full tier ran it
    reaching = {n for stack in record["stacks"] for n, t in tiers.recorded_tests(record, stack).items()
                if MODULE in t["reach"]}
    assert reaching
    with open(clone / MODULE, "a") as f:
        f.write("# one line\n")
    after = _gate(clone)
    assert set(after) - set(before) == reaching - set(before)
    assert all(MODULE in after[n] for n in reaching - set(before))


def test_a_change_to_the_docs_prose_adds_no_job_and_a_changed_command_adds_the_test_that_runs_it(clone):
    before = _gate(clone)
    page = clone / "docs" / "training.md"
    page.write_text(page.read_text().replace("\n## ", "\nOne more sentence of prose.\n\n## ", 1))
    assert _gate(clone) == before
    line, cmd = next((n, c) for n, c in commands(page) if c.startswith("python -m hvdtrain"))
    lines = page.read_text().splitlines()
    lines[line - 1] = lines[line - 1].replace(cmd, cmd + " --epochs 3")
    page.write_text("\n".join(lines) + "\n")
    added = set(_gate(clone)) - set(before)
    assert "tests/test_docs.py::test_every_local_command_of_the_readme_and_docs_runs_as_written" in added or \
        "tests/test_docs.py::test_every_local_command_of_the_readme_and_docs_runs_as_written" in before


def test_a_page_is_fingerprinted_by_its_commands_and_any_other_file_by_its_content(tmp_path, monkeypatch):
    monkeypatch.setattr(tiers, "ROOT", tmp_path)
    (tmp_path / "p.md").write_text("Prose.\n\n    python -m hvdtrain --epochs 2\n")
    (tmp_path / "m.py").write_text("x = 1\n")
    page, module = tiers.fingerprint("p.md"), tiers.fingerprint("m.py")
    (tmp_path / "p.md").write_text("Other prose, longer.\n\n    python -m hvdtrain --epochs 2\n\nMore.\n")
    (tmp_path / "m.py").write_text("x = 1  # a comment\n")
    assert tiers.fingerprint("p.md") == page and tiers.fingerprint("m.py") != module
    (tmp_path / "p.md").write_text("Prose.\n\n    python -m hvdtrain --epochs 3\n")
    assert tiers.fingerprint("p.md") != page
    assert tiers.fingerprint("gone.py") == "missing"


def test_a_module_read_from_its_cached_bytecode_counts_as_its_source():
    pyc = ROOT / "hvdtrain" / "__pycache__" / f"train.cpython-{sys.version_info[0]}{sys.version_info[1]}.pyc"
    assert tiers.relative(pyc) == "hvdtrain/train.py"
    assert tiers.relative(ROOT / ".venv" / "bin" / "python") is None
    assert tiers.relative("/usr/lib/os.py") is None and tiers.relative(ROOT / "tests" / "tiers.py") is None


def test_a_full_tier_test_never_passed_or_reaching_a_changed_file_is_run_and_one_unchanged_is_not():
    entry = {"seconds": 3.0, "reach": {"hvdtrain/train.py": "aaaa", "tests/jobs.py": "bbbb"}}
    same = {"hvdtrain/train.py": "aaaa", "tests/jobs.py": "bbbb"}.get
    assert tiers.why_selected(entry, same) is None
    assert tiers.why_selected(None, same) == "not passed in the full tier yet"
    changed = {"hvdtrain/train.py": "cccc", "tests/jobs.py": "bbbb"}.get
    assert tiers.why_selected(entry, changed) == "changed since the full tier passed it: hvdtrain/train.py"
