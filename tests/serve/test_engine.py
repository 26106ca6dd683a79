"""Continuous batching: greedy output in a batch equals the request alone, rows join and leave at
step boundaries, cancelled requests free their row, degrade steps reach the sampling."""
import time

import pytest
import torch
from serve_helpers import DEGRADED_ONCE, Collector, degrade_metrics, greedy

from deepseek_flash.serve.engine import Engine
from deepseek_flash.serve.generation import Generation
from deepseek_flash.serve.scheduler import FlashScheduler, SchedRequest


def generation(prompt, tokens, cls="L1", temperature=0.0, **kw):
    return Generation(SchedRequest(id=str(id(prompt)), priority_class=cls, max_new_tokens=tokens,
                                   temperature=temperature), list(prompt), Collector(), **kw)


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


def test_greedy_in_a_batch_equals_the_request_greedy(engine, tiny_reference):
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
        assert g.output_ids == greedy(tiny_reference, p, t)
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
    at_done = {}
    collect = short.on_event

    def on_event(kind, data):
        # Read in the engine thread as the short request ends: however late the test thread
        # gets to run on a busy machine, this is the state at that moment.
        if kind == "done":
            at_done.update(steps=eng.stats["steps"], long=long.finish_reason)
        collect(kind, data)
    short.on_event = on_event
    with eng._lock:             # no step boundary between reading the count and the arrival
        steps_before = eng.stats["steps"]
        assert eng.submit(short).admitted
    assert collect.result()[0] == "done"
    # Its prefill step (which samples the first token and decodes the second) + 3 decodes, plus at
    # most the step that was running when it arrived.
    assert at_done["steps"] - steps_before <= 5
    assert at_done["long"] is None                                       # still running meanwhile
    assert short.output_ids == greedy(tiny_reference, short.prompt_ids, 5)
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


def two_decoding(eng, tokens):
    """Two L1 requests of ``tokens`` new tokens admitted, brought to a step boundary and stepped
    once: both are decoding, two tokens out each."""
    running = [generation([3 + i, 4, 5], tokens) for i in range(2)]
    for g in running:
        assert eng.submit(g).admitted
    boundary(eng)
    with torch.inference_mode():
        eng._step()
    assert all(len(g.output_ids) == 2 for g in running)
    return running


def drive(eng, until):
    """Steps by hand (no engine thread), each followed by a step boundary, until ``until()``."""
    with torch.inference_mode():
        while not until():
            eng._step()
            boundary(eng)


def done(*gens):
    return lambda: all(g.on_event.done.is_set() for g in gens)


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
    drive(eng, done(g))
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
    # Each step in the server's metrics too.
    from deepseek_flash.serve.app import ServeState

    assert degrade_metrics(ServeState(eng, tiny_tokenizer, "m").metrics()) == DEGRADED_ONCE
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


@pytest.fixture(scope="module")
def streamed_store(tmp_path_factory):
    """A tiny Llama packed into a store, and the weight budget under which its MLPs stream."""
    from deepseek_flash.daemon.planner import resident_minimum
    from deepseek_flash.store import Store, pack
    from deepseek_flash.testing import make_tiny_model

    tmp = tmp_path_factory.mktemp("streamed")
    src = make_tiny_model(tmp / "src", num_layers=4, vocab_size=260, eos_token_id=256, bos_token_id=None,
                          pad_token_id=None)
    store = pack(src, tmp / "store")
    return src, store, resident_minimum(Store.open(store).blocks)


def test_a_streamed_model_gives_the_same_tokens_and_reports_its_stream(tiny_tokenizer, streamed_store):
    from deepseek_flash.client.model import load_model
    from deepseek_flash.testing import load_reference

    src, store, budget = streamed_store
    model = load_model(str(store), device="cpu", weight_budget=budget, embedded=True)
    try:
        assert model.flash.stream is not None                      # MLPs stream through slots
        eng = Engine(model, tiny_tokenizer, max_batch=2).start()
        try:
            g = generation([5, 6, 7], 6, prefetch_window=1)
            assert eng.submit(g).admitted
            kind, stats = g.on_event.result()
            assert kind == "done" and g.output_ids == greedy(load_reference(src), [5, 6, 7], 6)
            assert stats["prefetch_window"] == 1 and stats["bytes_streamed"] > 0
            assert 0.0 <= stats["prefetch_hit_rate"] <= 1.0
        finally:
            eng.close(timeout=5)
    finally:
        model.flash.close()


class Forwards:
    """Records the engine's forwards -- (kind, rows, tokens per row) -- and runs ``at[k]()`` when
    forward ``k`` begins (a request arriving while that forward is in flight)."""

    def __init__(self, eng, at=None):
        self.eng, self.at, self.log = eng, dict(at or {}), []
        self.inner = eng.runner.forward
        eng.runner.forward = self

    def __call__(self, rows, ids, positions, kv_len):
        k = len(self.log)
        kind = "decode" if ids.shape[1] == 1 and all(g is not None and g.output_ids and g.prefilled == len(g.fill_ids)
                                                     for g in (self.eng._rows[r] for r in rows)) else "prefill"
        self.log.append((kind, list(rows), ids.shape[1]))
        if k in self.at:
            self.at.pop(k)()
        return self.inner(rows, ids, positions, kv_len)


