"""GGUF files of Gemma 3, Qwen3 and Llama 3.1 (rope_freqs): tiny random checkpoints written by
transformers, converted the way llama.cpp does (`gguf_writer`), must come back as the same
Hugging Face tensors and an equivalent config; and the Gemma 3 270M demo file, when it is
fetched, must read as transformers reads it (config, tensors, tokenizer)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxllm.config import ModelConfig
from jaxllm.loaders.gguf import _tokenizer_from_metadata, gguf_hf_config, iter_gguf
from jaxllm.loaders.gguf_file import GGUFFile
from jaxllm.model_files import demo_model_path

from gguf_writer import SPM_SPECIALS, Q, llama3_rope_factors, write_gguf

torch = pytest.importorskip("torch")  # transformers writes the checkpoints

_CONFIGS = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        # 7 layers: the 6th is global, the others slide; query_pre_attn_scalar = head_dim, as
        # llama.cpp assumes for every size but the 27B.
        dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=16,
            max_position_embeddings=256,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        # head_dim 32 != hidden / heads (16): it must come from attention.key_length.
        dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
    ),
    "llama3.1": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
}


def _hf_checkpoint(name: str, out: Path) -> Path:
    """A tiny random checkpoint saved by transformers (every weight random, norms included)."""
    import transformers

    config_cls, model_cls, kwargs = _CONFIGS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(_CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_tensors_round_trip(checkpoint, qtype, tmp_path):
    """Every HF tensor comes back under its HF name, in HF layout: exactly what the file
    stores (un-permuted for llama, minus Gemma's +1 on norms), and close to the original."""
    name, hf_dir = checkpoint
    path = tmp_path / "m.gguf"
    expected = write_gguf(hf_dir, path, qtype, embed_type=qtype)
    original = load_file(str(hf_dir / "model.safetensors"))
    got = dict(iter_gguf(path))
    assert set(got) == set(original)  # rope_freqs is config, not a weight
    for key, value in original.items():
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
        # F32 is lossless but for Gemma's w + 1 - 1 (one rounding); Q8_0 keeps 8 bits a block.
        atol = 1e-6 if qtype == Q.F32 or value.ndim == 1 else np.abs(value).max() / 100
        np.testing.assert_allclose(got[key], value, rtol=0, atol=atol, err_msg=key)
    if name == "gemma3":  # the norms really were stored shifted
        raw = {t.name: t for t in GGUFFile(path).tensors}
        assert "blk.0.post_ffw_norm.weight" in raw and "blk.0.attn_q_norm.weight" in raw


def test_config_is_equivalent(checkpoint, tmp_path):
    """The config dict builds, in transformers' own config class and in ours, the model the
    checkpoint's config.json describes."""
    from transformers import AutoConfig

    name, hf_dir = checkpoint
    path = tmp_path / "m.gguf"
    write_gguf(hf_dir, path, Q.F32)
    ours = gguf_hf_config(GGUFFile(path))
    ref = AutoConfig.from_pretrained(hf_dir)
    rebuilt = type(ref)(**ours).to_dict()
    expected = ref.to_dict()
    fields = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "attention_bias",
    ]  # fmt: skip
    if name == "gemma3":  # (the made-up vocabulary has Gemma's special token ids)
        fields += [
            "bos_token_id", "pad_token_id", "layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
            "final_logit_softcapping", "attn_logit_softcapping", "rope_parameters",
        ]  # fmt: skip
    if name == "qwen3":
        fields += ["rope_parameters", "sliding_window"]
    for field in fields:
        assert rebuilt[field] == expected[field], field
    # GGUF stores the epsilon as float32.
    assert rebuilt["rms_norm_eps"] == pytest.approx(expected["rms_norm_eps"], rel=1e-6)

    # Our ModelConfig: the same, but for what GGUF spells differently.
    got, want = ModelConfig.from_hf_config(ours), ModelConfig.from_hf_config(expected)
    same = dict(
        rms_norm_eps=want.rms_norm_eps,
        eos_token_ids=want.eos_token_ids,
        bos_token_id=want.bos_token_id,
    )
    if name != "gemma3":  # transformers lists full attention per layer; none is the same
        assert not got.layer_types and set(want.layer_types) <= {"full_attention"}
        same["layer_types"] = want.layer_types
    if name == "llama3.1":  # rope_freqs instead of rope_scaling: checked below
        assert got.rope_freq_factors and not got.rope_scaling and want.rope_scaling
        same["rope_freq_factors"] = None
        want = dataclasses.replace(want, rope_scaling=None)
    assert dataclasses.replace(got, **same) == want
    if name == "gemma3":  # <eos> and the chat format's <end_of_turn>
        assert ours["eos_token_id"] == [1, SPM_SPECIALS.index("<end_of_turn>")]
    else:
        assert ours["eos_token_id"] == 1


