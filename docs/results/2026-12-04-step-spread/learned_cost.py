"""Thompson's learned acceptance and step cost against the scenario's true models, after one
closed-loop run. From the repository root:

    python docs/results/2026-12-04-step-spread/learned_cost.py \
        docs/results/2026-12-04-step-spread/sim-c4-600s-thompson.yaml 0 [label]
"""
import sys
from pathlib import Path
import numpy as np
import adaptspec.sim.runner as runner
import adaptspec.sim.closed_loop as cl
from adaptspec.sim.scenario import load_scenario

path, seed = sys.argv[1], int(sys.argv[2])
label = sys.argv[3] if len(sys.argv) > 3 else "thompson"
sc, base = load_scenario(Path(path))
caught = {}
for mod in (runner, cl):
    if hasattr(mod, "build_policy"):
        build = mod.build_policy
        def keep(spec, *a, _b=build, **kw):
            run = _b(spec, *a, **kw)
            caught[runner.policy_label(spec)] = run.policy
            return run
        mod.build_policy = keep
spec = [p for p in sc.policies if runner.policy_label(p) == label]
res = cl.run_closed_loop(sc, base, spec, seed=seed)
for r in res.runs:
    print(r.policy, "req/s %.3f" % r.request_throughput)
    for c in r.classes:
        print("   ", c.name, [(a, round(s, 3)) for a, s in c.arm_share[:4]])
p, K = caught[label], sc.max_k
truths = {t.name: t for t in runner.class_truths(sc, base)}
for cls in (c.name for c in sc.classes):
    for d, (acc, seen) in p.learned_acceptance(cls).items():
        true = truths[cls].at(0.0)[d].position_probs(K)
        print(f"  {cls:10s} {d:5s} {np.round(acc[:4], 3)} ({np.round(seen[:4]).astype(int)}) / {np.round(true[:4], 3)}")
truth = runner.cost_model(sc, base)
ctx = 300.0
print("step ms learned / true (n decoding, verify, draft batch pos0, ngram)")
for n in (2, 3, 4):
    for verify, d0, ng in [(n, 0, 0), (2 * n, n, 0), (2 * n - 1, n - 1, 0), (n + 2, 0, 1), (n + 3, 0, 1)]:
        D = np.zeros(K); D[0] = d0
        args = (np.array(verify, float), np.array(n * ctx), D, np.array(ng, float), ctx)
        print(f"  n={n} verify={verify:3d} draft0={d0} ngram={ng}: {float(p.cost.step_time(*args))*1e3:7.2f} / {float(truth.step_time(*args))*1e3:7.2f}")
