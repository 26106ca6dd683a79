"""L2's degrade steps seen over HTTP: a real server (tiny model, CPU), the official ``openai``
client; an elastic request running when L1 demand takes every slot is degraded step by step, and
its response and the server's metrics say so."""
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from serve_helpers import DEGRADED_ONCE, degrade_metrics, serve_in_thread, stop_server

from deepseek_flash.serve.cli import build


def start(store):
    # Two rows (one held for L0, lent to L1); a degrade window of 1 ms and no interval between
    # steps, so that pressure is seen at once and each engine step applies the next degrade step.
    app, state = build(str(store), device="cpu", max_batch=2, max_model_len=512, embedded=True)
    sched = state.engine.scheduler
    sched.idle_window, sched.degrade_interval = 1e-3, 0.0
    base, srv, thread = serve_in_thread(app)
    return base, state, srv, thread


def test_an_l2_request_under_l1_pressure_is_degraded_in_order_and_says_so(tiny_checkpoint, tmp_path):
    from deepseek_flash.store import pack

    base, state, srv, thread = start(pack(tiny_checkpoint, tmp_path / "tiny-degrade"))
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        def complete(cls, max_tokens, prompt):
            return client.completions.create(model="tiny-degrade", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, seed=5,
                                             extra_body={"flash_context": {"priority_class": cls}})

        with ThreadPoolExecutor(3) as pool:
            # The elastic request joins the idle server (every slot idle > 30 %); long enough that
            # the L1 requests below arrive while it runs, however busy the machine ...
            l2 = pool.submit(complete, "L2", 500, [5, 6, 7])
            deadline = time.monotonic() + 30
            while state.engine.stats["generated_tokens"] < 2:
                assert time.monotonic() < deadline and not l2.done(), "the L2 request did not start"
                time.sleep(0.001)
            # ... then two L1 requests: one takes the other row, one waits -- L0/L1 want every slot.
            l1 = [pool.submit(complete, "L1", 40, [8 + i, 9]) for i in range(2)]
            resp = l2.result()
            l1_resp = [f.result() for f in l1]
        extra = resp.model_extra
        assert extra["degraded"] is True
        assert extra["flash"]["class"] == "L2"
        assert extra["flash"]["degrade_steps"] == ["temperature", "top_p", "max_new_tokens"]
        # The last step cut max_new_tokens to what it had plus 70 % of what was left (sampled from
        # the first step on, it may also meet the end-of-text token before).
        assert resp.choices[0].finish_reason in ("length", "stop") and 3 <= resp.usage.completion_tokens < 500
        for r in l1_resp:
            assert (r.model_extra["degraded"], r.model_extra["flash"]["degrade_steps"]) == (False, [])
            assert r.usage.completion_tokens == 40
        assert degrade_metrics(httpx.get(base + "/metrics").text) == DEGRADED_ONCE
    finally:
        stop_server(srv, thread)
