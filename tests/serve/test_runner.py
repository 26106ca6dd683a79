"""The device side of a step: sampling (greedy, temperature + top-p, each request's own generator)
and the attention kernels a CUDA forward may use. Forwards over the shared KV cache are tested
through the engine (tests/serve/test_engine.py: the tokens of ``generate`` alone)."""
import torch

from deepseek_flash.serve.runner import RowRunner, SDPA_BACKENDS, sample


def hot(temperature=1.0, top_p=1.0, seed=None):
    from types import SimpleNamespace

    return SimpleNamespace(sched=SimpleNamespace(temperature=temperature, top_p=top_p), seed=seed, generator=None)


def test_sampling_rows_are_greedy_nucleus_and_the_given_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4, 1)
    logits[0, 2] = 5.0                                   # the greedy row's argmax
    gens = [hot(0.0), hot(1.0, 0.85, seed=1), hot(1.0, 0.6, seed=2), hot(1.0, seed=3)]
    draws = [sample(torch, logits, gens) for _ in range(4000)]
    cols = list(zip(*draws))
    assert set(cols[0]) == {2}                           # temperature 0: argmax, every time
    assert set(cols[1]) == {0, 1, 2}                     # top_p 0.85: 0.05 left out
    assert set(cols[2]) == {0, 1}                        # top_p 0.6: the first two
    freq = [cols[3].count(t) / 4000 for t in range(4)]
    assert all(abs(f - p) < 0.03 for f, p in zip(freq, probs.tolist())), freq
    # Renormalised nucleus: 0.5 / 0.8 of row 2's draws are token 0.
    assert abs(cols[2].count(0) / 4000 - 0.625) < 0.03


def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 260)
    alone = hot(0.8, 0.9, seed=7)
    solo = [sample(torch, logits[1:2], [alone])[0] for _ in range(50)]
    batch = [hot(1.2, seed=1), hot(0.8, 0.9, seed=7), hot(0.0)]
    together = [sample(torch, logits, batch)[1] for _ in range(50)]
    assert solo == together and len(set(solo)) > 1


def test_cudnn_attention_is_left_out_of_the_kernels_a_cuda_forward_may_use(tiny_reference):
    from torch.nn.attention import SDPBackend

    assert "CUDNN_ATTENTION" not in SDPA_BACKENDS and "MATH" in SDPA_BACKENDS
    assert all(isinstance(getattr(SDPBackend, name), SDPBackend) for name in SDPA_BACKENDS)
    runner = RowRunner(tiny_reference, rows=1, max_len=64)
    assert runner.sdpa is False                          # on the CPU the model's choice stands
    assert runner.cache.keys[0].shape[:1] == (1,) and runner.cache.max_len == 64
