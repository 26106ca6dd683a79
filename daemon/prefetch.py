"""Prefetch policy: which blocks to load ahead when a client acquires a decoder layer.

A forward pass walks *stages* in a fixed order: the head (embeddings), decoder layers 0..L-1, the
tail (final norm, lm_head); decoding then starts the next pass at the head again. Acquiring layer
``i`` asks for the next ``prefetch_window`` stages after it, wrapping round, so the blocks a client
needs next are read from NVMe while it computes on the current layer. Hot stages (head and tail
blocks are small and normally resident) are included; resident blocks cost nothing to ask for.

The policy is pure (no IO, no locks): the block manager calls ``stages_after`` and schedules the
loads itself.
"""
from __future__ import annotations


class ForwardOrder:
    """The stage sequence of one model: lists of block ids in forward order."""

    def __init__(self, blocks, num_layers: int):
        head, tail = [], []
        layers: list[list[int]] = [[] for _ in range(num_layers)]
        for block in blocks:
            if block.layer >= 0:
                while block.layer >= len(layers):
                    layers.append([])
                layers[block.layer].append(block.id)
            elif block.role == "embed":
                head.append(block.id)
            else:
                tail.append(block.id)
        self.layers = layers
        # Stage 0 is the head, stage i + 1 is layer i, the last stage is the tail.
        self.stages: list[list[int]] = [head, *layers, tail]

    def layer_blocks(self, layer: int) -> list[int]:
        return list(self.layers[layer])

    def stages_after(self, layer: int, window: int) -> list[int]:
        """Block ids of the ``window`` stages that follow ``layer``, nearest first (cyclic)."""
        if window <= 0 or not self.stages:
            return []
        start = layer + 1
        out: list[int] = []
        count = 0
        n = len(self.stages)
        for step in range(1, n):
            stage = self.stages[(start + step) % n]
            if not stage:
                continue
            out.extend(stage)
            count += 1
            if count >= window:
                break
        return out
