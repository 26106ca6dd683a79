"""The batch's fixed-shape decode step (``serve/graphs.py``): every row in one forward, rows with
nothing to decode at the scratch slot; CUDA graphs of it on a CUDA device, the eager decode with the
reason logged where they cannot be captured."""
import copy
import time
import logging

import pytest
import torch
from serve_helpers import greedy

from deepseek_flash.serve.engine import Engine
from deepseek_flash.serve.runner import RowRunner, prompt_sizes
from deepseek_flash.serve.scheduler import FlashScheduler
from test_engine import generation, streamed_store  # noqa: F401 -- a fixture

PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((3, 21, 9, 30, 1, 12, 5))]
TOKENS = [6, 14, 9, 5, 70, 11, 3]


def run_batch(model, tokenizer, device=None, **kw):
    """Seven requests through three rows (rows reused, joining mid-decode, prompts over several
    chunks), every forward's rows the same from run to run (in bfloat16 a prompt packed with
    another gets other rounding); returns each one's tokens and the engine."""
    eng = Engine(model, tokenizer, FlashScheduler(slots=3, l0_reserve=0.0), max_batch=3, prefill_chunk=8,
                 max_model_len=160, device=device, **kw).start()
    try:
        gens = [generation(p, t) for p, t in zip(PROMPTS, TOKENS)]
        with eng._lock:         # all queued before the first step boundary: the same batches each run
            for g in gens:
                assert eng.submit(g).admitted
        for g in gens:
            assert g.on_event.result()[0] == "done"
        return [g.output_ids for g in gens], eng
    finally:
        eng.close(timeout=5)


def test_the_fixed_shape_step_gives_the_tokens_of_the_request_alone(tiny_reference, tiny_tokenizer):
    outputs, eng = run_batch(tiny_reference, tiny_tokenizer, decode="static", warm=True)
    assert outputs == [greedy(tiny_reference, p, t) for p, t in zip(PROMPTS, TOKENS)]
    stats = eng.runner.decode_stats()
    assert stats["mode"] == "static" and stats["graphs"] == 0 and stats["reason"] is None
    # every prompt chunk through the fixed-shape prompt forward (rows and width padded)
    assert stats["prefill"]["static_steps"] == eng.stats["prefill_forwards"] > 0
    # every decode went through it (warm-up: one per width, 64, 128, 160)
    assert stats["static_steps"] == eng.stats["decode_steps"] + 3
    assert eng.stats["batch_rows_sum"] > eng.stats["decode_steps"]           # it really batched
    # The scratch slot is the cache's last, one past what any width reads.
    cache = eng.runner.cache
    assert cache.keys[0].shape[2] == cache.max_len + 1 == cache.scratch + 1


def test_on_the_cpu_the_decode_is_eager_and_says_why(tiny_reference, tiny_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="deepseek_flash.serve"):
        runner = RowRunner(tiny_reference, rows=2, max_len=64)
    assert runner.decode_mode == "eager" and runner.static is None
    reason = "CUDA graphs need a CUDA device (the model is on cpu)"
    assert runner.decode_stats() == {"mode": "eager", "reason": reason, "prefill": None}
    assert reason in caplog.text
    assert RowRunner(tiny_reference, rows=2, max_len=64, decode="eager").decode_reason == "decode='eager'"
    with pytest.raises(ValueError, match="graphs"):
        RowRunner(tiny_reference, rows=2, max_len=64, decode="graphs")


def test_a_step_that_cannot_run_falls_back_to_the_eager_decode_for_good(tiny_reference, tiny_tokenizer):
    # A capture that fails mid-serving: the step returns None with its reason, the runner decodes
    # eagerly from then on -- the request's tokens unchanged.
    eng = Engine(tiny_reference, tiny_tokenizer, FlashScheduler(slots=2), max_batch=2, max_model_len=96,
                 decode="static").start()
    try:
        static = eng.runner.static

        def fail(*args):
            static.reason = "capture failed: test"
            return None
        static.run = fail
        g = generation(PROMPTS[1], 12)
        assert eng.submit(g).admitted
        assert g.on_event.result()[0] == "done"
        assert g.output_ids == greedy(tiny_reference, PROMPTS[1], 12)
        assert eng.runner.decode_stats()["mode"] == "eager"
        assert eng.runner.decode_stats()["reason"] == "capture failed: test"
    finally:
        eng.close(timeout=5)


