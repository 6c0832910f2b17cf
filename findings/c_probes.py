"""(c) W's direct node calls (hosted by a pre-hook on a view of the anchor): attacks vs one fused backward (fp64).

Run: PYTHONPATH=. python findings/c_probes.py [case ...]
"""

import sys
import threading
import traceback

import torch
from torch import nn

from gradsafe.pipelining import stage_backward_input, stage_backward_weight

F64 = torch.float64


def err(a, b):
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    return float((a - b).abs().max())


class Two(nn.Module):
    """out = lin_a(x) + lin_c(x): the AddBackward hands the same gradient tensor to both Addmm nodes."""

    def __init__(self, d=4):
        super().__init__()
        self.a = nn.Linear(d, d, dtype=F64)
        self.c = nn.Linear(d, d, dtype=F64)
        self.hook = None

    def forward(self, x):
        a = self.a(x)
        if self.hook is not None and a.requires_grad:
            a.register_hook(self.hook)
        return a + self.c(x)


def pair(cls=Two, seed=0):
    torch.manual_seed(seed)
    m = cls()
    r = cls()
    r.load_state_dict(m.state_dict())
    return m, r


def pgrads_err(m, r):
    return max(err(p.grad, q.grad) for p, q in zip(m.parameters(), r.parameters()))


def split(m, x, g, wrap_w=None):
    x = x.detach().requires_grad_()
    out = m(x)
    (dx,), h = stage_backward_input(out, g, [x], list(m.parameters()))
    if wrap_w is None:
        stage_backward_weight(list(m.parameters()), h)
    else:
        wrap_w(lambda: stage_backward_weight(list(m.parameters()), h))
    return dx


def fused(r, x, g):
    x = x.detach().requires_grad_()
    out = r(x)
    out.backward(g)
    return x.grad


def inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4, dtype=F64, generator=gen), torch.randn(3, 4, dtype=F64, generator=gen)


CASES = {}


def case(f):
    CASES[f.__name__] = f
    return f


@case
def hook_mutates_in_place():
    def hook(g):
        g.mul_(2)  # mutates what it receives (torch says: don't), returns None

    m, r = pair()
    m.hook = r.hook = hook
    x, g = inputs()
    dx = split(m, x, g.clone())
    dxr = fused(r, x, g.clone())
    return f"dx err {err(dx, dxr):.3g}, param err {pgrads_err(m, r):.3g}"


@case
def hook_returns_new():
    m, r = pair()
    m.hook = r.hook = lambda g: g * 3
    x, g = inputs()
    dx = split(m, x, g)
    dxr = fused(r, x, g)
    return f"dx err {err(dx, dxr):.3g}, param err {pgrads_err(m, r):.3g}"


@case
def caller_mutates_output_grad_between_b_and_w():
    m, r = pair()
    x, g = inputs()
    xx = x.detach().requires_grad_()
    out = m(xx)
    gg = g.clone()
    (dx,), h = stage_backward_input(out, gg, [xx], list(m.parameters()))
    gg.zero_()  # caller reuses its gradient buffer after B
    stage_backward_weight(list(m.parameters()), h)
    fused(r, x, g)
    return (
        f"param err {pgrads_err(m, r):.3g} (caller zeroed its output-grad buffer between B and W)"
    )


@case
def dx_mutated_between_b_and_w():
    # the input gradient B returned aliases what arrived at an intermediate? (x + lin(x) passes g)
    class P(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=F64)

        def forward(self, x):
            return x * 1.0 + self.lin(x.detach() * 0 + 1) * x  # mul saves x; grad flows in

    m, r = pair(P)
    x, g = inputs()
    xx = x.detach().requires_grad_()
    out = m(xx)
    (dx,), h = stage_backward_input(out, g.clone(), [xx], list(m.parameters()))
    dx.mul_(5)  # previous stage's hook mutating it, say
    stage_backward_weight(list(m.parameters()), h)
    fused(r, x, g)
    return f"param err {pgrads_err(m, r):.3g}"


