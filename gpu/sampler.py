"""logits -> logit_bias -> allowed_token_ids -> bad_words -> grammar bitmask ->
min_tokens -> penalties -> logprobs -> temperature / min-p / top-k / top-p -> token ids.

Order matters: OpenAI's logit_bias is added to the model's logits first (a bias
of -100 bans the token), vLLM's allowed_token_ids and bad_words ban theirs; then
the grammar mask, so that no sampling step can ever pick a token the grammar
forbids. A row those bans leave without any token the grammar allows (a user's
ban against the grammar's only continuation) gets its logits back from before
the bans, masked by the grammar alone (`_revive`): the output still follows the
grammar, and a row is never left with nothing to pick. Returned logprobs follow vLLM's
`logprobs_mode`: "raw_logprobs" (default) are the model's own distribution,
before the mask, penalties and temperature; "processed_logprobs" are taken
after the mask and penalties, and top entries a mask or ban ruled out (-inf)
are left out. Either way every number returned is finite (JSON has no -inf).
Per-request seeds are reproducible regardless of batch composition: a seeded
row draws its uniforms from its own torch.Generator, seeded per sampled token.

A sampled row is drawn by inverse CDF: weights exp((logits - max) / T), a
cumulative sum, one uniform per row (`_draw`). Not a Gumbel race over the
vocabulary (argmax(logits / T + g), what torch.multinomial does too): torch's CPU
exponential_ fills [64, 49152] in ~50 ms, as long as the whole decode step; the
inverse CDF takes ~3.5 ms (vLLM's CPU build avoids the cost with a fused C++ op
hashing per-token noise).

Deferred masks (`keep`, `resample`): for a row whose sampling commutes with the
mask (`mask_can_wait`), the engine may skip its bitmask, check the token picked
without it, and only if the grammar refuses it ask `resample` to pick again
with the mask over the same logits. Greedy: the allowed argmax, the eager
pick bit for bit. Temperature: accept-or-redraw with a fresh uniform (drawn
with the first, from the row's own generator when seeded), whose result has
exactly the masked distribution: P(t) = p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A)
for an allowed t. The same distribution as the eager path, not the same token.
`score_prompt` computes prompt logprobs (vLLM's prompt_logprobs) on raw logits.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from formwork.kernels import cpu_sampling
from formwork.kernels.bitmask import apply_bitmask
from formwork.schemas.engine import Logprob, PromptLogprobs
from formwork.schemas.sampling import SamplingParams


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling state for the rows sampled this step (built by the runner)."""
    temperature: torch.Tensor          # [B] float32, 0 -> greedy
    top_p: torch.Tensor | None         # [B] float32, None when all rows are 1.0
    top_k: torch.Tensor | None         # [B] int64 (vocab = disabled), None when unused
    min_p: torch.Tensor | None         # [B] float32, None when unused
    all_greedy: bool
    # per row: the seed of THIS token's draw (derived from the request seed and the
    # output position, so it is independent of batch composition and preemption),
    # or None -> the process-wide generator
    seeds: list[int | None]
    # penalties (None when no row uses them)
    presence: torch.Tensor | None      # [B]
    frequency: torch.Tensor | None     # [B]
    repetition: torch.Tensor | None    # [B]
    output_token_ids: list[list[int]] | None   # per row, for presence/frequency
    all_token_ids: list[list[int]] | None      # per row, prompt+output, for repetition
    max_num_logprobs: int | None       # None -> no row wants logprobs
    num_logprobs: list[int | None]
    banned: list[tuple[int, int]] | None = None   # (row, token id) that must not be sampled
    # OpenAI logit_bias, flattened over the rows that have one (None when no row has):
    # ([N] int64 rows, [N] int64 token ids, [N] float32 biases, -inf for a ban)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # vLLM's allowed_token_ids, flattened: ([N] rows, [N] token ids); None when no row has them
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # vLLM's bad_words: (row, token id) pairs that would complete a bad word this step
    word_bans: list[tuple[int, int]] | None = None
    # [K] rows with a ban of any of the three kinds above (`_revive` looks at them only)
    restricted: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # per row: (chosen logprob, [(token_id, logprob) * n], chosen rank) or None
    logprobs: list[tuple[float, list[tuple[int, float]], int] | None] | None