def loaded_engine(tiny_reference, tiny_tokenizer):
    """Four rows (one held for L0), chunks of 8 tokens: two L1 requests decoding, and a third whose
    40-token prompt has just joined."""
    eng = Engine(tiny_reference, tiny_tokenizer, FlashScheduler(slots=4), max_batch=4, prefill_chunk=8)
    running = two_decoding(eng, 400)
    long_prompt = generation([(11 * j) % 250 + 2 for j in range(40)], 50)
    assert eng.submit(long_prompt).admitted
    return eng, running, long_prompt


def test_l0_prefill_goes_first_in_its_own_forward(tiny_reference, tiny_tokenizer):
    eng, running, long_prompt = loaded_engine(tiny_reference, tiny_tokenizer)
    l0 = generation([7, 8, 9, 10, 11], 4, cls="L0")
    assert eng.submit(l0).admitted
    boundary(eng)
    seen = []
    rec = Forwards(eng, {1: lambda: seen.append(len(l0.output_ids))})
    with torch.inference_mode():
        eng._step()
    # The L0 prompt alone, then one 8-token chunk of the long prompt, then the decode of all
    # three rows with a token to feed (the L0 row included).
    assert rec.log == [("prefill", [l0.row], 5), ("prefill", [long_prompt.row], 8),
                       ("decode", sorted([running[0].row, running[1].row, l0.row]), 1)]
    assert seen == [1]                                # first token out before the next forward
    assert l0.output_ids[:1] == greedy(tiny_reference, l0.prompt_ids, 1)
    eng.close(timeout=0)


@pytest.mark.parametrize("arrive_at", range(5))
def test_l0_arriving_under_load_waits_for_at_most_the_forward_in_flight(tiny_reference, tiny_tokenizer, arrive_at):
    # Unloaded, an L0 request's first token takes one forward (its prefill). Under load it arrives
    # while forward ``arrive_at`` of the batch runs (chunks of the long prompt, decodes); its first
    # token must come from the very next forward: <= 2 forwards from arrival, never the rest of
    # the step or the other prompts' chunks.
    eng, running, long_prompt = loaded_engine(tiny_reference, tiny_tokenizer)
    boundary(eng)
    l0 = generation([7, 8, 9, 10, 11], 4, cls="L0")
    marks = {}

    def arrive():
        marks["arrived"] = len(rec.log)               # the forward in flight is number len - 1
        assert eng.submit(l0).admitted
    rec = Forwards(eng, {arrive_at: arrive})
    drive(eng, lambda: l0.output_ids)
    first = next(i for i, (kind, rows, _) in enumerate(rec.log) if rows == [l0.row])
    assert rec.log[first] == ("prefill", [l0.row], 5)
    assert first - (marks["arrived"] - 1) + 1 <= 2
    # No forward but the L0 prefill carried more than one chunk of prompt.
    assert all(kind == "decode" or n <= 8 for kind, _, n in rec.log)
    assert l0.output_ids[:1] == greedy(tiny_reference, l0.prompt_ids, 1)
    eng.close(timeout=0)


def step_with_cut_in(eng, l0):
    """One engine step during whose first forward ``l0`` is submitted: the forwards it ran, as
    ``(nesting depth, rows, tokens)``."""
    inner, log, depth = eng.runner.forward, [], [0]

    def forward(rows, ids, positions, kv_len):
        log.append((depth[0], list(rows), ids.shape[1]))
        if len(log) == 1:
            assert eng.submit(l0).admitted
        depth[0] += 1
        try:
            return inner(rows, ids, positions, kv_len)
        finally:
            depth[0] -= 1
    eng.runner.forward = forward
    try:
        with torch.inference_mode():
            eng._step()
    finally:
        eng.runner.forward = inner
    return log


def test_l0_arriving_during_other_prompts_chunk_is_prefilled_between_two_of_its_layers(tiny_reference,
                                                                                       tiny_tokenizer):
    # The L0 request arrives as the long prompt's chunk begins: its prefill runs nested in that
    # forward (before its first layer), not after it; both requests' tokens stay the greedy ones.
    eng, running, long_prompt = loaded_engine(tiny_reference, tiny_tokenizer)
    boundary(eng)
    l0 = generation([7, 8, 9, 10, 11], 4, cls="L0")
    log = step_with_cut_in(eng, l0)
    assert log[:2] == [(0, [long_prompt.row], 8), (1, [l0.row], 5)]
    assert len(l0.output_ids) == 2 and long_prompt.prefilled == 8       # first token, then the decode
    drive(eng, done(l0, long_prompt))
    for g in (l0, long_prompt):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


