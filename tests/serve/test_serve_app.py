"""The official ``openai`` client against a real uvicorn server on 127.0.0.1 (tiny model, CPU,
embedded controller): completions and chat, streamed and not, extensions, error shapes, concurrency,
a client leaving mid-stream, overload."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import greedy, serve_in_thread, stop_server

from deepseek_flash.serve.app import DEFAULT_CHAT_TEMPLATE
from deepseek_flash.serve.cli import build

MAX_LEN = 96


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    from deepseek_flash.store import pack

    store = pack(tiny_checkpoint, tmp_path_factory.mktemp("serve-store") / "tiny-chat")
    spill_root = tmp_path_factory.mktemp("spill-root")
    app, state = build(str(store), device="cpu", max_batch=4, max_model_len=MAX_LEN, embedded=True,
                       kv_spill_root=str(spill_root))
    base, srv, thread = serve_in_thread(app)
    yield base, state
    stop_server(srv, thread)
    assert state.engine.scheduler.draining            # the lifespan shutdown closed the engine


@pytest.fixture
def client(served):
    base, _ = served
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_models_and_health(served, client):
    base, state = served
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    # The serve extra's C event loop (uvicorn takes it when installed).
    assert state.event_loop == "uvloop.Loop"
    health = httpx.get(base + "/healthz").json()
    assert health == {"status": "ok", "model": "tiny-chat", "running": 0, "queued": 0, "slots": 4}


def test_completion_is_the_greedy_continuation_with_flash_fields(served, client, tiny_reference, tiny_tokenizer):
    prompt = [72, 101, 108, 108, 111]
    want = greedy(tiny_reference, prompt, 8)
    before = time.monotonic()
    resp = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"flash_context": {"priority_class": "L0"}, "priority": 3})
    after = time.monotonic()
    assert (resp.choices[0].text, 8) == expected_text(tiny_tokenizer, want)
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (5, 8)
    extra = resp.model_extra
    assert extra["degraded"] is False
    flash = extra["flash"]
    assert (flash["class"], flash["priority"], flash["degrade_steps"]) == ("L0", 3, [])
    assert flash["queue_ms"] >= 0 and flash["ttft_ms"] >= flash["queue_ms"]
    assert flash["kv"] == {"tokens": 13, "cache": "rows", "bytes": 13 * served[1].engine.runner.cache.bytes_per_token}
    assert (flash["bytes_streamed"], flash["prefetch_hit_rate"]) == (0, None)    # fully resident
    # Where its time went, on the server's monotonic clock (this process's): the handler had it,
    # the scheduler took it, it joined the batch, its first token; no stream, so no first write.
    timing = flash["timing"]
    assert set(timing) == {"received_at", "queued_ms", "admitted_ms", "first_token_ms", "first_write_ms"}
    assert before <= timing["received_at"] <= after
    assert 0 <= timing["queued_ms"] <= timing["admitted_ms"] <= timing["first_token_ms"] <= (after - before) * 1e3
    assert timing["admitted_ms"] - timing["queued_ms"] == pytest.approx(flash["queue_ms"], abs=0.01)
    assert timing["first_token_ms"] - timing["queued_ms"] == pytest.approx(flash["ttft_ms"], abs=0.01)
    assert timing["first_write_ms"] is None


def test_streamed_completion_equals_the_plain_one(client):
    kwargs = dict(model="tiny-chat", prompt="def f(x):", max_tokens=12, temperature=0)
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "length"
    assert last.model_extra["flash"]["class"] == "L1" and last.model_extra["degraded"] is False
    # A stream's first token went to the HTTP server to write after the step that made it.
    timing = last.model_extra["flash"]["timing"]
    assert 0 <= timing["queued_ms"] <= timing["admitted_ms"] <= timing["first_token_ms"] <= timing["first_write_ms"]
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_chat_uses_the_documented_default_template(served, client, tiny_tokenizer):
    base, state = served
    assert state.default_template                          # the tiny tokenizer has none
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0)
    rendered = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert tiny_tokenizer.apply_chat_template(messages, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False,
                                              add_generation_prompt=True) == rendered
    assert plain.usage.prompt_tokens == len(rendered.encode())               # byte-level tokenizer
    completion = client.completions.create(model="tiny-chat", prompt=list(rendered.encode()), max_tokens=6,
                                           temperature=0)
    assert plain.choices[0].message.content == completion.choices[0].text
    assert plain.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6,
                                                 temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == plain.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_sixteen_concurrent_clients_each_get_their_own_greedy_answer(client, tiny_reference, tiny_tokenizer):
    prompts = [[(11 * i + j) % 250 + 3 for j in range(2 + i % 5)] for i in range(16)]

    def ask(prompt):
        return client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, temperature=0)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, resp in zip(prompts, answers):
        text, n = expected_text(tiny_tokenizer, greedy(tiny_reference, prompt, 10))
        assert (resp.choices[0].text, resp.usage.completion_tokens) == (text, n)


def expected_text(tokenizer, ids):
    """What the server answers for a greedy continuation: cut at eos, decoded without specials."""
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids)


def test_openai_error_shapes(served, client):
    base, _ = served
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    err = e.value.response.json()["error"]
    assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt=[5] * (MAX_LEN - 3), max_tokens=4)
    err = e.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded" and f"maximum context length is {MAX_LEN}" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x" * MAX_LEN}])
    assert e.value.response.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt="x", extra_body={"flash_context": {"priority_class": "L9"}})
    assert e.value.response.json()["error"]["param"] == "flash_context"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt="x", temperature=3)
    assert e.value.response.json()["error"]["param"] == "temperature"
    # Not through the client: a body that is not JSON, one without a model, a path that is not served.
    bad = httpx.post(base + "/v1/chat/completions", content=b'{"model": "tiny-chat", "messages": [',
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    missing = httpx.post(base + "/v1/completions", json={"prompt": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    nowhere = httpx.get(base + "/v1/engines")
    assert nowhere.status_code == 404 and set(nowhere.json()["error"]) == {"message", "type", "param", "code"}


def test_a_client_leaving_mid_stream_frees_its_row(served, monkeypatch):
    base, state = served
    forward = state.engine.runner.forward

    def slow_forward(*args, **kwargs):       # the request must still be running when the client leaves
        time.sleep(0.05)
        return forward(*args, **kwargs)
    monkeypatch.setattr(state.engine.runner, "forward", slow_forward)
    before = state.engine.stats["cancelled"]
    body = {"model": "tiny-chat", "prompt": [3, 4, 5], "max_tokens": MAX_LEN - 3, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", base + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["object"] == "text_completion"
            assert state.engine.running() == 1
    wait_for(lambda: state.engine.running() == 0 and state.engine.stats["cancelled"] == before + 1)
    metrics = httpx.get(base + "/metrics").text
    assert f"deepseek_flash_serve_cancelled_total {before + 1}" in metrics
    assert 'deepseek_flash_serve_running{class="L1"} 0' in metrics


def test_overload_is_429_with_retry_after_never_a_dropped_connection(served, client):
    base, state = served
    sched = state.engine.scheduler
    saved = sched.max_queued
    sched.max_queued = 0                    # every arrival finds the queue full
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny-chat", prompt="x", max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.response.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        sched.max_queued = saved
    metrics = httpx.get(base + "/metrics").text
    assert 'deepseek_flash_serve_requests_total{class="L1",outcome="refused_429"} 1' in metrics
    assert 'deepseek_flash_serve_http_responses_total{code="429"} 1' in metrics
    assert "deepseek_flash_serve_time_to_first_token_seconds" in metrics


def test_an_l2_request_alone_is_not_degraded_and_headroom_is_exported(served, client):
    base, state = served
    resp = client.completions.create(model="tiny-chat", prompt=[5, 6, 7], max_tokens=24, temperature=0,
                                     extra_body={"flash_context": {"priority_class": "L2"}})
    extra = resp.model_extra
    assert (extra["degraded"], extra["flash"]["class"], extra["flash"]["degrade_steps"]) == (False, "L2", [])
    assert resp.usage.completion_tokens == 24
    metrics = httpx.get(base + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("deepseek_flash_serve_l2_headroom_ratio "))
    assert 0.0 <= float(line.split()[1]) <= 1.0


# flash_context KV keys that are refused: (context, param, code, words in the message)
KV_REFUSED = [
    ({"kv_top_k_pages": 0}, "flash_context.kv_top_k_pages", "invalid_value", "null (every page: lossless)"),
    ({"kv_top_k_pages": 1.5}, "flash_context.kv_top_k_pages", "invalid_value", "1.5"),
    ({"kv_page_tokens": 24}, "flash_context.kv_page_tokens", "invalid_value", "16, 32, 64 or 128"),
    ({"kv_page_cache": 0.5}, "flash_context.kv_page_cache", "invalid_value", "multiple >= 1"),
    ({"kv_gpu_tokens": -1}, "flash_context.kv_gpu_tokens", "invalid_value", "kv_gpu_tokens"),
    ({"kv_sink_tokens": "4"}, "flash_context.kv_sink_tokens", "invalid_value", "kv_sink_tokens"),
    ({"kv_host_bytes": "lots"}, "flash_context.kv_host_bytes", "invalid_value", "kv_host_bytes"),
    ({"kv_host_bytes": "1MiB"}, "flash_context.kv_host_bytes", "invalid_value", "needs kv_spill_dir"),
    ({"kv_spill_dir": "../../etc"}, "flash_context.kv_spill_dir", "invalid_value", "outside the server's spill root"),
    ({"kv_spill_dir": "/tmp"}, "flash_context.kv_spill_dir", "invalid_value", "outside the server's spill root"),
    ({"kv_prune_threshold": 1.5}, "flash_context.kv_prune_threshold", "invalid_value", "kv_prune_threshold"),
    ({"kv_bogus": 1}, "flash_context", "invalid_value", "unknown flash_context key 'kv_bogus'"),
]


@pytest.mark.parametrize("context, param, code, words", KV_REFUSED)
def test_bad_kv_keys_are_a_400_naming_the_key(client, context, param, code, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=2, extra_body={"flash_context": context})
    err = e.value.response.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert words in err["message"]


def test_kv_keys_run_the_request_on_a_tiered_cache(served, client, tiny_reference):
    base, state = served
    prompt = [(3 * j) % 250 + 4 for j in range(40)]
    want = greedy(tiny_reference, prompt, 20)
    ctx = {"kv_gpu_tokens": 16, "kv_sink_tokens": 2, "kv_page_tokens": 16, "kv_top_k_pages": None,
           "kv_host_bytes": "1KiB", "kv_spill_dir": "req-1"}
    chunks = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, extra_body={"flash_context": ctx}))
    last = chunks[-1].model_extra
    kv = last["flash"]["kv"]
    assert (kv["cache"], kv["tokens"], kv["tiered"]["page_tokens"]) == ("tiered", 60, 16)
    assert kv["tiered"]["spilled_bytes"] > 0 and kv["tiered"]["pages"] > 0
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(state.tokenizer, want)[0]
    assert not any((Path(state.kv_spill_root) / "req-1").iterdir())       # removed with the request


def test_kv_prune_threshold_runs_the_request_with_pruning(served, client, tiny_reference):
    _, state = served
    prompt = [(5 * j) % 250 + 4 for j in range(60)]
    want = greedy(tiny_reference, prompt, 12)
    # threshold 0: every page stays on the device, so the text is the reference's
    ctx = {"kv_prune_threshold": 0.0, "kv_gpu_tokens": 16, "kv_page_tokens": 16}
    resp = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"flash_context": ctx})
    tiered = resp.model_extra["flash"]["kv"]["tiered"]
    assert tiered["pages"] > 0 and tiered["demotions"] == 0
    # no page on the host: it holds the pruning scorer's key and value norms alone (2 layers,
    # 2 norms x 2 KV heads, fp32, 128 tokens: whole chunks of 64)
    assert tiered["host_bytes"] == 2 * 128 * (2 * 2) * 4
    assert tiered["level_tokens"][0] == [60 + 11, 0, 0]  # the last token is not fed back
    assert resp.choices[0].text == expected_text(state.tokenizer, want)[0]


def test_events_of_one_step_wake_the_event_loop_once():
    import asyncio

    from deepseek_flash.serve.app import Delivery

    class Loop:
        def __init__(self):
            self.calls = []

        def call_soon_threadsafe(self, fn):
            self.calls.append(fn)

    loop = Loop()
    deliver = Delivery(loop)
    queues = [asyncio.Queue() for _ in range(16)]
    for i, q in enumerate(queues):                  # one step's token for each of 16 rows
        deliver(q, ("token", i))
    deliver(queues[3], ("done", {}))
    assert len(loop.calls) == 1
    loop.calls[0]()
    assert [q.qsize() for q in queues] == [1, 1, 1, 2] + [1] * 12
    assert queues[3].get_nowait() == ("token", 3) and queues[3].get_nowait() == ("done", {})
    deliver(queues[0], ("token", 99))               # after the drain: a new wake-up
    assert len(loop.calls) == 2


def test_an_l0_requests_events_resume_its_stream_first():
    # One step's tokens arrive in row order; the L0 request's (urgent) is put first, so its stream
    # resumes -- and writes -- before the other rows' of the same step, which keep their order.
    import asyncio

    from deepseek_flash.serve.app import Delivery

    async def main():
        deliver = Delivery(asyncio.get_running_loop())
        queues = {name: asyncio.Queue() for name in ("a", "b", "l0", "c")}
        resumed = []

        async def stream(name):
            item = await queues[name].get()
            resumed.append((name, item))
        tasks = [asyncio.create_task(stream(n)) for n in queues]
        await asyncio.sleep(0)                        # every stream waits on its queue
        for name in queues:                           # the engine thread's order: row order
            deliver(queues[name], ("token", name), urgent=name == "l0")
        await asyncio.gather(*tasks)
        return resumed

    assert asyncio.run(main()) == [("l0", ("token", "l0")), ("a", ("token", "a")), ("b", ("token", "b")),
                                   ("c", ("token", "c"))]


@pytest.mark.parametrize("chat", [False, True])
def test_every_streamed_chunk_is_json_dumps_of_its_object(served, chat):
    # A token's chunk is built as a constant envelope around the text's encoding: its bytes are
    # exactly json.dumps of the object it holds (key order, separators, escapes), as every other
    # chunk's; the texts join into the plain answer.
    base, state = served
    body = {"model": "tiny-chat", "max_tokens": 24, "temperature": 0, "stream": True}
    body.update({"messages": [{"role": "user", "content": 'say "hi"\n'}]} if chat else {"prompt": 'x = "\\n"'})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base + path, json=body) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        plain = http.post(base + path, json={**body, "stream": False}).json()
    assert lines[-1] == "data: [DONE]"
    objects = [json.loads(line[6:]) for line in lines[:-1]]
    assert [line[6:] for line in lines[:-1]] == [json.dumps(o) for o in objects]
    if chat:
        text = "".join(o["choices"][0]["delta"].get("content", "") for o in objects)
        assert text == plain["choices"][0]["message"]["content"]
    else:
        assert "".join(o["choices"][0]["text"] for o in objects) == plain["choices"][0]["text"]
    assert sum(1 for o in objects if o["choices"][0]["finish_reason"] is None) >= 2     # token chunks
