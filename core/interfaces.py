"""Seams the Scheduler depends on, as Protocols (implemented in grammar/)."""
from __future__ import annotations

from typing import Protocol

from formwork.schemas.structured import GrammarStatus, StructuredOutputsParams


class StructuredOutputManagerProtocol(Protocol):
    """Owner of per-request grammar matchers. The Scheduler only calls these."""

    def submit(self, request_id: str, params: StructuredOutputsParams,
               budget: int | None = None) -> None:
        """Start compiling the grammar (async); status() is "pending" meanwhile.
        `budget`: the most tokens the request may generate (budget-aware decoding)."""

    def status(self, request_id: str) -> GrammarStatus: ...

    def error(self, request_id: str) -> str:
        """Why compilation failed (status() == "failed"), or why the matcher refused
        to go on after accept_tokens() said False ('' if it simply refused a token)."""

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the matcher; False if a token is not allowed (nothing advanced)."""

    def is_terminated(self, request_id: str) -> bool: ...

    def budget_closed(self, request_id: str) -> bool:
        """Whether the output was steered to close within its token budget."""

    def budget_guard(self, request_id: str, token_id: int) -> int | None:
        """The token to commit in place of a sampled one that would leave the output
        no way to close within its budget (budget-aware decoding); None: keep it."""

    def jump_forward_tokens(self, request_id: str) -> list[int]:
        """Forced continuation, already accepted into the matcher; [] if none/disabled."""

    def remove(self, request_id: str) -> None:
        """Drop the request's matcher (finished, aborted or failed)."""