def test_prompt_graphs_cover_one_row_of_the_widest_chunk_at_every_attention_width(tiny_reference):
    # The batch's prompt graphs: rows x widths over a first chunk's attention widths, and one row
    # of the widest width (128) at every attention width up to the cache's length (a long prompt
    # in chunks); the L0 prompts' own graphs only the first. A chunk narrower than the widest
    # whose own width has no graph at that attention width runs as the widest, padded; two rows
    # deep into a prompt have none.
    runner = RowRunner(tiny_reference, rows=4, max_len=300, decode="static", prefill_chunk=512)
    general, l0 = runner.static_prefill, runner.static_prefill_l0
    assert general.widest() == 128 and general.deep and not l0.deep
    first = {(n, w, k) for n in (1, 2, 4) for w in (16, 32, 64, 128)
             for k in {runner.bucket(w), runner.bucket(w + 1)}}
    assert set(general.keys()) == first | {(1, 128, k) for k in (256, 300)}
    assert set(l0.keys()) == {key for key in first if key[0] <= 2}
    general.capture, general.graphs = True, dict.fromkeys(general.keys())     # as if captured
    assert general._key(1, 44, 300) == (1, 128, 300) and general.covers(1, 44, 299)
    assert general._key(1, 20, 64) == (1, 32, 64)                           # the nearest where it has one
    assert not general.covers(2, 44, 299) and not general.covers(1, 129, 300)
    general.reason = "capture failed"
    assert not general.covers(1, 20, 64)


