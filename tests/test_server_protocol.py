"""server/protocol/: request validation (400s naming the param), the conversion to
SamplingParams, logprob formatting and the JSON shapes of errors and responses. No HTTP."""

import json
import math

import pytest

from jaxllm.outputs import Logprob
from jaxllm.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_TOKEN_IDS,
    RANGES,
    SamplingParams,
)
from server.protocol import (
    MAX_ECHOED_CHARS,
    MAX_PROMPTS,
    MAX_STOP,
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    from_validation_error,
    parse_request,
)

MSGS = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields):
    return {"model": "m", "messages": MSGS, **fields}


# (request class, body, expected param)
BAD_BODIES = [
    # sampling ranges, on completions
    (CompletionRequest, completion(temperature=-0.1), "temperature"),
    (CompletionRequest, completion(temperature=2e4), "temperature"),  # SamplingParams' cap
    (CompletionRequest, completion(temperature=math.nan), "temperature"),
    (CompletionRequest, completion(temperature=math.inf), "temperature"),
    (CompletionRequest, completion(temperature=True), "temperature"),
    (CompletionRequest, completion(temperature="hot"), "temperature"),
    (CompletionRequest, completion(top_p=0.0), "top_p"),
    (CompletionRequest, completion(top_p=1.01), "top_p"),
    (CompletionRequest, completion(top_k=-2), "top_k"),
    (CompletionRequest, completion(top_k=2.5), "top_k"),
    (CompletionRequest, completion(min_p=1.5), "min_p"),
    (CompletionRequest, completion(min_p=-math.inf), "min_p"),
    (CompletionRequest, completion(presence_penalty=2.1), "presence_penalty"),
    (CompletionRequest, completion(frequency_penalty=-2.1), "frequency_penalty"),
    (CompletionRequest, completion(repetition_penalty=0.0), "repetition_penalty"),
    (CompletionRequest, completion(repetition_penalty=2.5), "repetition_penalty"),
    (CompletionRequest, completion(logit_bias={"abc": 1.0}), "logit_bias"),
    (CompletionRequest, completion(logit_bias={"-3": 1.0}), "logit_bias"),
    (CompletionRequest, completion(logit_bias={"5": 100.5}), "logit_bias"),
    (CompletionRequest, completion(logit_bias={"5": math.nan}), "logit_bias"),
    (CompletionRequest, completion(logit_bias=[1, 2]), "logit_bias"),
    (
        CompletionRequest,
        completion(logit_bias={str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
        "logit_bias",
    ),
    (CompletionRequest, completion(seed=2**64), "seed"),
    (CompletionRequest, completion(seed=-(2**63) - 1), "seed"),
    (CompletionRequest, completion(stop=[""]), "stop"),
    (CompletionRequest, completion(stop=5), "stop"),
    (CompletionRequest, completion(stop=["a", 1]), "stop"),
    (CompletionRequest, completion(stop=[f"s{i}" for i in range(MAX_STOP + 1)]), "stop"),
    (CompletionRequest, completion(stop_token_ids=[-1]), "stop_token_ids"),
    (CompletionRequest, completion(stop_token_ids=[True]), "stop_token_ids"),
    (
        CompletionRequest,
        completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
        "stop_token_ids",
    ),
    (CompletionRequest, completion(min_tokens=-1), "min_tokens"),
    (CompletionRequest, completion(min_tokens=10, max_tokens=5), "min_tokens"),
    (CompletionRequest, completion(max_tokens=0), "max_tokens"),
    (CompletionRequest, completion(max_tokens=-5), "max_tokens"),
    (CompletionRequest, completion(n=0), "n"),
    (CompletionRequest, completion(n=MAX_N + 1), "n"),
    (CompletionRequest, completion(best_of=3, n=2), "best_of"),
    (CompletionRequest, completion(logprobs=21), "logprobs"),
    (CompletionRequest, completion(logprobs=-1), "logprobs"),
    (CompletionRequest, completion(prompt_logprobs=21), "prompt_logprobs"),
    (
        CompletionRequest,
        completion(include_stop_str_in_output="maybe"),
        "include_stop_str_in_output",
    ),
    (CompletionRequest, completion(ignore_eos=[1]), "ignore_eos"),
    (CompletionRequest, completion(skip_special_tokens={}), "skip_special_tokens"),
    (CompletionRequest, completion(add_special_tokens="x"), "add_special_tokens"),
    (CompletionRequest, completion(stream_options={"include_usage": True}), "stream_options"),
    (
        CompletionRequest,
        completion(stream=True, stream_options={"include_usage": "x"}),
        "stream_options.include_usage",
    ),
    (CompletionRequest, completion(suffix="end"), "suffix"),
    (CompletionRequest, completion(response_format={"type": "xml"}), "response_format"),
    (CompletionRequest, completion(model=5), "model"),
    (CompletionRequest, completion(user=["u"]), "user"),
    # prompts
    (CompletionRequest, {"model": "m"}, "prompt"),
    (CompletionRequest, completion(prompt=None), "prompt"),
    (CompletionRequest, completion(prompt=""), "prompt"),
    (CompletionRequest, completion(prompt=[]), "prompt"),
    (CompletionRequest, completion(prompt=[[]]), "prompt"),
    (CompletionRequest, completion(prompt=[[1, 2], []]), "prompt"),
    (CompletionRequest, completion(prompt=["a", ""]), "prompt"),
    (CompletionRequest, completion(prompt=[1, -2]), "prompt"),
    (CompletionRequest, completion(prompt=[1, "a"]), "prompt"),
    (CompletionRequest, completion(prompt=[[1], [True]]), "prompt"),
    (CompletionRequest, completion(prompt=["p"] * (MAX_PROMPTS + 1)), "prompt"),
    (CompletionRequest, completion(prompt={"text": "x"}), "prompt"),
    # chat
    (ChatCompletionRequest, {"model": "m"}, "messages"),
    (ChatCompletionRequest, chat(messages=[]), "messages"),
    (ChatCompletionRequest, chat(messages="hi"), "messages"),
    (ChatCompletionRequest, chat(messages=["hi"]), "messages.0"),
    (ChatCompletionRequest, chat(messages=[{"content": "x"}]), "messages.0.role"),
    (ChatCompletionRequest, chat(messages=[{"role": "bot", "content": "x"}]), "messages.0.role"),
    (ChatCompletionRequest, chat(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    (
        ChatCompletionRequest,
        chat(
            messages=[
                {"role": "system", "content": "s"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "input_audio", "input_audio": {"data": "x"}},
                    ],
                },
            ]
        ),
        "messages.1.content.1.type",
    ),
    (
        ChatCompletionRequest,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
            ]
        ),
        "messages.0.content.0.image_url",
    ),
    (
        ChatCompletionRequest,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages.0.content.0.text",
    ),
    (
        ChatCompletionRequest,
        chat(messages=[{"role": "user", "content": "x", "name": 3}]),
        "messages.0.name",
    ),
    (ChatCompletionRequest, chat(temperature=-1), "temperature"),
    (ChatCompletionRequest, chat(top_logprobs=2), "top_logprobs"),
    (ChatCompletionRequest, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (ChatCompletionRequest, chat(logprobs="x"), "logprobs"),
    (ChatCompletionRequest, chat(max_completion_tokens=0), "max_completion_tokens"),
    (ChatCompletionRequest, chat(max_completion_tokens=3, min_tokens=5), "min_tokens"),
    (ChatCompletionRequest, chat(n=True), "n"),
    (ChatCompletionRequest, chat(cache_salt=""), "cache_salt"),
    (ChatCompletionRequest, chat(cache_salt=7), "cache_salt"),
    (ChatCompletionRequest, chat(stream_options={"include_usage": True}), "stream_options"),
    (
        ChatCompletionRequest,
        chat(add_generation_prompt=True, continue_final_message=True),
        "continue_final_message",
    ),
    (ChatCompletionRequest, chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
    (
        ChatCompletionRequest,
        chat(chat_template_kwargs={"chat_template": "{{ x }}"}),
        "chat_template_kwargs",
    ),
    (
        ChatCompletionRequest,
        chat(chat_template_kwargs={"enable_thinking": "yes"}),
        "chat_template_kwargs",
    ),
    (ChatCompletionRequest, chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (ChatCompletionRequest, chat(tools=[{"type": "function"}]), "tools"),
    (ChatCompletionRequest, chat(tool_choice="auto"), "tool_choice"),
    (ChatCompletionRequest, chat(functions=[{"name": "f"}]), "functions"),
    (ChatCompletionRequest, chat(response_format={"type": "json_schema"}), "response_format"),
    (ChatCompletionRequest, chat(logit_bias={"1.5": 2}), "logit_bias"),
    # tokenizer endpoints
    (TokenizeRequest, {"prompt": "a", "messages": MSGS}, "prompt"),
    (TokenizeRequest, {"messages": [{"role": "x"}]}, "messages.0.role"),
    (TokenizeRequest, {"prompt": 5}, "prompt"),
    (DetokenizeRequest, {"tokens": [1, -1]}, "tokens"),
    (DetokenizeRequest, {"tokens": "abc"}, "tokens"),
    (DetokenizeRequest, {}, "tokens"),
]


@pytest.mark.parametrize(
    "cls, body, param", BAD_BODIES, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_BODIES)]
)
def test_bad_body_is_400_naming_param(cls, body, param):
    with pytest.raises(APIError) as info:
        parse_request(cls, body)
    err = info.value
    assert err.status == 400
    assert err.param == param, err.message
    assert err.body() == {
        "error": {"message": err.message, "type": "BadRequestError", "param": param, "code": 400}
    }
    assert err.message and len(err.message) < 400
    json.dumps(err.body())


def test_table_is_large():
    assert len(BAD_BODIES) >= 30


def test_request_body_not_an_object():
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, [1, 2])
    assert info.value.param is None
    assert info.value.message == "The request body must be a JSON object."
    with pytest.raises(APIError) as info:
        parse_request(TokenizeRequest, {})
    assert (info.value.status, info.value.param) == (400, None)


