"""ForwardOrder: the stage sequence a forward pass walks and the window after a layer."""
from deepseek_flash.daemon.prefetch import ForwardOrder

from deepseek_flash.store import Store


def test_stages_follow_forward_order(tiny_store):
    store = Store.open(tiny_store)
    order = ForwardOrder(store.blocks, store.num_layers)
    roles = {b.id: b.role for b in store.blocks}
    assert [roles[i] for i in order.stages[0]] == ["embed"]
    assert [roles[i] for i in order.stages[-1]] == ["final_norm", "lm_head"]
    for layer in range(4):
        assert [roles[i] for i in order.layer_blocks(layer)] == ["norms", "attn", "mlp_gate_up", "mlp_down"]
    assert len(order.stages) == 6


def test_window_is_cyclic_and_bounded(tiny_store):
    store = Store.open(tiny_store)
    order = ForwardOrder(store.blocks, store.num_layers)
    layer_of = {b.id: (b.layer, b.role) for b in store.blocks}

    def stages(layer, window):
        return sorted({layer_of[i][0] if layer_of[i][0] >= 0 else layer_of[i][1]
                       for i in order.stages_after(layer, window)}, key=str)

    assert order.stages_after(1, 0) == []
    assert stages(0, 2) == [1, 2]
    # after the last layer: the head of the model (final norm, lm_head), then round to embed
    assert stages(3, 1) == ["final_norm", "lm_head"]
    assert stages(3, 3) == [0, "embed", "final_norm", "lm_head"]
    # a window larger than the model covers every other stage once, never the layer itself
    everything = order.stages_after(2, 64)
    assert len(everything) == len(set(everything)) == len(store.blocks) - 4
