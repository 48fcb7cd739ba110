"""Schema coverage over a JSONSchemaBench sample: the project's shared corpus
(../shared/corpus/jsonschemabench beside the checkout, 350 schemas) when it is
there, else the 22-schema slice in tests/data/jsonschemabench; `--corpus DIR`
picks another copy laid out the same way.

For every schema: accepted or rejected (and why: keyword and JSON path); for
accepted ones, does a matcher accept every valid instance (compact JSON text,
then the default `json.dumps` spacing) and reject every invalid one? Then
`--walks` random walks under the mask (SmolLM2's tokenizer, biased toward
closing tokens so they finish): every finished output must parse and validate
against the ORIGINAL schema, and no mask may allow a special token. Ground truth
is `jsonschema` with the draft the schema declares, and the format checkers of
its latest draft (`jsonschema[format-nongpl]`, a formwork dependency) whatever the
schema's draft (formwork enforces `format: date` in a draft-04 schema too): every
format a backend accepts it must enforce exactly.
Reported: accepted, rejections by keyword, valid-instance acceptance, invalid
instances accepted, invalid walk outputs, compile time p50/p95 (check + compile,
as the engine's compile pool runs them).

  python bench/schema_coverage.py [--backend auto|llguidance|xgrammar|outlines]
      [--subset Kubernetes] [--limit 20] [--walks 4] [--json]
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

_ROOT = pathlib.Path(__file__).resolve().parent.parent
SLICE = _ROOT / "tests" / "data" / "jsonschemabench"
_SHARED = _ROOT.parent / "shared" / "corpus" / "jsonschemabench"
CORPUS = _SHARED if _SHARED.is_dir() else SLICE


@dataclass(slots=True)
class Case:
    subset: str
    name: str
    schema: object
    tests: list[dict]


@dataclass(slots=True)
class Result:
    subset: str
    name: str
    accepted: bool
    backend: str = ""
    reason: str = ""             # rejection keyword (or "invalid-schema" / "compile-error")
    message: str = ""
    compile_s: float = 0.0
    valid_total: int = 0
    valid_accepted: int = 0
    formats_hold_total: int = 0      # valid texts whose formats hold too
    formats_hold_accepted: int = 0
    invalid_total: int = 0
    invalid_rejected: int = 0
    unsound: list[str] = field(default_factory=list)      # invalid accepted: failing keyword
    walks_finished: int = 0
    walks_unfinished: int = 0    # still open after --walk-tokens
    walk_invalid: list[str] = field(default_factory=list)  # finished walks that do not validate
    walk_special: int = 0        # walks whose mask allowed a special token
    walk_errors: list[str] = field(default_factory=list)  # the matcher failed (resource limit)
    restrictive: list[str] = field(default_factory=list)  # valid rejected: "key-order"/"other"


def load_cases(subset: str | None = None, limit: int | None = None,
               corpus: pathlib.Path = CORPUS) -> list[Case]:
    """Schemas in a fixed order (subset, file name); `limit` per subset."""
    cases = []
    for d in sorted(p for p in corpus.iterdir() if p.is_dir()):
        if subset and d.name != subset:
            continue
        files = sorted(f for f in d.glob("*.json") if not f.name.endswith(".tests.json"))
        for f in files[:limit]:
            data = json.loads(f.read_text())
            if d.name == "_maskbench_extra":
                cases.append(Case(d.name, f.stem, data["schema"], data.get("tests", [])))
                continue
            tests_file = f.with_name(f.stem + ".tests.json")
            tests = json.loads(tests_file.read_text())["tests"] if tests_file.exists() else []
            cases.append(Case(d.name, f.stem, data, tests))
    return cases


def _texts(instance) -> list[str]:
    compact = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    spaced = json.dumps(instance, ensure_ascii=False)
    return [compact] if spaced == compact else [compact, spaced]


@functools.lru_cache(maxsize=1)
def _formats():
    """The latest draft's format checkers, whatever draft a schema declares."""
    import jsonschema

    return jsonschema.Draft202012Validator.FORMAT_CHECKER


