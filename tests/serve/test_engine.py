"""Continuous batching: greedy output in a batch equals the request alone, rows join and leave at
step boundaries, cancelled requests free their row, degrade steps reach the sampling."""
import time

import pytest
import torch
from serve_helpers import Collector

from deepseek_flash.serve.engine import Engine, Generation
from deepseek_flash.serve.scheduler import FlashScheduler, SchedRequest


def generation(prompt, tokens, cls="L1", temperature=0.0, **kw):
    return Generation(SchedRequest(id=str(id(prompt)), priority_class=cls, max_new_tokens=tokens,
                                   temperature=temperature), list(prompt), Collector(), **kw)


def alone(model, prompt, tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                         min_new_tokens=tokens)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def engine(tiny_reference, tiny_tokenizer):
    engines = []

    def make(**kw):
        eng = Engine(tiny_reference, tiny_tokenizer, **kw).start()
        engines.append(eng)
        return eng
    yield make
    for eng in engines:
        eng.close(timeout=5)


def test_greedy_in_a_batch_equals_the_request_alone(engine, tiny_reference):
    # Prompts longer than a prefill chunk (8) join over several steps; more requests than rows, so
    # rows are reused by later requests (stale keys of the earlier occupant must stay masked).
    eng = engine(max_batch=3, prefill_chunk=8, scheduler=FlashScheduler(slots=3, l0_reserve=0.0))
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((3, 21, 9, 30, 1, 12))]
    tokens = [6, 14, 9, 5, 20, 11]
    gens = [generation(p, t) for p, t in zip(prompts, tokens)]
    for g in gens:
        assert eng.submit(g).admitted
    for g, p, t in zip(gens, prompts, tokens):
        kind, stats = g.on_event.result()
        assert kind == "done"
        assert g.output_ids == alone(tiny_reference, p, t)
        assert g.finish_reason == "length" and len(g.output_ids) == t
        assert stats["kv"]["tokens"] == len(p) + t
        assert g.on_event.text == g.text
    assert eng.stats["batch_rows_sum"] > eng.stats["decode_steps"]          # it really batched
    assert eng.running() == 0


def test_a_short_request_joins_a_running_long_one_at_the_next_step(engine, tiny_reference):
    eng = engine(max_batch=2, scheduler=FlashScheduler(slots=2, l0_reserve=0.0))
    long = generation([5, 6, 7], 400)
    assert eng.submit(long).admitted
    while not long.output_ids:
        time.sleep(0.001)
    short = generation([9, 10, 11, 12], 5)
    steps_before = eng.stats["steps"]
    assert eng.submit(short).admitted
    assert short.on_event.result()[0] == "done"
    # prefill (1 step, which also samples the first token) + 4 decodes, plus at most the step that
    # was running when it arrived.
    assert eng.stats["steps"] - steps_before <= 6
    assert long.finish_reason is None                                    # still running meanwhile
    assert short.output_ids == alone(tiny_reference, short.prompt_ids, 5)
    eng.cancel(long)


def test_cancel_frees_the_row_for_the_next_request(engine):
    eng = engine(max_batch=1, scheduler=FlashScheduler(slots=1))
    first = generation([3, 4], 500)
    assert eng.submit(first).admitted
    while not first.output_ids:
        time.sleep(0.001)
    waiting = generation([5, 6], 3)
    assert eng.submit(waiting).admitted
    time.sleep(0.05)
    assert waiting.row is None and waiting.output_ids == []             # one row, taken
    eng.cancel(first)
    assert waiting.on_event.result()[0] == "done"
    assert first.finish_reason == "cancelled" and not first.on_event.done.is_set()
    assert len(first.output_ids) < 500
    assert eng.stats["cancelled"] == 1 and eng.running() == 0
    assert eng.scheduler.snapshot()["running"] == {"L0": 0, "L1": 0, "L2": 0}


def boundary(eng):
    with eng._lock:
        eng._boundary()


