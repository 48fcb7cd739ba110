"""Which data-parallel engine gets a request: least outstanding work, with
prefix affinity. Pure bookkeeping (no I/O, no asyncio), shared by the server's
DPEngineClient and the offline LLM's EngineProcessGroup.

Owns: per-engine gateway-side counters (requests in flight, outstanding
tokens), the last EngineStats each engine reported, and the affinity map
(first prompt block -> engine). The callers own the engines and tell the
router what happened: `route` -> `started` -> `progressed`* -> `finished`.

The rule, for a request with prompt tokens `p` and `max_tokens` m (n choices):

    load(e)  = outstanding_tokens(e) + REQUEST_TOKENS * requests(e)
               + REQUEST_TOKENS * reported_waiting(e)        # engine saturated
               + KV_TOKENS * reported_kv_usage(e)            # 0..1, held blocks
    outstanding_tokens(e) = sum over its requests of prompt tokens
                            + n * (max_tokens - tokens generated so far)

Only engines that are ready are candidates. `least` = the candidate with the
smallest load (lowest index on a tie). When the prompt has at least one full
block (`block_size` tokens) and that first block was routed before to an
engine `home` that is still a candidate, the request goes to `home` unless it
is overloaded: load(home) > OVERLOAD_RATIO * load(least) + OVERLOAD_SLACK
tokens; then it goes to `least` (reason "load"). The first engine a block
goes to stays its home until that engine is no longer ready. A request's
sub-requests (n > 1) are one routing decision: they all go to the same engine.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from formwork.schemas.engine import EngineStats

REQUEST_TOKENS = 64          # a request's fixed cost, in tokens (scheduling, a batch slot)
KV_TOKENS = 1024             # the cost of a full KV cache, in tokens
OVERLOAD_RATIO = 1.5
OVERLOAD_SLACK = 512         # tokens
AFFINITY_ENTRIES = 4096      # first blocks remembered (least recently routed dropped)


@dataclass(slots=True)
class EngineLoad:
    """Gateway-side counters of one engine plus its last report."""
    requests: int = 0
    tokens: int = 0                 # outstanding: prompt + remaining max_tokens (x n)
    reported_waiting: int = 0
    reported_running: int = 0
    reported_kv_usage: float = 0.0
    routed: dict[str, int] = field(default_factory=lambda: {"affinity": 0, "load": 0})

    def load(self) -> float:
        return (self.tokens + REQUEST_TOKENS * self.requests
                + REQUEST_TOKENS * self.reported_waiting + KV_TOKENS * self.reported_kv_usage)


@dataclass(slots=True)
class _InFlight:
    engine: int
    prompt_tokens: int
    remaining: int                  # max_tokens - generated, per choice
    n: int

    def tokens(self) -> int:
        return self.prompt_tokens + self.n * max(0, self.remaining)


class Router:
    def __init__(self, num_engines: int, block_size: int, *,
                 overload_ratio: float = OVERLOAD_RATIO,
                 overload_slack: float = OVERLOAD_SLACK) -> None:
        assert num_engines >= 1
        self.engines = [EngineLoad() for _ in range(num_engines)]
        self.block_size = block_size
        self.overload_ratio = overload_ratio
        self.overload_slack = overload_slack
        self._homes: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._in_flight: dict[str, _InFlight] = {}

    # -- decisions ------------------------------------------------------------------
    def route(self, prompt_ids: list[int], ready: list[bool]) -> tuple[int, str]:
        """(engine index, "affinity" | "load") for a new request; ValueError when no
        engine is ready. Does not count the request: call `started` once it is sent."""
        candidates = [i for i, ok in enumerate(ready) if ok]
        if not candidates:
            raise ValueError("no engine is ready")
        least = min(candidates, key=lambda i: (self.engines[i].load(), i))
        key = self._key(prompt_ids)
        if key is None:
            return least, "load"
        home = self._homes.get(key)
        if home is None or not ready[home]:
            self._homes[key] = least
            self._homes.move_to_end(key)
            while len(self._homes) > AFFINITY_ENTRIES:
                self._homes.popitem(last=False)
            return least, "load"
        self._homes.move_to_end(key)
        if self.engines[home].load() > (self.overload_ratio * self.engines[least].load()
                                        + self.overload_slack):
            return least, "load"
        return home, "affinity"

    def _key(self, prompt_ids: list[int]) -> tuple[int, ...] | None:
        if len(prompt_ids) < self.block_size:
            return None
        return tuple(prompt_ids[:self.block_size])

    # -- bookkeeping ----------------------------------------------------------------
    def started(self, request_id: str, engine: int, reason: str, prompt_tokens: int,
                max_tokens: int, n: int = 1) -> None:
        if request_id in self._in_flight:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        entry = _InFlight(engine, prompt_tokens, max_tokens, n)
        self._in_flight[request_id] = entry
        e = self.engines[engine]
        e.requests += 1
        e.tokens += entry.tokens()
        e.routed[reason] = e.routed.get(reason, 0) + 1

    def progressed(self, request_id: str, new_tokens_per_choice: int) -> None:
        """`new_tokens_per_choice` more tokens were generated (largest over choices)."""
        entry = self._in_flight.get(request_id)
        if entry is None or new_tokens_per_choice <= 0:
            return
        before = entry.tokens()
        entry.remaining -= new_tokens_per_choice
        self.engines[entry.engine].tokens -= before - entry.tokens()

    def finished(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed); idempotent."""
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return
        e = self.engines[entry.engine]
        e.requests -= 1
        e.tokens -= entry.tokens()
        assert e.requests >= 0 and e.tokens >= 0, (e.requests, e.tokens)

    def engine_of(self, request_id: str) -> int | None:
        entry = self._in_flight.get(request_id)
        return None if entry is None else entry.engine

    def report(self, engine: int, *, running: int, waiting: int, kv_usage: float) -> None:
        """The engine's own view (EngineStats), polled every ~second."""
        e = self.engines[engine]
        e.reported_running, e.reported_waiting, e.reported_kv_usage = running, waiting, kv_usage

    def forget_reports(self, engine: int) -> None:
        """The engine died: its last report no longer says anything."""
        self.report(engine, running=0, waiting=0, kv_usage=0.0)


def sum_stats(stats: list[EngineStats | None]) -> EngineStats | None:
    """The engines' reports added up (counts, blocks and seconds all add); None
    when no engine reported."""
    got = [s for s in stats if s is not None]
    if not got:
        return None
    return EngineStats(**{f: sum(getattr(s, f) for s in got)
                          for f in EngineStats.__struct_fields__})