def _reorder(instance, schema, root, strip: bool = False):
    """`instance` with object keys in the schema's `properties` order and, if
    `strip`, without undeclared keys (best effort, for attributing rejections)."""
    from formwork.grammar.schema_walk import resolve_local_ref

    def deref(node):
        for _ in range(8):
            if isinstance(node, dict) and isinstance(node.get("$ref"), str):
                target = resolve_local_ref(root, node["$ref"])
                node = target[0] if target else None
        return node

    def candidates(node, depth=0):   # the node and its anyOf/oneOf/allOf branches
        node = deref(node)
        if not isinstance(node, dict):
            return []
        out = [node]
        for kw in ("anyOf", "oneOf", "allOf"):
            if depth < 3 and isinstance(node.get(kw), list):
                out += [c for b in node[kw] for c in candidates(b, depth + 1)]
        return out

    def undeclared(node, key):     # the schema of an undeclared key: a matching pattern's
        for pattern, sub in (node.get("patternProperties") or {}).items():
            try:
                if re.search(pattern, key):
                    return sub
            except re.error:
                pass
        extra = node.get("additionalProperties")
        return extra if isinstance(extra, dict) else None

    schema = deref(schema)
    if isinstance(instance, dict) and isinstance(schema, dict):
        declared = [c["properties"] for c in candidates(schema)
                    if isinstance(c.get("properties"), dict)]
        props = max(declared, key=lambda p: len(p.keys() & instance.keys()), default={})
        extra = [] if strip and props else [k for k in instance if k not in props]
        order = [k for k in props if k in instance] + extra
        return {k: _reorder(instance[k], props[k] if k in props else undeclared(schema, k),
                            root, strip) for k in order}
    if isinstance(instance, list) and isinstance(schema, dict):
        return [_reorder(x, schema.get("items"), root, strip) for x in instance]
    return instance