def test_error_messages_never_echo_huge_inputs():
    huge = "9x" * 50_000
    for cls, body in [
        (CompletionRequest, completion(temperature=huge)),
        (CompletionRequest, completion(logit_bias={huge: 1.0})),
        (CompletionRequest, completion(prompt=[1, huge])),
        (ChatCompletionRequest, chat(chat_template_kwargs={huge: 1})),
        (ChatCompletionRequest, chat(messages=[{"role": huge, "content": "x"}])),
        (ChatCompletionRequest, chat(messages=[{"role": "user", "content": [{"type": huge}]}])),
    ]:
        with pytest.raises(APIError) as info:
            parse_request(cls, body)
        assert len(info.value.message) < 3 * MAX_ECHOED_CHARS, info.value.message


def test_from_validation_error_on_fastapi_style_errors():
    class FakeRequestValidationError:
        def errors(self):
            return [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}]

    err = from_validation_error(FakeRequestValidationError())
    assert (err.status, err.param, err.message) == (400, "messages", "messages is required")


def test_error_constructors():
    cases = {
        APIError.unauthorized(): (401, "AuthenticationError", None),
        APIError.model_not_found("gpt-9"): (404, "NotFoundError", "model"),
        APIError.too_large(): (413, "RequestTooLargeError", None),
        APIError.unavailable(): (503, "ServiceUnavailableError", None),
        APIError.internal(): (500, "InternalServerError", None),
    }
    for err, (status, type_, param) in cases.items():
        body = err.body()
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert (err.status, body["error"]["type"], body["error"]["param"]) == (status, type_, param)
        assert body["error"]["code"] == status
    assert APIError.model_not_found("gpt-9").message == "The model `gpt-9` does not exist."
    assert APIError.internal().message == "Internal server error."
    assert APIError.too_large(1024).message == (
        "The request body is too large (the limit is 1024 bytes)."
    )
    assert len(APIError.model_not_found("x" * 10_000).message) < 200
    assert APIError(429, "slow down", "RateLimitError", code="rate_limit").body()["error"][
        "code"
    ] == ("rate_limit")