def test_an_l0_request_cutting_in_on_a_full_batch_preempts_a_row_the_forward_does_not_write(tiny_reference,
                                                                                             tiny_tokenizer):
    # Three rows, all busy: two L1 requests decoding, a third whose 40-token prompt is being
    # prefilled. An L0 request arriving during that chunk preempts the other L1 request that
    # started last -- never the prompt the forward is writing -- and is prefilled nested in it.
    eng = Engine(tiny_reference, tiny_tokenizer, FlashScheduler(slots=3, l0_reserve=0.0), max_batch=3,
                 prefill_chunk=8)
    a, b = generation([3, 4, 5], 20), generation([4, 5, 6], 20)
    for g in (a, b):
        assert eng.submit(g).admitted
    boundary(eng)
    with torch.inference_mode():
        eng._step()
    c = generation([(11 * j) % 250 + 2 for j in range(40)], 10)
    assert eng.submit(c).admitted
    boundary(eng)
    l0 = generation([7, 8, 9, 10, 11], 4, cls="L0")
    log = step_with_cut_in(eng, l0)
    assert b.sched.preempted == 1 and a.sched.preempted == 0 and c.sched.preempted == 0
    assert log[:2] == [(0, [c.row], 8), (1, [l0.row], 5)] and l0.row != c.row
    drive(eng, done(a, b, c, l0))
    for g in (a, b, c, l0):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
        assert [d["token"] for k, d in g.on_event.events if k == "token"] == g.output_ids
    eng.close(timeout=0)


@pytest.mark.parametrize("cls, expected", [("L0", 4), ("L1", 3), ("L2", 2)])
def test_the_class_of_a_request_is_the_priority_of_the_reads_it_causes(tiny_tokenizer, streamed_store, cls,
                                                                        expected):
    # A model streamed under a budget, loaded with read priority 3 (--read-priority): its streamed
    # layers are read on the first forward, with the priority of the class of the request in it.
    from deepseek_flash.client.model import load_model

    _, store, budget = streamed_store
    model = load_model(str(store), device="cpu", weight_budget=budget, embedded=True, priority=3)
    try:
        client, asked = model.flash.client, []
        real = client.acquire

        def acquire(*args, **kwargs):
            asked.append(kwargs.get("priority"))
            return real(*args, **kwargs)
        client.acquire = acquire
        eng = Engine(model, tiny_tokenizer, FlashScheduler(slots=2, l0_reserve=0.0), max_batch=2)
        g = generation([5, 6, 7], 3, cls=cls)
        assert eng.submit(g).admitted
        boundary(eng)
        drive(eng, done(g))
        assert len(asked) == len(model.flash.stream.plan.streamed_layers) > 0
        assert set(asked) == {expected} and model.flash.priority == expected
        eng.close(timeout=0)
    finally:
        model.flash.close()


def test_a_request_with_kv_keys_runs_on_a_tiered_cache_beside_the_batch(engine, tiny_reference, tmp_path):
    # Lossless settings (every page attended) with a tiny device window: pages go to the host and
    # past a tiny host budget to spill files, the greedy tokens stay those of the model alone, and
    # the request beside it in the shared batch is untouched by the attention switch.
    eng = engine(max_batch=3, prefill_chunk=8, scheduler=FlashScheduler(slots=3, l0_reserve=0.0))
    prompt = [(5 * j) % 250 + 3 for j in range(70)]
    tiered = generation(prompt, 30, kv_options={"gpu_tokens": 16, "sink_tokens": 2, "page_tokens": 16,
                                                "host_bytes": 1, "spill_dir": str(tmp_path / "spill")})
    plain = generation(prompt[:20], 30)
    assert eng.submit(tiered).admitted and eng.submit(plain).admitted
    kind, stats = tiered.on_event.result()
    assert kind == "done" and tiered.output_ids == greedy(tiny_reference, prompt, 30)
    assert plain.on_event.result()[0] == "done" and plain.output_ids == greedy(tiny_reference, prompt[:20], 30)
    kv = stats["kv"]
    assert (kv["cache"], kv["tokens"]) == ("tiered", 100)
    t = kv["tiered"]
    assert t["tokens"] == 99 and t["page_tokens"] == 16 and t["pages"] > 0
    assert t["spilled_bytes"] > 0 and kv["bytes"] == t["gpu_bytes"] + t["host_bytes"] + t["spilled_bytes"]
    assert tiny_reference.config._attn_implementation == eng.runner.attn_default
    assert list((tmp_path / "spill").iterdir()) == []             # spill files gone with the request
    assert plain.on_event.events[-1][1]["kv"]["cache"] == "rows"


# (chunk, decode forward s, prefill s per token, L0 seen lately) -> prompt tokens this step
BUDGET_TABLE = [
    (512, None, None, True, 512),         # nothing measured yet
    (512, 0.005, 0.0002, False, 512),     # no L0 traffic: a whole chunk
    (512, 0.005, 0.0002, True, 16),       # CPU-like: half a decode's time is 12 tokens -> the floor
    (512, 0.020, 0.0001, True, 100),      # 100 tokens ~ half a decode forward
    (512, 0.067, 0.00001, True, 512),     # launch-bound GPU step: tokens are nearly free
    (8, 0.005, 0.0002, True, 8),          # never more than a chunk, even at the floor
]


