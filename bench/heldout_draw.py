"""Draw a held-out sample of MaskBench schemas for `bench/schema_coverage.py`.

MaskBench (guidance-ai/jsonschemabench, `maskbench/data/*.json`: a schema and its
valid/invalid test instances per file) is the population; the schemas of
../shared/corpus are left out (by file name and by content), and so are those of
the folders given with --exclude (earlier draws). The sample is written in the
layout `schema_coverage.py --corpus` reads (`OUT/_maskbench_extra/NAME.json`).

  python bench/heldout_draw.py MASKBENCH_DATA OUT [--seed 20261217] [--size 400]
      [--stratified] [--exclude DIR ...]
  python bench/schema_coverage.py --corpus OUT --walks 3

`--stratified` draws up to --per-keyword schemas for each keyword that has hidden
loose masks before (patterns, composition, numeric steps, bounds, rare formats;
a schema counts for the first one it uses), then fills up to --size at random:
a sample that leans on the hard cases, so its acceptance figures run below a
plain random draw's and are not comparable with them.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import pathlib
import random
import shutil
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = _ROOT.parent / "shared" / "corpus" / "jsonschemabench"
RISKY = ("pattern", "patternProperties", "not", "allOf", "oneOf", "anyOf", "if", "dependencies",
         "uniqueItems", "propertyNames", "contains", "multipleOf", "additionalItems",
         "@minmaxProperties", "const", "@minmaxLength", "@minmaxItems", "@minmaxNumber",
         "@minmaxInteger")


def _key(schema) -> str:
    return json.dumps(schema, sort_keys=True)


def known(folders: list[pathlib.Path]) -> tuple[set[str], set[str]]:
    """(file names as MaskBench spells them, canonical schema texts) in `folders`,
    read as `schema_coverage.py` reads a corpus."""
    names, schemas = set(), set()
    for folder in folders:
        for case in _coverage().load_cases(corpus=folder):
            names.add(f"{case.name}.json" if case.subset == "_maskbench_extra"
                      else f"{case.subset}---{case.name}.json")
            schemas.add(_key(case.schema))
    return names, schemas


def _coverage():
    """bench/schema_coverage.py, loaded by path (bench/ is not a package)."""
    if "schema_coverage" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "schema_coverage", pathlib.Path(__file__).with_name("schema_coverage.py"))
        module = sys.modules["schema_coverage"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["schema_coverage"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=pathlib.Path, help="maskbench/data of a jsonschemabench checkout")
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--seed", type=int, default=20261217)
    ap.add_argument("--size", type=int, default=400)
    ap.add_argument("--stratified", action="store_true")
    ap.add_argument("--per-keyword", type=int, default=30)
    ap.add_argument("--exclude", type=pathlib.Path, nargs="*", default=[])
    args = ap.parse_args(argv)

    names, schemas = known(([SHARED] if SHARED.is_dir() else []) + args.exclude)
    pool: dict[str, list[pathlib.Path]] = collections.defaultdict(list)
    for f in sorted(args.data.glob("*.json")):
        if f.name in names:
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if _key(data["schema"]) in schemas or not data.get("tests"):
            continue
        features = set(data.get("meta", {}).get("features", []))
        rare = [k for k in RISKY if k in features] + sorted(
            x for x in features if x.startswith(("format:", "multipleOf:")))
        pool[rare[0] if rare and args.stratified else "_all"].append(f)
    rng = random.Random(args.seed)
    picked: set[pathlib.Path] = set()
    for keyword in sorted(k for k in pool if k != "_all"):
        picked.update(rng.sample(pool[keyword], min(args.per_keyword, len(pool[keyword]))))
    rest = sorted({f for files in pool.values() for f in files} - picked)
    picked.update(rng.sample(rest, max(0, min(len(rest), args.size - len(picked)))))
    target = args.out / "_maskbench_extra"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for f in sorted(picked):
        shutil.copy(f, target / f.name)
    print(f"{len(picked)} schemas in {target} (population {sum(map(len, pool.values()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
