"""A graphed module returning its weight (for a tied use) bumped the weight's version each call.

An eager use of the weight saved before the call (h @ weight with h requiring grad)
then raised torch's "modified by an inplace operation" at backward, nothing modified.
Before the fix: that error (2.13); after: "ok" and the gradient sum.
Run: PYTHONPATH=. python findings/a_param_output_version_bump.py
"""

import torch

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.testing import emulate_cuda_graphs

F64 = torch.float64


class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.lin = torch.nn.Linear(4, 4).double()

    def forward(s, x):
        return torch.tanh(s.lin(x)), s.lin.weight


with emulate_cuda_graphs():
    torch.manual_seed(0)
    m = M()
    try:
        g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    except Exception as e:
        print("make refused:", type(e).__name__, str(e)[:200])
        raise SystemExit from e
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    z = x @ m.lin.weight  # eager use of the weight, saved, before the call
    y, w = g(x)
    try:
        (z.sum() + y.sum() + w.sum()).backward()
        print("ok", m.lin.weight.grad.abs().sum())
    except Exception as e:
        print("backward raised:", str(e)[:300])
