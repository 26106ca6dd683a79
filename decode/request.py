"""Which ``generate()`` calls the captured step implements, decided before any work (pure).

``parse(model, args, kwargs)`` returns a ``DecodeRequest`` (prompt, mask, new-token count, eos and
pad ids, the minimum new tokens before an eos, greedy or sampling parameters) or a ``Fallback`` naming the first option the step does not
implement; the engine then hands the call to transformers' own ``generate`` unchanged. The
generation config is merged exactly as ``generate`` merges it (``_prepare_generation_config``), so
the defaults a model ships (``generation_config.json``) apply the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

# Options the step honours.
HONOURED = {"max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature",
            "top_k", "top_p", "pad_token_id", "bos_token_id", "eos_token_id", "use_cache"}
# Options that do not change greedy/sampled decoding with one beam and no assistant.
INERT = {"cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
         "transformers_version", "early_stopping", "length_penalty", "decoder_start_token_id",
         "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
         "assistant_lookbehind", "target_lookbehind", "diversity_penalty", "is_assistant",
         "max_matching_ngram_size", "assistant_early_exit", "prefill_chunk_size",
         "continuous_batching_config", "low_memory", "generation_kwargs"}
# generate() arguments beside the config that the step cannot honour when given.
CALL_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
             "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
             "custom_generate", "assistant_tokenizer", "tokenizer")
# Per-call sampling buffers hold this many eos ids.
MAX_EOS = 16


@dataclass
class Fallback:
    reason: str


@dataclass
class DecodeRequest:
    input_ids: object            # (batch, prompt) int64, on the model's device
    valid_from: object           # (batch,) int64: index of each row's first real token (left padding)
    new_tokens: int
    eos: list
    pad: int
    do_sample: bool
    temperature: float
    top_k: int                   # 0: no top-k filter
    top_p: float                 # 1.0: no top-p filter
    min_new: int = 0             # eos ids cannot be chosen before this many new tokens (0: no rule)

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt(self) -> int:
        return int(self.input_ids.shape[1])


def _neutral(value, default) -> bool:
    return value is None or value is False or value == default


def parse(model, args: tuple, kwargs: dict):
    """A ``DecodeRequest`` for ``model.generate(*args, **kwargs)``, or a ``Fallback``."""
    import torch

    kwargs = dict(kwargs)
    for name in CALL_ARGS:
        if kwargs.pop(name, None) is not None:
            return Fallback(f"generate({name}=...) is not captured")
    if len(args) > 2:
        return Fallback("generate() with positional arguments beyond inputs and generation_config")
    inputs = args[0] if args else None
    for name in ("inputs", "input_ids"):
        if name in kwargs:
            if inputs is not None:
                return Fallback(f"generate() got the prompt twice ({name})")
            inputs = kwargs.pop(name)
    generation_config = args[1] if len(args) > 1 else kwargs.pop("generation_config", None)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 or inputs.shape[1] == 0:
        return Fallback("generate() without a 2-D tensor of prompt ids")
    attention_mask = kwargs.pop("attention_mask", None)
    try:
        config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    except Exception as exc:   # noqa: BLE001 -- transformers raises its own message; let it speak
        return Fallback(f"generation config not understood here ({exc})")
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
    if model_kwargs:
        return Fallback(f"generate() with model inputs {sorted(model_kwargs)}")
    get_defaults = getattr(config, "_get_default_generation_params", None)
    defaults = get_defaults() if get_defaults is not None else {}
    for key, value in vars(config).items():
        if key.startswith("_") or key in HONOURED or key in INERT:
            continue
        if not _neutral(value, defaults.get(key)):
            return Fallback(f"generate({key}={value!r}) is not captured")
    if config.use_cache is False:
        return Fallback("generate(use_cache=False)")

    batch, prompt = inputs.shape
    if config.max_new_tokens is not None:
        new = int(config.max_new_tokens)
    elif config.max_length is not None:
        new = int(config.max_length) - prompt
    else:
        new = 20 - prompt
    if new <= 0:
        return Fallback(f"no new tokens to generate (max_length {config.max_length}, prompt {prompt})")

    eos = config.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    if len(eos) > MAX_EOS:
        return Fallback(f"more than {MAX_EOS} eos ids")
    pad = config.pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    pad = int(pad) if pad is not None else (eos[0] if eos else 0)

    if attention_mask is None:
        valid_from = torch.zeros(batch, dtype=torch.int64, device=inputs.device)
    else:
        mask = attention_mask.to(device=inputs.device, dtype=torch.int64)
        if mask.shape != inputs.shape:
            return Fallback(f"attention_mask of shape {tuple(mask.shape)} for prompt {tuple(inputs.shape)}")
        valid_from = prompt - mask.sum(dim=1)
        cols = torch.arange(prompt, device=inputs.device)
        left_padded = (mask == (cols[None, :] >= valid_from[:, None]).to(torch.int64)).all()
        if not bool(left_padded) or bool((valid_from >= prompt).any()):
            return Fallback("attention_mask is not left padding (ones after zeros, a token per row)")

    # generate()'s MinLength / MinNewTokensLength processors: eos logits are -inf while the
    # sequence (prompt + new, padding included) is shorter than min_length, or fewer than
    # min_new_tokens new tokens exist; both only where there are eos ids.
    min_new = 0
    if eos:
        if config.min_length is not None and config.min_length > 0:
            min_new = max(min_new, int(config.min_length) - prompt)
        if config.min_new_tokens is not None and config.min_new_tokens > 0:
            min_new = max(min_new, int(config.min_new_tokens))

    do_sample = bool(config.do_sample)
    temperature = float(config.temperature) if config.temperature is not None else 1.0
    top_k = int(config.top_k) if config.top_k is not None else 0
    top_p = float(config.top_p) if config.top_p is not None else 1.0
    if do_sample and temperature <= 0:
        return Fallback(f"do_sample with temperature {temperature}")
    return DecodeRequest(inputs, valid_from, new, eos, pad, do_sample, temperature,
                         top_k if do_sample else 0, top_p if do_sample else 1.0, min_new)