@pytest.mark.parametrize("chunk, decode_s, per_token_s, l0_recent, budget", BUDGET_TABLE)
def test_prefill_budget(chunk, decode_s, per_token_s, l0_recent, budget):
    from deepseek_flash.serve.engine import prefill_budget

    assert prefill_budget(chunk, decode_s, per_token_s, l0_recent) == budget


@pytest.mark.parametrize("prompts, chunks", [
    ([32] * 16, [32] * 16),               # 16 newcomers: one forward of 16 x 32 tokens
    ([4, 400], [4, 256]),                 # the second widens the forward to half the budget each
    ([400, 300], [400]),                  # two rows of 400 would be 800 tokens of compute
    ([600, 8], [512]),
])
def test_other_prompts_are_packed_into_one_forward_within_the_budget(tiny_reference, tiny_tokenizer, prompts,
                                                                     chunks):
    eng = Engine(tiny_reference, tiny_tokenizer, FlashScheduler(slots=16, l0_reserve=0.0), max_batch=16,
                 max_model_len=1024)
    gens = [generation([(i + j) % 250 + 3 for j in range(n)], 50) for i, n in enumerate(prompts)]
    for g in gens:
        assert eng.submit(g).admitted
    boundary(eng)
    rec = Forwards(eng)
    with torch.inference_mode():
        eng._step()
    assert rec.log[0] == ("prefill", [g.row for g in gens[:len(chunks)]], max(chunks))
    assert [g.prefilled for g in gens] == chunks + [0] * (len(prompts) - len(chunks))
    eng.close(timeout=0)


def test_attention_reads_a_bucket_of_key_positions_and_the_profile_counts_the_forwards(tiny_reference,
                                                                                      tiny_tokenizer):
    # A 3-token prompt and 70 new tokens in a 100-token cache: the attention reads 64 key positions
    # while the row is shorter, then the whole cache (128 capped at 100) -- never a length per step.
    eng = Engine(tiny_reference, tiny_tokenizer, FlashScheduler(slots=2, l0_reserve=0.0), max_batch=2,
                 max_model_len=100)
    seen, bind = [], eng.runner.cache.bind

    def record(rows, positions, kv_len, span=None):
        seen.append(kv_len)
        return bind(rows, positions, kv_len, span)
    eng.runner.cache.bind = record
    g = generation([5, 6, 7], 70)
    assert eng.submit(g).admitted
    boundary(eng)
    drive(eng, done(g))
    assert g.output_ids == greedy(tiny_reference, g.prompt_ids, 70)
    # The prefill and the decodes at positions 3..63 read 64 keys; those at 64..71 the whole cache.
    assert seen == [64] * 62 + [100] * 8
    prof = eng.runner.profile(reset=True)
    assert set(prof) == {"prefill", "decode_rows_1"}
    assert prof["prefill"]["forwards"] == 1 and prof["prefill"]["tokens_mean"] == 3
    assert prof["decode_rows_1"]["forwards"] == 69 and prof["decode_rows_1"]["rows_mean"] == 1
    assert 0 < prof["decode_rows_1"]["launch_ms_p50"] <= prof["decode_rows_1"]["ms_p50"] <= prof["decode_rows_1"]["ms_max"]
    assert eng.runner.profile() == {}
    eng.close(timeout=0)


def test_an_l0_request_takes_the_row_of_a_running_one_which_resumes_where_it_was(tiny_reference, tiny_tokenizer):
    # Both rows busy with L1 requests; an L0 request arrives: it preempts the one that joined last,
    # gets its first token in the step it arrived in, and the preempted request later prefills its
    # prompt and the tokens it had generated (but the last) and goes on: every client gets the
    # tokens it would have got alone, each exactly once.
    eng = Engine(tiny_reference, tiny_tokenizer, FlashScheduler(slots=2, l0_reserve=0.0), max_batch=2,
                 prefill_chunk=8)
    a, b = generation([3, 4, 5, 6, 7], 30), generation([9, 8, 7, 6], 30)
    for g in (a, b):
        assert eng.submit(g).admitted
    boundary(eng)
    with torch.inference_mode():
        for _ in range(6):
            eng._step()
            boundary(eng)
        assert len(b.output_ids) == 6                 # b's prompt waited one step (chunk budget 8)
        l0 = generation([11, 12, 13, 14, 15], 4, cls="L0")
        rec = Forwards(eng)
        assert eng.submit(l0).admitted
        eng._step()
        assert b.row is None and b.sched.preempted == 1 and eng.stats["preempted"] == 1
        assert rec.log[0] == ("prefill", [l0.row], 5) and len(l0.output_ids) >= 1
        b_rows, l0_done = set(), None
        while not all(g.on_event.done.is_set() for g in (a, b, l0)):
            eng._step()
            boundary(eng)
            b_rows.add(b.row)
            if l0_done is None and l0.on_event.done.is_set():
                l0_done = len(rec.log)
    b_rows.discard(None)
    assert len(b_rows) == 1
    # b's row came back when the L0 request finished: its 4 + 5 tokens went in again (8 + 1).
    assert [(kind, n) for kind, rows, n in rec.log[l0_done:] if rows == list(b_rows) and kind == "prefill"] == [
        ("prefill", 8), ("prefill", 1)]
    for g in (a, b, l0):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
        tokens = [d["token"] for k, d in g.on_event.events if k == "token"]
        assert tokens == g.output_ids and g.on_event.text == g.text
    assert b.on_event.result()[1]["preempted"] == 1 and a.on_event.result()[1]["preempted"] == 0
    assert eng.scheduler.snapshot()["preempted"] == {"L0": 0, "L1": 1, "L2": 0}
    eng.close(timeout=0)


