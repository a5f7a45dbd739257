"""The OpenAI-compatible schema of `jaxllm serve`: request models and their validation, the
response models the handlers fill, OpenAI's error shape, and logprob formatting. Callers
import every name from the package; its modules, each one concern:

    errors       APIError, parse_request: pydantic's errors as 400s naming the param
    fields       field types, the base model, chat messages, chat template fields
    sampling     the fields completions and chat share, their ranges (SamplingParams'),
                 the generation defaults, to_sampling_params
    completions  CompletionRequest
    chat         ChatCompletionRequest (tools, tool_choice)
    tokenize     TokenizeRequest, DetokenizeRequest
    responses    the response bodies
    logprobs     jaxllm's logprobs in OpenAI's shapes

Data flow of one request through this package (the FastAPI app and the engine client own the
rest):

    body (a JSON dict)
      -> parse_request(CompletionRequest | ChatCompletionRequest | TokenizeRequest
                       | DetokenizeRequest, body)              every check of one field, or
                                                               of fields among themselves
      -> [server] model name (APIError.model_not_found), chat template
         (req.conversation(), req.template_kwargs()), tokenization (req.prompts()), and the
         engine's input checks (InputProcessor: prompt length and ids, the room left)
      -> req.to_sampling_params(default_max_tokens=max_model_len - prompt_len,
                                generation_defaults=...)       checks that need the room the
                                                               prompt leaves
      -> the engine's input checks of the SamplingParams (ids against the vocabulary)
      -> (request_id, prompt_token_ids, SamplingParams) to the engine
      -> CompletionResponse / ChatCompletionResponse, or their *StreamResponse chunks,
         with completion_logprobs / chat_logprobs formatting jaxllm's logprobs.

Contract with the app:

- Every failure is an `APIError` carrying the HTTP status; the app answers
  `JSONResponse(err.body(), status_code=err.status)` (in a stream: one
  `data: {json of err.body()}` event). `parse_request` turns pydantic's `ValidationError` into
  a 400 via `from_validation_error`; `to_sampling_params` raises `APIError` itself. Any other
  exception is a bug: log it and answer `APIError.internal()`, which never shows internals.
  Errors of the chat template (jinja2 `TemplateError`, `ValueError`) are the client's
  messages: answer `APIError.bad_request(..., param="messages")`.
- Unknown body fields are accepted and ignored (as in vLLM); `req.ignored_fields()` lists them
  for a log line.
- `error.type` follows vLLM: the name of the openai-python exception for the status
  ("BadRequestError", "AuthenticationError", "NotFoundError", "InternalServerError"; and
  "RequestTooLargeError", "ServiceUnavailableError", which openai-python has no class for);
  `error.code` is the status code.
- Sampling fields a request leaves unset (or sets to null) come from the model's
  `generation_defaults` (keys read: temperature, top_p, top_k, min_p, repetition_penalty,
  max_new_tokens), then from vLLM's neutral values. max_tokens (chat: max_completion_tokens,
  which wins over max_tokens):
    explicit number      -> that number; 400 if above default_max_tokens (vLLM's rule)
    explicit null        -> default_max_tokens (up to the end of the context)
    unset, completions   -> min(16, max_new_tokens, default_max_tokens) (OpenAI's default is
                            16; vLLM's min)
    unset, chat          -> min(max_new_tokens, default_max_tokens)
- Not supported, each a 400 naming the field: suffix, the legacy functions / function_call
  (other than empty or "none"), best_of != n, content parts other than text.
- Structured outputs (`StructuredOutputsParams`, in SamplingParams.structured_outputs), from
  at most one of: `response_format` ({"type": "json_object"}, or {"type": "json_schema",
  "json_schema": {"schema": ...}}; {"type": "text"} is none), vLLM's `structured_outputs` (a
  dict of StructuredOutputsParams fields), its older `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`, and, in chat, a `tool_choice` that forces a call.
  `guided_whitespace_pattern` applies to whichever is given; `guided_decoding_backend` is
  ignored (llguidance decodes all). Two of them, an unknown structured_outputs key, or a
  schema, regex or grammar that does not compile: a 400 naming the field the client used.
- Tools (chat): `tools` are checked (non-empty unique names, parameters a schema that
  compiles; a 400 names "tools", the message says where) and reach the chat template (as
  `tools=`, OpenAI's dicts) unless tool_choice is "none"; assistant messages may carry
  `tool_calls` (their JSON `arguments` reach the template parsed, as dicts), tool messages a
  `tool_call_id`. `tool_choice` is as in vLLM: unset with tools means "auto"; other than
  "none" it needs `tools` (an empty list makes "auto" and "required" "none"); a named
  function must be one of them. A named function constrains the output to its parameters
  schema; "required" to `tool_parsers.required_tool_calls_schema` (one call at most with
  `parallel_tool_calls: false`); "auto" leaves it free for the server's `--tool-call-parser`,
  and `check_tool_choice` is a 400 when the server has none. `server.tool_parsers` turns the
  output into `tool_calls` (ChatResponseMessage, DeltaMessage).
- Completions `prompt_logprobs: k` scores the prompt tokens; `echo` with `logprobs: k` asks
  the engine for prompt logprobs too, so the echoed prompt carries logprobs as in vLLM.
- chat_template_kwargs: only the keys of CHAT_TEMPLATE_KWARGS reach the template, each with
  its type. Arbitrary keys could shadow the template's own variables (messages, tools,
  bos_token, ...) or switch templates into paths nobody tested; add keys here when a
  supported model needs one.
"""

