"""Schema coverage on a fixed slice of the JSONSchemaBench sample (the first 2
schemas of every subset, copied into tests/data/jsonschemabench so the test
needs nothing outside the checkout, minus two whose compile takes 5-10 s here;
the full run is `python bench/schema_coverage.py`), through that script, loaded by path
(bench/ is not part of the installed package).

The hard guarantee: no invalid instance is accepted by an accepted schema's
matcher (a finished output always validates). The other numbers are lower
bounds at the values measured when this test was written (xgrammar 0.2.9,
outlines-core 0.2.14); a drop means a regression in the checks or backends.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "bench" / "schema_coverage.py"
_spec = importlib.util.spec_from_file_location("schema_coverage", _SCRIPT)
schema_coverage = sys.modules["schema_coverage"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(schema_coverage)
SLICE, Runner, load_cases, summarize = (schema_coverage.SLICE, schema_coverage.Runner,
                                        schema_coverage.load_cases, schema_coverage.summarize)

SLOW = {"o21173", "sp_115_Normalized"}
# measured: 20 schemas, 16 accepted; valid instances 42/48 accepted (o16373:
# two carry "Invalid URI" in a `format: uri` field, formats are asserted;
# wp_100: its objects list keys out of the schema's order); invalid 54/54 rejected.
MIN_ACCEPTED = 16
MIN_VALID_ACCEPTED = 42
EXPECTED_REJECTED = {"o13152": "multipleOf", "o10092": "oneOf", "base-04": "oneOf",
                     "artifacthub-repo": "uniqueItems"}
# accepted through an exact rewrite (grammar/schema_rewrites.py)
EXPECTED_REWRITTEN = {"o11794": "required names declared",
                      "wp_100_Normalized": "draft-04 dependencies expanded"}


@pytest.fixture(scope="module")
def results():
    from formwork.core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    runner = Runner(tokenizer, len(tokenizer), "auto")
    return [runner.run(case) for case in load_cases(limit=2, corpus=SLICE) if case.name not in SLOW]


def test_no_invalid_instance_is_accepted(results):
    accepted = [r for r in results if r.accepted]
    assert sum(r.invalid_total for r in accepted) >= 54
    assert [(r.name, r.unsound) for r in accepted if r.unsound] == [], summarize(results)
    assert sum(r.invalid_rejected for r in accepted) == sum(r.invalid_total for r in accepted)


def test_coverage_lower_bounds(results):
    assert len(results) == 20
    assert sum(r.accepted for r in results) >= MIN_ACCEPTED, summarize(results)
    assert sum(r.valid_accepted for r in results) >= MIN_VALID_ACCEPTED, summarize(results)


def test_rejections_name_a_keyword_and_a_path(results):
    by_name = {r.name: r for r in results}
    for name, keyword in EXPECTED_REJECTED.items():
        r = by_name[name]
        assert not r.accepted and r.reason == keyword, (name, r.message)
        assert r.message.startswith(f"unsupported JSON Schema keyword '{keyword}' at $")
    for name in EXPECTED_REWRITTEN:
        assert by_name[name].accepted and not by_name[name].unsound, (name, by_name[name].message)