def test_a_warmed_engine_has_met_every_attention_width_before_its_first_request(engine, tiny_reference):
    # A shape's first forward on a CUDA device costs hundreds of milliseconds of host time; met
    # under load it stalls the whole batch and the L0 request queued behind it. The warm-up meets
    # every width a forward can read (KV_BUCKET multiples up to the cache), full batch and gathered
    # rows, so no request does -- and its keys, beyond any request's length, change no output.
    import gc

    from deepseek_flash.serve.runner import KV_BUCKET

    assert Engine(tiny_reference, None, max_batch=2).warm is False      # CPU default: nothing to warm
    eng = engine(max_batch=3, max_model_len=200, warm=True)
    widths = {KV_BUCKET, 2 * KV_BUCKET, 3 * KV_BUCKET, 200}
    assert eng.runner.kv_seen == widths and eng.warm_s > 0
    assert gc.get_freeze_count() > 0                     # start-up's objects out of the collector's scans
    prompt = [(5 * j) % 250 + 3 for j in range(60)]
    g = generation(prompt, 136)
    assert eng.submit(g).admitted
    kind, _ = g.on_event.result()
    assert kind == "done" and g.output_ids == greedy(tiny_reference, prompt, len(g.output_ids))
    assert len(prompt) + len(g.output_ids) > 3 * KV_BUCKET      # it reached the last width
    assert eng.runner.kv_seen == widths                  # and met none the warm-up had not


def test_a_running_engine_shortens_the_interpreter_switch_interval(tiny_reference, tiny_tokenizer):
    # The engine thread and the event loop share the interpreter lock: while the engine runs, a
    # thread waiting for it from a busy holder waits 0.5 ms at most, not CPython's 5 ms; closing
    # the engine gives the process its own value back. A longer interval asked is not imposed.
    import sys

    from deepseek_flash.serve.engine import SWITCH_INTERVAL_S

    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        eng = Engine(tiny_reference, tiny_tokenizer, max_batch=2).start()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S, abs=5e-6) == pytest.approx(0.0005, abs=5e-6)
        eng.close(timeout=5)
        assert sys.getswitchinterval() == pytest.approx(0.005, abs=5e-6)
        sys.setswitchinterval(0.0002)
        eng = Engine(tiny_reference, tiny_tokenizer, max_batch=2).start()
        assert sys.getswitchinterval() == pytest.approx(0.0002, abs=5e-6)
        eng.close(timeout=5)
        sys.setswitchinterval(0.005)
        eng = Engine(tiny_reference, tiny_tokenizer, max_batch=2, switch_interval_s=None).start()
        assert sys.getswitchinterval() == pytest.approx(0.005, abs=5e-6)
        eng.close(timeout=5)
    finally:
        sys.setswitchinterval(saved)


def beside_engine(model, tokenizer, scheduler=None, rows=3, **kw):
    """``rows`` rows, the fixed-shape decode (the CUDA graphs' step; by default run eagerly), two L1
    requests decoding. On a CUDA device (``device=``, ``decode="auto"``) the graphs are captured
    first (``RowRunner.warm``)."""
    eng = Engine(model, tokenizer, scheduler or FlashScheduler(slots=rows, l0_reserve=0.0), max_batch=rows,
                 **({"decode": "static"} | kw))
    if eng.runner.device.type == "cuda":
        eng.runner.warm(eng.prefill_chunk)
    return eng, two_decoding(eng, 24)


def step_with_l0_during_decode(eng, l0):
    """One engine step during whose decode ``l0`` is submitted: the forwards it ran, in order, as
    ``(kind, rows)``."""
    runner = eng.runner
    static_run, prefill, start, log = runner.static.run, runner.prefill, runner.prefill_start, []

    def run(rows, *args):
        log.append(("decode", list(rows)))
        out = static_run(rows, *args)
        assert eng.submit(l0).admitted              # arrives while the decode is in flight
        return out

    def prefill_logged(rows, *args, **kw):
        log.append(("prefill", list(rows)))
        return prefill(rows, *args, **kw)

    def start_logged(rows, *args, **kw):           # a prompt issued beside a forward
        log.append(("prefill", list(rows)))
        return start(rows, *args, **kw)
    runner.static.run, runner.prefill, runner.prefill_start = run, prefill_logged, start_logged
    try:
        with torch.inference_mode():
            eng._step()
    finally:
        runner.static.run, runner.prefill, runner.prefill_start = static_run, prefill, start
    return log


