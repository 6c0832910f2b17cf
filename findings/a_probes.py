"""(a) Replays attacks: graphed callable (emulated CUDA graphs, fp64) vs eager on the same math.

Run: PYTHONPATH=. python findings/a_probes.py
Each case prints OK (max err), REFUSED (message head) or WRONG (max err).
"""

import sys
import threading
import traceback

import torch

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.testing import emulate_cuda_graphs

F64 = torch.float64


def err(a, b):
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    return float((a - b).abs().max())


def mk(seed=0, d=4):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()).to(F64)
    r = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()).to(F64)
    r.load_state_dict(m.state_dict())
    return m, r


def pgrads(m):
    return [p.grad for p in m.parameters()]


def cmp(m, r):
    return max(err(a, b) for a, b in zip(pgrads(m), pgrads(r)))


class Mod(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(4, dtype=F64))
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


CASES = {}


def case(f):
    CASES[f.__name__] = f
    return f


@case
def param_modified_between_f_and_b():
    # eager raises (AddmmBackward saved weight? no: saves mat2 = weight.t()) -- see what eager does
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = g(x)
    with torch.no_grad():
        m[0].weight.mul_(2)
    y.sum().backward()
    try:
        yr = r(xr)
        with torch.no_grad():
            r[0].weight.mul_(2)
        yr.sum().backward()
        return f"eager no error; dx err {err(x.grad, xr.grad):.3g}, params {cmp(m, r):.3g}"
    except RuntimeError as e:
        return f"eager raises ({str(e)[:60]}); gradsafe returned dx (no error) -> WRONG-ish"


@case
def input_is_static_buffer_modified():
    m, r = mk()
    sample = torch.randn(2, 4, dtype=F64, requires_grad=True)
    g = make_graphed_callables(m, (sample,))
    with torch.no_grad():
        sample.copy_(torch.randn(2, 4, dtype=F64))
    xr = sample.detach().clone().requires_grad_()
    y = g(sample)
    yr = r(xr)
    with torch.no_grad():
        sample.mul_(3)
    y.sum().backward()
    yr.sum().backward()
    return f"no error; param err {cmp(m, r):.3g} (eager on unmodified input)"


@case
def view_of_output_modified():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    y = g(x)
    v = y[0]
    v.mul_(2)
    y.pow(2).sum().backward()
    return "no error WRONG?"


