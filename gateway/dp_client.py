"""Data parallelism behind one gateway: N EngineCore processes, each with its
own scheduler, KV cache and grammar compile cache, each supervised by its own
EngineClient (spawn, handshake, restart with backoff, 503 for what it held).

Owns: the N EngineClients, the Router (gateway/dp_router.py: least outstanding
work + prefix affinity; which engine holds which request) and the stats
poller that feeds the router each engine's own report. Has the public surface
api_server uses from an EngineClient, so the server does not care which it
holds; with data_parallel_size == 1 the server uses a plain EngineClient.

An engine that dies fails only its own in-flight requests and is restarted
while the others serve; `on_fatal` is called only once every engine has
failed for good.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

from formwork.gateway.dp_router import Router, sum_stats
from formwork.gateway.engine_client import EngineClient
from formwork.gateway.engine_launch import Launcher, dp_engine_config, rank_launcher
from formwork.gateway.errors import APIError, EngineDeadError
from formwork.gateway.metrics import EngineSample
from formwork.gateway.output_processor import RequestOutput
from formwork.gateway.replay import replaying
from formwork.schemas.config import EngineConfig
from formwork.schemas.engine import EngineInfo, EngineStats, UtilityResult
from formwork.schemas.sampling import SamplingParams

log = logging.getLogger("formwork.gateway")
STATS_POLL_S = 0.75
UNBOUNDED_MAX_TOKENS = 1024      # what the router counts for max_tokens=None


class DPEngineClient:
    def __init__(self, config: EngineConfig, tokenizer=None, *, on_fatal=None,
                 launcher: Launcher | None = None, bind_host: str | None = None,
                 **engine_kwargs) -> None:
        """`launcher` starts every engine (each pinned to its own CUDA device when
        CUDA_VISIBLE_DEVICES lists one per engine); other keywords go to each
        EngineClient (ready_timeout_s, max_restarts, restart_backoff_s)."""
        size = config.data_parallel_size
        assert size >= 1
        self.config = config
        self.engines = [EngineClient(dp_engine_config(config, i), tokenizer,
                                     on_fatal=self._on_engine_failed,
                                     launcher=rank_launcher(i, size, launcher),
                                     bind_host=bind_host, name=f"engine {i}", **engine_kwargs)
                        for i in range(size)]
        self.router = Router(size, config.block_size)
        self.on_fatal = on_fatal
        self.tokenizer = tokenizer
        self._poller: asyncio.Task | None = None
        self._stats: list[EngineStats | None] = [None] * size

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        for e in self.engines:
            e.set_tokenizer(tokenizer)

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Start every engine at once; the first one's model info (all load the same
        model). Any engine failing to start fails the start."""
        results = await asyncio.gather(*(e.start() for e in self.engines), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self._poller = asyncio.create_task(self._poll_stats(), name="dp-stats-poller")
        return self.info

    async def _poll_stats(self) -> None:
        """Feed the router each engine's own view of its load (~every STATS_POLL_S)."""
        while True:
            self._stats = await self.get_engine_stats(timeout_s=STATS_POLL_S)
            await asyncio.sleep(STATS_POLL_S)

    def _on_engine_failed(self) -> None:
        """One engine gave up restarting; the server exits only when all have."""
        if all(e.state == "failed" for e in self.engines):
            log.error("every data-parallel engine has failed")
            if self.on_fatal is not None:
                self.on_fatal()
        else:
            log.error("an engine failed for good; %d of %d still serve",
                      sum(e.state == "ready" for e in self.engines), len(self.engines))

    def stop_restarts(self) -> None:
        for e in self.engines:
            e.stop_restarts()

    def end_requests(self, error: Callable[[], APIError]) -> None:
        for e in self.engines:
            e.end_requests(error)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
        await asyncio.gather(*(e.shutdown(timeout_s) for e in self.engines),
                             return_exceptions=True)

    # -- what the server reads -------------------------------------------------
    @property
    def state(self) -> str:
        """"ready" while any engine serves; else "starting", "restarting" or
        (every engine) "failed"."""
        states = {e.state for e in self.engines}
        for s in ("ready", "starting", "restarting"):
            if s in states:
                return s
        return "failed"

    def engine_states(self) -> list[dict]:
        return [{"engine": i, "state": e.state, "pid": e.pid, "restarts": e.restarts,
                 "requests": self.router.engines[i].requests}
                | ({"node": e.node} if e.node is not None else {})
                for i, e in enumerate(self.engines)]

    def engine_samples(self, stats: list[EngineStats | None]) -> list[EngineSample]:
        """Per-engine values for /metrics; `stats` from get_engine_stats()."""
        ready = self._ready()
        return [EngineSample(index=i, up=ready[i], restarts=e.restarts, stats=stats[i],
                             requests=load.requests, tokens=load.tokens, routed=dict(load.routed))
                for i, (e, load) in enumerate(zip(self.engines, self.router.engines))]

    @property
    def info(self) -> EngineInfo | None:
        """The first started engine's (all load the same model); None before any has."""
        return next((e.info for e in self.engines if e.info is not None), None)

    @property
    def pids(self) -> list[int | None]:
        return [e.pid for e in self.engines]

    @property
    def restarts(self) -> int:
        return sum(e.restarts for e in self.engines)

    @property
    def pid(self) -> int | None:
        return self.engines[0].pid

    @property
    def dead(self) -> bool:
        return all(e.dead for e in self.engines)

    def _ready(self) -> list[bool]:
        return [e.state == "ready" and not e.dead for e in self.engines]

    # -- requests ----------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Route to one engine (all n choices there), then as EngineClient.generate. A
        request whose engine died before it yielded anything is routed again, once,
        to an engine that is ready (the others keep serving while it restarts)."""
        async def retry(_err: EngineDeadError) -> bool:
            if not any(self._ready()):
                return False
            log.info("%s: its engine died before it produced anything; routed again", request_id)
            return True

        async with contextlib.aclosing(replaying(lambda: self._generate_on_one(
                request_id, prompt, prompt_token_ids, params), retry)) as gen:
            async for ro in gen:
                yield ro

    async def _generate_on_one(self, request_id: str, prompt: str | None,
                               prompt_token_ids: list[int], params: SamplingParams
                               ) -> AsyncIterator[RequestOutput]:
        try:
            index, reason = self.router.route(prompt_token_ids, self._ready())
        except ValueError:
            raise EngineDeadError() from None
        max_tokens = UNBOUNDED_MAX_TOKENS if params.max_tokens is None else params.max_tokens
        self.router.started(request_id, index, reason, len(prompt_token_ids), max_tokens,
                            params.n)
        try:
            async with contextlib.aclosing(self.engines[index].generate(
                    request_id, prompt, prompt_token_ids, params, replay=False)) as gen:
                async for ro in gen:
                    self.router.progressed(request_id, max(
                        (len(c.delta_token_ids) for c in ro.outputs), default=0))
                    yield ro
        finally:
            self.router.finished(request_id)

    async def abort(self, request_id: str) -> None:
        index = self.router.engine_of(request_id)
        if index is not None:
            await self.engines[index].abort(request_id)

    # -- utility calls -------------------------------------------------------------
    async def call_utility(self, method: str, timeout_s: float = 5.0) -> UtilityResult:
        """On the first ready engine."""
        for e, ok in zip(self.engines, self._ready()):
            if ok:
                return await e.call_utility(method, timeout_s)
        raise EngineDeadError()

    async def is_healthy(self, timeout_s: float = 5.0) -> bool:
        """True while at least one engine answers."""
        answers = await asyncio.gather(*(e.is_healthy(timeout_s) for e, ok
                                         in zip(self.engines, self._ready()) if ok))
        return any(answers)

    async def get_engine_stats(self, timeout_s: float = 5.0) -> list[EngineStats | None]:
        """Each engine's report (None for one that is down or does not answer); the
        router gets them too."""
        async def one(i: int, e: EngineClient) -> EngineStats | None:
            if e.state != "ready" or e.dead:
                self.router.forget_reports(i)
                return None
            try:
                s = await e.get_stats(timeout_s)
            except Exception:  # noqa: BLE001 - a busy or dying engine: no report this time
                return None
            self.router.report(i, running=s.num_running,
                               waiting=s.num_waiting + s.num_waiting_for_grammar,
                               kv_usage=(s.kv_total_blocks - s.kv_free_blocks)
                               / max(1, s.kv_total_blocks))
            return s
        return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines))))

    async def get_stats(self, timeout_s: float = 5.0) -> EngineStats:
        """All engines' reports added up; EngineDeadError when none answers."""
        total = sum_stats(await self.get_engine_stats(timeout_s))
        if total is None:
            raise EngineDeadError()
        return total
