#!/usr/bin/env python
"""Label vs sequence accuracy and p50 latency of one GGUF on the labeled sample, in-process.

usage: python tools/quality_accuracy.py MODEL.gguf   (e.g. the quality reference model, Qwen2.5-Coder-1.5B-Instruct Q4_K_M)
"""
import json, time, sys
from pathlib import Path
from semif.serving.engine import Engine
from semif.serving import prompt as P
path=sys.argv[1]
rows=[json.loads(l) for l in open(Path(__file__).resolve().parents[1] / 'data' / 'decisions-sample.jsonl')]
e=Engine(path, n_ctx=4096, n_threads=2)
print(e.info['file'], e.info['sha256'][:12], flush=True)
for scoring in ('label','sequence'):
    c=0; ts=[]
    for r in rows:
        q=P.Question(r['question'], tuple(P.Outcome(o['id'], o.get('description')) for o in r['options']))
        t=time.perf_counter(); d=e.score(r['state'], [q], scoring=scoring).distributions[0]; ts.append(time.perf_counter()-t)
        ids=[o['id'] for o in r['options']]
        c+= ids[max(range(len(ids)), key=lambda i:d.probabilities[i])]==r['answer']
    ts.sort()
    print(scoring, f"acc {c}/{len(rows)}={c/len(rows):.3f}", f"p50 {ts[len(ts)//2]:.2f}s", flush=True)
