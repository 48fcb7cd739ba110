"""ModelRunner: the only writer of K/V tensors and of the runner-side request
state. Packs a variable-length SchedulerOutput into one flat batch
(input ids / positions / slot mapping / block table), runs the model and
samples.

Contract with the scheduler: a request's full data arrives once (NewRequestData,
again after preemption), then only diffs (CachedRequestData with the tokens
scheduled this step). Requests in `finished_req_ids` are dropped.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from formwork.gpu.cuda_graph import DecodeGraphRunner
from formwork.gpu.sampler import (Sampler, SamplingBatch, allowed_tensors, bad_word_bans,
                                  logit_bias_tensors, score_prompt)
from formwork.kernels import cpu_sampling
from formwork.schemas.sampling import SamplingParams
from formwork.schemas.scheduler import ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class _ReqState:
    req_id: str
    token_ids: list[int]            # prompt + outputs known to the runner
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    num_computed_tokens: int = 0
    scheduled: list[int] = field(default_factory=list)   # tokens scheduled this step


@dataclass(slots=True)
class _StepInputs:
    """Host-side flat batch; the forward path (graph or eager) builds the tensors."""
    input_ids: list[int]           # [T] new tokens, sequences contiguous
    positions: list[int]           # [T]
    query_lens: list[int]          # [num_seqs]
    seq_lens: list[int]            # [num_seqs] context incl. new tokens
    block_tables: list[list[int]]  # [num_seqs][blocks] (the requests' own lists: do not mutate)
    sample_rows: torch.Tensor      # [S] int64: flat index of the last token of each sampled req
    sample_req_ids: list[str]


def _token_seed(seed: int, output_index: int) -> int:
    """Seed of one token's draw: a function of (request seed, output position) only."""
    return (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class ModelRunner:
    def __init__(self, model, kv_caches, *, block_size: int, device: torch.device,
                 graphs: DecodeGraphRunner | None = None, logprobs_mode: str = "raw_logprobs",
                 samples: bool = True):
        """samples=False: a tensor-parallel rank other than 0, which runs the forward
        (its K/V shard) but computes no logits and never samples."""
        self.model = model
        self.samples = samples
        self.graphs = graphs            # captured decode graphs; None -> every step eager
        self.step_paths: collections.Counter[str] = collections.Counter()  # "graph" / "eager" forwards
        self.kv_caches = kv_caches      # list per layer of (k_cache, v_cache)
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(logprobs_mode)
        if device.type == "cpu" and samples:
            cpu_sampling.available()   # build the sampler's C++ pass now, not at the first request
        self.requests: dict[str, _ReqState] = {}
        self._plp_prompts: dict[str, list[int]] = {}   # prompts still to score (prompt_logprobs)
        self._plp_step: tuple[SchedulerOutput, dict] | None = None
        self._deferred: dict[str, int] = {}   # last sample()'s deferred request -> kept row

    # -- state -----------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in so.new_reqs:
            p = nr.sampling_params
            tokens = list(nr.prompt_token_ids) + list(nr.output_token_ids)
            st = _ReqState(nr.req_id, tokens, len(nr.prompt_token_ids), list(nr.block_ids), p, nr.eos_token_id,
                           nr.num_computed_tokens)
            n = so.num_scheduled_tokens[nr.req_id]
            st.scheduled = tokens[nr.num_computed_tokens:nr.num_computed_tokens + n]
            self.requests[nr.req_id] = st
        for cr in so.cached_reqs:
            st = self.requests[cr.req_id]
            st.block_ids.extend(cr.new_block_ids)
            st.num_computed_tokens = cr.num_computed_tokens
            del st.token_ids[cr.num_computed_tokens:]
            st.token_ids.extend(cr.new_token_ids)
            st.scheduled = list(cr.new_token_ids)

    # -- inputs ----------------------------------------------------------
    def _prepare(self, so: SchedulerOutput) -> _StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        last_row: dict[str, int] = {}
        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests[rid]
            assert len(st.scheduled) == n, (rid, len(st.scheduled), n)
            start = st.num_computed_tokens
            ids.extend(st.scheduled)
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(st.block_ids)
            last_row[rid] = len(ids) - 1
        rows = [last_row[r] for r in so.sampling_req_ids]
        return _StepInputs(
            input_ids=ids, positions=positions, query_lens=query_lens, seq_lens=seq_lens,
            block_tables=tables,
            sample_rows=torch.tensor(rows, dtype=torch.int64, device=self.device),
            sample_req_ids=list(so.sampling_req_ids),
        )

    def _forward(self, inp: _StepInputs) -> torch.Tensor:
        """hidden [T, hidden]: replay of a captured decode graph when one fits
        (pure decode, batch <= largest capture size), else the eager forward."""
        if self.graphs is not None and self.graphs.fits(inp.query_lens, inp.seq_lens):
            self.step_paths["graph"] += 1
            return self.graphs.run(inp.input_ids, inp.seq_lens, inp.block_tables)
        self.step_paths["eager"] += 1
        meta = self.model.attn_backend.build_metadata(inp.query_lens, inp.seq_lens, inp.block_tables,
                                                      self.block_size, self.device)
        ids = torch.tensor(inp.input_ids, dtype=torch.int64, device=self.device)
        positions = torch.tensor(inp.positions, dtype=torch.int64, device=self.device)
        return self.model(ids, positions, self.kv_caches, meta)

    # -- forward ---------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> torch.Tensor | None:
        """Runs the forward; returns logits [S, V] float32 for the sampled rows (None
        when nothing is sampled, and always on a rank with samples=False)."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return None
        inp = self._prepare(so)
        hidden = self._forward(inp)
        if not self.samples:
            return None
        self._plp_step = (so, self._prompt_logprobs(so, hidden))
        if not inp.sample_req_ids:
            return None
        return self.model.compute_logits(hidden.index_select(0, inp.sample_rows))

    @torch.inference_mode()
    def sample(self, so: SchedulerOutput, logits: torch.Tensor | None,
               bitmask: torch.Tensor | None, mask_req_ids: list[str] | None = None,
               deferred_req_ids: list[str] = ()) -> ModelRunnerOutput:
        """bitmask rows are for mask_req_ids (default: the plan's structured requests);
        deferred_req_ids: structured requests sampled without their mask this time,
        kept for `resample`."""
        req_ids = list(so.sampling_req_ids)
        step, self._plp_step = self._plp_step, None
        plp = step[1] if step is not None and step[0] is so and step[1] else None
        self._deferred = {}
        if logits is None or not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=plp)
        pos = {r: i for i, r in enumerate(req_ids)}
        rows = keep = None
        if bitmask is not None:
            masked = so.structured_req_ids if mask_req_ids is None else mask_req_ids
            rows = torch.tensor([pos[r] for r in masked], dtype=torch.int64, device=self.device)
            bitmask = bitmask.to(self.device)       # the grammar manager fills it on the host
        if deferred_req_ids:
            keep = torch.tensor([pos[r] for r in deferred_req_ids], dtype=torch.int64,
                                device=self.device)
            self._deferred = {r: i for i, r in enumerate(deferred_req_ids)}
        batch = self._sampling_batch(req_ids)
        out = self.sampler(logits, batch, bitmask, rows, keep)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=out.token_ids, logprobs=out.logprobs,
                                 prompt_logprobs=plp)

    @torch.inference_mode()
    def candidates(self, req_ids: list[str], k: int) -> list[list[int]]:
        """Sampler.candidates for deferred requests of the last sample()."""
        rows = torch.tensor([self._deferred[r] for r in req_ids], dtype=torch.int64, device=self.device)
        return self.sampler.candidates(rows, k)

    @torch.inference_mode()
    def resample(self, req_ids: list[str], bitmask: torch.Tensor) -> list[int]:
        """Masked picks for deferred requests of the last sample() (bitmask row i: req_ids[i])."""
        rows = torch.tensor([self._deferred[r] for r in req_ids], dtype=torch.int64, device=self.device)
        return self.sampler.resample(rows, bitmask.to(self.device))

    def _prompt_logprobs(self, so: SchedulerOutput, hidden: torch.Tensor) -> dict:
        """req_id -> (p, entries) for the prompt positions p.. computed this step by requests
        with prompt_logprobs (see ModelRunnerOutput). Only their rows reach the lm_head.
        hidden: [T, H], rows in num_scheduled_tokens order (as _prepare packs them)."""
        for rid in so.finished_req_ids:
            self._plp_prompts.pop(rid, None)
        for nr in so.new_reqs:   # resumed after outputs: the prompt was scored already
            if nr.sampling_params.prompt_logprobs is not None and not nr.output_token_ids:
                self._plp_prompts[nr.req_id] = list(nr.prompt_token_ids)
        out, row = {}, 0
        if not self._plp_prompts:
            return out
        for rid, n in so.num_scheduled_tokens.items():
            prompt = self._plp_prompts.get(rid)
            if prompt is not None:
                start = self.requests[rid].num_computed_tokens
                end = min(start + n, len(prompt) - 1)   # position p predicts prompt[p + 1]
                if end > start:
                    out[rid] = (start, score_prompt(
                        self.model.compute_logits, hidden[row:row + end - start],
                        prompt[start + 1:end + 1], self.requests[rid].params.prompt_logprobs))
                if start + n >= len(prompt) - 1:
                    del self._plp_prompts[rid]
            row += n
        return out

    def _sampling_batch(self, req_ids: list[str]) -> SamplingBatch:
        states = [self.requests[r] for r in req_ids]
        ps = [s.params for s in states]
        dev = self.device
        vocab = 1 << 62

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        all_greedy = all(p.greedy for p in ps)
        use_top_p = any(p.top_p < 1.0 for p in ps)
        use_top_k = any(p.top_k > 0 for p in ps)
        use_min_p = any(p.min_p > 0 for p in ps)
        use_pf = any(p.presence_penalty or p.frequency_penalty for p in ps)
        use_rep = any(p.repetition_penalty != 1.0 for p in ps)
        nlp = [p.logprobs for p in ps]
        # min_tokens: eos and stop ids cannot be sampled before that many outputs (as vLLM / HF)
        banned = []
        for row, (s, p) in enumerate(zip(states, ps)):
            if p.min_tokens and len(s.token_ids) - s.num_prompt_tokens < p.min_tokens:
                ids = list(p.stop_token_ids or []) + ([s.eos_token_id] if s.eos_token_id is not None else [])
                banned.extend((row, t) for t in ids)
        # rows with bans (logit_bias -100, allowed_token_ids, bad_words): the sampler gives
        # such a row its logits back when the bans leave no token the grammar allows
        restricted = [row for row, p in enumerate(ps) if p.restricts_tokens]
        return SamplingBatch(
            temperature=col([0.0 if p.greedy else p.temperature for p in ps]),
            top_p=col([p.top_p for p in ps]) if use_top_p else None,
            top_k=col([p.top_k if p.top_k > 0 else vocab for p in ps], torch.int64) if use_top_k else None,
            min_p=col([p.min_p for p in ps]) if use_min_p else None,
            all_greedy=all_greedy,
            seeds=[_token_seed(s.params.seed, len(s.token_ids) - s.num_prompt_tokens)
                   if s.params.seed is not None else None for s in states],
            presence=col([p.presence_penalty for p in ps]) if use_pf else None,
            frequency=col([p.frequency_penalty for p in ps]) if use_pf else None,
            repetition=col([p.repetition_penalty for p in ps]) if use_rep else None,
            output_token_ids=[s.token_ids[s.num_prompt_tokens:] for s in states] if use_pf else None,
            all_token_ids=[s.token_ids for s in states] if use_rep else None,
            max_num_logprobs=max((n for n in nlp if n is not None), default=None),
            num_logprobs=nlp,
            banned=banned or None,
            logit_bias=(logit_bias_tensors([p.logit_bias for p in ps], dev)
                        if any(p.logit_bias for p in ps) else None),
            allowed=(allowed_tensors([p.allowed_token_ids for p in ps], dev)
                     if any(p.allowed_token_ids for p in ps) else None),
            word_bans=(bad_word_bans([(p.bad_words_token_ids, s.token_ids[s.num_prompt_tokens:])
                                      for s, p in zip(states, ps)]) or None
                       if any(p.bad_words_token_ids for p in ps) else None),
            restricted=col(restricted, torch.int64) if restricted else None,
        )
