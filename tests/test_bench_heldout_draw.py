"""bench/heldout_draw.py (loaded by path: bench/ is not installed): a held-out draw
leaves out the shared corpus and excluded folders, by name and by content, is
the same for the same seed, and `--stratified` takes the rare keywords first."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

_SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "bench" / "heldout_draw.py"
_spec = importlib.util.spec_from_file_location("heldout_draw", _SCRIPT)
heldout_draw = sys.modules["heldout_draw"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heldout_draw)

TESTS = [{"description": "v", "valid": True, "data": 1}]


def _write(folder: pathlib.Path, name: str, schema, features=(), tests=TESTS) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(
        {"meta": {"features": list(features)}, "schema": schema, "tests": tests}))


def _drawn(out: pathlib.Path) -> set[str]:
    return {f.name for f in (out / "_maskbench_extra").glob("*.json")}


def test_draw_leaves_out_what_was_seen_and_is_reproducible(tmp_path, monkeypatch):
    data, shared, earlier = tmp_path / "data", tmp_path / "shared", tmp_path / "earlier"
    for i in range(40):
        _write(data, f"Github_easy---o{i}.json", {"type": "integer", "minimum": i})
    _write(data, "Kubernetes---kb_1.json", {"type": "string"})          # in the corpus by name
    _write(data, "Snowplow---sp_9.json", {"type": "boolean"})            # by content
    _write(data, "Github_easy---untested.json", {"type": "null"}, tests=[])
    (shared / "Kubernetes").mkdir(parents=True)
    (shared / "Kubernetes" / "kb_1.json").write_text(json.dumps({"type": "number"}))
    (shared / "Snowplow").mkdir()
    (shared / "Snowplow" / "sp_other.json").write_text(json.dumps({"type": "boolean"}))
    _write(earlier / "_maskbench_extra", "Github_easy---o0.json", {"type": "integer", "minimum": 0})
    monkeypatch.setattr(heldout_draw, "SHARED", shared)

    everything = [str(data), str(tmp_path / "all"), "--size", "100", "--exclude", str(earlier)]
    assert heldout_draw.main(everything) == 0
    assert _drawn(tmp_path / "all") == {f"Github_easy---o{i}.json" for i in range(1, 40)}

    args = [str(data), None, "--size", "10", "--seed", "7", "--exclude", str(earlier)]
    for out in ("a", "b"):
        args[1] = str(tmp_path / out)
        assert heldout_draw.main(args) == 0
    first, second = _drawn(tmp_path / "a"), _drawn(tmp_path / "b")
    assert first == second and len(first) == 10
    assert not first & {"Kubernetes---kb_1.json", "Snowplow---sp_9.json",
                        "Github_easy---untested.json", "Github_easy---o0.json"}
    args[1], args[5] = str(tmp_path / "c"), "8"
    heldout_draw.main(args)
    assert _drawn(tmp_path / "c") != first                                  # the seed matters


def test_stratified_draw_takes_the_rare_keywords_first(tmp_path, monkeypatch):
    data = tmp_path / "data"
    for i in range(50):
        _write(data, f"Github_easy---plain{i}.json", {"type": "integer", "minimum": i})
    for i in range(3):
        _write(data, f"Github_hard---ui{i}.json", {"type": "array", "uniqueItems": True,
                                                   "maxItems": i}, features=["uniqueItems"])
        _write(data, f"Github_hard---pat{i}.json", {"type": "string", "pattern": "a" * (i + 1)},
                                                   features=["pattern", "format:email"])
    monkeypatch.setattr(heldout_draw, "SHARED", tmp_path / "none")
    heldout_draw.main([str(data), str(tmp_path / "out"), "--stratified", "--size", "8",
                       "--per-keyword", "2"])
    drawn = _drawn(tmp_path / "out")
    assert len(drawn) == 8
    assert sum(n.startswith("Github_hard---ui") for n in drawn) >= 2
    assert sum(n.startswith("Github_hard---pat") for n in drawn) >= 2
