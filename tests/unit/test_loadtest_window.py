"""The load test measures inside its window: tokens that arrived in it, requests that
finished in it; a request cut at the window's end counts its tokens, not its latency."""
from adaptspec.serve.loadtest import LoadSpec, RequestRecord, Window, summarize

SPEC = LoadSpec(["chat"], max_tokens=4, slo_ttft_s=1.0, slo_tpot_s=0.5)


def _rec(start, ttft, token_times, cut=False, error="", cls="chat"):
    chunks = [(t, 1) for t in token_times]
    e2e = (token_times[-1] if token_times else start) - start
    return RequestRecord(cls, ttft, e2e, len(chunks), {"none:0": len(chunks)}, error, start, chunks, cut)


def test_only_the_window_counts():
    w = Window(10.0, 20.0)
    recs = [
        _rec(9.0, 0.5, [9.5, 9.8, 10.1, 10.4]),  # sent in the warm-up, finishing inside: 2 tokens in
        _rec(12.0, 0.5, [12.5, 13.0, 13.5, 14.0]),  # all inside, meets both SLOs
        _rec(15.0, 2.0, [17.0, 17.5, 18.0, 18.5]),  # inside, misses the TTFT SLO
        _rec(19.0, 0.5, [19.5, 20.0], cut=True),  # cut at the end: its 2 tokens count, its latency not
        _rec(5.0, 0.5, [5.5, 6.0, 6.5, 7.0]),  # warm-up only: nothing counts
    ]
    s = summarize("p", 1, recs, w, SPEC)
    assert s.duration_s == 10.0
    assert s.throughput_tokens_per_s == (2 + 4 + 4 + 2) / 10.0
    assert s.requests == 3  # finished inside the window, not cut
    assert s.goodput_requests_per_s == 2 / 10.0
    assert s.ttft_p50_s == 0.5


def test_rounds_add_their_windows_and_errors_count_once():
    w1, w2 = Window(0.0, 5.0), Window(100.0, 105.0)
    recs = [_rec(1.0, 0.1, [1.1, 1.2]), _rec(101.0, 0.1, [101.1, 101.2, 101.3]),
            _rec(50.0, 0.1, [50.1, 50.2]),  # between the windows (another policy's run): ignored
            RequestRecord("chat", 0.0, 0.01, 0, error="StatusCode.RESOURCE_EXHAUSTED", start_s=102.0)]
    s = summarize("p", 1, recs, [w1, w2], SPEC)
    assert s.duration_s == 10.0 and s.throughput_tokens_per_s == 5 / 10.0
    assert s.requests == 2 and s.errors == 1


def test_adaptive_vs_static_does_not_round_a_miss_into_the_goal():
    from types import SimpleNamespace as NS

    from adaptspec.serve.cli import adaptive_vs_static

    rows = [NS(concurrency=4, policy="thompson", throughput_tokens_per_s=51.13),
            NS(concurrency=4, policy="static:ngram:2", throughput_tokens_per_s=54.08),
            NS(concurrency=4, policy="static:none:0", throughput_tokens_per_s=41.8),
            NS(concurrency=16, policy="thompson", throughput_tokens_per_s=96.0),
            NS(concurrency=16, policy="static:none:0", throughput_tokens_per_s=95.0)]
    assert adaptive_vs_static(rows) == ["c=4: thompson / best static (static:ngram:2) = 0.945 (< 0.95)",
                                        "c=16: thompson / best static (static:none:0) = 1.011 (>= 0.95)"]
