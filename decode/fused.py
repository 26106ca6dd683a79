"""The decode step's own forward for the Llama family: merged projections and fused elementwise ops.

One token per row through every decoder layer with the fewest kernels the math allows:

    add_rms_norm -> q|k|v GEMV -> rope_cache -> sdpa -> o GEMV -> add_rms_norm -> gate|up GEMV
    -> silu_mul -> down GEMV        (and after the last layer: add_rms_norm, lm_head)

against 34 per layer through transformers' modules (rotary alone is 5 small kernels per q
and per k; dtype casts; residual adds; SiLU then the product). The residual add of each sub-block
runs inside the next norm (``kernels.add_rms_norm``); rotary, the cache write and the packed
grouped-query layout are one kernel (``kernels.rope_cache``). Attention over the cache is torch's
sdpa unless ``ATTENTION`` says otherwise (below). Where the CUDA int4 GEMV runs the layers
(``quant.cuda_gemv.ENABLED``), silu_mul can run inside the gate|up GEMV (``cuda_gemv.glu``,
``FUSE_GLU``: its epilogue, the same bits) or inside the down GEMV (``cuda_gemv.silu_down``,
``FUSE_SILU``: the kernel stages ``silu(gate) * up`` as its input, rounded as ``silu_mul`` rounds it).

The q, k, v (and gate, up) weights become one matrix per layer, so one GEMV reads them:
* a **view** where they already lie side by side in memory (a store block that holds them in that
  order);
* else, where each parameter owns its memory (a model of the user's), one concatenated matrix and
  the parameters **rebound** to views of it (no extra memory: the old storage is freed);
* else (views into memory shared with others, e.g. the daemon's arena) one concatenated **copy**
  (extra memory, counted in ``stats()["merged"]``).
Quantized projections (``QuantLinear``): int4 in the tile layout on fixed bytes whose codes lie
back to back (the host tier lays a block's codes out so, ``quant.host_tier.tiled_block``) become one
``QuantLinear`` over a view of the codes and a concatenation of the scales (``quant.linear.merge_tiles``;
``stats()["merged"]["quantized"]``, the new bytes of the scales and biases in ``quant_copy_bytes``); any other
projection that is not a plain ``nn.Linear`` runs as its module, unmerged.

Used only where the model is exactly this structure and no module has forward hooks (a hook would
not run: the step does not call the layer modules); otherwise the step runs transformers' modules.
A streamed model's ring hooks are the exception: the forward runs the same ring itself as a fixed
schedule (``client.stream.StaticRing``: copies into the slots on the copy stream, events the
compute waits on), which a CUDA graph captures with the rest of the step.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..quant import cuda_gemv
from ..quant.cuda_gemv import glu, norm_gemv, silu_down
from . import flash, kernels

ARCHS = ("llama", "qwen2", "mistral")
# Merge int4 tile-layout projections (``Merged``); False runs each as its module (bench/decode.py's
# ``graphs_unmerged`` variant measures the two in one run).
MERGE_QUANTIZED = True
# The step's attention: "auto" (the default: "flash" for a resident model, "sdpa" for a streamed
# one, whose step waits on its copies), "sdpa" (torch's, over the float mask the step builds),
# "flash" (``flash.decode_attention``: no mask tensor, the keys a row sees read from the device;
# on the H200 the int4 step 5.3 % faster than with sdpa: docs/benchmarks.md), "triton"
# (``kernels.decode_attention``: split-key Triton kernels over the mask) or "rope_triton"
# (``kernels.rope_attention``: the rotary and cache write inside that kernel, one operation a layer
# fewer). bench/decode.py's variants graphs_sdpa / graphs_flash_attention / graphs_triton_attention /
# graphs_rope_attention.
ATTENTION = "auto"


def attention(streamed: bool = False) -> str:
    """The attention ``ATTENTION`` names for a resident (``streamed`` False) or streamed model."""
    if ATTENTION == "auto":
        return "sdpa" if streamed else "flash"
    return ATTENTION


def uses_mask(streamed: bool = False) -> bool:
    """Whether the step's attention reads the mask tensor (``"flash"`` reads ``valid_from`` and
    the slot instead: the caller need not build one)."""
    return attention(streamed) != "flash"


def unsupported(model) -> str | None:
    """Why the fused forward cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in ARCHS:
        return f"model type {config.model_type!r}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (the fused MLP is SiLU x up)"
    inner = model.model
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, part):
            return f"a decoder without .{part}"
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj")),
                 (layer, ("input_layernorm", "post_attention_layernorm"))]
        for owner, parts in names:
            if owner is None or not all(hasattr(owner, p) for p in parts):
                return f"layer {i} is not a Llama-style decoder layer"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not hasattr(norm, "variance_epsilon") or getattr(norm, "weight", None) is None:
                return f"layer {i}: a norm that is not RMSNorm"
        if any(hasattr(attn, extra) for extra in ("q_norm", "k_norm")):
            return f"layer {i}: query/key norms"
    if not hasattr(inner.norm, "variance_epsilon"):
        return "a final norm that is not RMSNorm"
    return None


