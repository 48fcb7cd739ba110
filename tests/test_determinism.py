"""What the README promises about reproducibility, on the real default model:
with dtype float32, greedy and seeded sampling give the same tokens for a
prompt alone, in a batch (with other prompts around it) and after a
prefix-cache hit. bf16 is not batch-invariant (as vLLM without its
batch-invariant mode): the README says so, and nothing here asserts it."""
import pytest

from formwork import LLM, SamplingParams

PROMPTS = [
    "Write a short poem about the sea and the wind, in four lines.",
    "List three facts about the planet Mars, one per line, with a short explanation of each "
    "fact so that a child could follow it.",
    "Translate to French: the cat sits on the mat and looks at the birds in the garden.",
    "What is 17 times 23? Explain the steps of the multiplication.",
]
OTHERS = ["Hi.", "Tell me a joke about computers, programmers and coffee, please."]


def params(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i,
                              ignore_eos=True)
    return SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(engine_process=False, dtype="float32", num_kv_blocks=256, block_size=16,
              max_num_batched_tokens=512, max_num_seqs=16)
    yield llm
    llm.shutdown()


def run(llm, prompts, sps) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_fp32_same_tokens_alone_batched_and_after_prefix_hit(llm, seeded):
    sps = [params(i, seeded) for i in range(len(PROMPTS))]
    kv = llm.engine.kv_manager
    alone = []
    for p, sp in zip(PROMPTS, sps):
        assert kv.reset_prefix_cache()
        alone += run(llm, [p], [sp])
    assert kv.reset_prefix_cache()
    batched = run(llm, PROMPTS, sps)                 # one batch, no prefix hits
    hits = llm.get_stats().prefix_cache_hits
    cached = run(llm, PROMPTS, sps)                  # the prompts' blocks come from the cache
    assert llm.get_stats().prefix_cache_hits > hits
    other_sps = [params(99, seeded)] * len(OTHERS)
    mixed = run(llm, OTHERS[:1] + PROMPTS[::-1] + OTHERS[1:],
                other_sps[:1] + sps[::-1] + other_sps[1:])[1:-1][::-1]   # other company, order
    assert batched == alone
    assert cached == alone
    assert mixed == alone
