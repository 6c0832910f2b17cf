"""W's peak with a ``register_multi_grad_hook`` over a stage's parameters: gradsafe vs torch.

Run: PYTHONPATH=. python benchmarks/pipelining_multi_grad_hook_memory.py

One last stage, 8 x Linear(256)+tanh, microbatch 4, MSE loss, ``.grad``
already held (a later microbatch). Bytes are those of storages created from
the forward on and alive (:class:`gradsafe.testing.LiveStorage`): the peak
during W (torch's split and gradsafe's) and during one fused backward, with no
hook, with a mode-``"any"`` hook over every parameter and with a mode-``"all"``
one. A fused backward's mode-``"all"`` hook keeps every gradient it was given
until the last arrives (its buffer), so it holds the whole set of weight
gradients at once too; mode ``"any"`` keeps none.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import _backward as torch_split

from gradsafe.pipelining import stage_backward_input, stage_backward_weight
from gradsafe.testing import LiveStorage

LAYERS, DIM, BATCH = 8, 256, 4


def peak(impl: str, mode: str | None) -> int:
    """Bytes alive at the peak of W (of the backward, for "fused"), beyond what B left."""
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(LAYERS) for m in (nn.Linear(DIM, DIM), nn.Tanh())))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    if mode is not None:
        torch.autograd.graph.register_multi_grad_hook(params, lambda grads: None, mode=mode)  # type: ignore[arg-type]
    x = torch.randn(BATCH, DIM, requires_grad=True)
    y = torch.randn(BATCH, DIM)
    with LiveStorage([*params, x, y, *(p.grad for p in params)]) as live:
        loss = (model(x) - y).pow(2).mean()
        if impl == "fused":
            live.mark()
            loss.backward()
            return live.peak_since_mark
        b, w = (
            (stage_backward_input, stage_backward_weight)
            if impl == "gradsafe"
            else (torch_split.stage_backward_input, torch_split.stage_backward_weight)
        )
        _, handoff = b([loss], None, [x], params)
        live.mark()
        w(params, handoff)
        return live.peak_since_mark


def main() -> None:
    print(f"torch {torch.__version__}; {LAYERS} x Linear({DIM}), microbatch {BATCH}, .grad held")
    grads = LAYERS * (DIM * DIM + DIM) * 4
    print(f"the stage's weight gradients: {grads} bytes")
    for mode in (None, "any", "all"):
        ours, fused = peak("gradsafe", mode), peak("fused", mode)
        try:
            theirs = peak("torch", mode)
        except RuntimeError:  # torch's W is autograd.grad, which a mode-"all" hook crashes
            split = "torch's split crashes"
        else:
            split = f"torch's split {theirs:>9} B, gradsafe {ours / theirs:.2f}x of it"
        print(
            f"hook {mode or 'none':4}: peak during W: gradsafe {ours:>9} B ({split}); "
            f"fused backward {fused:>9} B"
        )


if __name__ == "__main__":
    main()
