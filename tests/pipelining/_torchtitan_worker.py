"""torchtitan's own trainer, llama3 debug model, pipeline-parallel under ScheduleZBVZeroBubble.

Run by test_torchtitan.py. argv: ``rank port mode(gradsafe|upstream) pp dp ac(selective|none)
reshard(default|always|never) fsdp(on|off) schedule compile(off|inductor|aot_eager) outdir``, or
``reference outdir ranks dp compile`` (one process, no process group). ``schedule`` is torchtitan's name (``ZBVZeroBubble``,
``InterleavedZeroBubble``, ``DualPipeV``); ``fsdp off`` (with dp 1) skips torchtitan's
``apply_fsdp_to_decoder``, so the chunked loss's per-chunk backward accumulates into a plain
``lm_head.weight.grad`` (hazard H6: torch's metadata inference runs that loss once on
uninitialised stage inputs, and without FSDP nothing clears what it accumulated). ``compile``
other than ``off`` sets ``--compile.enable`` with that backend: torchtitan compiles each
transformer block in place (over its activation-checkpoint wrapper) and the loss, with torch's
defaults (AOTAutograd's buffer donation on).

A training rank builds ``llama3_debugmodel()``'s ``Trainer`` with as few changes as make it run on
CPU with gloo and compare in fp32 (see ``config()``), trains STEPS steps with ``trainer.train()``
(inside ``with gradsafe.patch("pipelining"):`` in gradsafe mode) and writes outdir/rank{r}.pt: for
every step, the full parameters and the gradients the optimizer is about to apply (captured by an
optimizer step pre-hook, so after torchtitan's gradient clipping), or a crash message.

The reference mode reads those files and, for every step, loads that step's parameters into one
unsplit, unsharded model built from the same config, runs the same microbatches through a plain
forward + ``loss.backward()`` each (gradient accumulation, summed cross-entropy over the global
token count, as torchtitan normalizes), clips with the same max norm and writes
outdir/reference.pt with the gradients.

What no torchtitan option covers, done here instead:
- CPU: torchtitan picks its device type and device module once, at import, so it is imported
  through ``gradsafe.verify._torchtitan.import_torchtitan`` (which ``gradsafe verify
  --torchtitan`` uses too): torch's two probes answer "cpu" while torchtitan is imported.
  gloo follows: ``init_distributed`` takes the backend torch maps the device type to.
- gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 uses for torchtitan's gradient divide factor
  of 1 once there are 2 data-parallel ranks: the stages' FSDP modules are told
  ``set_force_sum_reduction_for_comms(True)`` (torch's public FSDP2 API) after the build.
- no tokenizer files or dataset (the wheel ships neither): a file-less tokenizer and a
  dataloader of seeded random tokens, through torchtitan's own ``BaseTokenizer`` /
  ``BaseDataLoader`` extension points.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradsafe.verify._torchtitan import import_torchtitan

STEPS = 3
SEQ_LEN = 16  # divisible by the chunked loss's 8 chunks
MICROBATCHES = 4  # per data-parallel rank and step (microbatch size 1)
SEED = 1234


def _components() -> tuple[Any, Any]:
    """A tokenizer that needs no files and a dataloader of seeded random tokens (no dataset).

    Both are torchtitan's own extension points (``BaseTokenizer``, ``BaseDataLoader``).
    """
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Config, *, tokenizer_path: str) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("random tokens need no tokenizer")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("random tokens need no tokenizer")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class RandomTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 0

        def __init__(
            self,
            config: Config,
            *,
            dp_world_size: int,
            dp_rank: int,
            tokenizer: Any,
            seq_len: int,
            local_batch_size: int,
            **kwargs: Any,
        ) -> None:
            self.batches = microbatches(dp_rank, config.vocab_size, local_batch_size, seq_len)

        def __iter__(self) -> Any:
            for tokens in self.batches:
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    return NoTokenizer, RandomTokens


def microbatches(dp_rank: int, vocab: int, batch: int, seq_len: int) -> list[torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s STEPS * MICROBATCHES batches of ``seq_len + 1`` tokens."""
    generator = torch.Generator().manual_seed(SEED + dp_rank)
    return [
        torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        for _ in range(STEPS * MICROBATCHES)
    ]