# ----------------------------------------------------------------------- to SamplingParams


def sp(cls, body, default_max_tokens=1000, generation_defaults=None, **kwargs):
    req = parse_request(cls, body)
    return req.to_sampling_params(
        default_max_tokens=default_max_tokens,
        generation_defaults=generation_defaults or {},
        **kwargs,
    )


def test_completion_to_sampling_params_all_fields():
    body = completion(
        max_tokens=20,
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"7": -100, "42": 3.5},
        seed=-(2**63),
        stop=["\n\n", "END"],
        stop_token_ids=[2, 3],
        include_stop_str_in_output=True,
        ignore_eos=True,
        min_tokens=4,
        n=3,
        best_of=3,
        logprobs=5,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
        user="u",
        skip_special_tokens=False,
        add_special_tokens=False,
        response_format={"type": "text"},
        some_future_field={"x": 1},
    )
    body.pop("echo")  # echo with logprobs needs prompt logprobs
    got = sp(CompletionRequest, body)
    assert got == SamplingParams(
        n=3,
        max_tokens=20,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        seed=-(2**63),
        stop=["\n\n", "END"],
        stop_token_ids=[2, 3],
        include_stop_str_in_output=True,
        ignore_eos=True,
        min_tokens=4,
        logprobs=5,
        skip_special_tokens=False,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={7: -100.0, 42: 3.5},
    )
    req = parse_request(CompletionRequest, body)
    assert req.ignored_fields() == ["some_future_field"]
    assert req.add_special_tokens is False


