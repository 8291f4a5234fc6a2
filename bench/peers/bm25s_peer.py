"""bm25s on a BEIR collection: the peer of Sleuth's BM25 in bench/retrieval.

Reads a JSON request on stdin:
  {"corpus": [[id, text], ...], "queries": [[id, text], ...], "k": 10, "repeat": N, "clients": [1, 32]}
Writes JSON: rankings (query id -> doc ids, from the first pass) and, per
client count, queries/s and per-query latencies in microseconds. Settings
are those of the reference figures: English stemming and stop words, k1 0.9, b 0.4.
"""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import bm25s
import Stemmer

request = json.load(sys.stdin)
ids = [doc_id for doc_id, _ in request["corpus"]]
stemmer = Stemmer.Stemmer("english")
corpus_tokens = bm25s.tokenize([text for _, text in request["corpus"]], stopwords="en", stemmer=stemmer, show_progress=False)
retriever = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
retriever.index(corpus_tokens, show_progress=False)
k = request["k"]


def search(text):
    started = time.perf_counter()
    tokens = bm25s.tokenize([text], stopwords="en", stemmer=stemmer, show_progress=False)
    documents, _ = retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
    return documents[0], (time.perf_counter() - started) * 1e6


queries = request["queries"]
rankings = {query_id: [ids[i] for i in search(text)[0]] for query_id, text in queries}
results = {}
for clients in request["clients"]:
    work = [text for _ in range(request["repeat"]) for _, text in queries]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        latencies = [latency for _, latency in pool.map(search, work)]
    elapsed = time.perf_counter() - started
    results[str(clients)] = {"qps": len(work) / elapsed, "latencies_us": latencies}
print(json.dumps({"rankings": rankings, "results": results}))
