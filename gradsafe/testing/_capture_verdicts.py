"""What a real CUDA graph capture does with each operation that reads device memory on the host: one table.

A CUDA kernel that copies a device value to the host and waits for it (a
scalar read, an output sized by the data, an error check) cannot be captured:
the capture fails with "operation not permitted when stream is capturing".
The CPU kernels the emulator runs sometimes read the host where the CUDA
kernel does not (ATen skips a range check on CUDA and relies on a device
assert), and sometimes do it inside one aten call that a dispatch mode sees
whole. So the emulator does not infer anything from what the CPU kernel does:
it refuses during capture exactly what this table says a CUDA capture
refuses, and runs the CUDA kernel's algorithm where the CPU kernel would read
the host and the CUDA kernel does not.

Each :class:`Verdict` names its upstream source (ATen file and function). The
CPU-only emulator cannot tell a host tensor from a device tensor (every
emulated tensor is on the CPU); the rows where that matters say what the
emulator assumes. ``tests/cuda_graphs/test_capture_verdicts.py`` checks every
row op by op, under the emulator and, on a GPU, under a real capture.

Not covered, and so run by the emulator as captured: linear-algebra kernels
that check their LAPACK/cuSOLVER status inside one aten call
(``_linalg_eigh``, ``_linalg_svd``, ``linalg_eig``, ``linalg_lstsq``, ...).
Their public wrappers that call ``_linalg_check_errors`` separately
(``linalg.inv``, ``linalg.cholesky``, ``linalg.solve``, ``linalg.lu_factor``)
are refused through that row.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Final

import torch

__all__ = ["VERDICTS", "Capture", "Verdict", "host_read_refused", "torch_function_verdict"]


class Capture(enum.Enum):
    """What a real CUDA graph capture does with the call."""

    REFUSED = "refused"  # the CUDA kernel synchronises with the host
    CAPTURED = "captured"  # the CUDA kernel stays on the device


def _always(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return True


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return kwargs.get(name, args[index] if len(args) > index else default)


_MASK_DTYPES: Final = (torch.bool, torch.uint8)


def _masks(indices: Any) -> list[torch.Tensor]:
    return [i for i in indices if isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES]


def _index_with_mask(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return bool(_masks(args[1]))


def _index_put_through_nonzero(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    masks = _masks(args[1])
    accumulate = _arg(args, kwargs, 3, "accumulate", False)
    # index_put_ hands one mask with a one-element host value to masked_fill_
    # (canDispatchToMaskedFill); every other masked assignment goes through nonzero.
    single_mask = len(masks) == 1 and sum(i is not None for i in args[1]) == 1
    return bool(masks) and not (single_mask and args[2].numel() == 1 and not accumulate)


def _one_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _on_device_of(value: torch.Tensor, self: torch.Tensor) -> bool:
    # Every emulated tensor is on the CPU, the emulated device: there a value
    # on self's device is the device tensor device-agnostic code makes.
    return value.device == self.device


def _setitem_with_mask(args: tuple[Any, ...]) -> bool:
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return bool(_masks(index))


def _setitem_device_element(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    value = args[2]
    return _setitem_with_mask(args) and _one_element(value) and _on_device_of(value, args[0])


def _setitem_host_element(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    value = args[2]
    return _setitem_with_mask(args) and _one_element(value) and value.device.type == "cpu"


def _index_put_device_element(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return bool(_masks(args[1])) and args[2].device.type != "cpu"


def _fill_value_on_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return _on_device_of(args[2], args[0])


def _no_output_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return _arg(args, kwargs, 1, "output_size", None) is None


def _histc_reads_range(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    low = _arg(args, kwargs, 2, "min", 0)
    high = _arg(args, kwargs, 3, "max", 0)
    return low == high and args[0].numel() > 0


def _equal_reads_the_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # cuda_equal answers without the device for different sizes, no elements,
    # or the same view of the same storage (is_alias_of and equal layout).
    a, b = args[0], args[1]
    if a.shape != b.shape or a.numel() == 0:
        return False
    same_view = (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
        and a.is_contiguous() == b.is_contiguous()
        and a.stride() == b.stride()
        and a.layout == b.layout
        and a.is_neg() == b.is_neg()
        and a.is_conj() == b.is_conj()
    )
    return not same_view


def _one_hot_infers_classes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return _arg(args, kwargs, 1, "num_classes", -1) == -1


def _one_hot_on_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``one_hot`` as ATen computes it on CUDA: no range check on the host (a device assert instead)."""
    t: torch.Tensor = args[0]
    num_classes = int(_arg(args, kwargs, 1, "num_classes", -1))
    if t.dtype != torch.long:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if num_classes < 1:
        raise RuntimeError("num_classes should be positive")
    if t.numel() == 0:
        return torch.empty((*t.shape, num_classes), dtype=t.dtype, device=t.device)
    out = torch.zeros((*t.shape, num_classes), dtype=t.dtype, device=t.device)
    return out.scatter_(-1, t.unsqueeze(-1), 1)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One case of one operation: what a CUDA capture does with it, why, and where upstream decides it.

    ``op`` is an aten overload packet (matched in the dispatch mode) or the
    Python callable a ``TorchFunctionMode`` sees. ``overload`` restricts an
    aten row to one overload. The first row of an ``op`` whose ``applies``
    holds decides. ``cuda_algorithm`` is run instead of the op during an
    emulated capture where the CPU kernel would read the host and the CUDA
    kernel does not. ``emulated`` differs from ``cuda`` only where the
    emulator cannot see what decides it; ``assumption`` says why. ``torch_error``: a
    refused operation that torch's own check stops before CUDA sees it, with
    this ``RuntimeError`` message; the capture stays valid.
    """

    case: str
    op: Any
    cuda: Capture
    why: str
    source: str
    overload: str | None = None
    applies: Callable[[tuple[Any, ...], dict[str, Any]], bool] = _always
    cuda_algorithm: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None
    emulated: Capture | None = None
    assumption: str = ""
    torch_error: str | None = None

    @property
    def emulated_capture(self) -> Capture:
        return self.cuda if self.emulated is None else self.emulated


_PINNED: Final = (
    "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor "
    "is pinned"
)
_PINNED_SOURCE: Final = "; torch's capture check refuses it first (seen on an H200, torch 2.11)"


_A = torch.ops.aten
_R, _C = Capture.REFUSED, Capture.CAPTURED

VERDICTS: Final[tuple[Verdict, ...]] = (
    # --- reads a device scalar on the host
    Verdict(
        "t.item() / bool(t) / int(t) / float(t)",
        _A._local_scalar_dense,
        _R,
        "copies one element to the host and waits for it",
        "aten/src/ATen/native/cuda/Scalar.cpp: _local_scalar_dense_cuda (memcpy_and_sync)",
    ),
    Verdict(
        "torch.equal",
        _A.equal,
        _R,
        "returns a host bool computed on the device",
        "aten/src/ATen/native/cuda/Equal.cpp: cuda_equal (eq(...).all().item())",
        applies=_equal_reads_the_host,
    ),
    Verdict(
        "torch.equal(t, t) / different sizes / no elements",
        _A.equal,
        _C,
        "answered from the metadata alone",
        "aten/src/ATen/native/cuda/Equal.cpp: cuda_equal (sizes differ: false; numel 0: true; "
        "is_alias_of with the same offset, strides, dtype and flags: true)",
    ),
    Verdict(
        "torch.allclose",
        _A.allclose,
        _R,
        "returns a host bool computed on the device",
        "aten/src/ATen/native/TensorCompare.cpp: allclose (isclose(...).all().item())",
    ),
    Verdict(
        "linalg.inv / cholesky / solve / lu_factor (error check)",
        _A._linalg_check_errors,
        _R,
        "reads the LAPACK status on the host to raise",
        "aten/src/ATen/native/BatchLinearAlgebra.cpp: _linalg_check_errors (infos.any().item())",
    ),
    Verdict(
        "torch.multinomial(p, n) without replacement",
        _A.multinomial,
        _C,
        "checks the probabilities with device asserts, samples on the device",
        "aten/src/ATen/native/Distributions.cpp: multinomial_out (not with_replacement or "
        "n_sample == 1: aminmax, _assert_async, exponential_, topk/argmax; the same aten "
        "calls on 2.11, 2.13 and 2.15)",
    ),
    Verdict(
        "torch.multinomial(p, n, replacement=True)",
        _A.multinomial,
        _C,
        "samples on the device",
        "aten/src/ATen/native/Distributions.cpp: multinomial_out (multinomial_with_replacement_stub)",
    ),
    Verdict(
        "torch.histc(x) with min == max (the default)",
        _A.histc,
        _R,
        "reads the data's min and max on the host",
        "aten/src/ATen/native/cuda/SummaryOps.cu: _histc_cuda_template (min == max: self.min()/max() to host)"
        + _PINNED_SOURCE,
        applies=_histc_reads_range,
        torch_error=_PINNED,
    ),
    Verdict(
        "torch.histc(x, min=a, max=b), a < b",
        _A.histc,
        _C,
        "bins on the device",
        "aten/src/ATen/native/cuda/SummaryOps.cu: _histc_cuda_template",
    ),
    Verdict(
        "x.masked_fill(mask, device value tensor)",
        _A.masked_fill,
        _R,
        "reads the device value tensor on the host (value.item(); capture-safe: "
        "torch.where(mask, v, x))",
        "aten/src/ATen/native/cuda/Indexing.cu: masked_fill__cuda(self, mask, const Tensor& value)",
        overload="Tensor",
        applies=_fill_value_on_device,
    ),
    Verdict(
        "x.masked_fill(mask, host value tensor)",
        _A.masked_fill,
        _C,
        "value.item() reads host memory; the value is fixed at capture",
        "aten/src/ATen/native/cuda/Indexing.cu: masked_fill__cuda(self, mask, const Tensor& value) "
        "(a CPU value is allowed)",
        overload="Tensor",
        emulated=_R,
        assumption="every emulated tensor is on the CPU, the emulated device, so the emulator "
        "cannot tell a host value tensor from a device one and refuses both (row above); a "
        "Python number is captured on both",
    ),
    # --- output size depends on device values
    Verdict(
        "torch.nonzero / torch.where(cond)",
        _A.nonzero,
        _R,
        "the output size is the count of nonzeros",
        "aten/src/ATen/native/cuda/Nonzero.cu: nonzero_cuda_out_impl (reads the count through pinned host memory)",
    ),
    Verdict(
        "torch.nonzero(as_tuple=True) (numpy form)",
        _A.nonzero_numpy,
        _R,
        "the output size is the count of nonzeros",
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp: nonzero_numpy (nonzero)",
    ),
    Verdict(
        "torch.argwhere",
        _A.argwhere,
        _R,
        "the output size is the count of nonzeros",
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp: argwhere (nonzero)",
    ),
    Verdict(
        "torch.masked_select",
        _A.masked_select,
        _R,
        "the output size is the count of true mask elements",
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp: masked_select_out_cuda_impl (index with the mask: nonzero)",
    ),
    Verdict(
        "torch.unique",
        _A._unique2,
        _R,
        "the output size is the count of unique values",
        "aten/src/ATen/native/cuda/Unique.cu: _unique2_cuda (copies the count to the host)",
    ),
    Verdict(
        "torch.unique (sorted=False fallback)",
        _A._unique,
        _R,
        "the output size is the count of unique values",
        "aten/src/ATen/native/cuda/Unique.cu: _unique_cuda",
    ),
    Verdict(
        "torch.unique(dim=d)",
        _A.unique_dim,
        _R,
        "the output size is the count of unique slices",
        "aten/src/ATen/native/cuda/Unique.cu: unique_dim_cuda",
    ),
    Verdict(
        "torch.unique_consecutive",
        _A.unique_consecutive,
        _R,
        "the output size is the count of runs",
        "aten/src/ATen/native/cuda/Unique.cu: unique_consecutive_cuda",
    ),
    Verdict(
        "torch.unique_consecutive(dim=d)",
        _A.unique_dim_consecutive,
        _R,
        "the output size is the count of runs",
        "aten/src/ATen/native/cuda/Unique.cu: unique_dim_consecutive_cuda",
    ),
    Verdict(
        "torch.bincount",
        _A.bincount,
        _R,
        "the output size is the largest value plus one",
        "aten/src/ATen/native/cuda/SummaryOps.cu: _bincount_cuda_template (self.max() to host)"
        + _PINNED_SOURCE,
        torch_error=_PINNED,
    ),
    Verdict(
        "torch.repeat_interleave(repeats_tensor) without output_size",
        _A.repeat_interleave,
        _R,
        "the output size is the sum of the repeats",
        "aten/src/ATen/native/Repeat.cpp: repeat_interleave_cuda (cumsum, last element to host)",
        overload="Tensor",
        applies=_no_output_size,
    ),
    Verdict(
        "torch.repeat_interleave(repeats_tensor, output_size=n)",
        _A.repeat_interleave,
        _C,
        "the output size is given",
        "aten/src/ATen/native/Repeat.cpp: repeat_interleave_cuda (output_size)",
        overload="Tensor",
    ),
    Verdict(
        "x[mask]",
        _A.index,
        _R,
        "a boolean index is turned into indices by nonzero",
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp: index (expandTensors: mask.nonzero())",
        applies=_index_with_mask,
    ),
    Verdict(
        "x[mask] = values (not one host scalar)",
        _A.index_put_,
        _R,
        "a boolean index is turned into indices by nonzero",
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp: index_put_ (canDispatchToMaskedFill, else nonzero)",
        applies=_index_put_through_nonzero,
    ),
    Verdict(
        "index_put_ with a mask and a one-element device tensor",
        _A.index_put_,
        _R,
        "masked_fill_ takes only a value on the CPU; the mask goes through nonzero",
        "aten/src/ATen/native/TensorAdvancedIndexingUtils.h: canDispatchToMaskedFill "
        "(value.numel() == 1 && value.device().is_cpu()), else index_put_ via nonzero",
        applies=_index_put_device_element,
        emulated=_C,
        assumption="at the aten level a Python number arrives as a one-element CPU tensor "
        "(torch 2.11-2.14; 2.15 calls masked_fill_ instead), which the emulator cannot tell "
        "from a device tensor, so a direct index_put_ call passes; x[mask] = tensor is decided "
        "before, from the Python value (the Tensor.__setitem__ rows)",
    ),
    Verdict(
        "x[mask] = Python number",
        _A.index_put_,
        _C,
        "the number becomes a one-element CPU tensor, and index_put_ masked_fill_ with its "
        "host value",
        "torch/csrc/autograd/python_variable_indexing.cpp: THPVariable_setitem (CUDA self: "
        "valueToTensor on the CPU); TensorAdvancedIndexingUtils.h: canDispatchToMaskedFill",
    ),
    Verdict(
        "index_put (out of place) with a mask",
        _A.index_put,
        _R,
        "a boolean index is turned into indices by nonzero",
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp: index_put (clone().index_put_)",
        applies=_index_put_through_nonzero,
    ),
    Verdict(
        "_index_put_impl_ with a mask",
        _A._index_put_impl_,
        _R,
        "a boolean index is turned into indices by nonzero",
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp: _index_put_impl_",
        applies=_index_put_through_nonzero,
    ),
    # --- the CPU kernel reads the host, the CUDA kernel does not
    Verdict(
        "F.one_hot(t)",
        torch.nn.functional.one_hot,  # the same object as torch._C._nn.one_hot
        _R,
        "infers num_classes from the data's max on the host",
        "aten/src/ATen/native/Onehot.cpp: one_hot (num_classes == -1: self.max().item())",
        applies=_one_hot_infers_classes,
    ),
    Verdict(
        "F.one_hot(t, num_classes=k)",
        torch.nn.functional.one_hot,  # the same object as torch._C._nn.one_hot
        _C,
        "no range check on the host: zeros + scatter_, a device assert for bad classes",
        "aten/src/ATen/native/Onehot.cpp: one_hot (the CPU branch alone reads aminmax)",
        cuda_algorithm=_one_hot_on_cuda,
    ),
    Verdict(
        "torch._assert_async(t)",
        _A._assert_async,
        _C,
        "a device-side assert",
        "aten/src/ATen/native/cuda/TensorCompare.cu: _assert_async_cuda (CPU: is_nonzero)",
    ),
    Verdict(
        "F.embedding(i, w, max_norm=m)",
        _A.embedding_renorm_,
        _C,
        "renorms the unique rows on the device (the CPU kernel reads each norm on the host)",
        "aten/src/ATen/native/cuda/Embedding.cu: embedding_renorm_cuda_ (cub::unique, count stays on the device)",
    ),
    Verdict(
        "torch.nonzero_static(x, size=n)",
        _A.nonzero_static,
        _C,
        "the output size is given",
        "aten/src/ATen/native/cuda/Nonzero.cu: nonzero_static_cuda_out_impl (kernels only; the count stays on the device)",
    ),
    # --- decided by where the Python value lives, before aten dispatch
    Verdict(
        "x[mask] = one-element device tensor",
        torch.Tensor.__setitem__,  # the same object as torch._C.TensorBase.__setitem__
        _R,
        "index_put_ dispatches to masked_fill_ only for a value on the CPU; otherwise the mask "
        "goes through nonzero (capture-safe: torch.where(mask, v, x), or a Python number)",
        "aten/src/ATen/native/TensorAdvancedIndexingUtils.h: canDispatchToMaskedFill "
        "(value.numel() == 1 && value.device().is_cpu()), else index_put_ via nonzero "
        "(TensorAdvancedIndexing.cpp)",
        applies=_setitem_device_element,
    ),
    Verdict(
        "x[mask] = one-element host tensor",
        torch.Tensor.__setitem__,
        _C,
        "index_put_ becomes masked_fill_ with value.item(), a read of host memory; the value "
        "is fixed at capture",
        "aten/src/ATen/native/TensorAdvancedIndexingUtils.h: canDispatchToMaskedFill; "
        "TensorAdvancedIndexing.cpp: _index_put_impl_ (masked_fill_(mask, value.item()))",
        applies=_setitem_host_element,
        emulated=_R,
        assumption="every emulated tensor is on the CPU, the emulated device, so the emulator "
        "cannot tell a host value tensor from a device one and refuses both (row above); a "
        "Python number is captured on both",
    ),
    # --- host copies that bypass aten dispatch
    Verdict(
        "t.tolist()",
        torch.Tensor.tolist,
        _R,
        "copies device memory to the host",
        "torch/csrc/utils/tensor_list.cpp: tensor_to_list (to CPU)" + _PINNED_SOURCE,
        torch_error=_PINNED,
    ),
    Verdict(
        "t.numpy()",
        torch.Tensor.numpy,
        _R,
        "needs a host copy",
        "torch/csrc/utils/tensor_numpy.cpp: tensor_to_numpy (CPU tensors only)",
    ),
    Verdict(
        "t.cpu()",
        torch.Tensor.cpu,
        _R,
        "copies device memory to pageable host memory and waits",
        "aten/src/ATen/native/cuda/Copy.cu: copy_kernel_cuda (device to pageable host: synchronous)"
        + _PINNED_SOURCE,
        torch_error=_PINNED,
    ),
    Verdict(
        "print(t) / repr(t)",
        torch.Tensor.__repr__,
        _R,
        "formats a host copy",
        "torch/_tensor_str.py: _str (tolist / item on the values)",
    ),
    Verdict(
        "f'{t}'",
        torch.Tensor.__format__,
        _R,
        "formats a host copy",
        "torch/_tensor.py: Tensor.__format__ (item() or _str)",
    ),
)


_ROWS: Final[dict[Any, tuple[Verdict, ...]]] = {}
for _row in VERDICTS:
    _ROWS[_row.op] = (*_ROWS.get(_row.op, ()), _row)


def _first(
    rows: tuple[Verdict, ...], overload: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Verdict | None:
    for row in rows:
        if row.overload is not None and row.overload != overload:
            continue
        if row.applies(args, kwargs):
            return row
    return None


def host_read_refused(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Verdict | None:
    """The row that makes an emulated capture refuse this aten call, or None if it captures."""
    packet = getattr(func, "overloadpacket", None)  # higher-order operators have none
    rows = _ROWS.get(packet) if packet is not None else None
    if not rows:
        return None
    row = _first(rows, func._overloadname, args, kwargs)
    return row if row is not None and row.emulated_capture is Capture.REFUSED else None


def torch_function_verdict(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Verdict | None:
    """The row deciding a Python-level call during an emulated capture, or None when no row covers it."""
    rows = _ROWS.get(func)
    return _first(rows, None, args, kwargs) if rows else None
