"""decode.request: which generate() calls the step implements, and what it reads from them."""
import pytest
import torch
from decode_models import tiny_model

from deepseek_flash.decode.request import DecodeRequest, Fallback, parse


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


IDS = torch.tensor([[5, 6, 7], [8, 9, 10]])


def test_greedy_defaults(model):
    req = parse(model, (IDS,), {"max_new_tokens": 7, "do_sample": False, "pad_token_id": 3})
    assert isinstance(req, DecodeRequest)
    assert (req.batch, req.prompt, req.new_tokens, req.pad, req.do_sample) == (2, 3, 7, 3, False)
    assert req.valid_from.tolist() == [0, 0]
    assert (req.top_k, req.top_p) == (0, 1.0)


def test_max_length_counts_the_prompt(model):
    assert parse(model, (), {"input_ids": IDS, "max_length": 10}).new_tokens == 7
    assert isinstance(parse(model, (IDS,), {"max_length": 3}), Fallback)


def test_eos_and_pad_resolution(model):
    req = parse(model, (IDS,), {"max_new_tokens": 2, "eos_token_id": [4, 9]})
    assert req.eos == [4, 9] and req.pad == 4          # pad falls back to the first eos, as generate does
    req = parse(model, (IDS,), {"max_new_tokens": 2, "eos_token_id": 4, "pad_token_id": 0})
    assert req.eos == [4] and req.pad == 0


def test_sampling_parameters(model):
    req = parse(model, (IDS,), {"max_new_tokens": 2, "do_sample": True, "temperature": 0.7,
                                "top_k": 20, "top_p": 0.9})
    assert (req.do_sample, req.temperature, req.top_k, req.top_p) == (True, 0.7, 20, 0.9)


def test_min_new_tokens_and_min_length(model):
    eos = {"eos_token_id": 4}
    assert parse(model, (IDS,), {"max_new_tokens": 9, "min_new_tokens": 5, **eos}).min_new == 5
    assert parse(model, (IDS,), {"max_new_tokens": 9, "min_length": 7, **eos}).min_new == 4  # prompt 3
    assert parse(model, (IDS,), {"max_new_tokens": 9, "min_length": 7, "min_new_tokens": 2,
                                 **eos}).min_new == 4
    assert parse(model, (IDS,), {"max_new_tokens": 9, "min_length": 2, **eos}).min_new == 0
    # No eos id: generate() adds no processor, nothing to suppress.
    assert parse(model, (IDS,), {"max_new_tokens": 9, "min_new_tokens": 5, "eos_token_id": None}).min_new == 0


def test_left_padding_gives_first_real_slot(model):
    mask = torch.tensor([[0, 0, 1], [1, 1, 1]])
    req = parse(model, (IDS,), {"attention_mask": mask, "max_new_tokens": 2})
    assert req.valid_from.tolist() == [2, 0]


@pytest.mark.parametrize("kwargs, words", [
    ({"num_beams": 2}, "num_beams=2"),
    ({"repetition_penalty": 1.3}, "repetition_penalty=1.3"),
    ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size=2"),
    ({"output_scores": True, "return_dict_in_generate": True}, "is not captured"),
    ({"streamer": object()}, "streamer"),
    ({"logits_processor": [lambda i, s: s]}, "logits_processor"),
    ({"use_cache": False}, "use_cache=False"),
    ({"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}, "left padding"),
    ({"attention_mask": torch.tensor([[0, 0, 0], [1, 1, 1]])}, "left padding"),
    ({"token_type_ids": torch.zeros(2, 3, dtype=torch.long)}, "token_type_ids"),
])
def test_what_falls_back(model, kwargs, words):
    got = parse(model, (IDS,), {"max_new_tokens": 3, **kwargs})
    assert isinstance(got, Fallback) and words in got.reason, got
