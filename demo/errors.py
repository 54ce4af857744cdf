"""The error every layer of the demo raises for a request it refuses: answered as OpenAI's error
JSON by demo.api (status, message, param, code, type; Retry-After where given)."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        retry_after: int | None = None,  # seconds, sent as Retry-After (503, 429)
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
