"""Writes the example route tables refit-bench replays with --layout recorded:FILE,FILE: what
refit.record makes of tests/python/engine_like.py's engines (vLLM-style layers and load_weights)
at TP=2, for the built-in models llama3-8b and qwen3-30b-a3b (bf16). Recorded on the meta device:
no weight is allocated. Run from the repository root:

    PYTHONPATH=build/lib/python python3 bench/layouts/gen_examples.py

and compare with the hand-written layout of the same model in one run, e.g.
    refit-bench --transport cuda_ipc --model llama3-8b --path direct --layout tp2
    refit-bench --transport cuda_ipc --model llama3-8b --path direct \\
        --layout recorded:bench/layouts/llama3-8b-tp2-rank0.json,bench/layouts/llama3-8b-tp2-rank1.json
"""
import sys
import time

sys.path.insert(0, "tests/python")
import torch  # noqa: E402

import refit  # noqa: E402
from engine_like import LLAMA3_8B, QWEN3_30B_A3B, LlamaForCausalLM, Parallel, hf_spec  # noqa: E402

for model, cfg in (("llama3-8b", LLAMA3_8B), ("qwen3-30b-a3b", QWEN3_30B_A3B)):
    sources = {n: (torch.bfloat16, s) for n, (_, s) in hf_spec(cfg).items()}
    for rank in range(2):
        engine = LlamaForCausalLM(cfg, Parallel(tp_rank=rank, tp_size=2, device="meta", dtype=torch.bfloat16))
        t0 = time.perf_counter()
        table = refit.record(engine.named_parameters(), engine.load_weights, sources)
        took = time.perf_counter() - t0
        assert not table.unrecorded, table.unrecorded
        path = f"bench/layouts/{model}-tp2-rank{rank}.json"
        with open(path, "w") as f:
            f.write(table.to_json())
        print(f"{path}: {len(sources)} sources recorded in {took:.3f} s, digest {table.digest()}")
