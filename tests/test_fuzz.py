"""Fuzzing the HTTP API (issue 13): generated request bodies for every endpoint, against a real
`jaxllm serve` on a tiny model.

Bodies mix valid values (so requests reach the engine, with n, logprobs, stop strings,
penalties, streaming) with anything else: wrong types, huge and negative numbers, NaN and
infinities, nesting, giant strings, unicode (lone surrogates included), unknown fields.
Invariants: no 5xx (nor a 5xx error event inside a stream), every error in OpenAI's shape
with its status as `code`, and after the run the engine is idle (no running or waiting request,
no KV block held) and still serves.

The default suite runs 300 derandomized cases (the same ones every run); `pytest -m "slow or
not slow" tests/test_fuzz.py` runs 10,000 random ones too, then the idle check.
"""

from __future__ import annotations

import collections
import json
import math
import signal
import threading
import time

import httpx
import pytest
import test_server_e2e as e2e
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
SEEN: collections.Counter = collections.Counter()  # (path, status) over the module's cases


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    proc, url = e2e._start_server(tiny_model_dir, "--api-key", e2e.API_KEY)
    # Read the server's log as it comes: thousands of requests' access lines fill a pipe
    # nobody reads (64 KiB), and the server then blocks writing its log.
    tail: collections.deque[str] = collections.deque(maxlen=2000)
    reader = threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True)
    reader.start()
    with httpx.Client(base_url=url, headers=e2e.AUTH, timeout=120) as client:
        yield client
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    reader.join(10)
    log = "".join(tail)
    assert proc.returncode in (0, -signal.SIGTERM), log[-3000:]
    assert "Traceback" not in log, log[-5000:]


# ---- values ------------------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]
INTS = st.one_of(st.integers(-3, 20), st.sampled_from(EDGE_INTS), st.integers())
FLOATS = st.one_of(
    st.floats(-3, 3),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, -0.0, 5e-324, 1e-45]),
)
TEXT = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", " ", "\x00", "\ud800", "\u2028", "🙂", "<|im_end|>", "{{ 7*7 }}"]),
)
GIANT = st.sampled_from(["x" * 100_000, "🙂" * 20_000, "hello " * 20_000, "\ud83d" * 1000])
SCALAR = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
ANYTHING = st.one_of(
    st.recursive(
        SCALAR,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    ),
    GIANT,
)


def _field(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, valid, ANYTHING)  # valid two times out of three


TOKEN = st.integers(0, 520)  # the tiny vocabulary has 403 ids: some of these are outside
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}
)
SAMPLING = {
    "model": st.sampled_from(["tiny", "other"]),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.integers(-1, 600), st.just(2**31)),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(0, 2**63),
    "stop": st.one_of(
        st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)
    ),
    "stop_token_ids": st.lists(TOKEN, max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 8),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "prompt_logprobs": st.integers(0, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "priority": st.integers(-3, 3),
    "user": TEXT,
}
FIELDS = {
    "/v1/completions": {
        **SAMPLING,
        "prompt": st.one_of(
            st.text(min_size=1, max_size=40),
            st.lists(TOKEN, min_size=1, max_size=20),
            st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3),
            st.lists(st.lists(TOKEN, min_size=1, max_size=8), min_size=1, max_size=2),
        ),
        "logprobs": st.integers(0, 5),
        "echo": st.booleans(),
        "add_special_tokens": st.booleans(),
    },
    "/v1/chat/completions": {
        **SAMPLING,
        "messages": st.lists(MESSAGE, min_size=1, max_size=3),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "add_generation_prompt": st.booleans(),
        "chat_template_kwargs": st.dictionaries(st.text(max_size=8), SCALAR, max_size=2),
    },
    "/tokenize": {
        "model": st.sampled_from(["tiny", "other"]),
        "prompt": st.text(min_size=1, max_size=40),
        "messages": st.lists(MESSAGE, min_size=1, max_size=3),
        "add_special_tokens": st.booleans(),
    },
    "/detokenize": {
        "model": st.sampled_from(["tiny", "other"]),
        "tokens": st.lists(TOKEN, max_size=20),
    },
}


@st.composite
def requests(draw) -> tuple[str, object]:
    path = draw(st.sampled_from(ENDPOINTS))
    fields = FIELDS[path]
    names = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=10))
    body = {name: draw(_field(fields[name])) for name in names}
    # The one field each endpoint needs, usually there.
    required = {"/v1/completions": "prompt", "/v1/chat/completions": "messages",
                "/tokenize": "prompt", "/detokenize": "tokens"}[path]  # fmt: skip
    if required not in body and draw(st.integers(0, 4)):
        body[required] = draw(fields[required])
    if draw(st.integers(0, 9)) == 0:  # unknown fields
        body |= draw(st.dictionaries(st.text(max_size=10), ANYTHING, max_size=2))
    if draw(st.integers(0, 19)) == 0:  # not an object at all
        body = draw(ANYTHING)
    return path, body


# ---- invariants --------------------------------------------------------------------------


def _check(path: str, r: httpx.Response) -> None:
    SEEN[path, r.status_code] += 1
    assert r.status_code < 500, (path, r.status_code, r.text[:1000])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == r.status_code, err
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in r.text.split("\n") if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", r.text[-500:]
        for line in lines[:-1]:
            event = json.loads(line[6:])
            if "error" in event:
                assert event["error"]["code"] < 500, event
    else:
        r.json()


def body_bytes(body) -> bytes:
    """A generated body as sent: JSON (NaN and infinities as JavaScript spells them), or,
    where JSON cannot hold it (lone surrogates), its repr: not JSON, a 400 then."""
    try:
        return json.dumps(body).encode()
    except (UnicodeEncodeError, ValueError):
        return repr(body).encode("utf-8", "surrogatepass")


def _send(server: httpx.Client, path: str, body) -> None:
    content = body_bytes(body)
    r = server.post(path, content=content, headers={"content-type": "application/json"})
    _check(path, r)


FUZZ_SETTINGS = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(max_examples=300, derandomize=True, **FUZZ_SETTINGS)
@given(case=requests())
def test_fuzzed_bodies_get_no_5xx(server, case):
    _send(server, *case)


@pytest.fixture(scope="module")
def slow_selected(request) -> bool:
    # Nothing in the suite deselects `slow` tests (see tests/test_deploy.py): ask for them.
    return "slow" in (request.config.getoption("markexpr") or "")


@pytest.mark.slow
@settings(max_examples=10_000, **FUZZ_SETTINGS)
@given(case=requests())
def test_fuzzed_bodies_get_no_5xx_10000(server, slow_selected, case):
    if not slow_selected:
        pytest.skip("10,000 cases (about 3 minutes): pytest -m slow tests/test_fuzz.py")
    _send(server, *case)


def test_after_fuzzing_the_engine_is_idle_and_serving(server):
    """No request left behind, no KV block leaked, and the server still answers."""
    ok = sum(n for (_, status), n in SEEN.items() if status == 200)
    refused = sum(n for (_, status), n in SEEN.items() if 400 <= status < 500)
    assert ok >= 30 and refused >= 30, SEEN  # both sides of the API were exercised
    url = str(server.base_url).rstrip("/")
    deadline = time.monotonic() + 30
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    while True:
        values = [e2e._metric(url, name) for name in names]
        if values == [0, 0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert values == [0, 0, 0], dict(zip(names, values, strict=True))
    assert server.get("/health").status_code == 200
    r = server.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
