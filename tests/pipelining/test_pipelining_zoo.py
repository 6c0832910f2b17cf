"""A zoo of stage graphs: gradsafe's B then W equals one fused backward (fp64).

Each case names the upstream failure it covers (see docs/pipelining.md).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsafe.pipelining import _hazards as hazards

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke


def x_(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=grad)


class Params(nn.Module):
    """A bag of parameters built from keyword shapes."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.randn(*shape) * 0.5))


class Block(nn.Module):
    """A pre-norm transformer block (attention + MLP), deterministic."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        split = lambda z: z.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        att = (split(q) @ split(k).transpose(-1, -2) / math.sqrt(d // self.heads)).softmax(-1)
        x = x + self.proj((att @ split(v)).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MatmulFn(torch.autograd.Function):
    """A custom Function (a Python autograd node) computing x @ w."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        return g @ w.t(), x.transpose(-1, -2) @ g


class ScaleBoth(torch.autograd.Function):
    """Custom Function with two weight-side inputs where one feeds the other (w and w*2)."""

    @staticmethod
    def forward(ctx, x, a, b):  # type: ignore[override]
        ctx.save_for_backward(x, a, b)
        return x * a + x * b

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, a, b = ctx.saved_tensors
        return g * (a + b), (g * x).sum(0), (g * x).sum(0)


def case(name: str, make, *, loss: bool = False):  # type: ignore[no-untyped-def]
    return pytest.param(make, loss, id=name)


def _nested(uses: int):  # type: ignore[no-untyped-def]
    def make():  # type: ignore[no-untyped-def]
        m = Params(w=(4, 4))

        def fwd(x):  # type: ignore[no-untyped-def]
            for _ in range(uses):
                x = x @ m.w
            return [x]

        return m, [x_(3, 4)], fwd

    return make


def _recurrence():  # type: ignore[no-untyped-def]
    m = Params(W=(4, 4), U=(4, 4))

    def fwd(x):  # type: ignore[no-untyped-def]
        h = torch.zeros(x.shape[1], 4)
        for t in range(x.shape[0]):
            h = torch.tanh(h @ m.W + x[t] @ m.U)
        return [h]

    return m, [x_(5, 3, 4)], fwd


def _reused_linear(bias: bool, times: int):  # type: ignore[no-untyped-def]
    def make():  # type: ignore[no-untyped-def]
        m = hazards.ReusedLinear(4, times, bias)
        return m, [x_(2, 3, 4)], lambda x: [m(x)]

    return make


def _sandwich():  # type: ignore[no-untyped-def]
    m = hazards.ReusedAroundOther()
    return m, [x_(3, 4)], lambda x: [m(x)]


def _hazard_param_only():  # type: ignore[no-untyped-def]
    m = hazards.ParamOnlyOutput()
    return m, [x_(3, 4)], m


def _lstm():  # type: ignore[no-untyped-def]
    m = nn.LSTM(4, 5, num_layers=2)

    def fwd(x):  # type: ignore[no-untyped-def]
        out, (h, c) = m(x)
        return [out.sum(0) + h[-1], c]

    return m, [x_(6, 2, 4)], fwd


def _gru():  # type: ignore[no-untyped-def]
    m = nn.GRU(4, 5, batch_first=True)

    def fwd(x):  # type: ignore[no-untyped-def]
        out, h = m(x)
        return [out[:, -1] * h[0]]

    return m, [x_(2, 6, 4)], fwd


def _layernorm_reused():  # type: ignore[no-untyped-def]
    m = nn.ModuleDict({"ln": nn.LayerNorm(4), "lin": nn.Linear(4, 4)})
    return m, [x_(3, 4)], lambda x: [m["ln"](m["lin"](m["ln"](x)))]


def _param_only_outputs():  # type: ignore[no-untyped-def]
    m = nn.ModuleDict({"lin": nn.Linear(4, 4), "prefix": Params(p=(2, 4))})

    def fwd(x):  # type: ignore[no-untyped-def]
        prefix = m["prefix"].p
        return [m["lin"](x), torch.tanh(prefix) * 2, prefix]

    return m, [x_(3, 4)], fwd