def test_llama31_rope_freqs_reproduce_llama3_scaling(tmp_path):
    """rope_freq_factors divide the plain inverse frequencies into HF's llama3-scaled ones."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_dir = _hf_checkpoint("llama3.1", tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_gguf(hf_dir, path, Q.F32)
    ours = gguf_hf_config(GGUFFile(path))
    assert "rope_scaling" not in ours
    ref = AutoConfig.from_pretrained(hf_dir)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](ref, None)
    dim = ours["head_dim"]
    plain = 1.0 / ours["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factors = np.array(ours["rope_freq_factors"])
    np.testing.assert_allclose(factors, llama3_rope_factors(json.loads(ref.to_json_string())))
    assert factors.min() == 1.0 and factors.max() == 8.0  # both ends and the smooth middle
    np.testing.assert_allclose(plain / factors, hf_inv_freq.numpy(), rtol=1e-5)


def test_rope_scaling_metadata(tmp_path):
    """Linear scaling (Gemma 3 4B and up, global layers) and YaRN (gpt-oss) become
    rope_scaling; kinds we do not implement are refused by name."""
    from transformers import AutoConfig

    hf_dir = _hf_checkpoint("gemma3", tmp_path / "hf")

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)

    write_gguf(hf_dir, tmp_path / "linear.gguf", edit=linear)
    ours = gguf_hf_config(GGUFFile(tmp_path / "linear.gguf"))
    assert ours["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    rope = type(AutoConfig.from_pretrained(hf_dir))(**ours).rope_parameters
    assert rope["full_attention"]["rope_type"] == "linear"
    assert rope["full_attention"]["factor"] == 8.0
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_beta_fast(32.0)

    write_gguf(hf_dir, tmp_path / "yarn.gguf", edit=yarn)
    assert gguf_hf_config(GGUFFile(tmp_path / "yarn.gguf"))["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
    }

    def longrope(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_rope_scaling_factor(4.0)

    write_gguf(hf_dir, tmp_path / "longrope.gguf", edit=longrope)
    with pytest.raises(ValueError, match="rope scaling 'longrope'.*not supported"):
        gguf_hf_config(GGUFFile(tmp_path / "longrope.gguf"))


def test_gguf_model_matches_transformers(checkpoint, tmp_path):
    """End to end: our model loaded from the GGUF gives transformers' logits on the original."""
    import jax.numpy as jnp

    from jaxllm.loaders import load_model

    from helpers import prefill_logits

    name, hf_dir = checkpoint
    path = tmp_path / "m.gguf"
    write_gguf(hf_dir, path, Q.F32, embed_type=Q.F32)
    loaded = load_model(path, dtype=jnp.float32, load_tokenizer=False)
    ids = [2] + list(range(6, 60))  # longer than the tiny Gemma's sliding window of 16
    ours = prefill_logits(loaded.model, loaded.config, ids)
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
    diff = np.abs(ours - ref).max()
    print(f"{name} GGUF F32: max abs logit diff vs transformers {diff:.2e}")
    assert diff < 1e-3 * max(1.0, np.abs(ref).max())


