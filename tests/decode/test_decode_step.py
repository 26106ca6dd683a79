"""decode.step: the masks and token choice of one step, exactly."""
import torch
from decode_models import tiny_model

from deepseek_flash.decode.step import MaskSpec, choose, decode_allowed, prefill_allowed, unsupported


def test_prefill_mask_is_causal_skips_padding_and_pads_see_themselves():
    allowed = prefill_allowed(4, 6, torch.tensor([0, 2]), None)
    assert allowed.shape == (2, 1, 4, 6)
    assert allowed[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                                            [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert allowed[1, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0],
                                            [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0]]


def test_prefill_mask_sliding_window():
    allowed = prefill_allowed(4, 4, torch.tensor([0]), 2)
    assert allowed[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_decode_mask_reads_up_to_the_slot():
    keys = torch.arange(8)
    allowed = decode_allowed(torch.tensor([4]), 6, torch.tensor([0, 3]), keys, None)
    assert allowed.shape == (2, 1, 1, 6)
    assert allowed[:, 0, 0].int().tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0]]
    windowed = decode_allowed(torch.tensor([4]), 6, torch.tensor([0]), keys, 3)
    assert windowed[0, 0, 0].int().tolist() == [0, 0, 1, 1, 1, 0]


def test_mask_kinds_follow_the_architecture():
    llama = MaskSpec(tiny_model("llama"))
    assert llama.windows == {"full_attention": None} and not llama.mapping
    mistral = MaskSpec(tiny_model("mistral", sliding_window=16))
    assert mistral.windows == {"full_attention": 16}
    qwen = MaskSpec(tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert qwen.mapping and qwen.windows == {"full_attention": None, "sliding_attention": 8}
    built = qwen.build(lambda w: prefill_allowed(3, 4, torch.tensor([0]), w))
    assert set(built) == {"full_attention", "sliding_attention"}


def test_eager_attention_gets_an_additive_mask():
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"
    spec = MaskSpec(model)
    mask = spec.build(lambda w: decode_allowed(torch.tensor([1]), 3, torch.tensor([0]), torch.arange(3), w))
    lowest = torch.finfo(torch.float32).min
    assert mask.dtype == torch.float32 and mask[0, 0, 0].tolist() == [0.0, 0.0, lowest]


def test_unsupported_names_the_reason():
    model = tiny_model("llama")
    assert unsupported(model) is None
    model.config._attn_implementation = "flex_attention"
    assert "flex_attention" in unsupported(model)


def test_choose_greedy_and_degenerate_sampling():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 2.5]])
    assert choose(logits, None).tolist() == [1, 0]
    one = torch.ones(1)
    assert choose(logits, (one, 1, None)).tolist() == [1, 0]          # top_k=1 keeps only the max
    assert choose(logits, (one, 0, torch.tensor([0.01]))).tolist() == [1, 0]   # top_p tiny: the max


def test_sampling_draws_from_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    draws = choose(logits, (torch.ones(1), 2, None))
    counts = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert counts[2] == 0 and counts[3] == 0                      # outside the top 2
    assert abs(counts[0].item() - 0.625) < 0.03                   # 0.5 / (0.5 + 0.3)