@case
def output_aliases_input():
    torch.manual_seed(0)
    f = Mod(lambda s, x: (x.tanh() * s.p, x))  # second output is the input itself
    p = f.p
    g = make_graphed_callables(f, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    a, b = g(x)
    (a.sum() + (b * b).sum()).backward()
    gx, gp = x.grad.clone(), p.grad.clone()
    x.grad = None
    p.grad = None
    a, b = f(x)
    (a.sum() + (b * b).sum()).backward()
    return f"dx err {err(gx, x.grad):.3g}, dp err {err(gp, p.grad):.3g}"


@case
def output_view_of_input():
    torch.manual_seed(0)
    f = Mod(lambda s, x: (x.tanh() * s.p, x[0]))
    p = f.p
    g = make_graphed_callables(f, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    a, b = g(x)
    (a.sum() + (b * b).sum()).backward()
    gx, gp = x.grad.clone(), p.grad.clone()
    x.grad = None
    p.grad = None
    a, b = f(x)
    (a.sum() + (b * b).sum()).backward()
    return f"dx err {err(gx, x.grad):.3g}, dp err {err(gp, p.grad):.3g}"


@case
def some_outputs_unused_nested():
    torch.manual_seed(0)

    def body(s, x):
        t = (x * s.p).tanh()
        return {"a": t, "b": [t * 2, (x.sin(),)]}

    f = Mod(body)
    p = f.p
    g = make_graphed_callables(f, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    o = g(x)
    o["b"][1][0].sum().backward()
    gx, gp = x.grad.clone(), (None if p.grad is None else p.grad.clone())
    x.grad = None
    p.grad = None
    o = f(x)
    o["b"][1][0].sum().backward()
    return f"dx err {err(gx, x.grad):.3g}, dp err {err(gp, p.grad)}"


@case
def retain_graph_double_backward():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = g(x)
    y.pow(2).sum().backward(retain_graph=True)
    y.pow(3).sum().backward()
    yr = r(xr)
    yr.pow(2).sum().backward(retain_graph=True)
    yr.pow(3).sum().backward()
    return f"dx err {err(x.grad, xr.grad):.3g} params {cmp(m, r):.3g}"


@case
def retain_graph_then_call_again_then_backward_old():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    y = g(x)
    y.sum().backward(retain_graph=True)
    g(torch.randn(2, 4, dtype=F64, requires_grad=True))
    y.sum().backward()
    return "no error WRONG"


@case
def autograd_grad_inputs_create_graph():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    x.detach().clone().requires_grad_()
    y = g(x)
    try:
        (gx,) = torch.autograd.grad(y.sum(), (x,), create_graph=True)
        gx.sum().backward()
    except RuntimeError as e:
        return f"REFUSED/raised: {str(e)[:150]}"
    return "no error (double backward through once_differentiable?)"


@case
def autograd_grad_inputs_kw():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y1 = g(x)
    w = m[0].weight
    (gw1,) = torch.autograd.grad(y1.sum(), (w,))
    y2 = g(x * 2)
    (gw2,) = torch.autograd.grad(y2.sum(), (w,))
    (rw1,) = torch.autograd.grad(r(xr).sum(), (r[0].weight,))
    (rw2,) = torch.autograd.grad(r(xr * 2).sum(), (r[0].weight,))
    return f"gw1 err {err(gw1, rw1):.3g} gw2 err {err(gw2, rw2):.3g}"


@case
def backward_inputs_kw():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    h = x * 1.5
    hr = xr * 1.5
    y = g(h)
    h.retain_grad()
    hr.retain_grad()
    y.sum().backward(inputs=[h])
    keep = h.grad
    y2 = g(x * 3)
    y2.sum().backward(inputs=[h]) if False else None
    r(hr).sum().backward(inputs=[hr])
    return f"h.grad err {err(keep, hr.grad):.3g}"


@case
def compile_around_callable():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    cg = torch.compile(lambda x: g(x) * 2, backend="aot_eager")
    xs = [torch.randn(2, 4, dtype=F64, requires_grad=True) for _ in range(2)]
    try:
        for x in xs:
            cg(x).sum().backward()
        for x in xs:
            xr = x.detach().clone().requires_grad_()
            (r(xr) * 2).sum().backward()
        return f"params {cmp(m, r):.3g}"
    except Exception as e:
        return f"raised {type(e).__name__}: {str(e)[:200]}"


@case
def compile_two_in_flight():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    cg = torch.compile(lambda x: g(x) * 2, backend="aot_eager")
    xs = [torch.randn(2, 4, dtype=F64, requires_grad=True) for _ in range(2)]
    try:
        ys = [cg(x) for x in xs]
        for y in ys:
            y.pow(2).sum().backward()
    except Exception as e:
        return f"raised {type(e).__name__}: {str(e)[:200]}"
    for x in xs:
        xr = x.detach().clone().requires_grad_()
        (r(xr) * 2).pow(2).sum().backward()
    return f"no error; params err {cmp(m, r):.3g}"


@case
def two_callables_two_threads():
    m1, r1 = mk(1)
    m2, r2 = mk(2)
    g1 = make_graphed_callables(m1, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    g2 = make_graphed_callables(m2, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    errs = []

    def work(g, r, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(20):
            x = torch.randn(2, 4, dtype=F64, generator=gen, requires_grad=True)
            g(x).pow(2).sum().backward()
            xr = x.detach().clone().requires_grad_()
            r(xr).pow(2).sum().backward()

    ts = [threading.Thread(target=work, args=a) for a in ((g1, r1, 5), (g2, r2, 6))]
    try:
        [t.start() for t in ts]
        [t.join() for t in ts]
    except Exception as e:
        errs.append(e)
    return f"m1 {cmp(m1, r1):.3g} m2 {cmp(m2, r2):.3g} {errs}"


@case
def checkpoint_two_regions_interleaved():
    from torch.utils.checkpoint import checkpoint

    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    xs = [torch.randn(2, 4, dtype=F64, requires_grad=True) for _ in range(2)]

    def region(x):
        return g(x).sin() * x

    try:
        outs = [checkpoint(region, x, use_reentrant=False) for x in xs]
        sum(o.pow(2).sum() for o in outs).backward()
    except RuntimeError as e:
        return f"REFUSED: {str(e)[:120]}"
    for x in xs:
        xr = x.detach().clone().requires_grad_()
        (r(xr).sin() * xr).pow(2).sum().backward()
    return f"params err {cmp(m, r):.3g}"


@case
def checkpoint_region_then_plain_call():
    from torch.utils.checkpoint import checkpoint

    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x1 = torch.randn(2, 4, dtype=F64, requires_grad=True)
    x2 = torch.randn(2, 4, dtype=F64, requires_grad=True)
    o1 = checkpoint(lambda x: g(x).sin(), x1, use_reentrant=False)
    o2 = g(x2).cos()
    try:
        (o1.sum() + o2.sum()).backward()
    except RuntimeError as e:
        return f"REFUSED: {str(e)[:120]}"
    for x, fn in ((x1, torch.sin), (x2, torch.cos)):
        xr = x.detach().clone().requires_grad_()
        fn(r(xr)).sum().backward()
    return f"params err {cmp(m, r):.3g}"


@case
def checkpoint_early_stop_off_two_calls():
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    with set_checkpoint_early_stop(False):
        o = checkpoint(lambda x: g(g(x) * 0.5), x, use_reentrant=False)
        try:
            o.pow(2).sum().backward()
        except RuntimeError as e:
            return f"REFUSED: {str(e)[:120]}"
    xr = x.detach().clone().requires_grad_()
    r(r(xr) * 0.5).pow(2).sum().backward()
    return f"params err {cmp(m, r):.3g}"


@case
def no_grad_call_between():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    y = g(x)
    with torch.no_grad():
        g(torch.randn(2, 4, dtype=F64))
    try:
        y.sum().backward()
    except RuntimeError as e:
        return f"REFUSED: {str(e)[:80]}"
    return "no error WRONG"


@case
def inference_mode_call_between():
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    y = g(x)
    try:
        with torch.inference_mode():
            g(torch.randn(2, 4, dtype=F64))
    except RuntimeError as e:
        return f"inference call raised: {str(e)[:150]}"
    try:
        y.sum().backward()
    except RuntimeError as e:
        return f"REFUSED: {str(e)[:80]}"
    xr = x.detach().clone().requires_grad_()
    r(xr).sum().backward()
    return f"no error; params err {cmp(m, r):.3g}"


@case
def gradient_penalty_create_graph():
    # WGAN-GP shape: penalty |dy1/dx1|^2 from one call (create_graph=True), loss from the next call
    m, r = mk()
    g = make_graphed_callables(m, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x1 = torch.randn(2, 4, dtype=F64, requires_grad=True)
    x2 = torch.randn(2, 4, dtype=F64)
    for mod in (g, r):
        inp = x1.detach().clone().requires_grad_()
        (gx,) = torch.autograd.grad(mod(inp).sum(), (inp,), create_graph=True)
        try:
            (mod(x2).pow(2).sum() + gx.pow(2).sum()).backward()
        except RuntimeError as exc:
            return "refused: " + str(exc)[:100]
    return f"no error; params err {cmp(m, r):.3g}"


def main():
    names = [a for a in sys.argv[1:] if a != "-v"] or list(CASES)
    for n in names:
        with emulate_cuda_graphs():
            try:
                res = CASES[n]()
            except Exception as e:
                res = f"EXC {type(e).__name__}: {str(e)[:300]}"
                if "-v" in sys.argv:
                    traceback.print_exc()
        print(f"{torch.__version__} {n}: {res}", flush=True)


if __name__ == "__main__":
    main()