def _token_counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[B, vocab] int counts of each token id in each row (does not mutate rows)."""
    b = len(rows)
    counts = torch.zeros(b, vocab, dtype=torch.int32, device=device)
    lens = [len(r) for r in rows]
    if sum(lens) == 0:
        return counts
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.int64, device=device)
    row_idx = torch.repeat_interleave(torch.arange(b, device=device), torch.tensor(lens, device=device))
    counts.index_put_((row_idx, flat), torch.ones_like(flat, dtype=torch.int32), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place. OpenAI presence/frequency on output tokens; HF/vLLM-style
    repetition penalty on prompt+output tokens."""
    vocab = logits.shape[1]
    if batch.repetition is not None and batch.all_token_ids is not None:
        seen = _token_counts(batch.all_token_ids, vocab, logits.device) > 0
        rep = batch.repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
    if batch.output_token_ids is not None and (batch.presence is not None or batch.frequency is not None):
        counts = _token_counts(batch.output_token_ids, vocab, logits.device).to(logits.dtype)
        if batch.frequency is not None:
            logits -= batch.frequency[:, None] * counts
        if batch.presence is not None:
            logits -= batch.presence[:, None] * (counts > 0).to(logits.dtype)


BAN_BIAS = -100.0     # OpenAI: -100 bans the token (a plain -100 could still be sampled)


def logit_bias_tensors(biases: list[dict[int, float] | None],
                       device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per-row {token id: bias} -> the flat (rows, ids, values) SamplingBatch.logit_bias;
    None when no row has a bias. A bias <= -100 becomes -inf (a ban)."""
    rows, ids, vals = [], [], []
    for row, bias in enumerate(biases):
        if bias:
            rows.extend([row] * len(bias))
            ids.extend(bias.keys())
            vals.extend(float("-inf") if v <= BAN_BIAS else v for v in bias.values())
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(vals, dtype=torch.float32, device=device))


def allowed_tensors(allowed: list[list[int] | None],
                    device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row allowed token ids -> the flat (rows, ids) SamplingBatch.allowed."""
    rows = [row for row, ids in enumerate(allowed) for _ in (ids or ())]
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor([t for ids in allowed for t in (ids or ())], dtype=torch.int64,
                         device=device))


def bad_word_bans(rows: list[tuple[list[list[int]] | None, list[int]]]) -> list[tuple[int, int]]:
    """(row, token) pairs to ban: per row (its bad words as token sequences, its output
    so far), the last token of each sequence whose other tokens end the output (a
    one-token word: always), as vLLM's bad_words."""
    out = []
    for row, (seqs, output) in enumerate(rows):
        for seq in seqs or ():
            head = len(seq) - 1
            if head == 0 or (head <= len(output) and output[-head:] == seq[:-1]):
                out.append((row, seq[-1]))
    return out


def _restrict(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place: allowed_token_ids (every other token of those rows to -inf), then
    the bad-word bans."""
    if batch.allowed is not None:
        rows, ids = batch.allowed
        kept = logits[rows, ids]
        urows = torch.unique(rows)
        logits.index_fill_(0, urows, float("-inf"))
        logits[rows, ids] = kept
    if batch.word_bans:
        logits[[r for r, _ in batch.word_bans], [t for _, t in batch.word_bans]] = float("-inf")


def _revive(logits: torch.Tensor, saved: torch.Tensor, rows: torch.Tensor,
            bitmask: torch.Tensor | None, bitmask_rows: torch.Tensor | None) -> None:
    """Restricted rows `rows` whose bans (with the grammar mask) left every token at
    -inf get `saved` (their logits before the bans) back, with the grammar mask alone."""
    dead = torch.isneginf(logits.index_select(0, rows)).all(-1)
    if not bool(dead.any()):
        return
    which = dead.nonzero().flatten()
    back = saved.index_select(0, which)
    targets = rows.index_select(0, which)
    if bitmask is not None and bitmask.shape[0] > 0:
        mask_rows = (bitmask_rows.tolist() if bitmask_rows is not None
                     else list(range(bitmask.shape[0])))
        where = {r: i for i, r in enumerate(mask_rows)}
        own = [(j, where[r]) for j, r in enumerate(targets.tolist()) if r in where]
        if own:
            dev = logits.device
            apply_bitmask(back, bitmask.index_select(
                0, torch.tensor([i for _, i in own], dtype=torch.int64, device=dev)),
                torch.tensor([j for j, _ in own], dtype=torch.int64, device=dev))
    logits.index_copy_(0, targets, back)


def _top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Returns logits with excluded tokens at -inf. logits: [B, V] float32, already / temperature."""
    if batch.min_p is not None:
        probs = logits.softmax(-1)
        top = probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < batch.min_p[:, None] * top, float("-inf"))
    if batch.top_k is None and batch.top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(-1, descending=True)
    if batch.top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= batch.top_k[:, None], float("-inf"))
    if batch.top_p is not None:
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        # keep a token if the mass strictly before it is < top_p (always keeps the first);
        # top_p 1 keeps every token (the rounded cumsum can reach 1 before the tail)
        remove = ((cum - probs) >= batch.top_p[:, None]) & (batch.top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, sorted_logits)


