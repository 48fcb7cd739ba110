"""docs/architecture.md stays true: every test it names exists, every file it names exists."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_named_tests_exist():
    refs = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?((?:`, `\w+)*)`", DOC)
    assert len(refs) > 10
    for path, first, more in refs:
        text = (ROOT / path).read_text()
        for name in ([first] if first else []) + re.findall(r"`(\w+)", more):
            assert re.search(rf"^\s*(?:def|class) {name}\b", text, re.M), f"{path}::{name}"


def test_named_files_exist():
    for path in set(re.findall(r"\b((?:gateway|core|gpu|grammar|kernels|schemas)/\w+\.py)", DOC)):
        assert (ROOT / path).exists(), path
