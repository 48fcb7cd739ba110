"""The bounded in-memory store of responses (`store: true`, the default) that
`previous_response_id` continues from and GET /v1/responses/{id} reads.

An LRU of the last `capacity` responses (1000 by default), per server process:
lost on restart, not shared between replicas. One writer: the event loop (the
handlers run on it, and nothing here awaits).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from formwork.gateway.errors import APIError

DEFAULT_CAPACITY = 1000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict              # the response object as sent (JSON)
    conversation: list[dict]    # chat messages: earlier turns, this input, this output;
                                # never the instructions (OpenAI does not carry them over)


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> StoredResponse:
        """The stored response (now the most recently used); 404 naming `param` if unknown."""
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found. This server keeps "
                           f"the last {self.capacity} stored responses in memory.",
                           type="invalid_request_error", param=param, code="response_not_found")
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        """Forgets a stored response; 404 naming `response_id` if unknown."""
        self.get(response_id, "response_id")
        del self._items[response_id]
