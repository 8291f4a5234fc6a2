"""Per-query trec_eval measures of a run, as JSON, for the Rust cross-check.

usage: pytrec_eval_check.py QRELS RUN
QRELS: `qid 0 docid rel` lines; RUN: TREC run lines.
"""
import json
import sys

import pytrec_eval

qrels_path, run_path = sys.argv[1:3]
qrels = {}
with open(qrels_path) as lines:
    for line in lines:
        query, _, doc, rel = line.split()
        qrels.setdefault(query, {})[doc] = int(rel)
run = {}
with open(run_path) as lines:
    for line in lines:
        query, _, doc, _, score, _ = line.split()
        run.setdefault(query, {})[doc] = float(score)
evaluator = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100", "recip_rank"})
print(json.dumps(evaluator.evaluate(run)))
