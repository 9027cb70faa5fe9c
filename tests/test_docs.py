"""The user's documents against the code: README.md's flag reference is what the CLI's parser
generates, every flag says what it does and its default, every environment variable the code reads
is in README.md's table, and the documents' links between themselves resolve."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from asyncserve import cli

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import flag_reference  # noqa: E402

DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_flag_reference_is_the_parsers():
    _, block, _ = flag_reference.split((ROOT / "README.md").read_text())
    assert block == flag_reference.generated(), (
        "README.md's flag reference differs from asyncserve/cli.py's parser: run "
        "`python scripts/flag_reference.py --write` and commit README.md")
    assert "| `--port PORT` |" in block and "### `asyncserve generate`" in block


def test_every_flag_has_help_and_a_default():
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| (.*) \|$", flag_reference.generated(), re.M)
    assert len(rows) > 50 and {"--host", "--port", "--api-key", "--device", "--dtype", "--block-size",
                                "--log-level", "--prompt"} <= {flag for flag, _ in rows}
    for flag, meaning in rows:
        assert re.search(r"\(default: [^)]+\)|\(required\)", meaning), f"{flag}'s help does not say its default: {meaning!r}"


def test_flag_reference_escapes_table_bars():
    parser = argparse.ArgumentParser(prog="x")
    sub = parser.add_subparsers()
    sub.add_parser("serve").add_argument("--mode", default="a", help="a | b (default: a)")
    assert "| `--mode MODE` | a \\| b (default: a) |" in cli.flag_reference(parser)


def _environment_variables() -> set[str]:
    """ASYNCSERVE_* names the code and scripts read."""
    names = set()
    for folder in ("asyncserve", "kernels", "ipc", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path.name != "test_docs.py":
                names.update(re.findall(r"\b(ASYNCSERVE_[A-Z_]+)\b", path.read_text()))
    return names


def test_every_environment_variable_is_in_the_readme():
    table = (ROOT / "README.md").read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(ASYNCSERVE_[A-Z_]+)`", table))
    read = _environment_variables()
    assert {"ASYNCSERVE_API_KEY", "ASYNCSERVE_NATIVE", "ASYNCSERVE_TEST_DEVICE"} <= read
    assert read <= documented, f"environment variables missing from README.md's table: {sorted(read - documented)}"


def test_document_links_resolve():
    broken = []
    for doc in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    readme = (ROOT / "README.md").read_text()
    for page in ("architecture", "adapters-and-tiers", "scheduling-policies", "cluster-mode", "native-kernels",
                 "api", "benchmarks-log"):
        assert f"(docs/{page}.md)" in readme, f"README.md does not link docs/{page}.md"
