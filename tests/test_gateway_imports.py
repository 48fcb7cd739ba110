"""The gateway process imports neither torch nor a grammar backend it does not
need (issue #15): `formwork serve`'s app, started with a fake engine (no engine
process), loads the tokenizer and answers requests without torch; a JSON
Schema llguidance accepts is checked with llguidance alone. Fresh interpreters:
this test process has imported everything already."""
import json
import subprocess
import sys
import textwrap

HEAVY = ("torch", "xgrammar", "outlines_core", "llguidance")

SERVE = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    from fastapi.testclient import TestClient
    from formwork.gateway import api_server, cli
    from formwork.gateway.engine_args import engine_config
    from formwork.gateway.params import validate_constraint
    from formwork.schemas.structured import StructuredOutputsParams

    HEAVY = {heavy!r}
    INFO = SimpleNamespace(dtype="bfloat16", device="cpu", num_kv_blocks=8, block_size=16,
                           max_model_len=2048, vocab_size=49152, attention_backend="torch",
                           cuda_graph_sizes=(), structured_backend="auto", load_seconds=0.0, pid=0)

    class FakeEngine:                   # what the lifespan calls; no process
        state = "ready"
        def set_tokenizer(self, tokenizer): pass
        async def start(self): return INFO
        async def shutdown(self): pass

    api_server.make_engine_client = lambda config, on_fatal: (FakeEngine(), lambda: None)
    argv = ["serve", "--host", "127.0.0.1"]
    args = cli.build_parser(argv).parse_args(argv)
    app = api_server.build_app(engine_config(args), served_model_names=args.served_model_name)
    seen = {{}}
    with TestClient(app) as client:     # runs the lifespan: loads the tokenizer
        r = client.post("/tokenize", json={{"messages": [{{"role": "user", "content": "hi"}}]}})
        assert r.status_code == 200 and r.json()["count"] > 3, r.text
        seen["started"] = [m for m in HEAVY if m in sys.modules]
        schema = {{"type": "object", "properties": {{"a": {{"type": "integer"}}}}, "required": ["a"]}}
        validate_constraint(StructuredOutputsParams(json=schema), "response_format")
        seen["json_checked"] = [m for m in HEAVY if m in sys.modules]
    print(json.dumps(seen))
""")


def _run(code: str):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_serving_app_imports_no_torch_nor_unneeded_backend(default_model_dir):
    seen = _run(SERVE.format(heavy=HEAVY))
    assert seen["started"] == [], seen               # tokenizer loaded, a request served
    assert seen["json_checked"] == ["llguidance"], seen


def test_schema_checks_import_no_backend_and_outlines_checks_need_no_torch():
    code = textwrap.dedent(f"""
        import json, sys
        from formwork.grammar.schema_check import check_schema
        from formwork.grammar.selection import validate_params
        from formwork.schemas.structured import StructuredOutputsParams
        seen = {{}}
        for backend in ("xgrammar", "outlines"):        # their keyword rules, not their libraries
            check_schema({{"type": "object", "properties": {{"a": {{"type": "string"}}}}}}, backend)
        seen["schema_checked"] = [m for m in {HEAVY!r} if m in sys.modules]
        validate_params(StructuredOutputsParams(regex="[0-9]+", backend="outlines"))
        seen["outlines_checked"] = [m for m in {HEAVY!r} if m in sys.modules]
        print(json.dumps(seen))
    """)
    assert _run(code) == {"schema_checked": [], "outlines_checked": ["outlines_core"]}


def test_the_output_check_of_lark_needs_llguidance_alone():
    """The gateway's Lark output check (a byte-level llguidance parser) reads the
    backend's limits without importing the backend module, which imports torch (it
    once did: ~1 s on the event loop at the first Lark check, and torch in the
    gateway)."""
    code = textwrap.dedent(f"""
        import json, sys
        from formwork.gateway.output_check import check_output, lark_grammars, prepare_lark
        from formwork.schemas.structured import StructuredOutputsParams
        so = StructuredOutputsParams(grammar='start: "a"+')
        prepare_lark(lark_grammars(so, None))
        verdict = check_output(so, None, "aaa", "stop", None)
        print(json.dumps({{"valid": verdict.valid,
                          "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
    """)
    assert _run(code) == {"valid": True, "heavy": ["llguidance"]}
