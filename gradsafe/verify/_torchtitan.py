"""``gradsafe verify --torchtitan MODEL[:CONFIG]``: a torchtitan model, split as torchtitan's pipeline splits it.

The model is built from torchtitan's own config registry
(``torchtitan.models.<MODEL>.config_registry.<CONFIG>()``, ``<MODEL>_debugmodel``
by default), cut to one transformer layer per stage that holds no embedding
or head, split into stages by torchtitan's own pipeline helpers (the stage
count and the module names per stage that ``pipeline_llm`` would use for the
schedule on ``ranks`` pipeline ranks), and each stage gets the config's
activation checkpointing as torchtitan's ``parallelize`` applies it. What the
single process cannot show (FSDP2 wrapping, the chunked loss applying
``lm_head`` outside the last stage, compile) is listed in docs/verify.md.

torchtitan picks its device type and device module once, at import
(``torchtitan.tools.utils.get_device_info``), from torch's probes, and asks
that device module for memory statistics: :func:`import_torchtitan` makes
those probes answer "cpu" while torchtitan is imported, so it runs without an
accelerator. The tests' torchtitan trainer worker imports it the same way.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch import nn

from gradsafe.pipelining.inspection import device_probes_answer

__all__ = ["build_stages", "import_torchtitan"]

SEQ_LEN = 16  # divisible by the chunked loss's 8 chunks
MICROBATCHES = 4
_SEED = 1234


def _cpu_device_module() -> Any:
    """torch.cpu, plus the memory queries torchtitan's metrics make of a device module."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return SimpleNamespace(
        set_device=torch.cpu.set_device,
        device_count=torch.cpu.device_count,
        synchronize=torch.cpu.synchronize,
        current_device=lambda: 0,  # an index, as barrier(device_ids=...) wants
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: SimpleNamespace(name="cpu", total_memory=memory),
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
        memory_stats=lambda device=None: {},
    )


def import_torchtitan(model: str = "llama3") -> ModuleType:
    """Import torchtitan with "cpu" as its device type; return ``torchtitan.models.<model>.config_registry``.

    Raises ImportError (torchtitan missing: install it) or RuntimeError
    (torchtitan was imported before with another device type: import it
    through this function first).
    """
    with device_probes_answer("cpu", _cpu_device_module()):
        import torchtitan.tools.utils

        registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
    if torchtitan.tools.utils.device_type != "cpu":
        raise RuntimeError(
            "torchtitan was imported with device type "
            f"{torchtitan.tools.utils.device_type!r} before gradsafe could make it 'cpu'; "
            "import it through gradsafe.verify._torchtitan.import_torchtitan first."
        )
    return registry


def _config(spec: str, schedule: str, ranks: int) -> tuple[Any, Any]:
    model, _, name = spec.partition(":")
    registry = import_torchtitan(model)
    name = name or f"{model}_debugmodel"
    make = getattr(registry, name, None)
    if not callable(make):
        known = sorted(n for n in dir(registry) if n.startswith(model) and "debug" in n)
        raise ValueError(
            f"torchtitan.models.{model}.config_registry has no config {name!r}; its debug "
            f"configs: {', '.join(known) or 'none'}"
        )
    cfg = make()
    cfg.parallelism.pipeline_parallel_schedule = schedule
    cfg.training.seq_len = SEQ_LEN
    return cfg, registry


def _eager_attention(model_config: Any) -> None:
    """FlexAttention's backward refuses CPU: torchtitan's eager SDPA (causal) in its place."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _, _, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())


def build_stages(
    spec: str, schedule: str, ranks: int
) -> tuple[list[nn.Module], list[tuple[torch.Tensor]], Callable[[Any, int], torch.Tensor]]:
    """``spec`` (``MODEL[:CONFIG]``)'s stages for ``schedule`` on ``ranks`` pipeline ranks, in stage order.

    Returns ``(stages, microbatches, loss_fn)`` for :func:`gradsafe.verify.verify`:
    MICROBATCHES sequences of SEQ_LEN random tokens, and the mean cross-entropy
    of the last stage's logits against random next tokens.
    """
    cfg, _ = _config(spec, schedule, ranks)  # imports torchtitan first, on CPU
    from torchtitan.distributed import pipeline_parallel as pp

    parallelism = cfg.parallelism
    model_config = cfg.model_spec.model
    _eager_attention(model_config)
    # As many stages as torchtitan makes for this schedule on ``ranks`` ranks;
    # then one layer per stage besides the first and last stage's weights.
    stages, _, first, last = pp._get_pipeline_metadata(
        SimpleNamespace(pp=ranks), parallelism, model_config
    )
    model_config.layers = model_config.layers[: max(1, stages - first - last)]
    model_config.update_from_config(config=cfg)
    torch.manual_seed(_SEED)
    with torch.device("cpu"):
        whole = model_config.build()
    with torch.no_grad():
        whole.init_weights(buffer_device=None)
    names = parallelism.module_fqns_per_model_part or pp._generate_llm_fqn_per_model_part(
        stages, len(model_config.layers), first, last
    )
    parts = [pp._split_module(whole, n) for n in names]
    if cfg.activation_checkpoint is not None:
        for part in parts:  # as torchtitan's parallelize does, per model part
            cfg.activation_checkpoint.build(dump_folder=cfg.dump_folder).apply(part)
    vocab = model_config.vocab_size
    generator = torch.Generator().manual_seed(_SEED)
    tokens = [
        torch.randint(0, vocab, (1, SEQ_LEN + 1), generator=generator) for _ in range(MICROBATCHES)
    ]

    def loss_fn(logits: torch.Tensor, k: int) -> torch.Tensor:
        labels = tokens[k][:, 1:]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return parts, [(t[:, :-1],) for t in tokens], loss_fn
