"""sentence-transformers encoding throughput: the peer of Sleuth's encoder in bench/retrieval.

Reads {"model_dir": ..., "texts": [...], "batch_size": 32} on stdin; writes
{"sentences_per_s": ..., "seconds": ...} after one warm-up batch.
"""
import json
import sys
import time

from sentence_transformers import SentenceTransformer

request = json.load(sys.stdin)
model = SentenceTransformer(request["model_dir"], device="cpu")
texts = request["texts"]
model.encode(texts[: request["batch_size"]], batch_size=request["batch_size"], normalize_embeddings=True)
started = time.perf_counter()
model.encode(texts, batch_size=request["batch_size"], normalize_embeddings=True)
seconds = time.perf_counter() - started
print(json.dumps({"sentences_per_s": len(texts) / seconds, "seconds": seconds}))