def test_an_l0_request_arriving_during_the_graph_decode_is_prefilled_beside_it(tiny_reference, tiny_tokenizer):
    # With L0 traffic, an L0 request arriving while the batch's decode (a graph on a GPU) is in
    # flight joins a free row at once and its prompt runs beside the decode: its first token comes
    # from the same step, before the decode's tokens are taken. Every request's tokens stay greedy.
    eng, running = beside_engine(tiny_reference, tiny_tokenizer)
    eng._l0_at = time.monotonic()                       # L0 traffic: the beside path is on
    l0 = generation([7, 8, 9, 10, 11], 4, cls="L0")
    log = step_with_l0_during_decode(eng, l0)
    assert log == [("decode", [g.row for g in running]), ("prefill", [l0.row])]
    assert l0.row not in [g.row for g in running] and eng.stats["l0_beside"] == 1
    assert len(l0.output_ids) == 1 and all(len(g.output_ids) == 3 for g in running)
    drive(eng, done(l0, *running))
    for g in (l0, *running):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


@pytest.mark.parametrize("case", ["fifo", "no L0 traffic", "no graph for its prompt"])
def test_an_l0_request_waits_for_the_next_step_where_it_cannot_go_beside(tiny_reference, tiny_tokenizer, case):
    # The scheduler off (FIFO), no recent L0 request (the decode waits for the device plainly), or
    # a prompt forward of a shape no graph has: the L0 request is prefilled at the next step.
    from deepseek_flash.serve.scheduler import FifoScheduler

    eng, running = beside_engine(tiny_reference, tiny_tokenizer,
                                 FifoScheduler(slots=3) if case == "fifo" else None)
    if case != "no L0 traffic":
        eng._l0_at = time.monotonic()
    prompt = [7, 8, 9, 10, 11] if case != "no graph for its prompt" else [(3 * j) % 250 + 3 for j in range(140)]
    l0 = generation(prompt, 4, cls="L0")
    log = step_with_l0_during_decode(eng, l0)
    assert log == [("decode", [g.row for g in running])]
    assert eng.stats["l0_beside"] == 0 and l0.output_ids == []
    drive(eng, done(l0, *running))
    for g in (l0, *running):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


def test_the_device_waiter_wakes_the_engine_when_the_device_is_done():
    # The engine waits on its condition for a new request or the decode's end, whichever first;
    # the waiter thread blocks on the step's event (off the interpreter lock) and then wakes it.
    import threading

    from deepseek_flash.serve.beside import DeviceWaiter

    cond = threading.Condition()
    waiter = DeviceWaiter(cond)
    try:
        event, flag = DeviceEvent(), [False]
        waiter.watch(event, flag)
        with cond:
            assert not cond.wait(0.05) and flag == [False]      # the device still busy: no wake-up
        threading.Timer(0.05, event.happened.set).start()
        with cond:
            assert cond.wait_for(lambda: flag[0], 10)
        event, flag = DeviceEvent(), [False]             # and again, for the next step
        waiter.watch(event, flag)
        event.happened.set()
        with cond:
            assert cond.wait_for(lambda: flag[0], 10)
    finally:
        waiter.close()
    assert not waiter._thread.is_alive()


def test_an_l0_request_arriving_during_other_prompts_graph_forward_is_prefilled_beside_it(tiny_reference,
                                                                                        tiny_tokenizer):
    # Other prompts' chunk as a graph (the fixed-shape forward; run eagerly here): an L0 request
    # arriving while it runs joins at once and its prompt runs from the L0 requests' own graphs
    # beside it, before that chunk's first tokens are taken -- not after the step's decode.
    eng, running = beside_engine(tiny_reference, tiny_tokenizer, rows=4)
    eng._l0_at = time.monotonic()
    newcomer = generation([(5 * j) % 250 + 3 for j in range(20)], 6)
    l0 = generation([7, 8, 9, 10, 11], 4, cls="L0")
    log = step_with_l0_during_prompt_graph(eng, newcomer, l0)
    assert log == [("prefill", [newcomer.row]), ("l0 prefill", [l0.row])]
    # Its first token beside the chunk, its second from the same step's decode (as the chunk's own).
    assert eng.stats["l0_beside"] == 1 and len(l0.output_ids) == 2 and len(newcomer.output_ids) == 2
    assert l0.row not in [g.row for g in (*running, newcomer)]
    drive(eng, done(l0, newcomer, *running))
    for g in (l0, newcomer, *running):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


def step_with_l0_during_prompt_graph(eng, newcomer, l0):
    """``newcomer`` (L1) joins; one engine step during whose prompt forward of it ``l0`` is
    submitted: the prompt forwards it ran, as ``(graphs, rows)``."""
    assert eng.submit(newcomer).admitted
    boundary(eng)
    general, l0_graphs, log = eng.runner.static_prefill.run, eng.runner.static_prefill_l0.run, []

    def run(rows, *args):
        log.append(("prefill", list(rows)))
        out = general(rows, *args)
        assert eng.submit(l0).admitted              # arrives while the chunk is in flight
        return out

    def run_l0(rows, *args):
        log.append(("l0 prefill", list(rows)))
        return l0_graphs(rows, *args)
    eng.runner.static_prefill.run, eng.runner.static_prefill_l0.run = run, run_l0
    try:
        with torch.inference_mode():
            eng._step()
    finally:
        eng.runner.static_prefill.run, eng.runner.static_prefill_l0.run = general, l0_graphs
    return log


