"""Which data-parallel engine gets a request: least outstanding work, with
prefix affinity. Pure bookkeeping (no I/O, no asyncio), shared by the server's
DPEngineClient and the offline LLM's EngineProcessGroup.

Owns: per-engine gateway-side counters (requests in flight, outstanding
tokens), the last EngineStats each engine reported, and the affinity map
(prompt prefix -> the engines it was sent to). The callers own the engines and tell the
router what happened: `route` -> `started` -> `progressed`* -> `finished`.

The rule, for a request with prompt tokens `p` and `max_tokens` m (n choices):

    load(e)  = outstanding_tokens(e) + REQUEST_TOKENS * requests(e)
               + REQUEST_TOKENS * reported_waiting(e)        # engine saturated
               + KV_TOKENS * reported_kv_usage(e)            # 0..1, held blocks
    outstanding_tokens(e) = sum over its requests of prompt tokens
                            + n * (max_tokens - tokens generated so far)

Only engines that are ready are candidates. `least` = the candidate with the
smallest load (lowest index on a tie).

Prefix affinity, on the longest prefix seen: for each full block of the prompt
(block_size tokens, up to AFFINITY_BLOCKS blocks) the router keeps, under a
hash of the whole prefix up to that block, the engines it sent that prefix to
(engines that stopped being ready are dropped: a restarted engine's cache is
gone). The deepest prefix of the prompt with a holder gives the `holders`.
When some candidates hold it and others do not, the request goes to the least
loaded holder `home` unless it is overloaded: load(home) > OVERLOAD_RATIO *
load(least) + OVERLOAD_SLACK tokens; then it goes to `least` (reason "load").
When every candidate holds it (a system prompt all engines have served) or
none does, only the load decides. A prefix shared by every engine thus stops
pulling traffic to one of them, while a conversation's longer prefix keeps
going where it is cached. A request's sub-requests (n > 1) are one routing
decision: they all go to the same engine.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from formwork.schemas.engine import EngineStats

REQUEST_TOKENS = 64          # a request's fixed cost, in tokens (scheduling, a batch slot)
KV_TOKENS = 1024             # the cost of a full KV cache, in tokens
OVERLOAD_RATIO = 1.5
OVERLOAD_SLACK = 512         # tokens
AFFINITY_ENTRIES = 65536     # prefixes remembered (least recently routed dropped)
AFFINITY_BLOCKS = 64         # the deepest prefix looked at, in blocks


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
        self._holders: OrderedDict[int, set[int]] = OrderedDict()   # prefix hash -> engines
        self._in_flight: dict[str, _InFlight] = {}

    # -- decisions ------------------------------------------------------------------
    def route(self, prompt_ids: list[int], ready: list[bool]) -> tuple[int, str]:
        """(engine index, "affinity" | "load") for a new request; ValueError when no
        engine is ready. Does not count the request: call `started` once it is sent."""
        candidates = [i for i, ok in enumerate(ready) if ok]
        if not candidates:
            raise ValueError("no engine is ready")
        least = min(candidates, key=lambda i: (self.engines[i].load(), i))
        keys = self._keys(prompt_ids)
        chosen, reason = least, "load"
        holders = self._deepest_holders(keys, ready)
        if holders and len(holders) < len(candidates):
            home = min(holders, key=lambda i: (self.engines[i].load(), i))
            if self.engines[home].load() <= (self.overload_ratio * self.engines[least].load()
                                             + self.overload_slack):
                chosen, reason = home, "affinity"
        for key in keys:
            self._holders.setdefault(key, set()).add(chosen)
            self._holders.move_to_end(key)
        while len(self._holders) > AFFINITY_ENTRIES:
            self._holders.popitem(last=False)
        return chosen, reason

    def _deepest_holders(self, keys: list[int], ready: list[bool]) -> set[int]:
        for key in reversed(keys):
            holders = self._holders.get(key)
            if holders:
                holders.intersection_update(i for i in holders if i < len(ready) and ready[i])
                if holders:
                    return holders
        return set()

    def _keys(self, prompt_ids: list[int]) -> list[int]:
        """Chained hashes of the prompt's full-block prefixes, shallowest first."""
        bs, keys, h = self.block_size, [], 0
        for k in range(min(len(prompt_ids) // bs, AFFINITY_BLOCKS)):
            h = hash((h, tuple(prompt_ids[k * bs:(k + 1) * bs])))
            keys.append(h)
        return keys

    def forget_prefixes(self, engine: int | None = None) -> None:
        """An engine's prefix cache was emptied (every engine's with None): it holds
        none of the prefixes routed to it."""
        for key in list(self._holders):
            holders = self._holders[key]
            holders.difference_update(range(len(self.engines)) if engine is None else (engine,))
            if not holders:
                del self._holders[key]

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
