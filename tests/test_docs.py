"""The documentation site builds in strict mode (`make docs`): every page in the nav exists, every method README
becomes a page, the API reference renders from the docstrings, and a broken link fails the build."""

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).parent / "mkdocs"


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_site_builds_with_every_method_page_and_the_api_reference(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py")], check=True, timeout=60)
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    methods = sorted(p.parent.name for p in (ROOT / "rl" / "methods").glob("*/README.md"))
    assert len(methods) == 19
    for name in methods:
        assert (tmp_path / "site" / "methods" / name / "index.html").is_file(), name
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "StageRuntime" in api and "register_alias" in api
    # the benchmark pages show every recorded figure, one per method, and the figures are in the site
    shown = (tmp_path / "site" / "benchmarks" / "methods" / "index.html").read_text()
    for png in ("inference_methods_densesteer", "inference_methods_dsr", "training_components_zo", "memo"):
        assert f"img/{png}.png" in shown, png
        assert (tmp_path / "site" / "benchmarks" / "img" / f"{png}.png").is_file(), png


def test_a_broken_link_fails_the_strict_build(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py")], check=True, timeout=60)
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "extending.md").write_text((docs / "extending.md").read_text() + "\nSee [the lost page](nowhere.md).\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "nowhere.md" in done.stderr