def mask_can_wait(p: SamplingParams) -> bool:
    """Whether a grammar mask commutes with this request's sampling, so that it may
    be applied only when the unmasked pick is refused (see the module docstring):
    greedy, or temperature alone. top-k / top-p / min-p choose their set from the
    distribution the mask changes; logprobs would report the unmasked pick's;
    min_tokens' ban of the end tokens must see the mask (`_ban`), and so must a ban
    (`_revive`)."""
    return p.logprobs is None and not p.min_tokens and not p.restricts_tokens and (
        p.greedy or (p.top_p >= 1.0 and p.top_k <= 0 and p.min_p <= 0))


def _ban(logits: torch.Tensor, banned: list[tuple[int, int]]) -> None:
    """min_tokens: the (row, token) pairs get -inf, except in a row where the grammar
    mask (applied before) allows nothing else: there the output is complete (a
    `choice` ended, a JSON document closed) and the grammar's end wins over
    min_tokens, which otherwise would leave the row no token at all."""
    rows, toks = [r for r, _ in banned], [t for _, t in banned]
    before = logits[rows, toks]
    logits[rows, toks] = float("-inf")
    urows = sorted(set(rows))
    empty = torch.isneginf(logits[urows]).all(-1).tolist()
    dead = {r for r, e in zip(urows, empty) if e}
    if dead:
        keep = [i for i, r in enumerate(rows) if r in dead]
        logits[[rows[i] for i in keep], [toks[i] for i in keep]] = before[keep]


# Spare uniforms a deferred sampled row keeps for `Sampler.candidates` (draws tried
# before its mask is filled); seeded rows draw them after their first two.
SPARE_DRAWS = 8


def _uniforms(seeds: list[int | None], device, spare: int = 0) -> torch.Tensor:
    """[B, 2 + spare] uniforms in (0, 1]: column 0 for the pick, column 1 for a
    redraw (`resample`), the rest for `candidates`; a seeded row draws them all
    from its own generator, the first two as when there are no spare ones."""
    n = 2 + spare
    u = torch.rand(len(seeds), n, device=device)
    if any(s is not None for s in seeds):
        gen = torch.Generator(device=device)
        for i, seed in enumerate(seeds):
            if seed is not None:
                gen.manual_seed(seed)
                u[i] = torch.rand(n, generator=gen, device=device)
    return 1.0 - u


def _tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, V] / temperature [B] (greedy rows, temperature 0, divided by 1)."""
    return logits / _divisor(temperature)[:, None]


def _divisor(temperature: torch.Tensor) -> torch.Tensor:
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def _weights(logits: torch.Tensor, temperature: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """Unnormalised softmax(logits / T): exp((logits - max) / T) in two passes
    (addcmul, exp) where a division and a softmax take four; `row_max` [B, 1]."""
    inv = (1.0 / _divisor(temperature))[:, None]
    return torch.addcmul(-row_max * inv, logits, inv).exp_()


def _row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B], indices [B]) of each row's first maximum: the C++ pass on CPU
    float32 (kernels/cpu_sampling.py: torch's index-returning max is not vectorized
    there, 1.8 ms vs 0.08 ms at [48, 49152]), else torch's `max` (the same result)."""
    if cpu_sampling.usable(x):
        return cpu_sampling.row_max(x)
    top = x.max(-1)
    return top.values, top.indices