class Runner:
    def __init__(self, tokenizer, vocab_size: int, backend: str, walks: int = 0,
                 walk_tokens: int = 256, seed: int = 0, additional_properties: str = "declared"):
        from formwork.grammar.vocab import TokenVocab

        self.tok = tokenizer
        self.vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size)
        self.backends: dict = {}
        self.backend = backend
        self.walks, self.walk_tokens, self.seed = walks, walk_tokens, seed
        self.additional_properties = additional_properties
        # token ids whose text closes something: the walks favour them so they finish
        self.closing = [i for i, b in enumerate(self.vocab.token_bytes)
                        if b and any(ch in b for ch in b'}]"') and len(b) <= 3]

    def _backend(self, name):
        from formwork.grammar.manager import build_backend

        if name not in self.backends:
            self.backends[name] = build_backend(name, self.vocab, self.tok, compile_timeout_s=60.0)
        return self.backends[name]

    def accepts(self, compiled, text: str) -> bool:
        m = compiled.new_matcher()
        ids = self.tok.encode(text, add_special_tokens=False)
        return m.accept_tokens(ids) and m.accept_tokens([self.vocab.eos_token_id]) \
            and m.is_terminated()

    def run(self, case: Case) -> Result:
        import jsonschema

        from formwork.grammar.schema_check import UnsupportedSchemaError
        from formwork.grammar.selection import choose_backend
        from formwork.schemas.structured import StructuredOutputsParams

        res = Result(case.subset, case.name, accepted=False)
        params = StructuredOutputsParams(json=case.schema, backend=self.backend,
                                         additional_properties=self.additional_properties)
        start = time.perf_counter()
        try:
            res.backend = choose_backend(params)
            compiled = self._backend(res.backend).compile(params)
        except UnsupportedSchemaError as err:
            res.reason, res.message = err.issues[0].keyword or "schema", str(err)
            return res
        except ValueError as err:
            res.message = str(err)
            res.reason = "invalid-schema" if "invalid JSON Schema" in str(err) else "compile-error"
            return res
        res.compile_s = time.perf_counter() - start
        res.accepted = True
        validator = jsonschema.validators.validator_for(
            case.schema, default=jsonschema.Draft202012Validator)(case.schema)
        for test in case.tests:
            self._check_instance(res, compiled, validator, case.schema, test["data"])
        for k in range(self.walks):
            self._walk(res, compiled, validator, random.Random(f"{self.seed}/{case.name}/{k}"))
        return res

    def _walk(self, res, compiled, validator, rng) -> None:
        """One random walk under the mask, biased toward closing tokens so that it
        finishes; a finished output must parse and validate against the original
        schema, formats included."""
        import torch

        from formwork.grammar.backend import allocate_bitmask, allowed_mask

        matcher = compiled.new_matcher()
        bitmask = allocate_bitmask(1, self.vocab.vocab_size)
        closing = torch.tensor(self.closing)
        out: list[int] = []
        for step in range(self.walk_tokens):
            matcher.fill_bitmask(bitmask, 0)
            allowed = allowed_mask(bitmask, 0, self.vocab.vocab_size)
            special = [i for i in torch.nonzero(allowed).flatten().tolist()
                       if self.vocab.token_bytes[i] is None and i != self.vocab.eos_token_id]
            if special:
                res.walk_special += 1
                return
            eos = self.vocab.eos_token_id
            close = closing[allowed[closing]].tolist()
            ids = close if close and rng.random() < min(0.9, 0.2 + step / self.walk_tokens) else \
                torch.nonzero(allowed).flatten().tolist()
            ids = [i for i in ids if i != eos]
            if allowed[eos] and (not ids or rng.random() < 0.3 or step > self.walk_tokens // 2):
                if not matcher.accept_tokens([eos]):
                    self._refused(res, matcher, eos)
                    return
                break
            if not ids:
                res.walk_invalid.append("dead end: the mask allows no token")
                return
            tid = rng.choice(ids)
            if not matcher.accept_tokens([tid]):
                self._refused(res, matcher, tid)
                return
            out.append(tid)
        else:
            res.walks_unfinished += 1
            return
        res.walks_finished += 1
        text = b"".join(self.vocab.token_bytes[i] for i in out).decode("utf-8", errors="replace")
        try:
            instance = json.loads(text)
        except json.JSONDecodeError:
            res.walk_invalid.append(f"not JSON: {text[:120]!r}")
            return
        checked = validator.evolve(format_checker=_formats())
        errors = list(checked.iter_errors(instance))
        if errors:
            res.walk_invalid.append(f"{errors[0].validator}: {text[:120]!r}")

    @staticmethod
    def _refused(res, matcher, token_id: int) -> None:
        """The mask allowed a token the matcher then refused: a failed matcher (the
        engine ends such a request with an error) or a mask/matcher disagreement."""
        if error := getattr(matcher, "error", ""):
            res.walk_errors.append(error.splitlines()[0])
        else:
            raise AssertionError(f"mask allowed {token_id} but the matcher refused it")

    def _check_instance(self, res, compiled, validator, schema, instance) -> None:
        errors = list(validator.iter_errors(instance))
        formats_hold = not errors and validator.evolve(format_checker=_formats()).is_valid(instance)
        for text in _texts(instance):
            got = self.accepts(compiled, text)
            if not errors:
                res.valid_total += 1
                res.valid_accepted += got
                res.formats_hold_total += formats_hold
                res.formats_hold_accepted += got and formats_hold
                if not got:
                    res.restrictive.append(
                        self._why_rejected(compiled, validator, schema, instance))
            else:
                res.invalid_total += 1
                res.invalid_rejected += not got
                if got:
                    res.unsound.append(errors[0].validator)


    def _why_rejected(self, compiled, validator, schema, instance) -> str:
        """Why a valid instance was refused: formats are asserted, keys must follow
        the schema's order, undeclared keys are refused (strict mode), or other."""
        if not validator.evolve(format_checker=_formats()).is_valid(instance):
            return "format"
        if self.accepts(compiled, _texts(_reorder(instance, schema, schema))[0]):
            return "key-order"
        if self.accepts(compiled, _texts(_reorder(instance, schema, schema, strip=True))[0]):
            return "undeclared-property"
        return "other"


def pct(a: int, b: int) -> str:
    return f"{100 * a / b:5.1f}%" if b else "   - "


def summarize(results: list[Result]) -> str:
    lines = [f"{'subset':18s} {'schemas':>7s} {'accepted':>11s} {'valid accepted':>17s} "
             f"{'invalid rejected':>17s} {'agree':>6s} {'unsound':>7s}"]
    groups = collections.defaultdict(list)
    for r in results:
        groups[r.subset].append(r)
    groups["ALL"] = results
    for name, rs in groups.items():
        acc = [r for r in rs if r.accepted]
        va, vt = sum(r.valid_accepted for r in acc), sum(r.valid_total for r in acc)
        ir, it = sum(r.invalid_rejected for r in acc), sum(r.invalid_total for r in acc)
        lines.append(f"{name:18s} {len(rs):7d} {len(acc):4d} {pct(len(acc), len(rs))} "
                     f"{va:4d}/{vt:<4d} {pct(va, vt)} {ir:4d}/{it:<4d} {pct(ir, it)} "
                     f"{pct(va + ir, vt + it)} {it - ir:7d}")
    reasons = collections.Counter(r.reason for r in results if not r.accepted)
    lines.append("rejections by keyword: "
                 + ", ".join(f"{k} {v}" for k, v in reasons.most_common()))
    unsound = collections.Counter(k for r in results for k in r.unsound)
    lines.append("invalid instances accepted, by failing keyword: "
                 + (", ".join(f"{k} {v}" for k, v in unsound.most_common()) or "none"))
    restrict = collections.Counter(k for r in results for k in r.restrictive)
    acc = [r for r in results if r.accepted]
    held = sum(r.formats_hold_accepted for r in acc), sum(r.formats_hold_total for r in acc)
    lines.append(f"valid instances whose formats hold too: {held[0]}/{held[1]} {pct(*held)} accepted")
    lines.append("valid instances rejected: "
                 + (", ".join(f"{k} {v}" for k, v in restrict.most_common()) or "none"))
    finished = sum(r.walks_finished for r in results)
    invalid = [(r.name, w) for r in results for w in r.walk_invalid]
    lines.append(f"random walks: {finished} finished, "
                 f"{sum(r.walks_unfinished for r in results)} unfinished; invalid outputs "
                 f"{len(invalid)} (in {len({n for n, _ in invalid})} schemas, formats checked); "
                 f"special token allowed in "
                 f"{sum(r.walk_special for r in results)}; matcher failed "
                 f"{sum(len(r.walk_errors) for r in results)}")
    lines += [f"  invalid walk output {name}: {w}" for name, w in invalid[:20]]
    times = sorted(r.compile_s for r in results if r.accepted)
    if times:
        lines.append(f"compile time all: n={len(times)} p50 {1000 * statistics.median(times):.1f} ms, "
                     f"p95 {1000 * percentile(times, 0.95):.1f} ms")
    for backend in sorted({r.backend for r in results if r.accepted}):
        times = sorted(r.compile_s for r in results if r.accepted and r.backend == backend)
        lines.append(f"compile time {backend}: n={len(times)} p50 "
                     f"{1000 * statistics.median(times):.1f} ms, p95 "
                     f"{1000 * percentile(times, 0.95):.1f} ms, p99 {1000 * percentile(times, 0.99):.1f} ms")
    return "\n".join(lines)


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=("auto", "llguidance", "xgrammar", "outlines"))
    ap.add_argument("--walks", type=int, default=4, help="random walks per accepted schema")
    ap.add_argument("--walk-tokens", type=int, default=256, help="tokens before a walk gives up")
    ap.add_argument("--additional-properties", default="declared", choices=("declared", "schema"),
                    help="undeclared properties: the default, or whatever the schema allows")
    ap.add_argument("--subset", default=None)
    ap.add_argument("--corpus", type=pathlib.Path, default=CORPUS,
                    help=f"JSONSchemaBench-layout folder (default {CORPUS})")
    ap.add_argument("--limit", type=int, default=None, help="schemas per subset")
    ap.add_argument("--json", action="store_true", help="print every result as JSON")
    args = ap.parse_args(argv)
    import jsonschema
    if "date-time" not in jsonschema.FormatChecker().checkers:
        print("warning: jsonschema's format checkers are not installed "
              "(pip install 'jsonschema[format-nongpl]'): formats go unchecked", file=sys.stderr)

    from formwork.gpu.model_files import load_model_tokenizer

    tokenizer = load_model_tokenizer(None)
    runner = Runner(tokenizer, len(tokenizer), args.backend, args.walks, args.walk_tokens,
                    additional_properties=args.additional_properties)
    results = []
    for case in load_cases(args.subset, args.limit, args.corpus):
        results.append(runner.run(case))
        r = results[-1]
        print(f"{r.subset}/{r.name}: {'ok ' + r.backend if r.accepted else r.reason} "
              f"{r.compile_s:.2f}s", file=sys.stderr, flush=True)
    if args.json:
        json.dump([asdict(r) for r in results], sys.stdout, indent=1)
        print()
    else:
        print(summarize(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
