import json, os, sys, torch
sys.path.insert(0, '.')
from benchmarks import markov_l2 as m
from dspark_trt.runtime import l2_residency as l2
info = l2.l2_info(0)
flush = torch.empty(256 * m.MB, dtype=torch.uint8, device="cuda")
pool = torch.cuda.MemPool()
rows = []
rows += m.run_case(1, 151936, 256, [{}, {"noise": False}, {"pipeline": False}, {"pipeline": False, "noise": False}], [0], 7, 0.8, info, flush, pool)
rows += m.run_case(1, 151936, 256, [{}, {"pipeline": False}], [0], 7, None, info, flush, pool)
open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w").write(json.dumps(rows))