def test_unset_fields_take_generation_defaults_explicit_ones_do_not():
    defaults = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "max_new_tokens": 64,
    }
    got = sp(ChatCompletionRequest, chat(), generation_defaults=defaults)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (
        0.6,
        0.95,
        20,
        0.1,
        1.1,
    )
    assert got.max_tokens == 64
    explicit = chat(temperature=0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    got = sp(ChatCompletionRequest, explicit, generation_defaults=defaults)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (
        0.0,
        1.0,
        0,
        0.0,
        1.0,
    )
    # Explicit null is unset (vLLM): the model's default applies.
    got = sp(
        ChatCompletionRequest, chat(temperature=None, top_k=None), generation_defaults=defaults
    )
    assert (got.temperature, got.top_k) == (0.6, 20)
    # No model default either: vLLM's neutral values.
    got = sp(ChatCompletionRequest, chat())
    assert got == SamplingParams(max_tokens=1000)


def test_max_tokens_resolution():
    # completions: unset is OpenAI's 16, capped by the model's max_new_tokens and the context
    assert sp(CompletionRequest, completion()).max_tokens == 16
    assert sp(CompletionRequest, completion(), 10).max_tokens == 10
    defaults = {"max_new_tokens": 8}
    assert sp(CompletionRequest, completion(), generation_defaults=defaults).max_tokens == 8
    # explicit null: up to the end of the context
    assert sp(CompletionRequest, completion(max_tokens=None), 300).max_tokens == 300
    assert sp(CompletionRequest, completion(max_tokens=300), 300).max_tokens == 300
    # chat: unset is up to the context, or the model's max_new_tokens
    assert sp(ChatCompletionRequest, chat(), 700).max_tokens == 700
    assert sp(ChatCompletionRequest, chat(), 700, defaults).max_tokens == 8
    assert sp(ChatCompletionRequest, chat(max_tokens=None), 700, defaults).max_tokens == 700
    # an explicit value wins over the model's default; max_completion_tokens over max_tokens
    assert sp(ChatCompletionRequest, chat(max_tokens=30), 700, defaults).max_tokens == 30
    body = chat(max_tokens=30, max_completion_tokens=40)
    assert sp(ChatCompletionRequest, body, 700).max_tokens == 40
    body = chat(max_tokens=30, max_completion_tokens=None)
    assert sp(ChatCompletionRequest, body, 700).max_tokens == 30
    assert sp(
        ChatCompletionRequest, chat(max_completion_tokens=None), 700, defaults
    ).max_tokens == (700)


@pytest.mark.parametrize(
    "cls, body, param",
    [
        (CompletionRequest, completion(max_tokens=101), "max_tokens"),
        (ChatCompletionRequest, chat(max_tokens=101), "max_tokens"),
        (ChatCompletionRequest, chat(max_completion_tokens=101), "max_completion_tokens"),
        (CompletionRequest, completion(min_tokens=50), "min_tokens"),  # max_tokens unset: 16
    ],
)
def test_max_tokens_beyond_the_context_is_400(cls, body, param):
    with pytest.raises(APIError) as info:
        sp(cls, body, default_max_tokens=100)
    assert (info.value.status, info.value.param) == (400, param)


def test_no_room_for_output_is_400():
    with pytest.raises(APIError) as info:
        sp(ChatCompletionRequest, chat(), default_max_tokens=0)
    assert info.value.param == "messages"


def test_logprobs_mapping():
    assert sp(ChatCompletionRequest, chat()).logprobs is None
    assert sp(ChatCompletionRequest, chat(logprobs=False)).logprobs is None
    assert sp(ChatCompletionRequest, chat(logprobs=None)).logprobs is None
    assert sp(ChatCompletionRequest, chat(logprobs=True)).logprobs == 0
    assert sp(ChatCompletionRequest, chat(logprobs=True, top_logprobs=7)).logprobs == 7
    assert sp(CompletionRequest, completion(logprobs=0)).logprobs == 0
    assert sp(CompletionRequest, completion(logprobs=20)).logprobs == 20
    assert sp(CompletionRequest, completion()).logprobs is None
    # Prompt logprobs: asked for, or implied by echo with logprobs (the echoed prompt's).
    assert sp(CompletionRequest, completion()).prompt_logprobs is None
    assert sp(CompletionRequest, completion(prompt_logprobs=3)).prompt_logprobs == 3
    assert sp(CompletionRequest, completion(echo=True, logprobs=2)).prompt_logprobs == 2
    assert sp(CompletionRequest, completion(echo=True)).prompt_logprobs is None
    assert sp(ChatCompletionRequest, chat(logprobs=True)).prompt_logprobs is None


def test_logit_bias_keys_become_token_ids():
    body = completion(logit_bias={"5": 1.0, 99: -1})
    assert sp(CompletionRequest, body).logit_bias == {5: 1.0, 99: -1.0}
    assert sp(CompletionRequest, completion(logit_bias={})).logit_bias is None


def test_sampling_params_errors_become_400s():
    # A generation default SamplingParams refuses (the second line of checks) still names it.
    with pytest.raises(APIError) as info:
        sp(ChatCompletionRequest, chat(), generation_defaults={"temperature": 1e9})
    assert (info.value.status, info.value.param) == (400, "temperature")


def test_request_ranges_are_sampling_params_ranges():
    # One range per parameter (RANGES): a request takes every bound SamplingParams takes
    # (temperature 2.5 as in vLLM, up to SamplingParams' cap) and refuses a value past one
    # with a 400 naming the field.
    for name, r in RANGES.items():
        step = 1 if r.kind is int else 0.5
        inside = [] if r.lo_open else [r.lo]
        outside = [r.lo if r.lo_open else r.lo - step]
        if r.hi is not None:
            inside.append(r.hi)
            outside.append(r.hi + step)
        for value in inside:
            expected = 0 if (name, value) == ("top_k", -1) else value  # -1 and 0: off
            assert getattr(sp(CompletionRequest, completion(**{name: value})), name) == expected
        for value in outside:
            with pytest.raises(APIError) as info:
                parse_request(CompletionRequest, completion(**{name: value}))
            assert (info.value.status, info.value.param) == (400, name), info.value.message
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: value})
    assert sp(ChatCompletionRequest, chat(temperature=2.5)).temperature == 2.5


