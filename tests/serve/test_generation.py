"""A request's tokens to text (``Generation.take``): incremental detokenization, stop strings held
back and cut, end of text, the length limits; ``rewind`` after a preemption."""
import pytest
from serve_helpers import Collector

from deepseek_flash.serve.generation import Generation
from deepseek_flash.serve.scheduler import SchedRequest

EOS = frozenset({256})


def generation(prompt, tokens, **kw):
    return Generation(SchedRequest(id="g", priority_class="L1", max_new_tokens=tokens), list(prompt), Collector(),
                      **kw)


# Token streams of the byte-level tokenizer (id == byte) -> (stop strings, streamed text, reason)
DETOK_TABLE = [
    (list("héllo wörld €1 🙂!".encode()), (), "héllo wörld €1 🙂!", "length"),
    # A lone continuation byte in the middle, and a character cut by the end: what the whole
    # output decodes to.
    (list(b"ab\x80cd\xe2\x82"), (), "ab\ufffdcd\ufffd", "length"),
    # Stop strings: across tokens and inside a multi-byte character's neighbourhood.
    (list("xé<END>yz".encode()), ("<END>",), "xé", "stop"),
    (list("aaé€b".encode()), ("é€", "zz"), "aa", "stop"),
    (list(b"q\xe2\x82\xac") + [256, 65], (), "q€", "stop"),           # eos ends it
]


@pytest.mark.parametrize("ids, stops, text, reason", DETOK_TABLE)
def test_incremental_detokenization_answers_what_the_whole_output_decodes_to(tiny_tokenizer, ids, stops, text,
                                                                              reason):
    g = generation([1], len(ids), stop_strings=stops)
    reasons = []
    for token in ids:
        reasons.append(g.take(token, EOS, 1 << 20, tiny_tokenizer))
        if reasons[-1] is not None:
            break
    assert reasons == [None] * (len(reasons) - 1) + [reason]
    assert (g.on_event.text, g.text) == (text, text)
    if reason == "length":
        assert text == tiny_tokenizer.decode(ids)
    # One token event per generated token (end of text is none).
    assert [k for k, _ in g.on_event.events] == ["token"] * len(g.output_ids)


def test_a_request_is_done_at_its_max_tokens_or_at_the_model_length(tiny_tokenizer):
    g = generation([1, 2, 3], 3)
    assert [g.take(t, EOS, 100, tiny_tokenizer) for t in b"abc"] == [None, None, "length"]
    g = generation([1, 2, 3], 10)                        # 3 prompt tokens + 2 reach a length of 5
    assert [g.take(t, EOS, 5, tiny_tokenizer) for t in b"ab"] == [None, "length"]
    assert g.text == "ab" and g.sched.generated == 2


def test_rewind_prefills_the_prompt_and_every_token_but_the_last_again(tiny_tokenizer):
    g = generation([1, 2, 3], 10)
    g.row, g.prefilled = 2, 3
    for t in b"xy":
        g.take(t, EOS, 100, tiny_tokenizer)
    g.rewind()
    assert (g.row, g.prefilled, g.resumed, g.fill_ids) == (None, 0, True, [1, 2, 3, ord("x")])
    fresh = generation([1, 2, 3], 10)
    fresh.row = 0
    fresh.rewind()                                       # preempted before its first token
    assert (fresh.row, fresh.resumed, fresh.fill_ids) == (None, False, [1, 2, 3])
