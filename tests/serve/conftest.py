"""A tiny random fp32 Llama with a locally built byte-level tokenizer (no download), shared by the
serve tests: the raw checkpoint for the engine, a packed store for the server."""
from pathlib import Path

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread while these tests run: on the shared CI CPU, torch's spinning workers
    otherwise starve the server's event-loop thread (tenfold slower answers)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from deepseek_flash.testing import make_tiny_model, make_tiny_tokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", vocab_size=260, eos_token_id=256,
                           bos_token_id=None, pad_token_id=None)
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_reference(tiny_checkpoint):
    from deepseek_flash.testing import load_reference

    return load_reference(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