def test_lenient_inputs_like_vllm():
    req = parse_request(CompletionRequest, completion(n=None, stream=None, echo=None, top_k=0))
    assert (req.n, req.stream, req.echo) == (1, None, None)
    req = parse_request(
        ChatCompletionRequest, chat(tools=[], tool_choice="none", temperature="0.5")
    )
    assert req.temperature == 0.5
    assert sp(CompletionRequest, completion(stop="END")).stop == ["END"]


def test_prompts():
    def prompts(prompt):
        return parse_request(CompletionRequest, completion(prompt=prompt)).prompts()

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def test_chat_conversation_and_template_kwargs():
    body = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "ann",
            },
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "developer", "content": "d"},
        ],
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"},
    )
    req = parse_request(ChatCompletionRequest, body)
    assert req.conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
        {"role": "developer", "content": "d"},
    ]
    assert req.template_kwargs() == {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "enable_thinking": False,
        "reasoning_effort": "low",
    }


def test_tokenize_and_detokenize_requests():
    req = parse_request(TokenizeRequest, {"prompt": "hello"})
    assert (req.prompt, req.add_special_tokens, req.messages) == ("hello", True, None)
    req = parse_request(TokenizeRequest, {"model": "m", "messages": MSGS})
    assert req.add_special_tokens is False  # the chat template holds the BOS token
    assert req.conversation() == MSGS
    assert req.template_kwargs()["add_generation_prompt"] is True
    req = parse_request(TokenizeRequest, {"messages": MSGS, "add_special_tokens": True})
    assert req.add_special_tokens is True
    assert parse_request(DetokenizeRequest, {"tokens": [0, 5]}).tokens == [0, 5]


