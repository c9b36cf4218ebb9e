"""Writes the generated pages of the documentation site into `docs/`: the home page (the README), one page per
method (each `rl/methods/NAME/README.md`), the methods' index, the benchmarks' index (`benchmarks/README.md`) and
the figures the benchmark pages show. `make docs` runs it before `mkdocs build --strict`; the generated pages are not committed (`.gitignore`)."""

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
    return [*written, index, home, *benchmark_pages()]


def benchmark_pages() -> list[Path]:
    """The benchmarks' index (`benchmarks/README.md`, its links into docs/ made links of the site) and the figures
    the recorded-results pages (`docs/benchmarks/*.md`, committed) show, copied from `benchmarks/results/`."""
    bench = DOCS / "benchmarks"
    index = bench / "index.md"
    index.write_text(re.sub(r"\(\.\./docs/benchmarks/([a-z_-]+\.md)\)", r"(\1)",
                            (ROOT / "benchmarks" / "README.md").read_text()))
    images = bench / "img"
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir()
    copied = [Path(shutil.copy(png, images)) for png in sorted((ROOT / "benchmarks" / "results").glob("*.png"))]
    return [index, *copied]


if __name__ == "__main__":
    print(f"wrote {len(generate())} pages into {DOCS}")
