"""Reference sentence embeddings from sentence-transformers, as JSON, for the Rust cross-check.

usage: st_reference.py MODEL_DIR < sentences.json
"""
import json
import sys

from sentence_transformers import SentenceTransformer

model = SentenceTransformer(sys.argv[1], device="cpu")
sentences = json.load(sys.stdin)
print(json.dumps(model.encode(sentences, normalize_embeddings=True).tolist()))
