"""The model skeleton: a ``transformers`` causal LM built without weight memory, and binding views.

``build_skeleton`` makes the model of a stored config with every parameter on the meta device
(~15 ms for an 8B shape); ``bind_parameters`` then makes each parameter a view of bytes the
controller holds. ``client.model`` (resident layers) and ``client.stream`` (streamed layers) both
bind through here.
"""
from __future__ import annotations

import contextlib
import threading

_meta = threading.local()          # .depth: this thread is inside meta_parameters()
_install_lock = threading.Lock()
_installed = {"count": 0, "original": None}


def _register_parameter(module, name, param):
    import torch

    if param is not None and getattr(_meta, "depth", 0):
        param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
    _installed["original"](module, name, param)


@contextlib.contextmanager
def meta_parameters():
    """Inside this block, parameters this thread registers go to the meta device; buffers
    (rotary tables) are made for real.

    Buffers are computed from the config in float32 exactly as ``from_pretrained`` computes them,
    which is what keeps logits bit-identical to a plain ``transformers`` load. torch offers no
    per-thread hook for parameter registration, so ``Module.register_parameter`` is wrapped while
    at least one thread is inside the block and the wrapper acts only for those threads: modules
    other threads build meanwhile keep real parameters, and the original method is back once the
    last thread leaves.
    """
    import torch

    with _install_lock:
        if _installed["count"] == 0:
            _installed["original"] = torch.nn.Module.register_parameter
            torch.nn.Module.register_parameter = _register_parameter
        _installed["count"] += 1
    _meta.depth = getattr(_meta, "depth", 0) + 1
    try:
        yield
    finally:
        _meta.depth -= 1
        with _install_lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                torch.nn.Module.register_parameter = _installed["original"]
                _installed["original"] = None


def _no_weight_init():
    """transformers' switch that skips initializing weights (they are all replaced by views):
    three quarters of building an 8B skeleton otherwise, even on meta."""
    try:
        from transformers.initialization import no_init_weights     # transformers >= 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4.x
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def build_skeleton(config_dict: dict):
    """A ``transformers`` causal LM of the stored config with all parameters on meta."""
    import transformers

    config = transformers.AutoConfig.for_model(**config_dict)
    with meta_parameters(), _no_weight_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    return model


def bind_parameters(model, tensors: dict, complete: bool = True, fixed: bool = True) -> None:
    """Make each named parameter of ``model`` the given tensor (a view; never copied).

    A quantized weight (``deepseek_flash.quant.QuantizedTensor``, from a quantized store) swaps its
    ``nn.Linear`` for a ``QuantLinear`` bound to the codes and scales: precision is chosen here,
    at bind time, never in the forward pass. With ``complete`` every parameter must be bound
    afterwards (none left on meta). ``fixed``: the bytes under the views stay the same while bound
    (False for a streaming slot, whose contents change every pass; ``QuantLinear.bind``).
    """
    import torch

    from ..quant import QuantizedTensor
    from ..quant.linear import bind_quantized

    for name, tensor in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        if isinstance(tensor, QuantizedTensor):
            bind_quantized(model, module_name, tensor, fixed)
            continue
        module = model.get_submodule(module_name)
        if leaf not in module._parameters:
            raise KeyError(f"the model has no parameter {name!r}")
        module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    if not complete:
        return
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise KeyError(f"parameters not served by the store: {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}")


def decoder_parts(model):
    """(embeddings, decoder layers, final norm, lm_head) of a Llama-family causal LM."""
    inner = model.model
    return inner.embed_tokens, list(inner.layers), inner.norm, model.lm_head