def test_gemma3_tokenizer_gets_gemma_chat_template(tmp_path):
    """A Gemma 3 file without tokenizer.chat_template gets Gemma's, <bos> first and the system
    prompt folded into the first user turn; the file's BOS rule holds."""
    hf_dir = _hf_checkpoint("gemma3", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf")
    assert "tokenizer.chat_template" not in GGUFFile(tmp_path / "m.gguf").metadata
    tok = _tokenizer_from_metadata(tmp_path / "m.gguf")
    _assert_gemma_chat_template(tok)
    assert tok.encode("abc")[0] == 2  # add_bos_token: <bos> prepended


def _assert_gemma_chat_template(tok) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "bye"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
        "<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = tok.encode(text, add_special_tokens=False)  # how the engine tokenizes a chat
    assert ids[:2] == tok.convert_tokens_to_ids(["<bos>", "<start_of_turn>"])
    assert ids.count(tok.bos_token_id) == 1
    with pytest.raises(Exception, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)


def test_string_index_without_decoding(tmp_path):
    hf_dir = _hf_checkpoint("gemma3", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf")
    lazy = GGUFFile(tmp_path / "m.gguf")
    full = GGUFFile(tmp_path / "m.gguf", string_arrays=True)
    tokens = full.field("tokenizer.ggml.tokens")
    for text in ["<pad>", "<end_of_turn>", tokens[-1], "\u2581", "missing"]:
        want = tokens.index(text) if text in tokens else None
        assert lazy.string_index("tokenizer.ggml.tokens", text) == want, text
        assert full.string_index("tokenizer.ggml.tokens", text) == want, text
    assert lazy.string_index("general.architecture", "gemma3") is None  # not an array


def test_mixture_of_experts_gguf_of_a_dense_family_is_refused_clearly(tmp_path):
    """Experts in an architecture whose GGUF layout we know only dense (tests/test_gguf_families.py
    loads the MoE families)."""
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mixture-of-experts GGUF file of architecture 'qwen3'"):
        gguf_hf_config(GGUFFile(path))


# --- The Gemma 3 270M demo file (Q4_K_M), when fetched ---------------------------------------

TEXTS = [
    "Hello world",
    "  two leading spaces,  double  spaces and a trailing one ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "Héllo wörld — ünïcödé 🙂 日本語のテキスト Ελληνικά",
    "3.14159 and 1234567890, 2025-01-01",
    "def square(x):\n    return x ** 2  # comment\n",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "",
    " ",
]


@pytest.fixture(scope="module")
def gemma3_demo() -> Path:
    path = demo_model_path("gemma3-270m")
    if not path.is_file():
        pytest.skip(
            f"the gemma3-270m demo model is not fetched ({path}); `jaxllm fetch gemma3-270m`"
        )
    return path


@pytest.mark.demo_model
@pytest.mark.slow
def test_gemma3_demo_config_matches_transformers(gemma3_demo, request):
    """The config we read from the demo file equals transformers' own reading of it (~20 s of
    transformers parsing the file; the tiny GGUF files above check the same mapping, and the
    demo parity test the model it builds). Runs when asked for: pytest -m slow."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip(
            "transformers parses the demo file (~20 s): pytest -m slow tests/test_gguf_models.py"
        )
    from transformers import AutoConfig, Gemma3TextConfig

    ours = gguf_hf_config(GGUFFile(gemma3_demo))
    ref = AutoConfig.from_pretrained(gemma3_demo.parent, gguf_file=gemma3_demo.name).to_dict()
    rebuilt = Gemma3TextConfig(**ours).to_dict()
    for field in [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "rms_norm_eps", "rope_parameters", "sliding_window", "layer_types",
        "query_pre_attn_scalar", "hidden_activation", "final_logit_softcapping",
        "attn_logit_softcapping", "tie_word_embeddings", "attention_bias", "bos_token_id",
        "pad_token_id",
    ]:  # fmt: skip
        assert rebuilt[field] == ref[field], field
    assert ref["model_type"] == rebuilt["model_type"] == "gemma3_text"
    # transformers keeps the file's single EOS; we add <end_of_turn> as llama.cpp does.
    assert ref["eos_token_id"] == 1 and ours["eos_token_id"] == [1, 106]
    assert ours["architectures"] == ["Gemma3ForCausalLM"]
    ModelConfig.from_hf_config(ours)


@pytest.mark.demo_model
@pytest.mark.slow  # the smollm2 demo's case runs by default
def test_gemma3_demo_every_tensor_dequantizes(gemma3_demo):
    """Every tensor (F32, Q8_0, Q5_0, Q4_K, Q6_K) dequantizes to the name and shape of
    transformers' Gemma3ForCausalLM."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = {gguf.GGMLQuantizationType(t.ggml_type).name for t in GGUFFile(gemma3_demo).tensors}
    assert types == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    with torch.device("meta"):
        model = Gemma3ForCausalLM(Gemma3TextConfig(**gguf_hf_config(GGUFFile(gemma3_demo))))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    got = {}
    for name, w in iter_gguf(gemma3_demo):
        assert w.dtype == np.float32 and np.isfinite(w).all(), name
        got[name] = w.shape
    assert got == shapes


@pytest.mark.demo_model
def test_smollm2_demo_every_tensor_dequantizes():
    """The other demo file's types (F32, Q8_0, Q4_1) too."""
    path = demo_model_path("smollm2-135m")
    if not path.is_file():
        pytest.skip(f"the smollm2-135m demo model is not fetched ({path})")
    names = [name for name, w in iter_gguf(path) if w.dtype == np.float32 and np.isfinite(w).all()]
    assert len(names) == len(GGUFFile(path).tensors)


@pytest.mark.demo_model
@pytest.mark.slow
def test_gemma3_demo_tensors_equal_transformers(gemma3_demo, request):
    """Our tensors equal transformers' own GGUF load (~80 s on two cores). Nothing in the
    suite deselects `slow` tests (see tests/test_deploy.py), so this one runs when asked for."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip(
            "loads the model with transformers (~80 s): pytest -m slow tests/test_gguf_models.py"
        )
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        gemma3_demo.parent, gguf_file=gemma3_demo.name, dtype=torch.float32
    ).state_dict()
    for name, w in iter_gguf(gemma3_demo):
        np.testing.assert_array_equal(w, ref[name].numpy(), err_msg=name)


@pytest.mark.demo_model
@pytest.mark.slow  # 3.5 minutes: transformers converts the demo file's tokenizer
def test_gemma3_demo_tokenizer_matches_transformers(gemma3_demo, tmp_path):
    """Ours (built without torch, then cached and reloaded) encodes and decodes like
    transformers' GGUF tokenizer, BOS included, and renders Gemma's chat template."""
    from transformers import AutoTokenizer

    from jaxllm.loaders.gguf import load_gguf_tokenizer

    ref = AutoTokenizer.from_pretrained(gemma3_demo.parent, gguf_file=gemma3_demo.name)
    built = load_gguf_tokenizer(gemma3_demo, tmp_path)
    cached = load_gguf_tokenizer(gemma3_demo, tmp_path)
    assert ref.chat_template is None  # the file has none: ours is the fallback
    for ours in (built, cached):
        for text in TEXTS:
            ids = ref.encode(text)
            assert ids[0] == 2, text  # <bos>
            assert ours.encode(text) == ids, text
            assert ours.decode(ids) == ref.decode(ids), text
            assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
                ids, skip_special_tokens=True
            )
        assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
        assert ours.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
        _assert_gemma_chat_template(ours)