def _regularized_loss():  # type: ignore[no-untyped-def]
    m = nn.Linear(4, 4)
    return m, [x_(3, 4)], lambda x: [m(x).pow(2).mean() + 0.1 * m.weight.pow(2).sum()]


def _learned_prefix():  # type: ignore[no-untyped-def]
    m = nn.ModuleDict({"lin": nn.Linear(4, 4), "prefix": Params(p=(1, 2, 4))})

    def fwd(x):  # type: ignore[no-untyped-def]
        seq = torch.cat([m["prefix"].p.expand(x.shape[0], 2, 4), x], dim=1)
        return [m["lin"](seq)]

    return m, [x_(2, 3, 4)], fwd


def _tied_embedding():  # type: ignore[no-untyped-def]
    m = nn.ModuleDict({"emb": nn.Embedding(10, 4), "ln": nn.LayerNorm(4)})
    ids = torch.tensor([[1, 2, 3], [3, 4, 9]])

    def fwd(x, ids):  # type: ignore[no-untyped-def]
        h = m["ln"](x + m["emb"](ids))
        return [h @ m["emb"].weight.t()]

    return m, [x_(2, 3, 4), ids], fwd


def _first_stage():  # type: ignore[no-untyped-def]
    m = nn.ModuleDict({"emb": nn.Embedding(10, 4), "block": Block(4, 2)})
    ids = torch.tensor([[1, 2, 3], [3, 4, 9]])
    return m, [ids, x_(2, 3, 4, grad=False)], lambda ids, x: [m["block"](m["emb"](ids) + x)]


def _odd_outputs():  # type: ignore[no-untyped-def]
    m = nn.Linear(4, 4)

    def fwd(x):  # type: ignore[no-untyped-def]
        y = m(x)
        return [y, "label", y.detach() * 3, 7, None, torch.ones(2)]

    return m, [x_(3, 4), "not a tensor", x_(2, grad=False)], lambda x, s, z: fwd(x)


def _transformer_stack():  # type: ignore[no-untyped-def]
    m = nn.Sequential(Block(), Block(), Block())
    return m, [x_(2, 3, 8)], lambda x: [m(x)]


def _shared_block():  # type: ignore[no-untyped-def]
    m = Block()
    return m, [x_(2, 3, 8)], lambda x: [m(m(m(x)))]


def _detach_and_no_grad():  # type: ignore[no-untyped-def]
    m = Params(w=(4, 4), v=(4, 4))

    def fwd(x):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            scale = (x @ m.v).abs().mean()
        y = x @ m.w + (x @ m.w).detach() * scale
        return [y @ m.w.detach() @ m.w]

    return m, [x_(3, 4)], fwd


def _custom_function_nested():  # type: ignore[no-untyped-def]
    m = Params(w=(4, 4), a=(4,))

    def fwd(x):  # type: ignore[no-untyped-def]
        h = MatmulFn.apply(MatmulFn.apply(x, m.w), m.w)
        return [ScaleBoth.apply(h, m.a, m.a * 2)]

    return m, [x_(3, 4)], fwd


def _shared_weight_only_node():  # type: ignore[no-untyped-def]
    m = Params(w=(4, 4))

    def fwd(x):  # type: ignore[no-untyped-def]
        wt = m.w.t() * 2  # one weight-only node used at nested sites
        return [x @ wt @ wt @ wt]

    return m, [x_(3, 4)], fwd


def _split_chunk():  # type: ignore[no-untyped-def]
    m = Params(w=(4, 6), v=(3, 4))

    def fwd(x):  # type: ignore[no-untyped-def]
        a, b = (x @ m.w).split(3, dim=1)
        c, d = (m.w @ m.w.t()).chunk(2, dim=0)
        return [a @ m.v + b @ m.v @ m.w[:, :4].t() @ (c[:, :4].t() @ c[:, :4]), d.sum() * a]

    return m, [x_(3, 4)], fwd


def _broadcast_mul_nested():  # type: ignore[no-untyped-def]
    m = Params(s=(4,), w=(4, 4))
    return m, [x_(3, 4)], lambda x: [((x * m.s) @ m.w * m.s) @ m.w + m.w.sum()]


def _two_inputs():  # type: ignore[no-untyped-def]
    m = Params(w=(4, 4))
    return (
        m,
        [x_(3, 4), x_(3, 4), x_(3, 4, grad=False)],
        lambda x, y, z: [x @ m.w + y @ m.w @ m.w + z, x],
    )


