"""Chat completion errors in an adapter's words, for the Responses and Messages adapters.

Each adapter turns its request into a chat completion request body and lets the chat's own
parsing check it (`protocol.parse_request`), so a refusal names the chat's parameters
(`max_completion_tokens`, `stop`, `messages.2.content`), which the adapter's client never
sent. `parse_chat_request` parses the body and renames them, in `param` and in the message,
to the adapter's.
"""

from __future__ import annotations

from server import protocol
from server.protocol import APIError


def parse_chat_request(
    body: dict, names: dict[str, str], *, messages_param: str | None = None
) -> protocol.ChatCompletionRequest:
    """The chat completion request of `body`, or the `APIError` its parsing raises with the
    chat's parameter names replaced by the adapter's (`names`: chat name -> adapter name).
    `messages_param`: the adapter's name for every error in the chat's messages (where the
    adapter's input does not map onto them one to one), else they keep the chat's."""
    try:
        return protocol.parse_request(protocol.ChatCompletionRequest, body)
    except APIError as e:
        message = e.message
        for old, new in names.items():
            message = message.replace(old, new)
        param = names.get(e.param, e.param)
        if messages_param is not None and param and param.startswith("messages"):
            param = messages_param
        raise APIError(e.status, message, e.type, param) from None