def test_an_l0_prompt_failing_beside_a_forward_switches_that_off_and_is_served_at_the_next_step(
        tiny_reference, tiny_tokenizer):
    # Whatever goes wrong beside a forward stays there: logged, the beside path off for good (with
    # the reason), and the L0 request prefilled at the next step like any other; tokens greedy.
    eng, running = beside_engine(tiny_reference, tiny_tokenizer)
    eng._l0_at = time.monotonic()
    l0_graphs = eng.runner.static_prefill_l0.run

    def broken(*args):
        raise RuntimeError("no second stream here")
    eng.runner.static_prefill_l0.run = broken
    l0 = generation([7, 8, 9, 10, 11], 4, cls="L0")
    try:
        step_with_l0_during_decode(eng, l0)
    finally:
        eng.runner.static_prefill_l0.run = l0_graphs
    assert (eng.l0_beside.enabled, eng.l0_beside.reason) == (False, "RuntimeError: no second stream here")
    assert eng.stats["l0_beside"] == 0 and l0.output_ids == [] and all(len(g.output_ids) == 3 for g in running)
    drive(eng, done(l0, *running))
    for g in (l0, *running):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


@pytest.mark.parametrize("prompt_len, beside", [(2, True), (4, False)])
def test_an_l0_request_reaching_a_full_batch_preempts_a_row_whose_decode_slot_is_beyond_its_prompt(
        tiny_reference, tiny_tokenizer, prompt_len, beside):
    # Both rows decode (each writes its slot 4 in this decode). An L0 prompt of 2 tokens writes
    # slots 0-2 at most: it may take a row now, beside the decode -- the two write different slots
    # of it -- and the decode's token for the request it preempts is dropped (the request rewinds
    # and recomputes, its tokens unchanged). A 4-token prompt would reach slot 4: it waits for the
    # step's end. Every request's tokens stay greedy.
    eng, running = beside_engine(tiny_reference, tiny_tokenizer, rows=2)
    eng._l0_at = time.monotonic()
    assert [len(g.prompt_ids) + len(g.output_ids) - 1 for g in running] == [4, 4]
    l0 = generation([7, 8, 9, 10][:prompt_len], 4, cls="L0")
    log = step_with_l0_during_decode(eng, l0)
    if beside:
        victim = next(g for g in running if g.row is None)
        assert log == [("decode", [0, 1]), ("prefill", [l0.row])] and len(l0.output_ids) == 1
        assert eng.stats["l0_beside"] == 1 and eng.stats["preempted"] == 1
        assert len(victim.output_ids) == 2                  # the decode's token for it dropped
        assert [len(g.output_ids) for g in running if g is not victim] == [3]
    else:
        assert log == [("decode", [0, 1])] and l0.output_ids == [] and eng.stats["preempted"] == 0
        assert all(len(g.output_ids) == 3 for g in running)
    drive(eng, done(l0, *running))
    for g in (l0, *running):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


@pytest.mark.parametrize("l0_traffic", [True, False])
def test_with_l0_traffic_a_long_prompt_goes_in_chunks_a_prompt_graph_runs(tiny_reference, tiny_tokenizer,
                                                                          l0_traffic):
    # With L0 requests about, a 300-token prompt (or a preempted request re-filling its prompt and
    # output) is prefilled in chunks of the widest prompt graph (128 tokens), each run from the
    # prompt graphs (here their fixed-shape forward, eagerly) -- so an L0 request arriving
    # meanwhile goes beside it -- not as one eager 300-token forward; without, as before. The
    # tokens are greedy either way.
    eng, running = beside_engine(tiny_reference, tiny_tokenizer)
    if l0_traffic:
        eng._l0_at = time.monotonic()
    long_prompt = generation([(11 * j) % 250 + 2 for j in range(300)], 3)
    assert eng.submit(long_prompt).admitted
    boundary(eng)
    row, prefill, log = long_prompt.row, eng.runner.prefill, []

    def logged(rows, ids, *args, **kw):
        log.append((list(rows), len(ids[0])))
        return prefill(rows, ids, *args, **kw)
    eng.runner.prefill = logged
    graphed = eng.runner.static_prefill.counters["static_steps"]
    drive(eng, done(long_prompt, *running))
    chunks = [n for rows, n in log if rows == [row]]
    assert chunks == ([128, 128, 44] if l0_traffic else [300])
    assert eng.runner.static_prefill.counters["static_steps"] - graphed == (3 if l0_traffic else 0)
    for g in (long_prompt, *running):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


class DeviceEvent:
    """A CUDA event's two methods, happening when the test says so."""

    def __init__(self):
        import threading

        self.happened = threading.Event()

    def synchronize(self):
        self.happened.wait(10)

    def query(self):
        return self.happened.is_set()


