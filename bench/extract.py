"""Throughput of `formwork extract` offline: all documents in one batched engine
call versus the same documents one request at a time (one `llm.chat` per
document), in the same process on the same LLM, greedy, with the example schemas.

Documents are synthetic contact notes or invoices (seeded), so both runs see the
same prompts; tok/s counts completion tokens.

    python bench/extract.py                        # 64 contact notes
    python bench/extract.py --kind invoice --num-docs 32 --json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

FIRST = ["Maria", "Tom", "Priya", "Li", "Anna", "Kofi", "Sara", "Jonas", "Yuki", "Omar"]
LAST = ["Lopez", "Becker", "Nair", "Wei", "Novak", "Mensah", "Berg", "Keller", "Sato", "Haddad"]
COMPANIES = ["Solara Energy", "Brightline Logistics", "Quillbyte Labs", "Northwind Traders",
             "Blue Peak Hosting", "Greenleaf Catering", "Riverside Dental", "Acme Supplies"]
ROLES = ["CTO", "head of procurement", "product manager", "office manager", "sales lead"]
ITEMS = ["Printer paper", "Toner cartridge", "Cloud server", "Backup storage", "Coffee service",
         "Lunch buffet", "Consulting hour", "Office chair"]


def contact_doc(rng: random.Random) -> str:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    company, role = rng.choice(COMPANIES), rng.choice(ROLES)
    email = f"{first.lower()}.{last.lower()}@{company.split()[0].lower()}.com"
    phone = f"+{rng.randint(1, 49)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    channel = rng.choice(["She prefers email.", "Call rather than write.", "No preference."])
    return (f"# Notes\n\nMet {first} {last}, {role} at {company}. Email: {email}, "
            f"phone {phone}. {channel}\n")


def invoice_doc(rng: random.Random) -> str:
    vendor, customer = rng.sample(COMPANIES, 2)
    cur = rng.choice(["USD", "EUR", "GBP"])
    lines = [(rng.choice(ITEMS), rng.randint(1, 5), rng.randint(10, 400)) for _ in range(rng.randint(1, 3))]
    body = "\n".join(f"  {q} x {name:<20} {cur} {q * p:.2f}" for name, q, p in lines)
    total = sum(q * p for _, q, p in lines)
    return (f"{vendor}\nINVOICE No. INV-{rng.randint(1000, 9999)}\n"
            f"Date: 2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\nBill to: {customer}\n\n"
            f"{body}\n\nTOTAL DUE: {cur} {total:.2f}\n")


def run_mode(llm, docs, opts, batched: bool) -> dict:
    from formwork.gateway.extract.offline import extract_offline
    t0 = time.perf_counter()
    records: list[dict] = []
    if batched:
        extract_offline(llm, docs, opts, records.append, progress=False)
    else:
        for d in docs:
            extract_offline(llm, [d], opts, records.append, progress=False)
    dt = time.perf_counter() - t0
    out = sum(r["usage"]["completion_tokens"] for r in records)
    print(f"{'batched' if batched else 'one-by-one'}: {len(docs)} docs in {dt:.1f} s",
          file=sys.stderr, flush=True)
    return {"seconds": dt, "docs_per_s": len(docs) / dt, "tok_per_s": out / dt,
            "completion_tokens": out, "valid": sum(r["valid"] for r in records),
            "records": records}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-docs", type=int, default=64)
    ap.add_argument("--kind", choices=("contact", "invoice"), default="contact")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    from formwork.gateway.extract.inputs import Document, load_schema
    from formwork.gateway.extract.prompt import ExtractOptions
    from formwork.gateway.llm import LLM

    schema = load_schema(str(ROOT / "examples" / "schemas" / f"{args.kind}.json"))
    opts = ExtractOptions(schema=schema, max_tokens=args.max_tokens)
    rng = random.Random(args.seed)
    make = contact_doc if args.kind == "contact" else invoice_doc
    docs = [Document(f"doc-{i}", "synthetic", make(rng)) for i in range(args.num_docs)]

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, num_threads=args.threads)
    load_s = time.perf_counter() - t0
    run_mode(llm, docs[:1], opts, batched=True)                 # warm-up: grammar compile, caches
    batched = run_mode(llm, docs, opts, batched=True)
    single = run_mode(llm, docs, opts, batched=False)
    same = sum(a["data"] == b["data"] for a, b in zip(batched.pop("records"), single.pop("records")))
    llm.shutdown()
    res = {"kind": args.kind, "num_docs": len(docs), "max_tokens": args.max_tokens,
           "load_s": load_s, "batched": batched, "one_by_one": single,
           "speedup_docs_per_s": batched["docs_per_s"] / single["docs_per_s"],
           "same_data": same}
    if args.json:
        print(json.dumps(res))
        return
    print(f"{len(docs)} synthetic {args.kind} documents, max_tokens {args.max_tokens}, "
          f"model loaded in {load_s:.1f} s, {os.cpu_count()} CPUs")
    print("| mode | seconds | docs/s | completion tok/s | valid |\n|---|---|---|---|---|")
    for name, r in (("batched (one llm.chat)", batched), ("one llm.chat per document", single)):
        print(f"| {name} | {r['seconds']:.1f} | {r['docs_per_s']:.2f} | {r['tok_per_s']:.1f} | "
              f"{r['valid']}/{len(docs)} |")
    print(f"speed-up batched / one-by-one: {res['speedup_docs_per_s']:.2f}x docs/s; "
          f"identical data in {same}/{len(docs)} documents")


if __name__ == "__main__":
    main()
