"""A graphed callable reads some inputs in place; modifying one between the call and its backward: silent.

torch's graphed forward copies an argument into its static input buffer only when
their data_ptrs differ, so (1) module parameters and (2) an argument that *is*
the sample tensor (the common "static_x.copy_(batch); graphed(static_x)" loop)
are read by the captured backward graph in place. Replays bumps and checks only
the outputs' versions, so an in-place change of such an input after the call
and before its backward passes every check; the backward replays with the new
values. Eager autograd raises torch's "modified by an inplace operation" error
for the same program (Linear saved its input and weight).

Run: PYTHONPATH=. python findings/f1_cuda_graphs_static_input_modified.py
Before the fix (2.11, 2.13, 2.15 alike): param grad max abs err 1.996 (sample refilled),
dx max abs err 0.726 (weight scaled), no error. After: both refused at backward.
Before the fix (2.11, 2.13, 2.15 alike): param grad max abs err 1.996 (sample refilled),
dx max abs err 0.726 (weight scaled), no error. After: both refused at backward.
"""

import torch

from gradsafe.cuda_graphs import make_graphed_callables
from gradsafe.testing import emulate_cuda_graphs

F64 = torch.float64


def build():
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to(F64)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to(F64)
    ref.load_state_dict(body.state_dict())
    return body, ref


def err(a, b):
    return float((a - b).abs().max())


def eager_refuses(modify):
    _, ref = build()
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    y = ref(x)
    modify(ref, x)
    try:
        y.sum().backward()
    except RuntimeError as exc:
        return "eager raises: " + str(exc)[:70]
    return "eager: no error"


def sample_input_case():
    body, ref = build()
    static_x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    graphed = make_graphed_callables(body, (static_x,))
    with torch.no_grad():
        static_x.copy_(torch.randn(2, 4, dtype=F64))  # this microbatch's data
    xr = static_x.detach().clone().requires_grad_()
    y = graphed(static_x)
    with torch.no_grad():  # the next microbatch prefetched into the static buffer
        static_x.copy_(torch.randn(2, 4, dtype=F64))
    y.sum().backward()  # no error
    ref(xr).sum().backward()
    return max(err(p.grad, q.grad) for p, q in zip(body.parameters(), ref.parameters()))


def param_case():
    body, ref = build()
    graphed = make_graphed_callables(body, (torch.randn(2, 4, dtype=F64, requires_grad=True),))
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = graphed(x)
    with torch.no_grad():  # e.g. an optimizer step between F and B
        body[0].weight.mul_(2)
    y.sum().backward()  # no error
    ref(xr).sum().backward()
    return err(x.grad, xr.grad)


def outcome(case, what):
    try:
        return f"no error; {what} max abs err {case():.3f}"
    except RuntimeError as exc:
        return "refused: " + str(exc)[:90]


def main():
    with emulate_cuda_graphs():
        print(torch.__version__)
        print(" input:", eager_refuses(lambda r, x: x.detach().mul_(3)))
        print(" weight:", eager_refuses(lambda r, x: r[0].weight.detach().mul_(2)))
        print(
            " gradsafe, sample tensor refilled before B:", outcome(sample_input_case, "param grad")
        )
        print(" gradsafe, weight scaled before B:", outcome(param_case, "dx"))


if __name__ == "__main__":
    main()