def _best(x: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Rows `rows` of x: their k best (values, ids), value descending, ties in an
    unspecified order (torch.topk; the C++ pass orders them by id)."""
    if cpu_sampling.usable(x):
        vals, ids = cpu_sampling.row_topk(x, rows, k)
    else:
        vals, ids = x.index_select(0, rows).topk(min(k, x.shape[-1]), dim=-1)
    return vals.tolist(), ids.tolist()


def _fast_draw(logits: torch.Tensor, temperature: torch.Tensor, top: torch.Tensor,
               u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """`fallback` [B] with each row of temperature > 0 replaced by its draw from
    softmax(logits / T), uniform u [B]: `_weights` and `_draw`'s two levels in one C++
    pass over the row (kernels/cpu_sampling.draw; CPU float32 only); a draw landing on
    a zero weight (rounding at a block edge) keeps the fallback, as `_draw` does."""
    rows = (temperature > 0).nonzero()[:, 0]
    ids = cpu_sampling.draw(logits, rows, top.index_select(0, rows),
                            1.0 / temperature.index_select(0, rows),
                            u.index_select(0, rows)[:, None], _block(logits.shape[1]))[:, 0]
    out = fallback.clone()
    out.index_copy_(0, rows, torch.where(ids >= 0, ids, fallback.index_select(0, rows)))
    return out


@functools.lru_cache(maxsize=8)
def _block(vocab: int) -> int:
    """The divisor of `vocab` nearest its square root: block length for `_draw`."""
    return min((d for d in range(1, min(vocab, 4096) + 1) if vocab % d == 0),
               key=lambda d: d + vocab // d)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from probs [B, V] (not necessarily normalised) by inverse
    CDF, u [B] in (0, 1]: the first token whose cumulative probability reaches
    u * total. Two levels (block sums, then the one block the target falls in),
    because a cumulative sum over the whole vocabulary is the slowest pass here.
    A token of probability 0 (masked, filtered: -inf) spans no interval and is
    never drawn; the fallback to the row's most likely token only guards against
    rounding at a block edge."""
    rows, vocab = probs.shape
    size = _block(vocab)
    blocks = probs.view(rows, vocab // size, size)
    ends = blocks.sum(-1).cumsum(-1)                                     # [B, nb]
    target = (u * ends[:, -1])[:, None]
    b = torch.searchsorted(ends, target).clamp_max_(ends.shape[1] - 1)  # [B, 1]
    start = torch.where(b > 0, ends.gather(1, (b - 1).clamp_min(0)), torch.zeros_like(target))
    inner = blocks.gather(1, b[:, :, None].expand(rows, 1, size)).squeeze(1).cumsum(-1) + start
    j = torch.searchsorted(inner, target).clamp_max_(size - 1)
    idx = (b * size + j).squeeze(1)
    ok = probs.gather(1, idx[:, None]).squeeze(1) > 0
    return idx if bool(ok.all()) else torch.where(ok, idx, _row_max(probs)[1])


@dataclass(slots=True)
class _Kept:
    """What resample() needs of the rows whose mask was deferred: the step's logits
    themselves (nothing mutates them after the pick; a copy of the kept rows cost
    ~0.2 ms a step at batch 32) and which of their rows were kept."""
    logits: torch.Tensor                # [B, V] after bias, bans and penalties, before temperature
    rows: torch.Tensor                  # [K] int64: the kept rows of `logits`
    row_max: torch.Tensor               # [B] each row's maximum of `logits`
    temperature: torch.Tensor           # [K]
    redraw: torch.Tensor | None         # [K] the rows' second uniforms; None when all greedy
    spare: torch.Tensor | None = None   # [K, SPARE_DRAWS] uniforms for `candidates`


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
_FLOOR = torch.finfo(torch.float32).min      # a chosen token's logprob is never -inf in JSON


def _logprobs(logits: torch.Tensor, chosen: torch.Tensor, batch: SamplingBatch):
    k = max(batch.max_num_logprobs, 1)
    if cpu_sampling.usable(logits):
        # x - logsumexp(x) for the k best and the chosen token only: the C++ passes take
        # 0.2 + ~0.3 ms at [64, 49152] where log_softmax and topk(20) took 1.6 + 2.2
        lse = cpu_sampling.row_logsumexp(logits)[:, None]
        vals, top_idx = cpu_sampling.row_topk(
            logits, torch.arange(logits.shape[0], device=logits.device), k)
        top_vals = vals - lse                       # -inf stays -inf (a padded entry)
        chosen_lp = logits.gather(1, chosen[:, None]) - lse
    else:
        logp = logits.log_softmax(-1)
        top_vals, top_idx = logp.topk(k, dim=-1)
        chosen_lp = logp.gather(1, chosen[:, None])
    # the chosen token's 1-based rank (vLLM's Logprob.rank): 1 + tokens scored higher
    ranks = ((logits > logits.gather(1, chosen[:, None])).sum(-1) + 1).tolist()
    chosen_lp = chosen_lp[:, 0].clamp_min(_FLOOR).tolist()
    top_vals, top_idx = top_vals.tolist(), top_idx.tolist()
    out = []
    for i, n in enumerate(batch.num_logprobs):
        if n is None:
            out.append(None)
        else:
            top = [(t, v) for t, v in zip(top_idx[i][:n], top_vals[i][:n])
                   if v != float("-inf") and t >= 0]
            out.append((chosen_lp[i], top, ranks[i]))
    return out


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self._kept: _Kept | None = None

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch,
                 bitmask: torch.Tensor | None = None,
                 bitmask_rows: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> SamplerOutput:
        """logits: [B, V] float32 (mutated). bitmask: [M, ceil(V/32)] int32 for rows bitmask_rows.
        keep: [K] int64 rows whose mask was deferred (rows `mask_can_wait` allows):
        their state is kept until the next call for `resample`."""
        self._kept = None
        raw = (logits.clone() if batch.max_num_logprobs is not None
               and self.logprobs_mode == "raw_logprobs" else None)
        saved = (logits.index_select(0, batch.restricted)
                 if batch.restricted is not None and batch.restricted.numel() else None)
        if batch.logit_bias is not None:
            rows, ids, vals = batch.logit_bias
            logits.index_put_((rows, ids), vals.to(logits.dtype), accumulate=True)
        if batch.allowed is not None or batch.word_bans:
            _restrict(logits, batch)
        if bitmask is not None and bitmask.shape[0] > 0:
            apply_bitmask(logits, bitmask, bitmask_rows)
        if saved is not None:
            _revive(logits, saved, batch.restricted, bitmask, bitmask_rows)
        if batch.banned:
            _ban(logits, batch.banned)
        if batch.presence is not None or batch.frequency is not None or batch.repetition is not None:
            apply_penalties(logits, batch)
        u = None
        kept = keep is not None and keep.numel() > 0
        top, chosen = _row_max(logits)
        if not batch.all_greedy:
            u = _uniforms(batch.seeds, logits.device, SPARE_DRAWS if kept else 0)
            plain = batch.top_k is None and batch.top_p is None and batch.min_p is None
            if plain and cpu_sampling.usable(logits):
                chosen = _fast_draw(logits, batch.temperature, top, u[:, 0], chosen)
            else:
                probs = (_weights(logits, batch.temperature, top[:, None]) if plain else
                         _top_k_top_p_min_p(_tempered(logits, batch.temperature), batch).softmax(-1))
                chosen = torch.where(batch.temperature > 0, _draw(probs, u[:, 0]), chosen)
        if kept:
            self._kept = _Kept(logits, keep, top, batch.temperature.index_select(0, keep),
                               u[:, 1].index_select(0, keep) if u is not None else None,
                               u[:, 2:].index_select(0, keep) if u is not None else None)
        logprobs = (_logprobs(raw if raw is not None else logits, chosen, batch)
                    if batch.max_num_logprobs is not None else None)
        return SamplerOutput(token_ids=chosen.tolist(), logprobs=logprobs)

    def candidates(self, kept_rows: torch.Tensor, k: int) -> list[list[int]]:
        """For kept rows `kept_rows` (indices into the last call's `keep`), tokens to
        try in order before the mask: the first one a grammar allows is an exact
        masked pick. A greedy row: its `k` best tokens in the order a masked argmax
        prefers them (higher logit, then lower id), cut before the k-th best value (a
        token tied with it may lie outside the k) and before -inf; the first allowed
        IS the eager greedy pick. A sampled row: up to SPARE_DRAWS independent draws
        from its unmasked distribution (its spare uniforms): taking the first allowed
        one is rejection sampling, and with the masked redraw when none is allowed
        the pick still has exactly the masked distribution (`_deferred` docs)."""
        kept = self._kept
        assert kept is not None, "candidates without kept rows"
        rows_of = kept.rows.index_select(0, kept_rows)        # rows of kept.logits
        greedy = ((kept.temperature.index_select(0, kept_rows) <= 0).tolist()
                  if kept.redraw is not None else [True] * len(kept_rows))
        out: list[list[int]] = [[] for _ in greedy]
        if any(greedy):
            for i, (g, vs, ids) in enumerate(zip(greedy, *_best(kept.logits, rows_of, k))):
                if g:
                    edge = vs[-1]
                    out[i] = [t for _, t in sorted((-v, t) for v, t in zip(vs, ids)
                                                   if v > edge and v != float("-inf"))]
        sampled = [i for i, g in enumerate(greedy) if not g]
        if sampled and kept.spare is not None:
            rows = torch.tensor(sampled, dtype=torch.int64, device=kept.logits.device)
            which = rows_of.index_select(0, rows)                 # rows of kept.logits
            temp = kept.temperature.index_select(0, kept_rows).index_select(0, rows)
            u = kept.spare.index_select(0, kept_rows).index_select(0, rows)[:, :k].contiguous()
            if cpu_sampling.usable(kept.logits):
                idx = cpu_sampling.draw(kept.logits, which, kept.row_max.index_select(0, which),
                                        1.0 / temp, u,
                                        _block(kept.logits.shape[1]))
                fine = idx >= 0
            else:
                sub = kept.logits.index_select(0, which)
                weights = _weights(sub, temp, kept.row_max.index_select(0, which)[:, None])
                cdf = weights.cumsum(-1)
                idx = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_max_(cdf.shape[-1] - 1)
                fine = weights.gather(1, idx) > 0        # rounding at the end: never a zero
            for i, ids, ok in zip(sampled, idx.tolist(), fine.tolist()):
                out[i] = [t for t, o in zip(ids, ok) if o]
        return out

    def resample(self, kept_rows: torch.Tensor, bitmask: torch.Tensor) -> list[int]:
        """Picks again, masked, for kept rows `kept_rows` [R] (indices into the last
        call's `keep`) with bitmask [R, words]: greedy rows the token an eager mask would
        have given, sampled rows a redraw from the masked distribution."""
        k = self._kept
        assert k is not None, "resample without kept rows"
        logits = k.logits.index_select(0, k.rows.index_select(0, kept_rows))
        apply_bitmask(logits, bitmask)
        top, chosen = _row_max(logits)
        if k.redraw is not None:
            temp = k.temperature.index_select(0, kept_rows)
            redraw = k.redraw.index_select(0, kept_rows)
            if cpu_sampling.usable(logits):
                chosen = _fast_draw(logits, temp, top, redraw, chosen)
            else:
                drawn = _draw(_weights(logits, temp, top[:, None]), redraw)
                chosen = torch.where(temp > 0, drawn, chosen)
        return chosen.tolist()


def score_prompt(logits_fn, hidden: torch.Tensor, targets: list[int], k: int,
                 rows_per_chunk: int = 256) -> list[PromptLogprobs]:
    """Prompt logprobs of one request's rows. hidden: [R, H], row r predicts targets[r].

    logits_fn maps [r, H] -> [r, V] float32 (the model's lm_head); it runs on at most
    rows_per_chunk rows at a time so a long prompt never holds [R, V] at once.
    Each entry: the target's logprob and 1-based rank (1 + tokens strictly more
    likely), and the top-k (token id, logprob), best first. log_softmax in float32.
    """
    assert hidden.shape[0] == len(targets), (hidden.shape, len(targets))
    out: list[PromptLogprobs] = []
    tgt_all = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    for lo in range(0, len(targets), rows_per_chunk):
        logp = logits_fn(hidden[lo:lo + rows_per_chunk]).float().log_softmax(-1)   # [r, V]
        tgt = tgt_all[lo:lo + rows_per_chunk, None]
        tgt_lp = logp.gather(1, tgt)                                               # [r, 1]
        ranks = (logp > tgt_lp).sum(-1) + 1
        top_vals, top_idx = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], tgt[:, :0])
        for t, lp, rank, ids, vals in zip(tgt[:, 0].tolist(), tgt_lp[:, 0].tolist(), ranks.tolist(),
                                          top_idx.tolist(), top_vals.tolist()):
            out.append(PromptLogprobs(Logprob(t, lp), rank,
                                      [Logprob(i, v) for i, v in zip(ids, vals)]))
    return out