def _non_leaf_input():  # type: ignore[no-untyped-def]
    previous = nn.Linear(4, 4)
    m = Params(w=(4, 4))
    x = previous(torch.randn(3, 4))  # an input with a graph behind it (another stage's)

    def fwd(x):  # type: ignore[no-untyped-def]
        return [x @ m.w @ m.w]

    return m, [x], fwd


def _mixed_dtype():  # type: ignore[no-untyped-def]
    m = Params(w=(4, 4))
    m.float()
    return m, [x_(3, 4)], lambda x: [x @ m.w.double() @ m.w.double()]


class NoMaterialize(torch.autograd.Function):
    """Custom Function that sees None for unused output grads (two outputs, one weight)."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w)
        return x @ w, x * 2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, g2):  # type: ignore[override]
        x, w = ctx.saved_tensors
        dx = None if g is None else g @ w.t()
        if g2 is not None:
            dx = g2 * 2 if dx is None else dx + g2 * 2
        return dx, None if g is None else x.t() @ g


def _custom_function_partial_grads():  # type: ignore[no-untyped-def]
    m = Params(w=(4, 4))

    def fwd(x):  # type: ignore[no-untyped-def]
        y, _unused = NoMaterialize.apply(x, m.w)
        z, doubled = NoMaterialize.apply(torch.tanh(y), m.w)
        return [z, doubled]

    return m, [x_(3, 4)], fwd


def _same_output_twice():  # type: ignore[no-untyped-def]
    m = nn.Linear(4, 4)

    def fwd(x):  # type: ignore[no-untyped-def]
        y = m(m(x))
        return [y, y, m.weight]

    return m, [x_(3, 4)], fwd


def _checkpointed():  # type: ignore[no-untyped-def]
    from torch.utils.checkpoint import checkpoint

    m = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})

    def block(x):  # type: ignore[no-untyped-def]
        return m["a"](torch.tanh(m["b"](m["a"](x))))

    return m, [x_(3, 4)], lambda x: [checkpoint(block, x, use_reentrant=False) @ m["a"].weight]


def _inplace_on_views():  # type: ignore[no-untyped-def]
    m = Params(w=(2, 2))

    def fwd(x):  # type: ignore[no-untyped-def]
        h = x * 1.0
        h[:, :2] = h[:, :2].clone() @ m.w  # CopySlices nodes between the uses of w
        h[:, 2:] = torch.tanh(h[:, 2:].clone() @ m.w) @ m.w
        return [h @ torch.cat([m.w, m.w], 1).t()]

    return m, [x_(3, 4)], fwd


def _conv_reused():  # type: ignore[no-untyped-def]
    c = nn.Conv2d(3, 3, 3, padding=1)
    return c, [x_(2, 3, 5, 5)], lambda x: [c(torch.relu(c(x)))]


def _batchnorm_eval():  # type: ignore[no-untyped-def]
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)).eval()
    return m, [x_(5, 4)], lambda x: [m(x), m[1](m(x))]


def _attention_modules():  # type: ignore[no-untyped-def]
    m = nn.ModuleDict(
        {"mha": nn.MultiheadAttention(8, 2, batch_first=True), "qkv": nn.Linear(8, 24)}
    )

    def fwd(x):  # type: ignore[no-untyped-def]
        q, k, v = m["qkv"](x).view(2, 4, 3, 2, 4).unbind(2)
        sdpa = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        out, weights = m["mha"](x, x, x)
        return [sdpa, out, weights]

    return m, [x_(2, 4, 8)], fwd


def _group_norm_reused():  # type: ignore[no-untyped-def]
    m = nn.ModuleDict({"g": nn.GroupNorm(2, 4), "l": nn.Linear(4, 4)})
    return m, [x_(3, 4)], lambda x: [m["g"](m["l"](m["g"](x)))]


def _gru_cell_loop():  # type: ignore[no-untyped-def]
    c = nn.GRUCell(4, 4)

    def fwd(x):  # type: ignore[no-untyped-def]
        h = torch.zeros(2, 4)
        for t in range(3):
            h = c(x[t], h)
        return [h]

    return c, [x_(3, 2, 4)], fwd


def _embedding_bag_tied():  # type: ignore[no-untyped-def]
    m = nn.ModuleDict({"e": nn.EmbeddingBag(10, 4, mode="mean"), "l": nn.Linear(4, 4)})
    ids, offsets = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 3])
    return m, [x_(2, 4)], lambda x: [m["l"](x * m["e"](ids, offsets)) @ m["e"].weight.t()]


def _indexing_ops():  # type: ignore[no-untyped-def]
    m = Params(w=(4, 4), v=(4,))

    def fwd(x):  # type: ignore[no-untyped-def]
        s = torch.stack([x, x @ m.w, m.w[:3]])
        e = torch.einsum("bij,jk->bik", s, m.w)
        rows = torch.tensor([0, 2])
        y = e[1].index_put((rows,), m.v.expand(2, 4) * e[2][rows])
        return [torch.where(y > 0, y, m.v) @ m.w, (e**2).sum(0), m.w.clone()]

    return m, [x_(3, 4)], fwd


CASES = [
    case("nested x@w@w", _nested(2)),
    case("nested x@w@w@w", _nested(3)),
    case("recurrence", _recurrence),
    case("same bias-free Linear x4", _reused_linear(False, 4)),
    case("same Linear with bias x3 on 3D", _reused_linear(True, 3)),
    case("Linear reused around another Linear", _sandwich),
    case("LSTM out and h_n, c_n", _lstm),
    case("GRU out and h_n", _gru),
    case("LayerNorm reused", _layernorm_reused),
    case("parameter-only outputs", _param_only_outputs),
    case("parameter-only output (doctor's)", _hazard_param_only),
    case("regularizer in loss", _regularized_loss, loss=True),
    case("learned prefix", _learned_prefix),
    case("tied embedding and head, LayerNorm between", _tied_embedding),
    case("first stage: no input requires grad", _first_stage),
    case("odd outputs and inputs", _odd_outputs),
    case("transformer stack", _transformer_stack),
    case("one transformer block applied 3x", _shared_block),
    case("detach and no_grad branches", _detach_and_no_grad),
    case("custom Functions, nested and chained", _custom_function_nested),
    case("shared weight-only node at nested sites", _shared_weight_only_node),
    case("split and chunk", _split_chunk),
    case("broadcast mul nested", _broadcast_mul_nested),
    case("several inputs", _two_inputs),
    case("non-leaf stage input", _non_leaf_input),
    case("fp32 parameter in fp64 graph", _mixed_dtype),
    case("custom Function with unmaterialized grads", _custom_function_partial_grads),
    case("same output twice, parameter as output", _same_output_twice),
    case("non-reentrant activation checkpoint", _checkpointed),
    case("in-place writes into views", _inplace_on_views),
    case("Conv2d with bias reused", _conv_reused),
    case("BatchNorm (eval) applied twice", _batchnorm_eval),
    case("SDPA and MultiheadAttention with weights output", _attention_modules),
    case("GroupNorm reused", _group_norm_reused),
    case("GRUCell loop", _gru_cell_loop),
    case("EmbeddingBag tied to a head", _embedding_bag_tied),
    case("stack, einsum, index_put, where", _indexing_ops),
]


@pytest.mark.parametrize("make, loss", CASES)
def test_split_equals_fused(make, loss, split_checker) -> None:  # type: ignore[no-untyped-def]
    split_checker(make, loss=loss)


def test_loss_without_output_grads(split_checker) -> None:  # type: ignore[no-untyped-def]
    def make():  # type: ignore[no-untyped-def]
        m = nn.Linear(4, 4)
        return m, [x_(3, 4)], lambda x: [m(m(x)).sum()]

    split_checker(make, loss=True)


def test_non_leaf_input_stops_at_stage_boundary() -> None:
    from gradsafe.pipelining import stage_backward_input, stage_backward_weight

    previous = nn.Linear(4, 4)
    m = Params(w=(4, 4))
    x = previous(torch.randn(3, 4))
    _, handoff = stage_backward_input([x @ m.w @ m.w], [torch.ones(3, 4)], [x], m.parameters())
    stage_backward_weight(m.parameters(), handoff)
    assert previous.weight.grad is None and m.w.grad is not None
