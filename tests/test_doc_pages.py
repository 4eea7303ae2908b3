"""The pages as a reader finds them: the flag table of docs/training.md is the one hvdtrain/config.py makes
(never restated by hand), every link between README.md and docs/*.md leads to a file and, with #anchor,
to a heading there, and every dated result file in docs/ is named by a page. In-process, in about a
second: no command is run (tests/test_docs.py runs the pages' commands)."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGENERATE = ".venv/bin/python scripts/flags_doc.py"

sys.path.insert(0, str(ROOT / "scripts"))
from flags_doc import PAGE, split  # noqa: E402


def prose(path: Path) -> str:
    """The page without its fenced blocks and code spans, where a [text](target) is not a link."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(path: Path) -> list:
    """Every link and image target of a page: inline [text](target) and reference [name]: target."""
    text = prose(path)
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    return inline + re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, flags=re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered, lower case, without punctuation but - and _,
    each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*\*|__|\*)", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        a = anchor(heading)
        found.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return found


def test_the_flag_table_of_training_md_is_the_one_config_py_makes():
    from hvdtrain.config import build_parser, flags_markdown

    _, table, _ = split(PAGE.read_text())
    assert table == flags_markdown(), \
        f"docs/training.md's flag table differs from hvdtrain/config.py's fields: run {REGENERATE}"
    flags = [s for a in build_parser()._actions for s in a.option_strings if s not in ("-h", "--help")]
    missing = [f for f in flags if f"`{f}`" not in table and f"`{f} " not in table]
    assert len(flags) > 50 and not missing, f"flags not in docs/training.md: {missing}; run {REGENERATE}"


def test_no_page_restates_the_flag_table_by_hand():
    for path in PAGES:
        if path != PAGE:
            rows = re.findall(r"^\| `--[a-z-]+", path.read_text(), flags=re.M)
            assert len(rows) < 5, f"{path.relative_to(ROOT)} has a table of flags: link docs/training.md#the-flags"


def test_github_anchors_as_github_makes_them():
    assert anchor("Gloo across hosts: where horovodrun must run") == "gloo-across-hosts-where-horovodrun-must-run"
    assert anchor("How scripts/test.sh runs the suite") == "how-scriptstestsh-runs-the-suite"
    assert anchor("Preemption: a scheduler's SIGTERM") == "preemption-a-schedulers-sigterm"
    assert anchor("The `stacks` tests, **again**") == "the-stacks-tests-again"
    assert anchor("num_classes") == "num_classes"


def test_every_link_between_the_pages_resolves_to_a_file_and_a_heading():
    broken = []
    for path in PAGES:
        for target in links(path):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{where}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_every_dated_result_file_in_docs_is_named_by_a_page():
    named = {(path.parent / t.partition("#")[0]).resolve() for path in PAGES for t in links(path)}
    results = [*(ROOT / "docs").glob("bench-*.json"), *(ROOT / "docs" / "sync-vs-async").iterdir()]
    unnamed = [str(p.relative_to(ROOT)) for p in results if p.resolve() not in named]
    assert len(results) >= 18 and not unnamed, f"link these from the page that reports them, or delete them: {unnamed}"


def test_no_page_cites_an_internal_issue_number():
    cited = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in PAGES
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bissues? \d+|\(#\d+\)", line, flags=re.I)]
    assert not cited, "\n".join(cited)


def test_the_readme_stays_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    cells = [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]
    assert cells and max(len(c) for c in cells) <= 200
