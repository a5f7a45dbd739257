"""The GGUF loader on small files written with the `gguf` package the way llama.cpp's
converter writes them (`gguf_writer`: Q/K rows permuted, quantized linear layers), so no
download is needed. The newer architectures and the Gemma 3 demo file: test_gguf_models.py."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxllm.loaders import load_model
from jaxllm.loaders.gguf import iter_gguf

from conftest import write_tiny_checkpoint
from gguf_writer import Q, write_gguf
from helpers import prefill_logits


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tokenizer_dir):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("hf"), tokenizer_dir, num_heads=4, num_kv_heads=2, head_dim=16
    )


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantized_unpermuted_tensors(qtype, hf_dir, tmp_path):
    path = tmp_path / "m.gguf"
    expected = write_gguf(hf_dir, path, qtype)
    got = dict(iter_gguf(path))
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    if qtype == Q.F32:  # lossless: the original HF tensors come back exactly
        original = load_file(str(hf_dir / "model.safetensors"))
        for name in original:
            if name.startswith("model.layers.0."):
                np.testing.assert_array_equal(got[name], original[name])


def test_gguf_model_matches_transformers(hf_dir, tmp_path):
    """transformers loads the same GGUF (undoing the permutation itself): logits agree, ours
    dequantized as transformers' are (kept quantized, x would be rounded to 8 bits)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = tmp_path / "m.gguf"
    write_gguf(hf_dir, path, Q.Q8_0)
    loaded = load_model(path, dtype=jnp.float32, quantization="float")
    ids = list(range(3, 60))
    ours = prefill_logits(loaded.model, loaded.config, ids)
    ref_model = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32
    )
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
    diff = np.abs(ours - ref).max()
    print(f"GGUF Q8_0 tiny model: max abs logit diff vs transformers {diff:.2e}")
    assert diff < 1e-4 * max(1.0, np.abs(ref).max())
    # Tokenizer and chat template come from the GGUF metadata.
    tok = loaded.tokenizer
    ref_tok = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok.convert_tokens_to_ids("<|im_end|>") == ref_tok["<|im_end|>"]
    assert "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )


def test_clear_errors(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an existing path"):
        load_model(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(bad)
    other = tmp_path / "gpt2.gguf"
    write_gguf(hf_dir, other, Q.F32, arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(other)
    ints = tmp_path / "int.gguf"
    write_gguf_with_int_tensor(hf_dir, ints)
    with pytest.raises(ValueError, match="blk.0.attn_norm.weight"):
        list(iter_gguf(ints))


def write_gguf_with_int_tensor(hf_dir: Path, out: Path) -> None:
    """A file whose first norm is stored as I32, a type the loader cannot use as weights."""
    path = out.with_suffix(".tmp.gguf")
    write_gguf(hf_dir, path, Q.F32)
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(out), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.0.attn_norm.weight":
            w.add_tensor(t.name, data.astype(np.int32))
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_hf_loader_errors(tmp_path, hf_dir):
    with pytest.raises(ValueError, match="neither a Hugging Face checkpoint directory nor a .gguf"):
        (tmp_path / "weights.bin").write_bytes(b"x")
        load_model(tmp_path / "weights.bin")
    d = tmp_path / "arch"
    d.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(d)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(d)


def test_runtime_needs_no_torch(hf_dir, tmp_path):
    """Loading a GGUF (tokenizer conversion included) and generating work with torch absent."""
    import subprocess
    import sys

    path = tmp_path / "m.gguf"
    write_gguf(hf_dir, path, Q.Q8_0)
    code = f"""
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from jaxllm import LLM, SamplingParams
llm = LLM({str(path)!r}, max_model_len=64, num_pages=8, max_num_seqs=8, max_num_batched_tokens=32,
          attention_backend="xla")  # the C++ kernel would be built anew in the fresh cache
out = llm.generate("The quick brown", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    env = {**__import__("os").environ, "JAXLLM_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
    assert (tmp_path / "cache" / "tokenizers").is_dir()  # the converted tokenizer was cached


TEXTS = [
    "The quick brown fox",
    "Héllo wörld 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  spaces\tand\nlines  ",
]


def _assert_same_tokenizer(ours, ref):
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids)
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_torch_free_tokenizer_equals_transformers(hf_dir, tmp_path):
    pytest.importorskip("torch")  # transformers' own GGUF tokenizer path imports torch
    from transformers import AutoTokenizer

    from jaxllm.loaders.gguf import _tokenizer_from_metadata

    path = tmp_path / "m.gguf"
    write_gguf(hf_dir, path, Q.F32)
    _assert_same_tokenizer(
        _tokenizer_from_metadata(path), AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    )


@pytest.mark.demo_model
def test_torch_free_tokenizer_equals_transformers_on_demo_model():
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from jaxllm.loaders.gguf import _tokenizer_from_metadata
    from jaxllm.model_files import fetch_demo_model

    path = fetch_demo_model("smollm2-135m")
    _assert_same_tokenizer(
        _tokenizer_from_metadata(path),
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name),
    )
