"""Shared fixtures: a tiny byte-level BPE tokenizer trained on the spot, and tiny random
Llama-family checkpoints written with numpy + safetensors (no torch, no network), both from
`jaxllm.testing`. Tests import `write_tiny_checkpoint` and `CHATML` from here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaxllm.testing import CHATML, write_tiny_checkpoint, write_tiny_tokenizer

__all__ = ["CHATML", "write_tiny_checkpoint", "write_tiny_tokenizer"]

# Tests run on the CPU: JAX stays off any accelerator a machine has, unless JAXLLM_TEST_DEVICE
# is set (to anything): then JAX picks its device as usual and the on-device test classes run
# there (`JAXLLM_TEST_DEVICE=1 pytest tests/test_attention_kernels.py -k OnDevice`).
if not os.environ.get("JAXLLM_TEST_DEVICE"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    """One engine shared by a module's engine tests (each test must leave it idle). Per module,
    not per session: built after `_fresh_jax_caches`, its warmed-up programs stay cached."""
    from jaxllm import LLM

    return LLM(
        tiny_model_dir,
        max_model_len=256,
        num_pages=128,
        max_num_seqs=16,
        max_num_batched_tokens=128,
    )


@pytest.fixture(scope="module", autouse=True)
def _fresh_jax_caches():
    """Each test module starts with JAX's in-memory caches empty. The suite compiles thousands
    of programs in one process, and JAX's lowering and compilation caches are LRUs of 1-4k
    entries: past that, a module-scoped engine's warmed-up programs can be evicted by other
    modules' and compile again, which the no-compilation-after-warmup checks then count (a
    serving process compiles a few dozen programs and never gets near)."""
    import jax

    jax.clear_caches()


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (long fuzz, soak, whole shape matrices, second and third variants
    of an end-to-end check the default suite makes once) run only when `-m` names them
    (`pytest -m slow`): the default suite must stay within CI's time."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
