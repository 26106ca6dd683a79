"""The batch-1 int4 GEMV in CUDA C++ (compiled at run time through NVRTC, ``torch.cuda._compile_kernel``),
on the tile layout the host tier already stores (torch's CUDA int4 layout, ``inner_k_tiles`` 8;
``int4pack.cuda_layout``) and its ``[K/group, N, 2]`` bfloat16 (scale, zero) pairs, zero 0
(``int4pack.scales_and_zeros``): nothing repacked, nothing derived.

Why CUDA C++: a batch-1 int4 GEMV streams 1/4 byte a weight, so at the copy rate an H200 SM must
retire ~33 weights a cycle. Turning each nibble into a float32 and one FMA costs ~3 instructions a
weight (the Triton kernels of ``quant.gemv``: 33-38 SASS a 32-bit word), which is already the SM's
whole issue rate. Here the tensor cores do the multiply: per 32-bit word four ``lop3`` (plus three
shifts) give four bfloat16x2 registers ``128 + q`` that *are* the B fragments of
``mma.m16n8k16`` in this layout (``gemv_asm._mma_asm`` says how) -- and, two n-tiles side by
side, its A fragments (rows g and g + 8): with ``Config.A`` (``SWAP``, the default) the codes are
A and x is B (every column), one ``mma`` a 16 x 16 tile, half the ``mma`` of x as A (15 of its 16
rows padding): ~9 instructions a word.

Kernel shape (``Config``): a CTA of ``W`` warps owns ``NT`` n-tiles (8 output rows each) over all of
K; its warps split K evenly (``K/128/W`` chunks of 128 columns each), every warp streaming its
chunks of the ``NT`` n-tiles (512 contiguous bytes a chunk and n-tile: one 16-byte load a lane)
``U`` chunks at a time, all their loads issued before any arithmetic. x is staged once into shared
memory in the A-fragment order (each lane then reads a chunk's 16 registers as four 16-byte loads,
reused for the ``NT`` n-tiles) with each chunk's sum. Each chunk's float32 accumulator starts at
``-136 * sum(x over the chunk)`` (so it ends at ``sum x * (q - 8)``: the ``128 + q`` of the
conversion, minus 8) and one FMA applies the chunk's scale. The ``W`` warps' sums meet in shared
memory and are added in warp order: one launch, no workspace, no atomics, the same bits every run,
capturable in a CUDA graph. Group 128 (one scale per chunk) only; ``supports`` says what else.

The arithmetic is ``gemv.mma_reference`` (split 1, float32 sums in another order): the CPU tests
hold that to the dequantize + matmul allowance and run this module's launch path through
``cuda_gemv_emu.Emulated``, a stand-in that executes the kernel's index arithmetic and each ``mma``'s fragment
layout; the GPU tests run the kernel against the allowance and torch's int4 kernel.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from . import cuda_launch
from .cuda_gemv_src import SOURCE   # the kernel's CUDA C++ text

log = logging.getLogger(__name__)

# Whether ``QuantLinear`` runs one-row int4 tile-layout calls through this kernel (``supports``):
# on by default, measured faster than torch's int4 kernel at every 8B shape (docs/benchmarks.md).
ENABLED = True

@dataclass(frozen=True)
class Config:
    """``NT`` n-tiles (8 rows each) a CTA, ``W`` warps a CTA splitting K, ``U`` chunks of 128
    columns a batch of loads; ``P`` 1: each batch's loads issued before the previous batch's
    arithmetic (the first before x is staged)."""
    NT: int = 2
    W: int = 8
    U: int = 2
    P: int = 1
    LO: int = 0         # 1: loads and stores only, no arithmetic (wrong results; bench/gemv.py)
    S: int = 0          # 1: x is gate | up and the kernel multiplies silu(gate) * up (matmul's silu)
    A: int = 0          # 1: two n-tiles as the mma's A operand, x as B (half the mma of A = x)
    G: int = 0          # > 0: at most G CTAs an SM, each looping over blocks (x staged once a CTA)
    GLU: int = 0        # 1: W is gate | up and the output silu(gate) * up (N / 2 values; ``glu``)
    R: int = 0          # > 0: codes and scales through a ring of R chunks a warp in shared memory (cp.async)
    NORM: int = 0       # 1: x is a sub-block's output; the residual add and RMSNorm staged (``norm``)
    PDL: int = 0        # 1: launched with programmatic dependent launch (``cuda_launch``)

    def fits(self, N: int, K: int) -> str | None:
        """None when this shape can run ``N x K``, else why not."""
        KO = K // 128
        if self.A and self.NT % 2:
            return f"NT = {self.NT} n-tiles with A = 1 (pairs of n-tiles)"
        if self.NORM and self.S:
            return "NORM with S (the input is either a norm's or silu's)"
        if self.R and not (self.A and self.U == 1):
            return f"R = {self.R} (the ring) with A = {self.A}, U = {self.U} (it takes A = 1, U = 1)"
        if self.GLU and (N % 16 or self.NT % 2):
            return (f"GLU over N = {N} rows with NT = {self.NT} (gate and up halves of whole n-tiles, "
                    f"NT / 2 of each a block)")
        if KO % self.W:
            return f"K / 128 = {KO} chunks not a multiple of W = {self.W} warps"
        if (KO // self.W) % self.U:
            return f"{KO // self.W} chunks a warp not a multiple of U = {self.U}"
        return None

    def smem(self, K: int) -> int:
        KO = K // 128
        ring = (-KO % 4) * 4 + self.W * self.R * self.NT * (512 + 128) if self.R else 0
        return KO * 256 + KO * 4 + self.W * self.NT * 8 * 4 + ring


# (NT, U, P, G) per (N, K) of the 8B llama's decode GEMVs: the H200 sweep's fastest (bench/gemv.py
# --cuda, 2026-12-02); other shapes take (2, 1, 1, 0). W, the warps splitting K, is a function of K
# alone (``warps``): it sets the order of a row's float32 sums, so a merged GEMV's outputs keep the
# bits of each projection's own call (``linear.merge_tiles``), whatever N. gate|up: one n-tile a
# block (with GLU, one of gate and one of up), at most 4 CTAs an SM looping over blocks -- the step
# 3.1 % faster than with (4, 1, 1, 0) on the H200 (417.6 vs 405.2 tok/s, 2026-12-02).
PINNED = {(6144, 4096): (2, 1, 1, 0), (4096, 4096): (2, 1, 1, 0), (28672, 4096): (2, 1, 1, 4),
          (4096, 14336): (2, 1, 1, 0)}
WARPS_BY_K = {4096: 8, 14336: 16}
# Whether the default shapes put two n-tiles in the mma's A operand (``Config.A``): on, the step
# 7.6 % faster than with x as A on the H200 (379.4 vs 352.8 tok/s, 2026-12-02).
SWAP = 1
# Whether the fused decode step multiplies silu(gate) * up inside the down GEMV (``silu_down``):
# off, measured slower on the H200 (its prologue costs more than the launch it saves: 375.8 vs
# 379.4 tok/s with SWAP, 349.2 vs 352.8 without, 2026-12-02).
FUSE_SILU = False
# Whether the fused decode step takes silu(gate) * up straight from the merged gate|up GEMV
# (``glu``: the block's gate and up rows in one CTA, silu_mul in its epilogue -- one launch and the
# gate|up output's round trip less a layer; the rows' bits as the GEMV's, the activation's rounding
# within a last place of ``silu_mul``'s): on, the int4 step 1.3 % faster on the H200 (405.8 vs
# 400.6 tok/s, 2026-12-02).
FUSE_GLU = True
# Whether the fused decode step runs the residual add + RMSNorm before q|k|v and gate|up inside
# those GEMVs (``norm_gemv``: every CTA stages the norm of the residual plus the sub-block's
# output, one writes the new residual) instead of ``decode.kernels.add_rms_norm`` apart.
FUSE_NORM = False


# Chunk slots a warp of the default shapes streams through shared memory (``Config.R``; 0: off,
# the codes go through registers). bench/decode.py's variant graphs_ring measures 4.
RING = 0
# Whether the default shapes are launched with programmatic dependent launch (``Config.PDL``: a
# GEMV's first loads overlap the end of the kernel before it). bench/decode.py's variant graphs_pdl.
PDL = 0


def warps(K: int) -> int:
    """The warps a CTA splitting K (each a whole number of 128-column chunks)."""
    if K in WARPS_BY_K:
        return WARPS_BY_K[K]
    return next(w for w in (8, 4, 2, 1) if (K // 128) % w == 0)


def default_config(N: int, K: int) -> Config:
    """The shape used when none is given: a pure function of ``N x K`` (and ``SWAP``)."""
    nt, u, p, g = PINNED.get((N, K), (2, 1, 1, 0))
    cfg = Config(nt, warps(K), u, p, A=SWAP, G=g, R=RING if SWAP and u == 1 else 0, PDL=PDL)
    return cfg if cfg.fits(N, K) is None else Config(2, warps(K), 1, 1, A=SWAP, R=RING if SWAP else 0,
                                                      PDL=PDL)


def glu_config(N: int, K: int) -> Config:
    """``matmul``'s shape with ``glu``: the plain call's (``default_config``) where its NT fits, else
    NT 4 (two n-tiles of gate, two of up) -- the same W, so the same bits a row."""
    cfg = dataclasses.replace(default_config(N, K), GLU=1)
    return cfg if cfg.fits(N, K) is None else dataclasses.replace(cfg, NT=4)


def supports(x: torch.Tensor, N: int, K: int, group: int) -> str | None:
    """None when the kernel takes this call, else why not (the caller keeps its other kernel)."""
    if x.device.type != "cuda":
        return f"device type {x.device.type}"
    if x.dtype != torch.bfloat16:
        return f"{x.dtype} activations"
    if x.numel() != K:
        return f"{x.numel() // max(K, 1)} rows (the kernel takes one)"
    if group != 128:
        return f"scale group {group} (the kernel takes 128)"
    if N % 8 or K % 128:
        return f"shape {N} x {K} (N a multiple of 8, K of 128)"
    if K > 65536:
        return f"K = {K} input features (x is staged in shared memory: at most 65536)"
    return None


class Kernels:
    """The compiled kernels of one process, one per ``Config`` (``compile`` is
    ``torch.cuda._compile_kernel`` or, in tests, a stand-in with its signature)."""

    def __init__(self, compile=None):
        self._compile = compile
        self._cache: dict = {}

    def get(self, cfg: Config):
        cfg = dataclasses.replace(cfg, G=0)       # the grid is the launch's, not the source's
        k = self._cache.get(cfg)
        if k is None:
            compile = self._compile or torch.cuda._compile_kernel
            opts = [f"-DNT={cfg.NT}", f"-DW={cfg.W}", f"-DU={cfg.U}", f"-DPIPE={cfg.P}",
                    f"-DSILU={cfg.S}", f"-DSWAP={cfg.A}", f"-DGLU={cfg.GLU}", f"-DRING={cfg.R}", f"-DNORM={cfg.NORM}", f"-DPDL={cfg.PDL}", "-std=c++17"]
            k = compile(SOURCE, "int4_gemv_m1", nvcc_options=opts + ["-DLOADS_ONLY"] * cfg.LO)
            self._cache[cfg] = k
        return k


KERNELS = Kernels()


def matmul(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int, K: int,
           cfg: Config | None = None, kernels: Kernels | None = None,
           out: torch.Tensor | None = None, silu: bool = False, glu: bool = False,
           norm: tuple | None = None) -> torch.Tensor:
    """``x [1, K] @ W.T`` -> ``[1, N]`` bfloat16, ``W`` in the tile layout ``words`` with its
    ``[K/128, N, 2]`` scales ``sz`` (group 128). ``supports`` must have said yes. ``silu``: ``x``
    is ``[1, 2K]``, gate then up, and the product is taken with ``silu(gate) * up`` (rounded as
    ``decode.kernels.silu_mul`` rounds it) -- that kernel and this one's input in one launch.
    ``glu``: ``W`` is gate | up (``N / 2`` rows each) and the result ``silu(gate) * up``, ``[1, N / 2]``:
    each row's sum as the plain call rounds it, then ``silu_mul``'s rounding (``glu_config``).
    ``norm`` = (residual, weight, eps, residual_out): ``x`` is a sub-block's output and the product
    is taken with ``add_rms_norm(x, residual, weight, eps)`` (its rounding points), the new residual
    written to ``residual_out`` (all ``[1, K]`` bfloat16, contiguous)."""
    cfg = dataclasses.replace(cfg or (glu_config(N, K) if glu else default_config(N, K)), S=int(silu),
                              GLU=int(glu), NORM=int(norm is not None))
    if x.numel() != (2 * K if silu else K):
        raise ValueError(f"int4 GEMV input of {x.numel()} values for K = {K}"
                         + (" (silu: gate and up, 2K)" if silu else ""))
    why = cfg.fits(N, K)
    if why:
        raise ValueError(f"int4 GEMV config {cfg} for {N} x {K}: {why}")
    if x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)    # 16-byte loads of x
    if words.data_ptr() % 16 or sz.data_ptr() % 8 or not (words.is_contiguous()
                                                           and sz.is_contiguous()):
        raise ValueError("int4 GEMV operands must be contiguous, the codes 16-byte and the "
                         "scales 8-byte aligned")
    rows = N // 2 if glu else N
    y = out if out is not None else torch.empty((1, rows), dtype=torch.bfloat16, device=x.device)
    k = (kernels or KERNELS).get(cfg)
    smem = cfg.smem(K)
    if smem >= 48 * 1024 and getattr(k, "_max_shared_mem_bytes", 0) < smem:
        k.set_shared_memory_config(smem)
    blocks = -(-(N // 16) // (cfg.NT // 2)) if glu else -(-(N // 8) // cfg.NT)
    if cfg.G:
        blocks = min(blocks, cfg.G * _sms(x.device))
    res, nw, eps, res_out = norm if norm is not None else (x, x, 0.0, y)
    if norm is not None and not all(t.numel() == K and t.is_contiguous() and t.data_ptr() % 16 == 0
                                    for t in (res, nw, res_out)):
        raise ValueError(f"int4 GEMV norm operands must be {K} contiguous 16-byte aligned values")
    args = [x, words, sz, y, N, K, res, nw, res_out, float(eps)]
    if cfg.PDL and hasattr(k, "func"):       # a compiled kernel (the CPU stand-in has no CUfunction)
        cuda_launch.launch(k, (blocks, 1, 1), (32 * cfg.W, 1, 1), args, smem)
    else:
        k(grid=(blocks, 1, 1), block=(32 * cfg.W, 1, 1), args=args, shared_mem=smem)
    return y


_failed: list = []
_SMS: dict = {}


def _sms(device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200; the CPU stand-in: 1)."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def layer_matmul(x, words, sz, N, K):
    """``matmul`` for ``QuantLinear`` with the default shape; None (the layer then takes torch's
    int4 kernel) when the operands do not fit or the kernel cannot be compiled here -- logged once,
    and not tried again in this process."""
    if (_failed or words.data_ptr() % 16 or sz.data_ptr() % 8 or not words.is_contiguous()
            or not sz.is_contiguous()):
        return None
    try:
        return matmul(x, words, sz, N, K)
    except (RuntimeError, OSError) as exc:         # NVRTC missing or refusing
        _failed.append(f"{type(exc).__name__}: {exc}")
        log.warning("the CUDA int4 GEMV is not used: %s", _failed[0])
        return None


def silu_down(down, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``down(silu(gate) * up)`` in one launch (``matmul``'s ``silu``) for a ``QuantLinear`` the
    kernel takes (``ENABLED`` and ``FUSE_SILU``, one row, the tile layout with group 128, no bias) when ``up``
    follows ``gate`` in memory (the two halves of a merged gate|up GEMV's output); None otherwise
    (the caller multiplies and calls the layer)."""
    if (not (ENABLED and FUSE_SILU) or getattr(down, "_tiles_group", 0) != 128
            or down.bias is not None):
        return None
    K, N = down.in_features, down.out_features
    if (supports(gate, N, K, 128) is not None or up.numel() != K or up.dtype != gate.dtype
            or not (gate.is_contiguous() and up.is_contiguous())
            or up.data_ptr() != gate.data_ptr() + K * gate.element_size()):
        return None
    gu = gate.as_strided((1, 2 * K), (2 * K, 1))
    y = _guarded(down, lambda: matmul(gu, down.codes, down.scales, N, K, silu=True))
    return None if y is None else y.view(*gate.shape[:-1], N)


