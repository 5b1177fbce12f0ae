"""Per-kernel GPU times of the fused op on the seed problem (torch.profiler), for tuning.

    python scripts/profile_seed.py [eval|train] [contiguous|channels_last_3d] [algo]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops

mode = sys.argv[1] if len(sys.argv) > 1 else "eval"
layout = sys.argv[2] if len(sys.argv) > 2 else "contiguous"
memory_format = {"contiguous": torch.contiguous_format,
                 "channels_last_3d": torch.channels_last_3d}[layout]
algo = sys.argv[3] if len(sys.argv) > 3 else "auto"
m = fused_ops.ConvTransposeBNPool3d(64, 128, 5, 2.0, algo=algo).cuda().train(mode == "train")
xs = [torch.randn(16, 64, 16, 32, 32, device="cuda").contiguous(memory_format=memory_format)
      for _ in range(6)]
with torch.no_grad():
    for x in xs:
        m(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(30 if mode == "eval" else 10):
            m(xs[i % len(xs)])
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
