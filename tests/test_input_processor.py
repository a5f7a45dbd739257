"""The front end's one input path (`InputProcessor`): the checks `LLM`, `AsyncLLM` and the
server share, and what it resolves for the core (max_tokens, seeds, EOS ids, the n
completions' ids and prefix parents)."""

from __future__ import annotations

import pytest

from jaxllm.engine.input_processor import InputProcessor, resolve_eos_token_ids
from jaxllm.errors import InputError
from jaxllm.sampling_params import SamplingParams


@pytest.fixture
def inputs() -> InputProcessor:
    return InputProcessor(None, eos_token_ids=(2, 7), vocab_size=100, max_model_len=50, seed=3)


def _error(fn, *args) -> InputError:
    with pytest.raises(InputError) as info:
        fn(*args)
    assert isinstance(info.value, ValueError)  # what library callers catch
    return info.value


def test_prompt_checks_name_the_parameter(inputs):
    assert inputs.check_prompt([5] * 30) == 20  # the room left
    err = _error(inputs.check_prompt, [], "messages")
    assert err.param == "messages" and "empty" in str(err)
    err = _error(inputs.check_prompt, [5, 100], "prompt")
    assert err.param == "prompt" and "token id 100 is outside the vocabulary [0, 100)" in str(err)
    err = _error(inputs.check_prompt, [5] * 50, "prompt")
    assert err.param == "prompt" and "50 tokens" in str(err) and "max_model_len" in str(err)
    # A huge id is shortened in the message, never echoed whole.
    assert len(str(_error(inputs.check_token_ids, [10**400], "tokens"))) < 120


def test_parameter_checks_against_the_vocabulary(inputs):
    """Issue 13, defect 1: a stop id outside the vocabulary is refused naming it (it used to
    overflow an int32 array in the runner and fail every request of the step)."""
    inputs.check_params(SamplingParams(stop_token_ids=[99], logit_bias={0: 1.0, 99: -1.0}))
    for bad in (100, 2**31):
        err = _error(inputs.check_params, SamplingParams(stop_token_ids=[bad], min_tokens=1))
        assert err.param == "stop_token_ids"
    assert _error(inputs.check_params, SamplingParams(logit_bias={100: 1.0})).param == "logit_bias"
    assert _error(inputs.check_params, {"temperature": 0}).param == "sampling_params"


def test_text_too_long_for_the_context_is_refused_before_tokenizing():
    class Tokenizer:
        def get_vocab(self):
            return {"a": 0, "abcd": 1}

        def encode(self, text, add_special_tokens=True):
            raise AssertionError("tokenized a text that cannot fit")

    inputs = InputProcessor(Tokenizer(), eos_token_ids=(), vocab_size=2, max_model_len=10)
    inputs.check_text_fits("x" * 80)  # 2 * 10 tokens * 4 characters
    err = _error(inputs.check_text_fits, "x" * 81, "messages")
    assert err.param == "messages" and "81 characters" in str(err)
    assert _error(inputs.tokenize, "x" * 81).param == "prompt"


def test_tokenize_forms(inputs):
    assert inputs.tokenize({"prompt_token_ids": [1, 2], "prompt": "hi"}) == ("hi", [1, 2])
    assert _error(inputs.tokenize, {"prompt_token_ids": ["a"]}).param == "prompt_token_ids"
    assert _error(inputs.tokenize, {"prompt_token_ids": [True]}).param == "prompt_token_ids"
    assert _error(inputs.tokenize, {"prompt_token_ids": [100]}).param == "prompt_token_ids"
    assert _error(inputs.tokenize, 3).param == "prompt"
    assert "no tokenizer" in str(_error(inputs.tokenize, "text"))


def test_requests_are_resolved_for_the_core(inputs):
    request = inputs.request("a", [5] * 45, SamplingParams(max_tokens=None, seed=11))
    assert (request.max_tokens, request.seed, request.eos_token_ids) == (5, 11, [2, 7])
    assert inputs.request("b", [5] * 10, SamplingParams(max_tokens=8)).max_tokens == 8
    assert inputs.request("c", [5] * 10, SamplingParams(max_tokens=80)).max_tokens == 40

    # No seed: a fresh one each time, from the processor's own generator (reproducible).
    def seeds():
        fresh = InputProcessor(None, eos_token_ids=(), vocab_size=100, max_model_len=50, seed=3)
        return [fresh.request("d", [5], SamplingParams()).seed for _ in range(3)]

    assert len(set(seeds())) == 3 and seeds() == seeds()


def test_fan_out_shares_the_first_completions_prompt(inputs):
    one = inputs.fan_out("r", [5, 6], SamplingParams(seed=4), priority=2)
    assert [(i, r.request_id, r.prefix_parent, r.priority) for i, r in one] == [(0, "r", None, 2)]
    many = inputs.fan_out("r", [5, 6], SamplingParams(n=3, seed=4))
    assert [(i, r.request_id, r.prefix_parent) for i, r in many] == [
        (0, "r-0", None),
        (1, "r-1", "r-0"),
        (2, "r-2", "r-0"),
    ]
    seeds = [r.seed for _, r in many]
    assert seeds[0] == 4 and len(set(seeds)) == 3
    assert seeds == [r.seed for _, r in inputs.fan_out("s", [5], SamplingParams(n=3, seed=4))]


def test_eos_ids_from_model_generation_config_and_tokenizer():
    class Tokenizer:
        eos_token_id = 9

    assert resolve_eos_token_ids([2], {"eos_token_id": [3, 2]}, Tokenizer()) == (2, 3, 9)
    assert resolve_eos_token_ids([], {"eos_token_id": 4}, None) == (4,)
