"""Streamed text deltas: decoded incrementally (a window of recent tokens, not the whole
output per chunk), always a prefix of the final text, never holding back more than a
partial character or a possible stop-string beginning."""
from __future__ import annotations

import random

import pytest


@pytest.mark.slow
def test_incremental_text_deltas_are_a_prefix_of_the_full_decode(smollm_dir):
    from transformers import AutoTokenizer

    from adaptspec.serve.loop import _Callers, _Stream
    from adaptspec.serve.types import EngineChunk

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    callers = _Callers.__new__(_Callers)  # only the detokenizer is used
    callers._detok = tok
    text = "Héllo wörld! 日本語のテキスト 🚀🔥 naïve café, “quotes” and code: def f(x): return x**2\n" * 4
    ids = tok(text, add_special_tokens=False)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    calls = []
    real = tok.decode
    tok.decode = lambda t, **kw: (calls.append(len(t)), real(t, **kw))[1]
    for seed in range(10):
        rng = random.Random(seed)
        stream = _Stream(None, None, None, True, stop=("STOP",))
        got, i, seen = "", 0, []
        while i < len(ids):
            n = rng.randint(1, 4)
            seen += ids[i:i + n]
            i += n
            chunk = EngineChunk("r", token_ids=ids[i - n:i], finished=False)
            callers._text_delta(stream, chunk, seen)
            got += chunk.text
            assert full.startswith(got)
        assert len(full) - len(got) < 8  # only a partial character / stop beginning is held back
    assert max(calls) <= 40 < len(ids) / 4  # windows of recent tokens, never the whole output
