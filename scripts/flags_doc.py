"""Write the flag table of docs/training.md from hvdtrain/config.py (hvdtrain.config.flags_markdown), between
its two marker comments; the rest of the page is left as it is. Run it after changing a config field:

    .venv/bin/python scripts/flags_doc.py

tests/test_doc_pages.py fails, naming this command, while the page and the fields differ."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "training.md"
BEGIN = "<!-- flags: written by scripts/flags_doc.py from hvdtrain/config.py; edit the fields, not this table -->"
END = "<!-- end of flags -->"


def split(text: str):
    """The page before the table, the table, the page after it."""
    head, found, rest = text.partition(BEGIN + "\n")
    table, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise SystemExit(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing")
    return head + BEGIN + "\n", table, END + tail


def main():
    sys.path.insert(0, str(ROOT))
    from hvdtrain.config import flags_markdown

    head, table, tail = split(PAGE.read_text())
    new = flags_markdown()
    if new == table:
        print(f"{PAGE.relative_to(ROOT)}: the flag table is up to date")
        return
    PAGE.write_text(head + new + tail)
    print(f"{PAGE.relative_to(ROOT)}: the flag table written from hvdtrain/config.py")


if __name__ == "__main__":
    main()