def hooked_module(model, allowed=()) -> str | None:
    """The first module with forward hooks (the fused forward would skip them), or None;
    ``allowed``: ids of modules whose hooks the caller replaces (a streaming ring's)."""
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return "global forward hooks"
    for name, module in model.named_modules():
        if id(module) in allowed:
            continue
        if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return f"module {name or type(module).__name__} has forward hooks"
    return None


def _plain(modules) -> bool:
    return all(type(m) is torch.nn.Linear for m in modules) and len(
        {(m.weight.dtype, m.weight.device, m.weight.shape[1]) for m in modules}) == 1


def _owns_storage(t) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _adjacent_view(weights):
    """One (rows, cols) view over ``weights`` when they lie back to back in one storage."""
    first = weights[0]
    if not all(w.is_contiguous() for w in weights):
        return None
    ptr = first.data_ptr()
    for w in weights:
        if w.data_ptr() != ptr or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        ptr += w.numel() * w.element_size()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


@dataclass
class MergeStats:
    views: int = 0
    rebound: int = 0
    copies: int = 0
    copy_bytes: int = 0
    unmerged: int = 0
    quantized: int = 0          # int4 tile-layout groups merged over a view of their codes
    quant_copy_bytes: int = 0   # their concatenated scales and biases (new memory)

    def as_dict(self) -> dict:
        return dict(vars(self))


class Merged:
    """Several ``nn.Linear`` of one input as one matrix; ``__call__`` returns each one's output
    (views of one GEMV's result). Modules that are not plain Linear run one by one."""

    def __init__(self, modules, stats: MergeStats, fixed: bool = True):
        self.modules = list(modules)
        self.sizes = [m.out_features if hasattr(m, "out_features") else m.weight.shape[0]
                      for m in self.modules]
        self.weight = self.bias = self.quant = None
        if not _plain(self.modules):
            self._merge_quantized(stats, fixed)
            return
        weights = [m.weight.detach() for m in self.modules]
        biases = [m.bias for m in self.modules]
        if any(b is not None for b in biases):
            if not all(b is not None for b in biases):
                stats.unmerged += 1
                return
            self.bias = torch.cat([b.detach() for b in biases])
        view = _adjacent_view(weights)
        if view is not None:
            self.weight = view
            stats.views += 1
            return
        if not fixed:      # bytes that change under us (a streamed slot): never a copy
            self.bias = None
            stats.unmerged += 1
            return
        self.weight = torch.cat(weights)
        if all(_owns_storage(w) for w in weights):
            row = 0
            with torch.no_grad():
                for m, size in zip(self.modules, self.sizes):
                    m.weight.data = self.weight[row:row + size]
                    row += size
            stats.rebound += 1
        else:
            stats.copies += 1
            stats.copy_bytes += self.weight.numel() * self.weight.element_size()

    def _merge_quantized(self, stats: MergeStats, fixed: bool) -> None:
        """int4 layers in the tile layout whose codes lie back to back: one ``QuantLinear`` over
        a view of them (their scales and biases concatenated: ``quant_copy_bytes``); otherwise unmerged."""
        from ..quant.linear import merge_tiles

        if not MERGE_QUANTIZED:
            merged = "MERGE_QUANTIZED off"
        else:
            merged = merge_tiles(self.modules) if fixed else "bytes that change (a streamed slot)"
        if isinstance(merged, str):
            stats.unmerged += 1
            return
        self.quant = merged
        stats.quantized += 1
        stats.quant_copy_bytes += sum(t.numel() * t.element_size() for t in (merged.scales, merged.bias)
                                      if t is not None)

    def __call__(self, x):
        if self.quant is not None:
            return self.quant(x).split(self.sizes, dim=-1)
        if self.weight is None:
            return [m(x) for m in self.modules]
        return torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


