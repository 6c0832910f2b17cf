"""B + W fixed cost on a small stage (12 x Linear(64), 64 tokens): thread CPU time, min and median.

Run alternately against two checkouts: PYTHONPATH=<checkout> python findings/ab_fixed_cost.py
"""

import statistics
import time

import torch
from torch import nn

import gradsafe
from gradsafe.pipelining import stage_backward_input, stage_backward_weight

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])
params = list(model.parameters())
g = torch.randn(64, 64)
times = []
for _ in range(400):
    x = torch.randn(64, 64, requires_grad=True)
    out = model(x)
    t0 = time.thread_time()
    _, h = stage_backward_input(out, g, [x], params)
    stage_backward_weight(params, h)
    times.append(time.thread_time() - t0)
times = times[50:]
print(
    f"{gradsafe.__file__.split('/gradsafe/')[0]} torch {torch.__version__}: "
    f"B+W min {min(times) * 1e3:.3f} ms, median {statistics.median(times) * 1e3:.3f} ms"
)