def test_the_warm_up_runs_prompts_of_every_size_class():
    assert prompt_sizes(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    assert prompt_sizes(512)[-3:] == [256, 384, 512] and prompt_sizes(1) == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_decode_the_tokens_of_the_eager_step(tiny_reference, tiny_tokenizer, dtype):
    model = copy.deepcopy(tiny_reference).to("cuda:0", dtype)
    graphs, eng = run_batch(model, tiny_tokenizer, device="cuda:0")
    stats = eng.runner.decode_stats()
    assert stats["mode"] == "graphs" and stats["reason"] is None, stats
    assert stats["graphs"] == 3 and stats["replays"] == eng.stats["decode_steps"] > 0
    # Prompt forwards of 1 and 2 rows (of the 3) at width 8 (the chunk), attention over 64 keys;
    # one row of the widest width (8 here) also at every other attention width: 128 and 160.
    assert stats["prefill"]["mode"] == "graphs" and stats["prefill"]["graphs"] == 4, stats
    assert 0 < stats["prefill"]["replays"] <= eng.stats["prefill_forwards"]
    # The same fixed-shape step run eagerly (the same kernels): the same tokens, in any dtype.
    static, eng_static = run_batch(model, tiny_tokenizer, device="cuda:0", decode="static")
    assert eng_static.runner.decode_stats()["static_steps"] > 0
    assert graphs == static
    if dtype == torch.float32:
        # The eager decode over the gathered rows, and transformers' generate alone.
        eager, eng_eager = run_batch(model, tiny_tokenizer, device="cuda:0", decode="eager")
        assert eng_eager.runner.decode_mode == "eager"
        assert graphs == eager
        assert graphs == [greedy(model, p, t) for p, t in zip(PROMPTS, TOKENS)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_loaded_model_decodes_in_graphs_resident_and_eagerly_streamed(tiny_tokenizer, streamed_store):
    # load_model's gates (a pre-hook per layer until the load is in) are waited out, not taken for
    # hooks that stay; a streamed model's layer ring is: its steps run eagerly, and say why.
    from deepseek_flash.client.model import load_model
    from deepseek_flash.testing import load_reference

    src, store, budget = streamed_store
    want = [greedy(load_reference(src), p, t) for p, t in zip(PROMPTS, TOKENS)]
    for weight_budget in (None, budget):
        model = load_model(str(store), device="cuda:0", weight_budget=weight_budget, embedded=True)
        try:
            outputs, eng = run_batch(model, tiny_tokenizer, device="cuda:0")
            stats = eng.runner.decode_stats()
            if weight_budget is None:
                assert stats["mode"] == "graphs" and stats["replays"] > 0, stats
            else:
                assert stats["mode"] == "eager" and "hooks" in stats["reason"], stats
            assert outputs == want
        finally:
            model.flash.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_l0_prompt_on_its_own_stream_beside_the_graph_decode_keeps_every_token(tiny_reference, tiny_tokenizer):
    # The decode graph in flight on the main stream, the L0 request's prompt graph on a stream of its
    # own: both write the same KV cache (other rows, other slots) at once; every request's tokens
    # are still transformers' greedy ones, the L0 request's first from the same step.
    from test_engine import beside_engine, done, drive, step_with_l0_during_decode, step_with_l0_during_prompt_graph

    model = copy.deepcopy(tiny_reference).to("cuda:0")
    eng, running = beside_engine(model, tiny_tokenizer, rows=4, device="cuda:0", decode="auto", max_model_len=160)
    assert eng.runner.decode_stats()["mode"] == "graphs"
    prefill_replays = eng.runner.static_prefill_l0.counters["replays"]
    for i in range(3):
        eng._l0_at = time.monotonic()
        l0 = generation([7 + i, 8, 9, 10, 11], 4, cls="L0")
        log = step_with_l0_during_decode(eng, l0)
        assert log[1] == ("prefill", [l0.row]) and len(l0.output_ids) == 1
        drive(eng, done(l0))
        assert l0.output_ids == greedy(model, l0.prompt_ids, 4)
    assert eng.runner.static_prefill_l0.counters["replays"] >= prefill_replays + 3     # from graphs
    # And beside another prompt's graph (L1, 20 tokens): the L0 prompt from the L0 graphs.
    newcomer = generation([(5 * j) % 250 + 3 for j in range(20)], 6)
    eng._l0_at = time.monotonic()
    l0 = generation([9, 8, 7, 6], 3, cls="L0")
    l0_replays = eng.runner.static_prefill_l0.counters["replays"]
    log = step_with_l0_during_prompt_graph(eng, newcomer, l0)
    assert log == [("prefill", [newcomer.row]), ("l0 prefill", [l0.row])]
    drive(eng, done(l0, newcomer))
    assert l0.output_ids == greedy(model, l0.prompt_ids, 3)
    assert newcomer.output_ids == greedy(model, newcomer.prompt_ids, 6)
    assert eng.stats["l0_beside"] == 4
    assert eng.runner.static_prefill_l0.counters["replays"] >= l0_replays + 1      # from its graphs
    drive(eng, done(*running))
    for g in running:
        assert g.output_ids == greedy(model, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_l0_prompt_in_a_preempted_row_beside_the_graph_decode_keeps_every_token(tiny_reference, tiny_tokenizer):
    # A full batch: the L0 prompt takes the row of a request the decode graph in flight still
    # writes (at slot 4; the prompt writes slots 0-2), on its own stream at the same time; the
    # preempted request's token from that decode is dropped and it recomputes. All tokens greedy.
    from test_engine import beside_engine, done, drive, step_with_l0_during_decode

    model = copy.deepcopy(tiny_reference).to("cuda:0")
    eng, running = beside_engine(model, tiny_tokenizer, rows=2, device="cuda:0", decode="auto", max_model_len=160)
    eng._l0_at = time.monotonic()
    l0 = generation([7, 8], 4, cls="L0")
    log = step_with_l0_during_decode(eng, l0)
    assert log[1] == ("prefill", [l0.row]) and eng.stats["preempted"] == 1 and eng.stats["l0_beside"] == 1
    drive(eng, done(l0, *running))
    for g in (l0, *running):
        assert g.output_ids == greedy(model, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_long_prompt_in_chunks_of_the_deep_prompt_graphs_keeps_every_token(tiny_reference, tiny_tokenizer):
    # With L0 traffic, a 300-token prompt goes in chunks of 128, 128 and 44 tokens, all from
    # prompt graphs: the second at attention width 256 and the last (padded to 128 tokens) at 320
    # exist only as the widest width's deep graphs. Its tokens, and the decoding rows', greedy.
    from test_engine import beside_engine, done, drive

    model = copy.deepcopy(tiny_reference).to("cuda:0")
    eng, running = beside_engine(model, tiny_tokenizer, rows=3, device="cuda:0", decode="auto", max_model_len=320)
    assert {(1, 128, 256), (1, 128, 320)} <= set(eng.runner.static_prefill.graphs)
    eng._l0_at = time.monotonic()
    long_prompt = generation([(11 * j) % 250 + 2 for j in range(300)], 5)
    replays = eng.runner.static_prefill.counters["replays"]
    assert eng.submit(long_prompt).admitted
    drive(eng, done(long_prompt, *running))
    assert eng.runner.static_prefill.counters["replays"] - replays >= 3
    for g in (long_prompt, *running):
        assert g.output_ids == greedy(model, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_l0_prompts_at_once_on_two_side_streams_beside_the_graph_decode_keep_every_token(tiny_reference,
                                                                                             tiny_tokenizer):
    # a's prompt is held on its side stream (a device sleep queued before it) when b arrives: b's
    # prompt runs from the second set of L0 graphs on the second side stream at the same time,
    # both beside the decode graph on the main one. Every request's tokens greedy.
    from test_engine import beside_engine, done, drive, step_with_l0_during_decode

    model = copy.deepcopy(tiny_reference).to("cuda:0")
    eng, running = beside_engine(model, tiny_tokenizer, rows=4, device="cuda:0", decode="auto", max_model_len=160)
    assert eng.runner.static_prefill_l0b is not None and len(eng.l0_beside.lanes()) == 2
    eng._l0_at = time.monotonic()
    a = generation([7, 8, 9, 10, 11], 4, cls="L0")
    b = generation([9, 8, 7], 4, cls="L0")
    runner, start = eng.runner, eng.runner.prefill_start

    def start_slow_then_b(rows, *args):
        if rows == [a.row]:
            torch.cuda._sleep(100_000_000)          # ~50 ms of device time on a's stream first
        out = start(rows, *args)
        if rows == [a.row]:
            assert eng.submit(b).admitted
        return out
    runner.prefill_start = start_slow_then_b
    try:
        step_with_l0_during_decode(eng, a)
    finally:
        runner.prefill_start = start
    assert eng.stats["l0_beside"] == 2 and eng.stats["l0_beside_concurrent"] == 1
    assert len(a.output_ids) == 1 and len(b.output_ids) == 1
    assert eng.runner.static_prefill_l0b.counters["replays"] == 1
    drive(eng, done(a, b, *running))
    for g in (a, b, *running):
        assert g.output_ids == greedy(model, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)
