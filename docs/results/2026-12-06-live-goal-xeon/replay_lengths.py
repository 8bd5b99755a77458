"""Accepted length per k: what the simulator's replay of recorded acceptance draws, beside the
chain of pooled per-position chances (what a planner fed the "true" models plans with).

    .venv/bin/python docs/results/2026-12-06-live-goal-xeon/replay_lengths.py \
        docs/results/2026-12-02-one-thread/fidelity-closed/acceptance.json
"""
import sys

import numpy as np

from adaptspec.control.acceptance import accepted_length_curve
from adaptspec.sim.acceptance_replay import AcceptanceFile, RecordedAcceptance

K, DRAWS = 8, 20000

f = AcceptanceFile.load(sys.argv[1])
for cls, drafters in f.classes.items():
    for d, rec in drafters.items():
        m = RecordedAcceptance.from_record(rec)
        rng = np.random.default_rng(0)
        pooled = accepted_length_curve(m.position_probs(K))[1:]
        replay = [1 + m.sample(k, DRAWS, rng).mean() for k in range(1, K + 1)]
        steps = {k: int(np.asarray(v).sum()) for k, v in sorted(rec.joint.items())}
        print(f"{cls} {d}: request-steps recorded per k {steps}")
        print("  pooled chain " + " ".join(f"{x:.3f}" for x in pooled))
        print("  replay       " + " ".join(f"{x:.3f}" for x in replay))