def config(
    pp: int,
    dp: int,
    selective_ac: bool,
    reshard: str,
    dump_folder: str,
    schedule: str = "ZBVZeroBubble",
    compile_backend: str = "off",
) -> Any:
    """``llama3_debugmodel()`` as torchtitan ships it, changed only where this test must.

    - 2 of its 6 transformer layers: with ZBV's 4 stages on PP 2, the layer split gives stage 0
      the embedding, stages 1 and 2 one block each, stage 3 the final norm + lm_head.
    - eager attention (``ScaledDotProductAttention``, causal) instead of FlexAttention, whose
      backward refuses CPU; positions are then not needed (the dataloader yields none).
    - fp32 FSDP2 compute (``mixed_precision_param``), so the comparison can be tight.
    - ZBV schedule, PP and FSDP degrees, short sequences, microbatch size 1, STEPS steps, no
      validation, no checkpoints, no CUDA graphs, files only under ``dump_folder``.
    - as the caller asks: no activation checkpointing, another FSDP2 reshard policy,
      ``--compile.enable`` with a backend (torchtitan's default is inductor).
    Kept as shipped: FSDP2 on every stage, selective activation checkpointing, the chunked
    cross-entropy loss (lm_head applied in the loss), AdamW with warmup, gradient clipping at 1.0
    (but see dp > 1 below).
    """
    config_registry = import_torchtitan("llama3")
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    NoTokenizer, RandomTokens = _components()
    cfg = config_registry.llama3_debugmodel()
    model = cfg.model_spec.model
    model.layers = model.layers[:2]
    for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    cfg.tokenizer = NoTokenizer.Config(vocab_size=model.vocab_size)
    cfg.dataloader = RandomTokens.Config(vocab_size=model.vocab_size)
    cfg.dump_folder = dump_folder
    training = cfg.training
    training.local_batch_size = MICROBATCHES
    training.seq_len = SEQ_LEN
    training.steps = STEPS
    training.mixed_precision_param = "float32"
    training.disable_cuda_graphs = True
    parallelism = cfg.parallelism
    parallelism.pipeline_parallel_degree = pp
    parallelism.pipeline_parallel_schedule = schedule
    parallelism.pipeline_parallel_microbatch_size = 1
    parallelism.data_parallel_shard_degree = dp
    if dp > 1:
        # With FSDP2 over 2 ranks, torchtitan's gradient norm is ~4e-5 (relative) above the
        # single-process one, so clipping scales every gradient that much differently; also
        # without gradsafe, with a fused schedule (Interleaved1F1B) and without pipelining
        # (PP 1). Not this test's subject: compare unclipped gradients there.
        training.max_norm = float("inf")
    parallelism.fsdp_reshard_after_forward = reshard
    if not selective_ac:
        cfg.activation_checkpoint = None  # as torchtitan's own configs spell "no AC"
    cfg.validator.enable = False
    cfg.checkpoint.enable = False
    cfg.comm.init_timeout_seconds = 60
    cfg.comm.train_timeout_seconds = 60
    cfg.comm.trace_buf_size = 0
    if compile_backend != "off":
        cfg.compile.enable = True
        cfg.compile.backend = compile_backend
        # A rank compiling its blocks keeps its peer waiting on a recv meanwhile.
        cfg.comm.init_timeout_seconds = cfg.comm.train_timeout_seconds = 300
    cfg.debug.enable_structured_logging = False
    return cfg


def _fqn(name: str) -> str:
    """The unwrapped model's name for a parameter (activation checkpointing adds a wrapper)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _without_fsdp() -> None:
    """torchtitan's llama3 parallelize, minus FSDP2 (it applies it even at shard degree 1)."""
    from torchtitan.models.llama3 import parallelize

    parallelize.apply_fsdp_to_decoder = lambda *args, **kwargs: None


