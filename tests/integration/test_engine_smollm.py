"""Greedy speculative decoding on the real SmolLM2-135M is token-for-token exact (fp32)."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from adaptspec import SamplingParams, SpecConfig

PROMPTS = [
    "Rewrite this function with type hints:\ndef area(w, h):\n    return w * h\n",
    "What is the boiling point of water at sea level?",
    "Extract the names from: Alice met Bob and Carol in Paris.",
    "Write one sentence about the ocean.",
]
N = 20
ARMS = [SpecConfig("ngram", 1), SpecConfig("ngram", 3), SpecConfig("ngram", 8),
        SpecConfig("draft", 1), SpecConfig("draft", 3), SpecConfig("draft", 8)]


def test_mixed_batch_equals_plain_and_transformers(smollm_engine, smollm_dir):
    eng = smollm_engine
    params = SamplingParams(max_new_tokens=N, ignore_eos=False)
    plain = eng.generate(PROMPTS, params, SpecConfig())
    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    for p, out in zip(PROMPTS, plain):
        ids = torch.tensor([eng.encode(p)])
        ref = hf.generate(ids, max_new_tokens=N, do_sample=False, pad_token_id=2)[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref[:len(out.token_ids)]
        # shorter than N only by stopping at an end-of-sequence or stop token (transformers made the same)
        assert len(out.token_ids) == N or out.finish_reason in ("eos", "stop")
    # a batch of mixed requests: every prompt under every arm, all in flight together
    prompts = [p for p in PROMPTS for _ in ARMS]
    specs = [a for _ in PROMPTS for a in ARMS]
    outs = eng.generate(prompts, params, specs)
    for i, o in enumerate(outs):
        assert o.token_ids == plain[i // len(ARMS)].token_ids, specs[i]
    for drafter in ("ngram", "draft"):  # each drafter's own requests drafted and had tokens accepted
        mine = [o for o, a in zip(outs, specs) if a.drafter == drafter]
        assert sum(o.stats.drafted for o in mine) > 0 and sum(o.stats.accepted for o in mine) > 0, drafter


def test_shipped_draft_head_matches_the_target_and_is_exact(smollm_dir):
    """The shipped `smollm2-135m-draft` loads as a head over SmolLM2, shares its vocabulary,
    and greedy speculative output with it equals plain output token for token (fp32)."""
    from adaptspec import Engine
    from adaptspec.models.loader import LoadedHead

    eng = Engine.from_pretrained(str(smollm_dir), draft="smollm2-135m-draft", dtype="float32",
                                 max_num_seqs=4, max_model_len=1024)
    head = eng.draft
    assert isinstance(head, LoadedHead)
    assert head.model.cfg.target_vocab_size == eng.target.vocab_size
    assert int(head.model.vocab_ids.max()) < eng.target.vocab_size
    params = SamplingParams(max_new_tokens=24)
    plain = eng.generate(PROMPTS, params, SpecConfig())
    for k in (1, 3, 8):
        spec = eng.generate(PROMPTS, params, SpecConfig("draft", k))
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], f"k={k}"
    # a trained draft: the untrained head accepts ~0 (its measured numbers are in the model card)
    assert eng.totals.accepted / eng.totals.drafted > 0.08
