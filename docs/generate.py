"""Writes the generated pages of the documentation site into `docs/`: the home page (the README), one page per
method (each `rl/methods/NAME/README.md`), the methods' index, and the benchmarks page (`benchmarks/README.md`).
`make docs` runs it before `mkdocs build --strict`; the generated pages are not committed (`.gitignore`)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def method_pages() -> list[tuple[str, str]]:
    """(folder name, title) of every method README, in folder order."""
    out = []
    for readme in sorted((ROOT / "rl" / "methods").glob("*/README.md")):
        title = readme.read_text().splitlines()[0].lstrip("# ").strip()
        out.append((readme.parent.name, title))
    return out


def generate() -> list[Path]:
    """Write the generated pages; returns their paths."""
    methods = DOCS / "methods"
    shutil.rmtree(methods, ignore_errors=True)
    methods.mkdir(parents=True)
    written = []
    for name, _ in method_pages():
        page = methods / f"{name}.md"
        page.write_text((ROOT / "rl" / "methods" / name / "README.md").read_text())
        written.append(page)
    rows = "".join(f"| [{title}]({name}.md) | `rl/methods/{name}/` |\n" for name, title in method_pages())
    index = methods / "index.md"
    index.write_text("# Methods\n\nOne folder a method (`rl/methods/NAME/`), named as it is registered; its README is "
                     "its page here.\n\n| method | folder |\n|---|---|\n" + rows)
    home = DOCS / "index.md"
    # the README's pointers into docs/ become links of the site
    text = re.sub(r"`docs/([a-z/_-]+\.md)`", r"[\1](\1)", (ROOT / "README.md").read_text())
    home.write_text(text)
    bench = DOCS / "benchmarks.md"
    bench.write_text((ROOT / "benchmarks" / "README.md").read_text())
    return [*written, index, home, bench]


if __name__ == "__main__":
    print(f"wrote {len(generate())} pages into {DOCS}")