# ------------------------------------------------------------------------------- logprobs

# Two generated tokens over a 4-token vocabulary {10: "A", 11: "B", 12: "C", 13: "é"}; the
# engine gives per step the top tokens by rank plus the sampled one.
TOKENS = [11, 13]
STEPS = [
    {
        10: Logprob(-0.5, 1, "A"),
        11: Logprob(-1.25, 2, "B"),
        12: Logprob(-2.0, 3, "C"),
    },
    {
        10: Logprob(-0.1, 1, "A"),
        13: Logprob(-math.inf, 4, None),  # sampled, not in the top: decoded by the tokenizer
    },
]
VOCAB = {10: "A", 11: "B", 12: "C", 13: "é"}


def test_completion_logprobs():
    got = completion_logprobs(TOKENS, STEPS, 1, VOCAB.__getitem__, initial_text_offset=5)
    assert got == {
        "tokens": ["B", "é"],
        "token_logprobs": [-1.25, -9999.0],
        "top_logprobs": [{"A": -0.5, "B": -1.25}, {"A": -0.1, "é": -9999.0}],
        "text_offset": [5, 6],
    }
    got = completion_logprobs(TOKENS, STEPS, 0, VOCAB.__getitem__)
    assert got["top_logprobs"] == [{"B": -1.25}, {"é": -9999.0}]
    assert got["text_offset"] == [0, 1]
    # Tokens without logprobs (e.g. an echoed prompt) have None entries.
    got = completion_logprobs([12, 11], [None, STEPS[0]], 2, VOCAB.__getitem__)
    assert got["tokens"] == ["C", "B"]
    assert got["token_logprobs"] == [None, -1.25]
    assert got["top_logprobs"][0] is None
    assert list(got["top_logprobs"][1]) == ["A", "B"]
    json.dumps(got, allow_nan=False)
    with pytest.raises(ValueError):
        completion_logprobs([1, 2], [None], 1, VOCAB.__getitem__)


def test_chat_logprobs():
    got = chat_logprobs(TOKENS, STEPS, 2, VOCAB.__getitem__)
    assert got == {
        "content": [
            {
                "token": "B",
                "logprob": -1.25,
                "bytes": [66],
                "top_logprobs": [
                    {"token": "A", "logprob": -0.5, "bytes": [65]},
                    {"token": "B", "logprob": -1.25, "bytes": [66]},
                ],
            },
            {
                "token": "é",
                "logprob": -9999.0,
                "bytes": [0xC3, 0xA9],
                "top_logprobs": [{"token": "A", "logprob": -0.1, "bytes": [65]}],
            },
        ]
    }
    got = chat_logprobs(TOKENS, STEPS, 0)
    assert [c["top_logprobs"] for c in got["content"]] == [[], []]
    assert got["content"][1]["token"] == "token_id:13"  # no decoded text, no tokenizer
    json.dumps(got, allow_nan=False)
    # The dicts fit the response models.
    ChatCompletionResponse(
        model="m",
        choices=[{"index": 0, "message": {"content": "Bé"}, "logprobs": got}],
        usage=UsageInfo.of(3, 2),
    )


