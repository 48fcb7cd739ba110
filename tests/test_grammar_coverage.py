"""Schema coverage and soundness, per backend, on a fixed slice of the
JSONSchemaBench sample (the first 2 schemas of every subset, copied into
tests/data/jsonschemabench so the test needs nothing outside the checkout; the
full run is `python bench/schema_coverage.py --backend B`), through that script,
loaded by path (bench/ is not part of the installed package).

The hard guarantees, for every backend and for `auto`: no invalid instance is
accepted, every random walk under the mask that finishes validates against the
ORIGINAL schema with jsonschema (formats included: the test extras install its
checkers), no mask ever allows a special token, and every
rejection names a keyword and its JSON path. The other numbers are lower bounds
at the values measured when this test was written (llguidance 1.9.1, xgrammar
0.2.9, outlines-core 0.2.14); a drop means a regression in the checks or backends.
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

# o21173 / sp_115 take 5-10 s each to compile under xgrammar here.
SLOW = {"o21173", "sp_115_Normalized"}
# measured on the 20 schemas (walks: 3 per schema, seed 0):
# backend: (accepted, valid instances accepted, walks finished)
MIN = {"auto": (19, 50, 44), "llguidance": (19, 50, 44), "xgrammar": (13, 34, 25),
       "outlines": (8, 14, 15)}
EXPECTED_REJECTED = {"auto": {"artifacthub-repo": "uniqueItems"},
                     "xgrammar": {"o13152": "maxLength", "artifacthub-repo": "uniqueItems",
                                  # its names are compiled as loosely as `pattern`
                                  "wp_100_Normalized": "patternProperties"}}
# accepted only through formwork's exact rewrites (grammar/schema_rewrites.py)
EXPECTED_REWRITTEN = {"xgrammar": {"o11794": "required names declared"},
                      "auto": {"o10092": "oneOf of closed objects that share only {}",
                               "base-04": "oneOf of listed strings and a free string"},
                      "llguidance": {"o10092": "oneOf of closed objects that share only {}",
                                     "base-04": "oneOf of listed strings and a free string",
                                     "o16373": "a format no draft defines"}}


_RESULTS: dict[str, list] = {}


@pytest.fixture(params=sorted(MIN))
def results(request, tokenizer):
    backend = request.param
    if backend not in _RESULTS:
        runner = Runner(tokenizer, len(tokenizer), backend, walks=3)
        _RESULTS[backend] = [runner.run(case) for case in load_cases(limit=2, corpus=SLICE)
                             if case.name not in SLOW]
    return backend, _RESULTS[backend]


def test_no_invalid_instance_accepted_and_no_invalid_walk(results):
    backend, rs = results
    accepted = [r for r in rs if r.accepted]
    assert [(r.name, r.unsound) for r in accepted if r.unsound] == [], summarize(rs)
    assert sum(r.invalid_rejected for r in accepted) == sum(r.invalid_total for r in accepted)
    assert [(r.name, r.walk_invalid) for r in accepted if r.walk_invalid] == [], summarize(rs)
    assert sum(r.walk_special for r in accepted) == 0
    assert sum(r.walks_finished for r in accepted) >= MIN[backend][2], summarize(rs)


def test_coverage_lower_bounds(results):
    backend, rs = results
    assert len(rs) == 20
    assert sum(r.accepted for r in rs) >= MIN[backend][0], summarize(rs)
    assert sum(r.valid_accepted for r in rs) >= MIN[backend][1], summarize(rs)


def test_every_rejection_names_a_keyword_and_a_path(results):
    backend, rs = results
    for r in rs:
        if not r.accepted:
            assert r.reason not in ("compile-error", "invalid-schema", ""), (r.name, r.message)
            assert r.message.startswith(f"unsupported JSON Schema keyword '{r.reason}' at $"), \
                (r.name, r.message)
    by_name = {r.name: r for r in rs}
    for name, keyword in EXPECTED_REJECTED.get(backend, {}).items():
        assert not by_name[name].accepted and by_name[name].reason == keyword, \
            (name, by_name[name].message)
    for name in EXPECTED_REWRITTEN.get(backend, {}):
        assert by_name[name].accepted, (name, by_name[name].message)