@dataclass
class _Layer:
    in_norm: object
    in_eps: float
    qkv: Merged
    o_proj: object
    post_norm: object
    post_eps: float
    gate_up: Merged
    down: object
    scaling: float
    kind: str


@dataclass
class FusedForward:
    """The fused decode forward of one model (built once; ``merge`` stats in ``stats``)."""

    model: object
    ring: object = None
    layers: list = field(default_factory=list)
    stats: MergeStats = field(default_factory=MergeStats)

    def uses_mask(self) -> bool:
        return uses_mask(self.ring is not None)

    @classmethod
    def build(cls, model, ring=None) -> FusedForward:
        """``ring``: the ``client.stream.StaticRing`` of a streamed model (its layers' weights are
        views into slots: merged only where they are views side by side, never copied)."""
        self = cls(model, ring=ring)
        streamed = set(ring.layers) if ring is not None else set()
        config = model.config
        kinds = getattr(config, "layer_types", None) if config.model_type == "qwen2" else None
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                attn, mlp = layer.self_attn, layer.mlp
                # A streamed projection (the ring's projection units) runs through the ring.
                wrap = ring.wrap if i in streamed else (lambda module: module)
                self.layers.append(_Layer(
                    layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon),
                    Merged((attn.q_proj, attn.k_proj, attn.v_proj), self.stats, i not in streamed),
                    attn.o_proj,
                    layer.post_attention_layernorm.weight,
                    float(layer.post_attention_layernorm.variance_epsilon),
                    Merged((wrap(mlp.gate_proj), wrap(mlp.up_proj)), self.stats, i not in streamed),
                    wrap(mlp.down_proj),
                    float(attn.scaling), kinds[i] if kinds else "full_attention"))
        return self

    def __call__(self, tokens, positions, mask, keys, values, slot, visible: int, valid_from=None,
                 windows=None):
        """Float32 logits of the next token for each row: ``tokens`` (batch,), ``positions``
        (batch, 1), ``mask`` as ``step.MaskSpec.build`` gives it (None where ``uses_mask`` says
        no), ``keys``/``values`` one cache buffer per layer (batch, kv_heads, capacity, head_dim),
        ``slot`` the (1,) slot written; ``valid_from`` (batch,) each row's first real slot and
        ``windows`` (``MaskSpec.windows``: sliding window by layer kind) for ``"flash"``."""
        inner, ring = self.model.model, self.ring
        if ring is not None:
            ring.begin()
        hidden = inner.embed_tokens(tokens[:, None])
        cos, sin = inner.rotary_emb(hidden, positions)
        kind = attention(ring is not None)
        use_flash = kind == "flash" and valid_from is not None
        if not use_flash:
            if mask is None:
                raise ValueError(f"the fused step's attention {kind!r} needs the mask")
            mask = {k: _additive(m, hidden.dtype) for k, m in mask.items()} if isinstance(mask, dict) \
                else _additive(mask, hidden.dtype)
        residual = hidden
        x = None
        for i, layer in enumerate(self.layers):
            streamed = ring is not None and i in ring.index
            if streamed:
                ring.before(i)
            got = _norm_gemv(layer.qkv, x, residual, layer.in_norm, layer.in_eps)
            if got is not None:             # the residual add and norm inside the GEMV
                qkv, residual = got
                q, k, v = qkv.split(layer.qkv.sizes, dim=-1)
            else:
                normed = kernels.add_rms_norm(x, residual, layer.in_norm, layer.in_eps)
                q, k, v = layer.qkv(normed)
            layer_mask = mask[layer.kind] if isinstance(mask, dict) else mask
            if use_flash:
                query = kernels.rope_cache(q, k, v, cos, sin, slot, keys[i], values[i])
                attn = flash.decode_attention(query, keys[i], values[i], valid_from, slot, visible,
                                              int((windows or {}).get(layer.kind) or 0), layer.scaling)
            elif kind == "rope_triton":
                attn = kernels.rope_attention(q, k, v, cos, sin, slot, keys[i], values[i], visible,
                                              layer_mask, layer.scaling)
            else:
                query = kernels.rope_cache(q, k, v, cos, sin, slot, keys[i], values[i])
                attend = (kernels.decode_attention if kind == "triton" else
                          lambda q_, k_, v_, m_, s_: torch.nn.functional.scaled_dot_product_attention(
                              q_, k_, v_, attn_mask=m_, scale=s_))
                attn = attend(query, keys[i][:, :, :visible], values[i][:, :, :visible], layer_mask,
                              layer.scaling)
            x = layer.o_proj(attn.reshape(attn.shape[0], 1, -1))
            fuse_glu = cuda_gemv.FUSE_GLU
            got = _norm_gemv(layer.gate_up, x, residual, layer.post_norm, layer.post_eps, fuse_glu)
            if got is not None:
                out, residual = got
                act = out if fuse_glu else None
                gate_up = None if fuse_glu else out.split(layer.gate_up.sizes, dim=-1)
            else:
                normed = kernels.add_rms_norm(x, residual, layer.post_norm, layer.post_eps)
                act = glu(layer.gate_up.quant, normed) if layer.gate_up.quant is not None else None
                gate_up = None if act is not None else layer.gate_up(normed)
            if act is not None:             # silu(gate) * up straight from the gate|up GEMV
                x = layer.down(act)
            else:
                gate, up = gate_up
                x = silu_down(layer.down, gate, up)
                if x is None:
                    x = layer.down(kernels.silu_mul(gate, up))
            if streamed:
                ring.after(i)
        final = self.model.model.norm
        hidden = kernels.add_rms_norm(x, residual, final.weight, float(final.variance_epsilon))
        logits = self.model.lm_head(hidden)[:, -1, :].float()
        if ring is not None:
            ring.end()
        return logits


def _norm_gemv(group, x, residual, weight, eps, fuse_glu=False):
    """``cuda_gemv.norm_gemv`` over a merged int4 group (None where it cannot: the caller runs
    ``add_rms_norm`` then the group; the first layer's norm has no sub-block output)."""
    if x is None or group.quant is None:
        return None
    return norm_gemv(group.quant, x, residual, weight, eps, fuse_glu)


def _additive(mask, dtype):
    """A boolean mask as sdpa turns it into a bias (0 / -inf), once per step instead of once per
    layer inside every sdpa call."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations that run (views and metadata-only ops apart): on the CPU, what a GPU
    step would launch as kernels, one per fused custom op."""

    SKIP = {"aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::t", "aten::transpose",
            "aten::expand", "aten::slice", "aten::select", "aten::split", "aten::split_with_sizes",
            "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::reshape", "aten::alias",
            "aten::detach", "aten::empty", "aten::empty_like", "aten::empty_strided",
            "aten::_reshape_alias", "aten::unbind", "aten::lift_fresh", "aten::sym_size",
            "aten::sym_stride", "aten::sym_numel", "aten::is_same_size"}

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name not in self.SKIP:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
