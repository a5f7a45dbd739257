"""The errors that cross packages: raised in one (the engine's input path, its core client,
the image processor) and caught in another (the server, `LLM`, the multimodal front end).

A leaf: it imports nothing of jaxllm, so any package may import it without depending on the
package that raises.
"""

from __future__ import annotations


class InputError(ValueError):
    """A request the engine cannot run, with the parameter to blame (a 400 on the server)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (its step raised); the engine itself goes on."""
