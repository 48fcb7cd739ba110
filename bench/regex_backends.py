"""Regex constraints: compile time and mask time per step, xgrammar vs llguidance.

    python bench/regex_backends.py                       # 36 written + 488 generated regexes
    python bench/regex_backends.py --generated 0 --tokens 200 --json out.jsonl

Each regex is compiled by each backend (formwork's own wrappers: the same class
spelling and guards the engine uses) and walked --tokens steps: fill the mask,
pick a random allowed token (seeded by the regex), accept it, until no token but
the end is allowed or the masks of the walk took --cap-s seconds. Reports per
backend: served, compile p50/p95/max, the slowest step of each walk (p50 / p95 /
p99 / max over walks), walks with a step over 10 ms, walks stopped by the cap,
walks failed by the matcher's time limits, and every output that does not match
its regex (the server's output check: Python `re`'s reading, a full match; an
output it could not check in time is not counted) -- the `auto` order for
regexes rests on these figures (grammar/selection.py, README).

The written regexes are the kinds users send (e-mail, URL, phone, dates, lists,
sentences, key=value, numbered steps, nested repetitions); the generated ones
come from a seeded random grammar of atoms (classes, escapes, non-ASCII),
quantifiers (lazy ones too), groups and alternations, kept where Python's `re`
compiles them.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

WRITTEN = [
    r"(\w+\s?)*", r"([a-z]+ ?)+\.", r"([A-Za-z ]+)+", r"[A-Z][a-z]+( [A-Z][a-z]+)*",
    r"\d{3}-\d{3}-\d{4}", r"\(?\d{3}\)?[-. ]?\d{3}[-. ]?\d{4}",
    r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}",
    r"([a-zA-Z0-9_\-\.]+)@((\[[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.)|(([a-zA-Z0-9\-]+\.)+))"
    r"([a-zA-Z]{2,4}|[0-9]{1,3})(\]?)",
    r"https?://(www\.)?[-a-zA-Z0-9@:%._\+~#=]{1,256}\.[a-zA-Z0-9()]{1,6}([-a-zA-Z0-9()@:%_\+.~#?&//=]*)",
    r"\d{4}-\d{2}-\d{2}", r"(0[1-9]|1[0-2])/(0[1-9]|[12]\d|3[01])/\d{4}",
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    r"(\d+(\.\d+)?,\s*)*\d+(\.\d+)?", r"(yes|no|maybe)", r"[A-Z]{2}\d{2}[A-Z0-9]{1,30}",
    r"(\w+ ){3,10}\w+\.", r"([^,\n]*,)*[^,\n]*", r"(\s*-\s+[^\n]+\n)+", r"(\w+=\w+&?)*",
    r"(\"[^\"]*\"|[^,]+)(,(\"[^\"]*\"|[^,]+))*", r"[ab]*a[ab]{12}", r"(a|b)*a(a|b){16}",
    r"x{500}", r"[a-z]{0,1000}", r"(ab|a)*(bc|c)*d", r"((a+)+)+b", r"(a|aa)+b",
    r"(\w+\s*)+[.!?]", r"([A-Z][a-z]*\s?)+", r"(.*,)*.*", r"(\d+\s*[+\-*/]\s*)+\d+",
    r"\s*(\w+\s*:\s*\w+\s*;\s*)*", r"(Step \d+: [^\n]+\n){1,5}Answer: \d+",
    r"[\u4e00-\u9fff]{1,20}", r"[^\n]{0,200}", r"(([a-z]*)*)*",
]
ATOMS = ['"', '[^"]', r"[^\\]", r'[^"\\]', r"\\", "a", "b", "x", "Z", "0", "7", "-", "_", " ",
         "é", "ß", "中", r"\.", r"\-", r"\/", r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", ".",
         "[a-c]", "[^a-c]", "[0-9a-f]", r"[^\d]", r"[\w-]", r"[^\s,]", "[α-ω]", r"\u00e9",
         r"\x41", "[A-Z_]", r"[\]]", "[.]", r"\$", r"\^", r"\(", r"\+"]
QUANTS = ["", "", "", "?", "*", "+", "{2}", "{1,3}", "{0,2}", "{2,}", "*?", "+?"]


def generated(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)

    def node(depth: int) -> str:
        r = rng.random()
        if depth > 1 or r < 0.6:
            return rng.choice(ATOMS) + rng.choice(QUANTS)
        if r < 0.75:
            alts = "|".join(seq(depth + 1) for _ in range(rng.randint(2, 3)))
            return f"({alts}){rng.choice(QUANTS)}"
        if r < 0.85:
            return f"(?:{seq(depth + 1)}){rng.choice(QUANTS)}"
        return seq(depth + 1)

    def seq(depth: int) -> str:
        return "".join(node(depth) for _ in range(rng.randint(1, 3)))

    out: list[str] = []
    while len(out) < count:
        p = seq(0)
        try:
            re.compile(p)
        except re.error:
            continue
        if p not in out:
            out.append(p)
    return out


def walk(compiled, vocab, pattern: str, tokens: int, cap_s: float) -> dict:
    import torch

    from formwork.gateway.output_check import check_output
    from formwork.grammar.backend import allocate_bitmask, allowed_mask
    from formwork.schemas.structured import StructuredOutputsParams as P

    eos, size = vocab.eos_token_id, vocab.vocab_size
    rng = random.Random(pattern)
    m, row = compiled.new_matcher(), allocate_bitmask(1, size)
    steps, kept, error, capped = [], [], None, False
    ended = False
    for _ in range(tokens):
        start = time.perf_counter()
        m.fill_bitmask(row, 0)
        steps.append(time.perf_counter() - start)
        if getattr(m, "error", ""):
            error = m.error
            break
        allowed = allowed_mask(row, 0, size)
        ids = [i for i in torch.nonzero(allowed).flatten().tolist() if i != eos]
        if not ids:
            ended = bool(allowed[eos])
            break
        if sum(steps) > cap_s:
            capped = True
            break
        kept.append(rng.choice(ids))
        if not m.accept_tokens([kept[-1]]):
            error = getattr(m, "error", "") or "a token its own mask allowed was refused"
            break
    text = b"".join(vocab.token_bytes[t] for t in kept).decode("utf-8", "replace")
    # a walk cut before its end is a prefix: checked only when it ended by the mask, by
    # the server's own output check (Python `re`'s reading, matched under a timeout:
    # `re` itself backtracks without bound on these patterns when a text does not match)
    wrong = False
    if ended and error is None:
        verdict = check_output(P(regex=pattern), None, text, "stop", None)
        wrong = verdict is not None and verdict.valid is False
    return {"slowest_ms": round(max(steps, default=0) * 1000, 2),
            "masks_ms": round(sum(steps) * 1000, 1), "steps": len(steps),
            "capped": capped, "error": error, "wrong": text if wrong else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generated", type=int, default=488)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--cap-s", type=float, default=3.0, help="stop a walk after this much mask time")
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    ap.add_argument("--json", help="also write one JSON line per regex here")
    args = ap.parse_args()

    from formwork.gpu.model_files import load_model_tokenizer
    from formwork.grammar.manager import build_backend
    from formwork.grammar.vocab import TokenVocab
    from formwork.schemas.structured import StructuredOutputsParams as P

    tok = load_model_tokenizer(None)
    vocab = TokenVocab.from_tokenizer(tok, 49152)
    backends = {b: build_backend(b, vocab, tok) for b in args.backends}
    patterns = WRITTEN + generated(args.generated, args.seed)
    rows = []
    sink = open(args.json, "w") if args.json else None
    for p in patterns:
        row: dict = {"regex": p}
        for name, backend in backends.items():
            start = time.perf_counter()
            try:
                compiled = backend.compile(P(regex=p, backend=name))
            except ValueError as err:
                row[name] = {"refused": str(err)[:120]}
                continue
            compile_ms = round((time.perf_counter() - start) * 1000, 1)
            row[name] = {"compile_ms": compile_ms, **walk(compiled, vocab, p, args.tokens, args.cap_s)}
        rows.append(row)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    def q(values: list[float], f: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(f * len(values)))] if values else float("nan")

    print(f"{len(patterns)} regexes ({len(WRITTEN)} written, {args.generated} generated, "
          f"seed {args.seed}), {args.tokens} tokens each")
    for name in backends:
        served = [r[name] for r in rows if "refused" not in r[name]]
        comp = [s["compile_ms"] for s in served]
        slow = [s["slowest_ms"] for s in served]
        print(f"{name:10} served {len(served)}, refused {len(rows) - len(served)}; "
              f"compile ms p50/p95/max {q(comp, .5)}/{q(comp, .95)}/{max(comp, default=0)}; "
              f"slowest step ms p50/p95/p99/max {q(slow, .5)}/{q(slow, .95)}/{q(slow, .99)}/"
              f"{max(slow, default=0)}; walks with a step > 10 ms "
              f"{sum(s > 10 for s in slow)}, capped at {args.cap_s:g} s "
              f"{sum(s['capped'] for s in served)}, failed by time limits "
              f"{sum(bool(s['error']) for s in served)}, outputs not matching "
              f"{sum(s['wrong'] is not None for s in served)}")
        for r in rows:
            s = r[name]
            if "refused" not in s and s["wrong"] is not None:
                print(f"  not matching: {r['regex']!r} -> {s['wrong']!r}")


if __name__ == "__main__":
    main()