# ------------------------------------------------------------------------------- responses


def test_completion_response_json():
    logprobs = completion_logprobs(TOKENS, STEPS, 1, VOCAB.__getitem__)
    resp = CompletionResponse(
        model="m",
        choices=[
            {"index": 0, "text": "Bé", "logprobs": logprobs, "finish_reason": "length"},
        ],
        usage=UsageInfo.of(3, 2),
    )
    data = json.loads(resp.model_dump_json())
    assert set(data) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "system_fingerprint",
        "kv_transfer_params",  # vLLM's: a prefiller's answer, else null
    }
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion"
    assert isinstance(data["created"], int) and data["system_fingerprint"] is None
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert data["choices"][0] == {
        "index": 0,
        "text": "Bé",
        "logprobs": logprobs,
        "finish_reason": "length",
        "stop_reason": None,
    }


def test_stream_chunks_json():
    chunk = CompletionStreamResponse(
        id="cmpl-1", model="m", choices=[{"index": 0, "text": "B", "finish_reason": None}]
    )
    assert "usage" not in json.loads(chunk.model_dump_json())
    last = CompletionStreamResponse(id="cmpl-1", model="m", choices=[], usage=UsageInfo.of(1, 1))
    assert json.loads(last.model_dump_json())["usage"]["total_tokens"] == 2

    first = ChatCompletionStreamResponse(
        id="chatcmpl-1", model="m", choices=[{"index": 0, "delta": {"role": "assistant"}}]
    )
    data = json.loads(first.model_dump_json())
    assert data["object"] == "chat.completion.chunk" and "usage" not in data
    assert data["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant"},
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
    ]
    mid = ChatCompletionStreamResponse(
        id="chatcmpl-1", model="m", choices=[{"index": 0, "delta": {"content": "Hi"}}]
    )
    assert mid.model_dump()["choices"][0]["delta"] == {"content": "Hi"}
    end = ChatCompletionStreamResponse(
        id="chatcmpl-1",
        model="m",
        choices=[{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}],
    )
    assert end.model_dump()["choices"][0]["delta"] == {}


def test_chat_response_json():
    resp = ChatCompletionResponse(
        model="m",
        choices=[{"index": 0, "message": {"content": "hello"}, "finish_reason": "stop"}],
        usage=UsageInfo.of(4, 1),
    )
    data = json.loads(resp.model_dump_json())
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert data["choices"][0]["logprobs"] is None


def test_model_list_json():
    card = ModelCard(id="smollm2-135m", max_model_len=2048, supported_tasks=["generate"])
    data = ModelList(data=[card]).model_dump()
    assert data["object"] == "list"
    card = data["data"][0]
    assert set(card) == {
        "id", "object", "created", "owned_by", "max_model_len", "supported_tasks", "root", "parent"
    }  # fmt: skip
    assert (card["object"], card["owned_by"], card["max_model_len"]) == ("model", "jaxllm", 2048)
    assert card["parent"] is None  # vLLM's: set on a LoRA adapter's card only
    assert card["supported_tasks"] == ["generate"]


def test_a_streamed_event_is_one_line_whatever_the_text_holds():
    """Text with characters str.splitlines (and httpx's aiter_lines) breaks on still gives one
    `data:` line per event, which decodes back to the same text."""
    from pydantic import BaseModel

    from server.generation import _sse

    class Chunk(BaseModel):
        text: str

    text = "a\u2028b\u2029c\x85d\ne\rf\x0bg\x1ch"
    event = _sse(Chunk(text=text))
    lines = event.splitlines()
    assert lines[1:] == [""] and event.endswith("\n\n"), lines
    assert json.loads(lines[0].removeprefix("data: "))["text"] == text
