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
    # a batch of mixed requests: every prompt under every arm, all in flight together
    prompts = [p for p in PROMPTS for _ in ARMS]
    specs = [a for _ in PROMPTS for a in ARMS]
    outs = eng.generate(prompts, params, specs)
    for i, o in enumerate(outs):
        assert o.token_ids == plain[i // len(ARMS)].token_ids, specs[i]
    assert sum(o.stats.accepted for o in outs) > 0