@pytest.mark.parametrize("second_lane", [True, False])
def test_a_second_l0_request_arriving_while_one_runs_beside_goes_on_the_second_lane(tiny_reference, tiny_tokenizer,
                                                                                   second_lane):
    # L0 request a's prompt is issued beside the decode and is still on the device (its event has
    # not happened) when b arrives: b's prompt is issued at once from the second set of L0 graphs,
    # on the second side stream -- it does not wait for a's. Without a second set (or once it
    # failed), b waits for a's prompt, as before. The first tokens come from the prompts, every
    # token greedy.
    import threading

    eng, running = beside_engine(tiny_reference, tiny_tokenizer, rows=4)
    if not second_lane:
        eng.runner.static_prefill_l0b = None
    eng._l0_at = time.monotonic()
    a = generation([7, 8, 9, 10, 11], 4, cls="L0")
    b = generation([9, 8, 7], 4, cls="L0")
    runner, events, launches = eng.runner, [], []
    start, issued_event = runner.prefill_start, runner.issued_event

    def event():                                    # each prompt's: happens 0.2 s after b's issue
        events.append(DeviceEvent())
        if len(events) == 2:
            threading.Timer(0.2, lambda: [e.happened.set() for e in events]).start()
        return events[-1]

    def start_logged(rows, ids, positions, kv_len, graphs):
        # (rows, from the second set, a's tokens then, a's prompt done on the device then)
        launches.append((list(rows), graphs is runner.static_prefill_l0b, len(a.output_ids),
                         [e.query() for e in events]))
        out = start(rows, ids, positions, kv_len, graphs)
        if len(launches) == 1:
            assert eng.submit(b).admitted           # arrives while a's prompt is on the device
        return out
    runner.prefill_start, runner.issued_event = start_logged, event
    taken_by, prefilled = [], eng._prefilled

    def prefilled_logged(group, *args):            # who takes a prompt's first tokens
        taken_by.append((group[0][0] is a, threading.current_thread().name))
        return prefilled(group, *args)
    eng._prefilled = prefilled_logged
    if not second_lane:                             # a's event: the waiter's, set in time
        threading.Timer(0.2, lambda: [e.happened.set() for e in events]).start()
    try:
        log = step_with_l0_during_decode(eng, a)
    finally:
        runner.prefill_start, runner.issued_event = start, issued_event
    # Each prompt's first tokens taken by its lane's waiter thread once its event happened (one
    # hand-off of the interpreter lock), not by the engine thread after a wake-up.
    assert sorted(taken_by) == [(False, "serve-device-waiter"), (True, "serve-device-waiter")]
    if second_lane:
        # b issued on the second lane while a's prompt had not happened yet.
        assert launches == [([a.row], False, 0, []), ([b.row], True, 0, [False])]
        assert eng.stats["l0_beside_concurrent"] == 1
    else:
        assert launches[0] == ([a.row], False, 0, []) and launches[1][:3] == ([b.row], False, 1)
        assert eng.stats["l0_beside_concurrent"] == 0
    assert log[0][0] == "decode" and eng.stats["l0_beside"] == 2
    assert len(a.output_ids) == 1 and len(b.output_ids) == 1
    drive(eng, done(a, b, *running))
    for g in (a, b, *running):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)


def test_a_failure_on_the_second_lane_switches_only_that_lane_off(tiny_reference, tiny_tokenizer):
    # The second set of L0 graphs failing: logged, that lane off for good (with the reason), the
    # request served at the next step; the first lane and the path stay on.
    import threading

    eng, running = beside_engine(tiny_reference, tiny_tokenizer, rows=4)
    eng._l0_at = time.monotonic()
    a = generation([7, 8, 9, 10, 11], 4, cls="L0")
    b = generation([9, 8, 7], 4, cls="L0")
    runner, events = eng.runner, []
    start, issued_event, second = runner.prefill_start, runner.issued_event, runner.static_prefill_l0b.run

    def event():
        events.append(DeviceEvent())
        threading.Timer(0.2, events[-1].happened.set).start()
        return events[-1]

    def start_then_b(rows, *args):
        out = start(rows, *args)
        if rows == [a.row]:
            assert eng.submit(b).admitted
        return out

    def broken(*args):
        raise RuntimeError("no third stream here")
    runner.prefill_start, runner.issued_event, runner.static_prefill_l0b.run = start_then_b, event, broken
    try:
        step_with_l0_during_decode(eng, a)
    finally:
        runner.prefill_start, runner.issued_event, runner.static_prefill_l0b.run = start, issued_event, second
    assert eng.l0_beside.enabled and eng.l0_beside.reason is None
    assert eng.l0_beside.second_reason == "RuntimeError: no third stream here"
    assert len(eng.l0_beside.lanes()) == 1
    assert eng.stats["l0_beside"] == 1 and len(a.output_ids) == 1 and b.output_ids == []
    drive(eng, done(a, b, *running))
    for g in (a, b, *running):
        assert g.output_ids == greedy(tiny_reference, g.prompt_ids, g.sched.max_new_tokens)
    eng.close(timeout=0)
