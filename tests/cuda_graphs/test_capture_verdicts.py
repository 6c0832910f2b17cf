"""The emulator's table of what a CUDA capture refuses, checked row by row (issue 19, item 7).

Every row of ``gradsafe.testing._capture_verdicts.VERDICTS`` has an example
here. Under ``emulate_cuda_graphs`` (CPU) the capture must do what the row's
emulated verdict says; on a GPU (``cuda``, skipped without one) a real capture
must do what the row's CUDA verdict says, which is how the table's sources are
checked against the installed torch's kernels.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gradsafe.testing import emulate_cuda_graphs
from gradsafe.testing._capture_verdicts import VERDICTS, Capture, Verdict

CUDA_ERROR = getattr(torch, "AcceleratorError", RuntimeError)


@dataclasses.dataclass(frozen=True)
class Example:
    """Inputs made on a device, the captured body, and an in-place change of the inputs before replay."""

    inputs: Callable[[torch.device], tuple[torch.Tensor, ...]]
    body: Callable[..., Any]
    alter: Callable[..., None] | None = None
    comparable: bool = True  # False: the output is random, check only its shape and dtype
    cuda_error: tuple[type[Exception], str] | None = None  # a real GPU refuses it another way


def _floats(*shape: int) -> Callable[[torch.device], tuple[torch.Tensor, ...]]:
    return lambda d: (torch.arange(1.0, 1.0 + torch.Size(shape).numel(), device=d).reshape(shape),)


def _double(x: torch.Tensor) -> None:
    x.mul_(2)


def _spd(d: torch.device) -> tuple[torch.Tensor, ...]:
    a = torch.tensor([[4.0, 1.0], [1.0, 3.0]], device=d, dtype=torch.float64)
    return (a,)


def _masked_put(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[y > 2] = torch.zeros_like(y)[y > 2]
    return y


def _mask_put_scalar(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[y > 2] = 0.0
    return y


def _mask_put_element(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[y > 1] = v
    return y


EXAMPLES: dict[str, Example] = {
    "t.item() / bool(t) / int(t) / float(t)": Example(_floats(2), lambda x: x.sum().item()),
    "torch.equal": Example(_floats(2), lambda x: torch.equal(x, x * 1)),
    "torch.equal(t, t) / different sizes / no elements": Example(
        _floats(2), lambda x: (torch.equal(x, x), torch.equal(x, x[:1]), torch.equal(x[:0], x[:0]))
    ),
    "torch.allclose": Example(_floats(2), lambda x: torch.allclose(x, x)),
    "linalg.inv / cholesky / solve / lu_factor (error check)": Example(_spd, torch.linalg.inv),
    "torch.multinomial(p, n) without replacement": Example(
        _floats(4), lambda p: torch.multinomial(p, 2), comparable=False
    ),
    "torch.multinomial(p, n, replacement=True)": Example(
        _floats(4),
        lambda p: torch.multinomial(p, 3, replacement=True),
        alter=None,
        comparable=False,
    ),
    "torch.histc(x) with min == max (the default)": Example(
        _floats(6), lambda x: torch.histc(x, bins=3)
    ),
    "torch.histc(x, min=a, max=b), a < b": Example(
        _floats(6), lambda x: torch.histc(x, bins=4, min=0.0, max=16.0), alter=_double
    ),
    "x.masked_fill(mask, device value tensor)": Example(
        lambda d: (torch.arange(4.0, device=d), torch.tensor(7.0, device=d)),
        lambda x, v: x.masked_fill(x > 1, v),
    ),
    "x.masked_fill(mask, host value tensor)": Example(
        lambda d: (torch.arange(4.0, device=d), torch.tensor(7.0)),
        lambda x, v: x.masked_fill(x > 1, v),
        alter=lambda x, v: x.mul_(2),  # v is read once, at capture
    ),
    "torch.nonzero / torch.where(cond)": Example(_floats(3), lambda x: torch.nonzero(x > 1)),
    "torch.nonzero(as_tuple=True) (numpy form)": Example(
        _floats(3), lambda x: torch.ops.aten.nonzero_numpy(x > 1)
    ),
    "torch.argwhere": Example(_floats(3), lambda x: torch.argwhere(x > 1)),
    "torch.masked_select": Example(_floats(3), lambda x: torch.masked_select(x, x > 1)),
    "torch.unique": Example(_floats(3), torch.unique),
    "torch.unique (sorted=False fallback)": Example(
        _floats(3), lambda x: torch.ops.aten._unique(x)
    ),
    "torch.unique(dim=d)": Example(_floats(2, 2), lambda x: torch.unique(x, dim=0)),
    "torch.unique_consecutive": Example(_floats(3), torch.unique_consecutive),
    "torch.unique_consecutive(dim=d)": Example(
        _floats(2, 2), lambda x: torch.unique_consecutive(x, dim=0)
    ),
    "torch.bincount": Example(lambda d: (torch.tensor([0, 2, 2], device=d),), torch.bincount),
    "torch.repeat_interleave(repeats_tensor) without output_size": Example(
        _floats(3), lambda x: torch.repeat_interleave(x, x.long(), dim=0)
    ),
    "torch.repeat_interleave(repeats_tensor, output_size=n)": Example(
        lambda d: (torch.arange(3.0, device=d), torch.tensor([1, 1, 2], device=d)),
        lambda x, r: torch.repeat_interleave(x, r, dim=0, output_size=4),
        alter=lambda x, r: x.mul_(3),
    ),
    "x[mask]": Example(_floats(3), lambda x: x[x > 1]),
    "x[mask] = values (not one host scalar)": Example(_floats(3), _masked_put),
    "x[mask] = Python number": Example(_floats(4), _mask_put_scalar, alter=lambda x: x.sub_(1)),
    "index_put_ with a mask and a one-element device tensor": Example(
        _floats(4),
        lambda x: x.clone().index_put_((x > 2,), torch.zeros((), device=x.device)),
        alter=lambda x: x.sub_(1),
    ),
    "x[mask] = one-element device tensor": Example(
        lambda d: (torch.arange(4.0, device=d), torch.tensor(7.0, device=d)),
        _mask_put_element,
    ),
    "x[mask] = one-element host tensor": Example(
        lambda d: (torch.arange(4.0, device=d), torch.tensor([7.0])),
        _mask_put_element,
        alter=lambda x, v: x.mul_(2),  # v is read once, at capture
    ),
    "index_put (out of place) with a mask": Example(
        _floats(3), lambda x: torch.ops.aten.index_put(x, [x > 1], torch.zeros(2, device=x.device))
    ),
    "_index_put_impl_ with a mask": Example(
        _floats(3),
        lambda x: torch.ops.aten._index_put_impl_(
            x.clone(), [x > 1], torch.zeros(2, device=x.device)
        ),
    ),
    "F.one_hot(t)": Example(lambda d: (torch.tensor([0, 2, 1], device=d),), F.one_hot),
    "F.one_hot(t, num_classes=k)": Example(
        lambda d: (torch.tensor([0, 2, 1], device=d),),
        lambda t: F.one_hot(t, num_classes=4),
        alter=lambda t: t.copy_(torch.tensor([3, 0, 0])),
    ),
    "torch._assert_async(t)": Example(
        _floats(2), lambda x: (torch._assert_async((x > 0).all()), x * 2)[1], alter=_double
    ),
    "F.embedding(i, w, max_norm=m)": Example(
        lambda d: (
            torch.tensor([0, 2, 2], device=d),
            torch.arange(1.0, 13.0, device=d).reshape(4, 3),
        ),
        lambda i, w: F.embedding(i, w, max_norm=1.0),
        alter=lambda i, w: i.copy_(torch.tensor([1, 3, 0])),
    ),
    "torch.nonzero_static(x, size=n)": Example(
        _floats(4), lambda x: torch.nonzero_static(x > 2, size=3), alter=lambda x: x.sub_(1)
    ),
    "t.tolist()": Example(_floats(2), lambda x: x.tolist()),
    "t.numpy()": Example(
        _floats(2), lambda x: x.numpy(), cuda_error=(TypeError, "can't convert cuda")
    ),
    "t.cpu()": Example(_floats(2), lambda x: x.cpu()),
    "print(t) / repr(t)": Example(_floats(2), repr),
    "f'{t}'": Example(_floats(2), lambda x: f"{x}"),
}


@dataclasses.dataclass(frozen=True)
class Env:
    device: torch.device
    emulated: bool

    def expected(self, row: Verdict) -> Capture:
        return row.emulated_capture if self.emulated else row.cuda


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    if request.param == "cuda":
        yield Env(torch.device("cuda"), emulated=False)
    else:
        with emulate_cuda_graphs():
            yield Env(torch.device("cpu"), emulated=True)


def test_every_row_has_an_example_and_a_source() -> None:
    cases = [row.case for row in VERDICTS]
    assert len(cases) == len(set(cases))
    assert set(cases) == set(EXAMPLES)
    for row in VERDICTS:
        assert row.source and row.why
        # The emulator departs from CUDA only where it says what it assumes.
        assert (row.emulated is None or row.emulated is row.cuda) or row.assumption


def _capture(
    body: Callable[..., Any], inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.cuda.CUDAGraph, Any]:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = body(*inputs)
    return g, out


@pytest.mark.parametrize("row", VERDICTS, ids=[row.case for row in VERDICTS])
def test_capture_does_what_the_table_says(env: Env, row: Verdict) -> None:
    example = EXAMPLES[row.case]
    inputs = example.inputs(env.device)
    body = example.body
    if env.emulated or env.expected(row) is Capture.CAPTURED:
        body(*inputs)  # eagerly first: the example itself is valid
    if env.expected(row) is Capture.REFUSED:
        error, message = (
            CUDA_ERROR,
            "not permitted when stream is capturing|previous error during capture",
        )
        if row.torch_error is not None:
            error, message = RuntimeError, re.escape(row.torch_error)
        if example.cuda_error is not None and not env.emulated:
            error, message = example.cuda_error
        with pytest.raises(error, match=message):
            _capture(body, inputs)
        assert not torch.cuda.is_current_stream_capturing()
        return
    g, out = _capture(body, inputs)
    if example.alter is not None:
        example.alter(*inputs)
    g.replay()
    if env.device.type == "cuda":
        torch.cuda.synchronize()
    want = body(*inputs)
    if example.comparable:
        torch.testing.assert_close(out, want)
    else:
        assert out.shape == want.shape and out.dtype == want.dtype


def test_one_hot_with_num_classes_keeps_torch_s_error_for_a_non_long_index(env: Env) -> None:
    with pytest.raises(RuntimeError, match="LongTensor"):
        _capture(lambda t: F.one_hot(t, num_classes=3), (torch.zeros(2, device=env.device),))
