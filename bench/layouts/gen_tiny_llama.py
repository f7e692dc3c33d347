"""Writes bench/layouts/tiny-llama.json (the model of tests/python/engine_like.py's default Config,
bf16, as a refit-bench manifest) and tiny-llama-tp2-rank{0,1}.json (refit.record's route tables of
that engine at TP=2). Run from the repository root:

    PYTHONPATH=build/lib/python python3 bench/layouts/gen_tiny_llama.py
"""
import json
import sys

sys.path.insert(0, "tests/python")
import torch  # noqa: E402

import refit  # noqa: E402
from engine_like import Config, LlamaForCausalLM, Parallel, hf_spec  # noqa: E402

cfg = Config()
spec = hf_spec(cfg)
with open("bench/layouts/tiny-llama.json", "w") as f:
    json.dump({n: {"dtype": "bf16", "shape": list(s)} for n, (_, s) in spec.items()}, f, indent=1)
sources = {n: (torch.bfloat16, s) for n, (_, s) in spec.items()}
for rank in range(2):
    engine = LlamaForCausalLM(cfg, Parallel(tp_rank=rank, tp_size=2, device="meta", dtype=torch.bfloat16))
    table = refit.record(engine.named_parameters(), engine.load_weights, sources)
    assert not table.unrecorded, table.unrecorded
    with open(f"bench/layouts/tiny-llama-tp2-rank{rank}.json", "w") as f:
        f.write(table.to_json(indent=1))