def train(
    rank: int,
    port: str,
    mode: str,
    pp: int,
    dp: int,
    ac: str,
    reshard: str,
    fsdp: str,
    schedule: str,
    compile_backend: str,
    outdir: str,
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(pp * dp),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
    )
    result: dict[str, Any] = {"steps": []}
    try:
        cfg = config(pp, dp, ac == "selective", reshard, outdir, schedule, compile_backend)
        if fsdp == "off":
            _without_fsdp()
        trainer = cfg.build()
        parts = trainer.model_parts
        from torch.distributed.fsdp import FSDPModule

        # torchtitan sets FSDP2's gradient divide factor to 1 (it normalizes by token count),
        # which FSDP2 reduces with ReduceOp.PREMUL_SUM: gloo has none.
        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)

        def capture(optimizer: Any, args: Any, kwargs: Any) -> None:
            step: dict[str, dict[str, torch.Tensor | None]] = {"params": {}, "grads": {}}
            for part in parts:
                for name, p in part.named_parameters():
                    step["params"][_fqn(name)] = _full(p)
                    step["grads"][_fqn(name)] = None if p.grad is None else _full(p.grad)
            result["steps"].append(step)

        trainer.optimizers.register_step_pre_hook(capture)
        if mode == "gradsafe":
            import gradsafe

            with gradsafe.patch("pipelining"):
                trainer.train()
        else:
            trainer.train()
        trainer.close()
    except Exception as exc:  # the upstream run may fail; report, don't hang
        result["crash"] = (
            f"{type(exc).__name__}: {exc}"[:2000] + "\n" + traceback.format_exc()[-3000:]
        )
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    if "crash" in result:
        os._exit(1)  # close the sockets so the peers fail fast instead of waiting on a recv
    torch.distributed.destroy_process_group()


def reference(outdir: str, ranks: int, dp: int, compile_backend: str) -> None:
    """Per step: the same parameters, one unsplit model, gradient accumulation, same clipping.

    With ``compile_backend``, each transformer block is compiled in place as torchtitan's
    ``apply_compile`` does (``block.compile(backend=..., fullgraph=True)``).
    """
    cfg = config(2, dp, False, "default", outdir)  # the training run's model, data, clipping
    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("cpu"):
        model = model_config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the RoPE cache; parameters are loaded below
    if compile_backend != "off":
        for block in model.layers.children():
            block.compile(backend=compile_backend, fullgraph=True)
    results = [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
    vocab = model_config.vocab_size
    data = [microbatches(d, vocab, 1, SEQ_LEN) for d in range(dp)]
    tokens_per_step = dp * MICROBATCHES * SEQ_LEN
    out: list[dict[str, torch.Tensor]] = []
    for step in range(STEPS):
        params: dict[str, torch.Tensor] = {}
        for res in results:
            params.update(res["steps"][step]["params"])
        names = {n for n, _ in model.named_parameters()}
        if set(params) != names:
            raise RuntimeError(f"the ranks' parameters are not the model's: {set(params) ^ names}")
        model.load_state_dict(params, strict=False)  # buffers (the RoPE cache) stay
        model.zero_grad(set_to_none=True)
        for d in range(dp):
            for m in range(MICROBATCHES):
                tokens = data[d][step * MICROBATCHES + m]
                logits = model(tokens[:, :-1])
                loss = (
                    torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum"
                    )
                    / tokens_per_step
                )
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    torch.save(out, Path(outdir) / "reference.pt")


def main() -> None:
    if sys.argv[1] == "reference":
        reference(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    rank, port, mode, pp, dp, ac, reshard, fsdp, schedule, compile_backend, outdir = sys.argv[1:12]
    train(
        int(rank),
        port,
        mode,
        int(pp),
        int(dp),
        ac,
        reshard,
        fsdp,
        schedule,
        compile_backend,
        outdir,
    )


if __name__ == "__main__":
    main()
