"""Fast decode: a static KV cache and one captured CUDA graph per decode step.

``enable(model, capacity=...)`` (or ``load_model(..., decode="graphs")``) replaces the model's
``generate`` with ``GraphDecoder.generate``: the same call, the same tokens. The prompt runs once
through the model as today (prefill); every following token is one replay of a CUDA graph that
embeds the last token, runs every layer against a static KV cache, picks the next token on the
device (greedy, or temperature / top-k / top-p sampling) and advances the positions -- no host
sync, no Python per layer. What cannot be captured falls back, with a logged reason, to the same
static-cache step run eagerly (CPU, forward hooks, a capture that fails) or to transformers'
``generate`` (options the step does not implement: beams, logits processors, streamers, ...).

Decode steps run the model's own fused forward (``fused``: merged q|k|v and gate|up GEMVs,
rotary + cache write, residual add + norm, SiLU x up as one kernel each, ``kernels``) where the
model has the Llama structure and no forward hooks; a streamed model's slot ring runs inside it
as a fixed schedule (``client.stream.StaticRing``), so its copies are captured with the step.

Modules: ``cache`` (the static KV cache, a transformers ``Cache``), ``request`` (which
``generate()`` calls the step implements; pure), ``step`` (masks, positions, one forward through
transformers' modules, token choice), ``fused`` (the step's own forward), ``kernels`` (its fused
operations: Triton on CUDA, transformers' arithmetic on the CPU), ``engine`` (buckets, capture,
the decode loop).
"""
from .cache import KVStore, StaticKVCache
from .engine import DEFAULT_CAPACITY, LENGTH_BUCKET, GraphDecoder, enable

__all__ = ["DEFAULT_CAPACITY", "LENGTH_BUCKET", "GraphDecoder", "KVStore", "StaticKVCache", "enable"]