from __future__ import annotations

from server.protocol.chat import MAX_TOP_LOGPROBS, ChatCompletionRequest, TopLogprobs
from server.protocol.completions import MAX_PROMPTS, CompletionRequest
from server.protocol.errors import (
    MAX_ECHOED_CHARS,
    APIError,
    from_validation_error,
    parse_request,
)
from server.protocol.errors import _ParamError as _ParamError
from server.protocol.errors import _short as _short
from server.protocol.fields import (
    CHAT_TEMPLATE_KWARGS,
    ChatMessage,
    FunctionCallParam,
    ImageContentPart,
    ImageURL,
    StreamOptions,
    TextContentPart,
    ToolCallParam,
)
from server.protocol.fields import _integer as _integer
from server.protocol.fields import _Model as _Model
from server.protocol.fields import _token_list as _token_list
from server.protocol.logprobs import (
    LOGPROB_FLOOR,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
)
from server.protocol.responses import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    TokenizeResponse,
    ToolCall,
    UsageInfo,
    tool_call_id,
)
from server.protocol.responses import _id as _id
from server.protocol.responses import _now as _now
from server.protocol.responses import _Response as _Response
from server.protocol.sampling import (
    GENERATION_DEFAULT_KEYS,
    MAX_STOP,
    MAX_STOP_CHARS,
    BestOf,
    FrequencyPenalty,
    Logprobs,
    MaxTokens,
    MinP,
    MinTokens,
    N,
    PresencePenalty,
    PromptLogprobs,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopK,
    TopP,
)
from server.protocol.tokenize import DetokenizeRequest, TokenizeRequest

# The private names imported above as redundant aliases (`_Model as _Model`, ...) are what the
# Anthropic, Responses and pooling adapters build on; they stay importable from here as when
# this package was one module, outside __all__.
__all__ = [
    "APIError",
    "BestOf",
    "CHAT_TEMPLATE_KWARGS",
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "ChatResponseMessage",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionStreamResponse",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "FrequencyPenalty",
    "FunctionCall",
    "FunctionCallParam",
    "GENERATION_DEFAULT_KEYS",
    "ImageContentPart",
    "ImageURL",
    "LOGPROB_FLOOR",
    "Logprobs",
    "MAX_ECHOED_CHARS",
    "MAX_PROMPTS",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_TOP_LOGPROBS",
    "MaxTokens",
    "MinP",
    "MinTokens",
    "ModelCard",
    "ModelList",
    "N",
    "PresencePenalty",
    "PromptLogprobs",
    "RepetitionPenalty",
    "Seed",
    "StreamOptions",
    "Temperature",
    "TextContentPart",
    "TokenizeRequest",
    "TokenizeResponse",
    "ToolCall",
    "ToolCallParam",
    "TopK",
    "TopLogprobs",
    "TopP",
    "UsageInfo",
    "chat_logprobs",
    "completion_logprobs",
    "from_validation_error",
    "parse_request",
    "prompt_logprobs_json",
    "tool_call_id",
]
