"""The offline LLM under data parallelism: N EngineProcesses (each its own
EngineCore process, scheduler and KV cache) driven synchronously as one.

Owns: the N EngineProcesses, the Router (gateway/dp_router.py; the same
least-outstanding-work + prefix-affinity rule as the server) and which
engine holds which engine request. `EngineProcessGroup` has the surface `LLM`
uses from one EngineProcess: add_request / abort_requests / step /
has_unfinished_requests / check_prompt / get_stats / reset_prefix_cache / shutdown, plus
`tokenizer`, `max_model_len`, `vocab_size`, `info` (engine 0's).

The sub-requests of an n > 1 request (`<id>#<i>`, gateway/output_processor.py)
all go to the engine their parent was routed to; LLM's own ids never hold '#'.
"""
from __future__ import annotations


import zmq

from formwork.gateway.dp_router import Router, sum_stats
from formwork.gateway.engine_launch import Launcher, dp_engine_config, rank_launcher
from formwork.gateway.engine_process import POLL_MS, EngineProcess
from formwork.gpu.model_files import load_model_tokenizer
from formwork.schemas.config import EngineConfig
from formwork.schemas.engine import EngineCoreOutputs, EngineCoreRequest, EngineStats


def parent_id(engine_request_id: str) -> str:
    return engine_request_id.split("#", 1)[0]


class EngineProcessGroup:
    def __init__(self, config: EngineConfig, *, ready_timeout_s: float = 900.0,
                 launcher: Launcher | None = None, bind_host: str | None = None) -> None:
        """Starts every engine, then loads the tokenizer once while they load the model."""
        size = config.data_parallel_size
        self.config = config
        self.engines: list[EngineProcess] = []
        try:
            for i in range(size):
                self.engines.append(EngineProcess(
                    dp_engine_config(config, i), ready_timeout_s=ready_timeout_s,
                    launcher=rank_launcher(i, size, launcher), bind_host=bind_host,
                    wait=False))
            self.tokenizer = load_model_tokenizer(config.model, weights=config.reads_weights)
            for e in self.engines:
                e.tokenizer = self.tokenizer
                e.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        first = self.engines[0]
        self.info, self.max_model_len, self.vocab_size = first.info, first.max_model_len, first.vocab_size
        self.router = Router(size, config.block_size)
        self._parents: dict[str, list] = {}   # parent id -> [engine, reason, live sub-requests]
        self._engine_of: dict[str, int] = {}              # engine request id -> engine

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()

    # -- the EngineCore surface LLM uses ----------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        self.engines[0].check_prompt(ids)

    def add_request(self, req: EngineCoreRequest) -> None:
        parent = parent_id(req.request_id)
        if parent not in self._parents:
            self._parents[parent] = [*self.router.route(req.prompt_token_ids,
                                                        [True] * len(self.engines)), 0]
        entry = self._parents[parent]
        index, reason = entry[0], entry[1]
        entry[2] += 1
        max_tokens = req.sampling_params.max_tokens
        self.router.started(req.request_id, index, reason, len(req.prompt_token_ids),
                            self.max_model_len if max_tokens is None else max_tokens)
        self._engine_of[req.request_id] = index
        try:
            self.engines[index].add_request(req)
        except BaseException:
            self._done(req.request_id)
            raise

    def abort_requests(self, request_ids) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self._engine_of:
                by_engine.setdefault(self._engine_of[rid], []).append(rid)
        for index, ids in by_engine.items():
            try:
                self.engines[index].abort_requests(ids)
            finally:
                for rid in ids:
                    self._done(rid)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self) -> EngineCoreOutputs:
        """The outputs every engine with something to say has published (waits for
        at least one); EngineDiedError when a busy engine is gone."""
        busy = [e for e in self.engines if e.has_unfinished_requests()]
        if not busy:
            return EngineCoreOutputs(outputs=[])
        ready = [e for e in busy if e.has_buffered_output()]
        if not ready:
            poller = zmq.Poller()
            for e in busy:
                poller.register(e.output_socket, zmq.POLLIN)
            while not (events := dict(poller.poll(POLL_MS))):
                for e in busy:
                    e.check_alive()
            ready = [e for e in busy if e.output_socket in events]
        outputs = []
        for e in ready:
            outputs.extend(e.step().outputs)
        for o in outputs:
            self.router.progressed(o.request_id, len(o.new_token_ids))
            if o.finish_reason is not None:
                self._done(o.request_id)
        return EngineCoreOutputs(outputs=outputs)

    def _done(self, request_id: str) -> None:
        self.router.finished(request_id)
        if self._engine_of.pop(request_id, None) is None:
            return
        parent = parent_id(request_id)
        entry = self._parents[parent]
        entry[2] -= 1
        if entry[2] == 0:
            del self._parents[parent]

    def reset_prefix_cache(self) -> bool:
        """Every engine's; True only if each one emptied its cache."""
        done = [e.reset_prefix_cache() for e in self.engines]
        for i, ok in enumerate(done):
            if ok:
                self.router.forget_prefixes(i)
        return all(done)

    def get_stats(self) -> EngineStats:
        """The engines' reports added up."""
        return sum_stats([e.get_stats() for e in self.engines])