@case
def node_prehook_on_intermediate_mutates():
    m, r = pair()
    x, g = inputs()
    for mod in (m, r):

        def fwd(x, mod=mod):
            a = mod.a(x)
            out = a + mod.c(x)
            out.grad_fn.register_prehook(lambda go: (go[0] * 2,))
            return out

        mod.forward = fwd
    dx = split(m, x, g)
    dxr = fused(r, x, g)
    return f"dx err {err(dx, dxr):.3g}, param err {pgrads_err(m, r):.3g}"


@case
def w_under_no_grad():
    m, r = pair()
    x, g = inputs()
    split(
        m, x, g, wrap_w=lambda f: (torch.no_grad().__enter__(), f(), torch.set_grad_enabled(True))
    )
    fused(r, x, g)
    return f"param err {pgrads_err(m, r):.3g}"


@case
def w_under_inference_mode():
    m, r = pair()
    x, g = inputs()

    def wrap(f):
        with torch.inference_mode():
            f()

    split(m, x, g, wrap_w=wrap)
    fused(r, x, g)
    return f"param err {pgrads_err(m, r):.3g}"


@case
def w_under_anomaly_mode():
    m, r = pair()
    x, g = inputs()

    def wrap(f):
        with torch.autograd.detect_anomaly(check_nan=True):
            f()

    split(m, x, g, wrap_w=wrap)
    fused(r, x, g)
    return f"param err {pgrads_err(m, r):.3g}"


@case
def b_and_w_under_anomaly_mode():
    m, r = pair()
    x, g = inputs()
    with torch.autograd.detect_anomaly(check_nan=True):
        xx = x.detach().requires_grad_()
        out = m(xx)
        _, h = stage_backward_input(out, g, [xx], list(m.parameters()))
        stage_backward_weight(list(m.parameters()), h)
    fused(r, x, g)
    return f"param err {pgrads_err(m, r):.3g}"


@case
def two_stages_w_interleaved_and_inside_hook():
    # W of stage 1 run from a tensor hook fired inside W of stage 2's delivery
    m1, r1 = pair(seed=1)
    m2, r2 = pair(seed=2)
    x, g = inputs()
    x1 = x.detach().requires_grad_()
    o1 = m1(x1)
    h1_in = o1.detach().requires_grad_()
    o2 = m2(h1_in)
    (d2,), h2 = stage_backward_input(o2, g, [h1_in], list(m2.parameters()))
    (d1,), h1 = stage_backward_input(o1, d2, [x1], list(m1.parameters()))
    fired = []

    def hook(grad):
        if not fired:
            fired.append(1)
            stage_backward_weight(list(m1.parameters()), h1)

    hd = m2.a.weight.register_hook(hook)
    stage_backward_weight(list(m2.parameters()), h2)
    hd.remove()
    xr = x.detach().requires_grad_()
    r2(r1(xr)).backward(g)
    return f"m1 err {pgrads_err(m1, r1):.3g} m2 err {pgrads_err(m2, r2):.3g}"