def glu(gate_up, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of a merged gate|up ``QuantLinear`` (``N / 2`` rows each) in one launch
    (``matmul``'s ``glu``) where the kernel takes it (``ENABLED`` and ``FUSE_GLU``, one row, the
    tile layout with group 128, no bias); None otherwise (the caller runs the GEMV and ``silu_mul``)."""
    if (not (ENABLED and FUSE_GLU) or getattr(gate_up, "_tiles_group", 0) != 128
            or gate_up.bias is not None):
        return None
    K, N = gate_up.in_features, gate_up.out_features
    if supports(x, N, K, 128) is not None or glu_config(N, K).fits(N, K) is not None:
        return None
    y = _guarded(gate_up, lambda: matmul(x.reshape(1, K), gate_up.codes, gate_up.scales, N, K, glu=True))
    return None if y is None else y.view(*x.shape[:-1], N // 2)


def norm_gemv(layer, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              glu: bool = False) -> tuple | None:
    """``layer(add_rms_norm(x, residual, weight, eps))`` (``glu``: ``silu(gate) * up`` of it, as
    ``glu``) in one launch, with the new residual in a new tensor: ``(y, residual)``; None where the
    kernel does not take it (``ENABLED`` and ``FUSE_NORM``, one row, the tile layout with group 128,
    no bias, bfloat16 operands): the caller runs ``add_rms_norm`` then the layer."""
    if (not (ENABLED and FUSE_NORM) or getattr(layer, "_tiles_group", 0) != 128
            or layer.bias is not None):
        return None
    K, N = layer.in_features, layer.out_features
    if (supports(x, N, K, 128) is not None or residual.numel() != K or weight.numel() != K
            or not all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % 16 == 0
                       for t in (x, residual, weight))
            or (glu and glu_config(N, K).fits(N, K) is not None)):
        return None
    res_out = torch.empty_like(residual)
    y = _guarded(layer, lambda: matmul(x.reshape(1, K), layer.codes, layer.scales, N, K, glu=glu,
                                       norm=(residual, weight, eps, res_out)))
    return None if y is None else (y.view(*x.shape[:-1], y.shape[-1]), res_out)


def _guarded(layer, call):
    """``call()`` unless the kernel failed to compile before or ``layer``'s operands are off
    alignment (None); a compile failure is logged once and not tried again in this process."""
    if _failed or layer.codes.data_ptr() % 16 or layer.scales.data_ptr() % 8:
        return None
    try:
        return call()
    except (RuntimeError, OSError) as exc:         # NVRTC missing or refusing
        _failed.append(f"{type(exc).__name__}: {exc}")
        log.warning("the CUDA int4 GEMV is not used: %s", _failed[0])
        return None
