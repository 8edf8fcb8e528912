"""``--bert-load``: start parts of a model from a BERT checkpoint's weights (Megatron's ICT starts
both retriever towers this way).

Each of the model's ``pretrained_encoders()`` holds BERT's body under BERT's parameter names, so
the sharded load reads its tensors from the checkpoint's ``model.*`` entries directly, under any
layout (its records are the model's, with the submodule's prefix removed). The checkpoint's
other tensors (the masked-LM and sentence-order heads, its optimizer state) are not read.
"""

from __future__ import annotations

from typing import Callable

from meshtron.checkpoint.checkpoint import CheckpointError, load_checkpoint
from meshtron.models.contract import ModelFamily, ParamMeta
from meshtron.parallel.mesh import Mesh


def load_pretrained_encoders(load_dir: str, model: ModelFamily, optimizer, mesh: Mesh, metas: dict[str, ParamMeta],
                             log: Callable[[str], None] = print) -> None:  # fmt: skip
    """Fill every ``model.pretrained_encoders()`` submodule from the newest checkpoint in
    ``load_dir``, then refresh the optimizer's fp32 masters from the loaded weights."""
    targets = model.pretrained_encoders()
    if not targets:
        raise CheckpointError("--bert-load starts the retriever's towers; this model type has none to start (drop --bert-load)")
    for name in targets:
        sub_metas = {k.removeprefix(f"{name}."): m for k, m in metas.items() if k.startswith(f"{name}.")}
        meta = load_checkpoint(load_dir, model.get_submodule(name), optimizer=None, load_rng=False, mesh=mesh, metas=sub_metas,
                               strict=False, log=lambda _: None)  # fmt: skip
        if meta is None:
            raise CheckpointError(f"--bert-load {load_dir} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    if optimizer is not None:
        optimizer.reload_model_params()
    log(f"started {', '.join(targets)} from the BERT checkpoint of iteration {meta['iteration']} in {load_dir} (its heads are not used)")
