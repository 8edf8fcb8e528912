"""Write the GroupedMLP test checkpoints with Megatron-Core 0.16.1's own GroupedMLP, on the CPU.

Megatron-Core 0.19 no longer has the legacy ``GroupedMLP`` (``experts.weight1`` [h, experts*2f],
``weight2`` [experts*f, h]); its ``TEGroupedMLP`` needs Transformer Engine, which does not run
without a GPU. 0.16.1 still builds GroupedMLP under the local spec with ``moe_grouped_gemm``, but
its wheel carries no ``megatron/training``, so this script saves as Megatron-LM's
``save_checkpoint`` does, with Megatron-Core's own pieces: the torch_dist case through
``dist_checkpointing.save`` of ``{'model': model.sharded_state_dict(), 'args', 'iteration',
'checkpoint_version'}`` (GroupedMLP's ``sharded_state_dict`` turns its packed weights into
SequentialMLP's per-expert keys), the legacy case as ``torch.save`` of each tensor rank's
``model.state_dict_for_save_checkpoint()`` with the same common entries; ``args`` is an
``argparse.Namespace`` of the model-defining fields written here (the ones Megatron-LM's
``parse_args`` would give for these flags). Run from the repository root::

    pip download --no-deps megatron-core==0.16.1 -d /tmp/mcore16 && unzip -q /tmp/mcore16/*.whl -d /tmp/mcore16/site
    PYTHONPATH=/tmp/mcore16/site /work/venv-megatron/bin/python tests/data/megatron/make_grouped_checkpoints.py

GroupedMLP's constructor asks for the ``grouped_gemm`` package (a CUDA extension), its forward for
bf16 and that package's kernels; nothing here runs its forward (a stand-in ``grouped_gemm`` module
with no kernels passes the constructor's check; and 0.16.1's router leaves ``te_general_gemm``
undefined without Transformer Engine, where its code tests it for None). Megatron's logits come from a SequentialMLP
model that loads the torch_dist case through ``dist_checkpointing.load``: Megatron's own mapping
of GroupedMLP's weights onto SequentialMLP's, so ``reference.pt`` holds Megatron's logits of the
same weights without any layout reasoning of meshtron's. Two tensor-parallel ranks (gloo), so the
packed ``weight1`` of each rank holds each expert's [gate | up] halves of that rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from make_checkpoints import (
    CONSUMED,
    HERE,
    ITERATION,
    SEQ,
    VOCAB,
    _cpu_cuda_rng,
    _fill,
    _forward,
    _tokens,
)

TP = 2
MODEL = {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "ffn_hidden_size": 16, "num_moe_experts": 4, "moe_router_topk": 2,
         "moe_ffn_hidden_size": 8, "moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "aux_loss", "layernorm_epsilon": 1e-6}  # fmt: skip
# Megatron-LM's args for the same model (pretrain_gpt.py flags as in make_checkpoints.py's MOE, smaller).
ARGS = {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 16, "num_attention_heads": 2, "group_query_attention": False, "num_query_groups": 1,
        "kv_channels": 8, "padded_vocab_size": VOCAB, "max_position_embeddings": SEQ, "seq_length": SEQ, "normalization": "RMSNorm",
        "norm_epsilon": 1e-6, "swiglu": True, "position_embedding_type": "rope", "rotary_base": 10000, "rotary_percent": 1.0,
        "add_bias_linear": False, "untie_embeddings_and_output_weights": True, "num_experts": 4, "moe_router_topk": 2,
        "moe_ffn_hidden_size": 8, "moe_router_load_balancing_type": "aux_loss", "moe_router_score_function": "softmax",
        "moe_grouped_gemm": True, "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None, "moe_aux_loss_coeff": 0.0,
        "tensor_model_parallel_size": TP, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": TP, "transformer_impl": "local", "consumed_train_samples": CONSUMED, "iteration": ITERATION}  # fmt: skip
CASES = ("grouped_tp2_dist", "grouped_tp2_torch")


def _model(grouped: bool, mpu):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(**MODEL, tensor_model_parallel_size=TP, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False, moe_grouped_gemm=grouped,
                               moe_token_dispatcher_type="allgather", use_cpu_initialization=True, bias_activation_fusion=False,
                               masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                               gradient_accumulation_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    spec = get_gpt_layer_local_spec(4, moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=grouped, normalization="RMSNorm")
    return GPTModel(config, spec, VOCAB, SEQ, pre_process=True, post_process=True, parallel_output=False,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope")  # fmt: skip


def _run(rank: int, port: int) -> None:
    _cpu_cuda_rng()
    sys.modules["grouped_gemm"] = types.SimpleNamespace(ops=None)  # the constructor's check only
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as mpu

    dist.init_process_group("gloo", rank=rank, world_size=TP)
    mpu.initialize_model_parallel(TP, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    grouped = _model(True, mpu)
    assert type(grouped.decoder.layers[0].mlp.experts).__name__ == "GroupedMLP"
    _fill(grouped, mpu)
    common = {"args": argparse.Namespace(**ARGS), "checkpoint_version": 3.0, "iteration": ITERATION}
    dist_dir = HERE / CASES[0] / f"iter_{ITERATION:07d}"
    dist_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({**common, "model": grouped.sharded_state_dict()}, str(dist_dir))
    legacy = HERE / CASES[1] / f"iter_{ITERATION:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
    legacy.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**common, "model": grouped.state_dict_for_save_checkpoint()}, legacy)
    dist.barrier()
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # 0.16.1 names it only where TE imports (NameError); its own test wants None
    sequential = _model(False, mpu)  # Megatron's own reading of GroupedMLP's weights
    sequential.load_state_dict(dist_checkpointing.load({"model": sequential.sharded_state_dict()}, str(dist_dir))["model"])
    logits = _forward(sequential, mpu)
    if rank == 0:
        for case in CASES:
            (HERE / case / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
            torch.save({"tokens": _tokens(), "logits": logits}, HERE / case / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    for case in CASES:
        shutil.rmtree(HERE / case, ignore_errors=True)
        (HERE / case).mkdir()
    mp.spawn(_run, args=(29811,), nprocs=TP, join=True)
    print(f"wrote {', '.join(str(HERE / case) for case in CASES)}")
