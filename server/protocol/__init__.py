"""The OpenAI-compatible schema of `jaxllm serve` (see `server.protocol.sampling`, the module
this package grew from, until it is split by concern)."""

from server.protocol.sampling import *  # noqa: F403
from server.protocol.sampling import (  # noqa: F401
    _id,
    _integer,
    _Model,
    _now,
    _ParamError,
    _Response,
    _short,
    _token_list,
)