@case
def threads_two_stages_concurrent_w():
    errs = []
    res = {}
    barrier = threading.Barrier(2)

    def work(seed):
        try:
            torch.manual_seed(seed)
            m, r = pair(seed=seed)
            for it in range(30):
                x, g = inputs(seed * 100 + it)
                xx = x.detach().requires_grad_()
                out = m(xx)
                _, h = stage_backward_input(out, g, [xx], list(m.parameters()))
                barrier.wait()
                stage_backward_weight(list(m.parameters()), h)
                fused(r, x, g)
            res[seed] = pgrads_err(m, r)
        except Exception as e:  # noqa: BLE001
            errs.append(f"{type(e).__name__}: {str(e)[:200]}")
            barrier.abort()

    ts = [threading.Thread(target=work, args=(s,)) for s in (3, 4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return f"{res} {errs}"


@case
def w_twice_retain():
    m, r = pair()
    x, g = inputs()
    xx = x.detach().requires_grad_()
    out = m(xx)
    _, h = stage_backward_input(out, g, [xx], list(m.parameters()))
    stage_backward_weight(list(m.parameters()), h)
    try:
        stage_backward_weight(list(m.parameters()), h)
    except Exception as e:
        return f"second W refused: {type(e).__name__}: {str(e)[:150]}"
    fused(r, x, g)
    return f"second W ran; param err {pgrads_err(m, r):.3g} (fused once)"


@case
def dx_aliases_recorded_grad_mutated():
    # out = x + lin(z): AddBackward hands g itself to x (dx is g) and to lin's Addmm node (recorded).
    class P(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=F64)

        def forward(self, x, z):
            return x + self.lin(z)

    m, r = pair(P)
    x, g = inputs()
    z, _ = inputs(7)
    xx = x.detach().requires_grad_()
    zz = z.detach().requires_grad_()
    out = m(xx, zz)
    (dx, dz), h = stage_backward_input(out, g.clone(), [xx, zz], list(m.parameters()))
    alias = (
        dx.data_ptr() in {t.data_ptr() for rec in h.recorded for t in rec.grads if t is not None}
        if hasattr(h, "recorded")
        else "?"
    )
    dx.mul_(5)  # e.g. the previous stage's in-place hook on the gradient it receives
    stage_backward_weight(list(m.parameters()), h)
    xr = x.detach().requires_grad_()
    zr = z.detach().requires_grad_()
    r(xr, zr).backward(g)
    return f"dx aliases a recorded grad: {alias}; param err {pgrads_err(m, r):.3g}"


@case
def saved_input_mutated_between_b_and_w():
    m, r = pair()
    x, g = inputs()
    xx = x.detach().requires_grad_()
    out = m(xx)
    _, h = stage_backward_input(out, g, [xx], list(m.parameters()))
    with torch.no_grad():
        xx.mul_(2)
    try:
        stage_backward_weight(list(m.parameters()), h)
    except Exception as e:
        return f"REFUSED {type(e).__name__}: {str(e)[:160]}"
    fused(r, x, g)
    return f"no error; param err {pgrads_err(m, r):.3g}"


@case
def weight_mutated_between_b_and_w():
    m, r = pair()
    x, g = inputs()
    xx = x.detach().requires_grad_()
    out = m(xx)
    _, h = stage_backward_input(out, g, [xx], list(m.parameters()))
    with torch.no_grad():
        m.a.weight.mul_(2)  # e.g. an optimizer step before W
    try:
        stage_backward_weight(list(m.parameters()), h)
    except Exception as e:
        return f"REFUSED {type(e).__name__}: ...{str(e)[-330:]}"
    return "no error"


@case
def weight_only_output_grad_reused():
    # a stage output computed from parameters alone (W's output root) and a K leaf
    class P(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=F64)
            self.w = nn.Parameter(torch.randn(4, dtype=F64))

        def forward(self, x):
            return self.lin(x), self.w * 2

    m, r = pair(P)
    x, g = inputs()
    xx = x.detach().requires_grad_()
    o1, o2 = m(xx)
    g2 = torch.ones(4, dtype=F64)
    _, h = stage_backward_input([o1, o2], [g, g2], [xx], list(m.parameters()))
    g2.zero_()
    try:
        stage_backward_weight(list(m.parameters()), h)
    except Exception as e:
        return f"REFUSED {type(e).__name__}: {str(e)[:200]}"
    return "no error (WRONG if w.grad is 0): w.grad " + str(m.w.grad)


def main():
    names = [a for a in sys.argv[1:] if a != "-v"] or list(CASES)
    for n in names:
        try:
            res = CASES[n]()
        except Exception as e:
            res = f"EXC {type(e).__name__}: {str(e)[:300]}"
            if "-v" in sys.argv:
                traceback.print_exc()
        print(f"{torch.__version__} {n}: {res}", flush=True)


if __name__ == "__main__":
    main()