def test_degrade_steps_reach_sampling_and_the_response(tiny_reference, tiny_tokenizer):
    # Steps driven by hand (no engine thread). Two rows: an L2 request joins the idle engine, then
    # two long L1 requests arrive -- one joins, one waits -- so L0/L1 want every slot; with a tiny
    # window and no interval the L2 request gets one step per engine step: temperature +0.1,
    # top_p 0.85, then 70 % of what is left.
    sched = FlashScheduler(slots=2, degrade_interval=0.0, idle_window=1e-6, l0_reserve=0.0)
    eng = Engine(tiny_reference, tiny_tokenizer, sched, max_batch=2)
    g = generation([3, 4, 5], 100, cls="L2", seed=1)
    assert eng.submit(g).admitted
    boundary(eng)
    long = [generation([6, 7], 400), generation([8, 9], 400)]
    for other in long:
        assert eng.submit(other).admitted
    boundary(eng)
    assert [x.row is not None for x in long] == [True, False]
    with torch.inference_mode():
        while not g.on_event.done.is_set():
            eng._step()
            boundary(eng)
    kind, stats = g.on_event.result()
    assert stats["degrade_steps"] == ["temperature", "top_p", "max_new_tokens"]
    assert (g.sched.temperature, g.sched.top_p) == (0.1, 0.85)
    # Step 1 sends the prefill's token and decodes the next, steps 2 and 3 one more each: the cut
    # at the third tick leaves 4 + 70 % of the 96 left.
    assert g.sched.max_new_tokens == 4 + int(96 * 0.7)
    assert len(g.output_ids) == g.sched.max_new_tokens and g.finish_reason == "length"
    assert sched.snapshot()["degrade_steps"] == {"temperature": 1, "top_p": 1, "max_new_tokens": 1}
    # The waiting L1 request took the freed row; nothing of L1 was degraded.
    assert long[1].row is not None and not any(x.sched.degraded for x in long)
    eng.close(timeout=0)


def test_l2_alone_is_never_degraded_by_the_engine(engine):
    # One row, an L2 request in it: the batch is full and every step is busy, yet nobody else
    # wants the row -- no degrade step, its tokens are the greedy ones.
    eng = engine(max_batch=1, scheduler=FlashScheduler(slots=1, degrade_interval=0.0, idle_window=1e-3))
    g = generation([3, 4, 5], 60, cls="L2")
    assert eng.submit(g).admitted
    kind, stats = g.on_event.result()
    assert (kind, stats["degrade_steps"], g.sched.temperature) == ("done", [], 0.0)
    assert len(g.output_ids) == 60 and eng.scheduler.snapshot()["degraded_requests"] == 0
    assert 0.0 <= eng.utilisation() <= 1.0


def test_stop_strings_and_eos_end_generation(engine, tiny_reference):
    eng = engine(max_batch=2)
    prompt = [40, 41, 42]
    free = generation(prompt, 12)
    assert eng.submit(free).admitted
    free.on_event.result()
    stop_at = free.output_ids[4]
    stopped = generation(prompt, 12, stop_ids=frozenset({stop_at}))
    assert eng.submit(stopped).admitted
    stopped.on_event.result()
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(stop_at)]
    assert stopped.finish_reason == "stop"


def test_a_streamed_model_gives_the_same_tokens_and_reports_its_stream(tiny_tokenizer, tmp_path):
    from deepseek_flash.client.model import load_model
    from deepseek_flash.daemon.planner import resident_minimum
    from deepseek_flash.store import Store, pack
    from deepseek_flash.testing import load_reference, make_tiny_model

    src = make_tiny_model(tmp_path / "src", num_layers=5, vocab_size=260, eos_token_id=256, bos_token_id=None,
                          pad_token_id=None)
    store_path = pack(src, tmp_path / "store")
    budget = resident_minimum(Store.open(store_path).blocks)
    model = load_model(str(store_path), device="cpu", weight_budget=budget, embedded=True)
    try:
        assert model.flash.stream is not None                      # MLPs stream through slots
        eng = Engine(model, tiny_tokenizer, max_batch=2).start()
        try:
            g = generation([5, 6, 7], 6, prefetch_window=1)
            assert eng.submit(g).admitted
            kind, stats = g.on_event.result()
            assert kind == "done" and g.output_ids == alone(load_reference(src), [5, 6, 7], 6)
            assert stats["prefetch_window"] == 1 and stats["bytes_streamed"] > 0
            assert 0.0 <= stats["prefetch_hit_rate"] <= 1.0
        finally:
            eng.close(timeout=5)
    finally:
        model.flash.close()
