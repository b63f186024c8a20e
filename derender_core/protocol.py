"""Plain types shared by every layer: which endpoint, and what it answered.

The engine behaves like the render server's HTTP endpoints: a JSON body goes
in, a status and a JSON body come out. Keeping that shape means a record's
output is exactly what ``POST`` to ``vllm launch render`` would have returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Any

import orjson


class Endpoint(str, Enum):
    """The two derender endpoints of `vllm launch render`."""

    CHAT = "chat"
    COMPLETION = "completion"

    @property
    def path(self) -> str:
        """The HTTP path of the endpoint on the render server."""
        if self is Endpoint.CHAT:
            return "/v1/chat/completions/derender"
        return "/v1/completions/derender"

    @property
    def request_key(self) -> str:
        """The body field that carries the original OpenAI request."""
        return "chat_request" if self is Endpoint.CHAT else "completion_request"


@dataclass(frozen=True)
class Answer:
    """What the endpoint answered: HTTP status and the JSON body's bytes,
    exactly as the server would send them."""

    status: int
    raw: bytes

    @cached_property
    def body(self) -> dict[str, Any]:
        return orjson.loads(self.raw)

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def error_message(self) -> str:
        """The error's message, or "" for a successful answer."""
        if self.ok:
            return ""
        return str(self.body.get("error", {}).get("message", ""))
