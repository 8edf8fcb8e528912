"""DeepSeek-V2's multi-head latent attention (MLA).

Keys and values of every head are up-projected from one narrow latent per token (``kv_lora_rank``,
512 in DeepSeek-V2), so generation caches that latent and one RoPE key shared by all heads (64):
576 numbers per token and layer instead of 2 x 16 heads x 128. RoPE cannot pass through the
up-projection (positions would no longer factor out of the absorbed weights below), so it is
"decoupled": a separate slice of each query (``qk_pos_emb_head_dim``) and the shared key carry
positions, the rest (``qk_head_dim``) does not. Query/key heads are therefore 128 + 64 = 192
wide while value heads are 128.

Submodules are named as in Megatron-Core's ``MLASelfAttention`` (local spec); Hugging Face's
``DeepseekV2Attention`` maps onto them one to one, weights copied as they are ([out, in]):

=====================  ======================  ===============================================
meshtron / Megatron    Hugging Face            shape
=====================  ======================  ===============================================
linear_q_proj          q_proj                  [heads*(nope+rope), hidden]  (q_lora_rank 0)
linear_q_down_proj     q_a_proj                [q_lora_rank, hidden]
q_layernorm            q_a_layernorm           [q_lora_rank]
linear_q_up_proj       q_b_proj                [heads*(nope+rope), q_lora_rank]
linear_kv_down_proj    kv_a_proj_with_mqa      [kv_lora_rank + rope, hidden]
kv_layernorm           kv_a_layernorm          [kv_lora_rank]
linear_kv_up_proj      kv_b_proj               [heads*(nope+v), kv_lora_rank], per head [k | v]
linear_proj            o_proj                  [hidden, heads*v]
=====================  ======================  ===============================================

Each query head is laid out [nope | rope]. The rope dims of the checkpoints rotate adjacent pairs
(see ``deinterleave``); they are reordered at run time, as Megatron does, so that HF and
Megatron checkpoints load without permuting rows. On a GPU (``fused_kernels``) the reordering,
the rotations and the assembly of q and k are one Triton kernel each way (``kernels/triton_mla.py``). (Permuting the rope rows of the q and kv-down
weights once at load would save that copy of a third of q; not worth a second layout yet.)

Tensor parallelism splits the heads (Megatron's layout): ``linear_q_proj`` / ``linear_q_up_proj``
and ``linear_kv_up_proj`` by output rows, whole heads per rank (each head's rows are contiguous,
[nope | rope] and [k | v], so a contiguous split needs no layout of its own), ``linear_proj`` by
input columns. The down-projections and latent norms are replicated and, under sequence
parallelism, see their rank's tokens; the shared RoPE key, which every rank's heads read, enters
the tensor-parallel region through ``rope_key_to_heads`` (an identity in one process).

Attention runs through ``SelfAttentionBase`` with qk dim 192 and v dim 128 as they are. On an
H100 (torch 2.11, cuDNN 9.19; b 4, 16 heads, 4096 causal, bf16, fwd+bwd) SDPA's cuDNN kernel takes
them in 3.0 ms, its flash kernel refuses unequal dims (6.2 ms with v padded to 192), the
memory-efficient one takes them in 28 ms; ``auto`` tries cuDNN first. ``--attention-backend flash``
(what ROCm's launch scripts use), and ``auto`` where there is no cuDNN (ROCm), pad v with zeros to
the qk dim and drop the extra output columns (``CoreAttention``, ``attention.pads_values``), which
changes nothing in the result.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config import ModelConfig
from meshtron.kernels import use_triton
from meshtron.layers.attention import SelfAttentionBase, head_dim
from meshtron.layers.kv_cache import LatentKVCache
from meshtron.layers.norms import build_norm
from meshtron.layers.rope import apply_rotary, deinterleave, yarn_mscale


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's temperature squared (``mscale_all_dim``) as DeepSeek applies
    it: the cos/sin tables carry only the ratio of the two temperatures, this the rest."""
    scale = (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) ** -0.5
    if cfg.rope_scaling == "yarn":
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def rope_table_dim(cfg: ModelConfig) -> int:
    """Width of the RoPE tables a block of ``cfg`` reads: MLA's decoupled rope dims, else the head dim."""
    return cfg.qk_pos_emb_head_dim if cfg.multi_latent_attention else head_dim(cfg)


class MultiLatentAttention(SelfAttentionBase):
    """MLA of block ``layer_number``; ``forward`` takes what ``Attention.forward`` takes, with
    ``cos``/``sin`` of width ``rope_table_dim(cfg)`` (YaRN's, as ``rope_tables`` builds them).

    ``absorb_decode``: with a ``LatentKVCache``, a one-token chunk attends to the cached rows
    directly, the key up-projection folded into the query and the value one applied after
    (Megatron's ``--cache-mla-latents``). Longer chunks up-project the cached latents.
    """

    absorb_decode = True

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__(cfg, layer_number, softmax_scale(cfg))
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        q_out = heads * (self.nope_dim + self.rope_dim)

        def latent_norm(dim: int) -> nn.Module:
            return build_norm(cfg.normalization, dim, cfg.norm_epsilon, cfg.fused_kernels) if cfg.qk_layernorm else nn.Identity()

        # The projections into and out of the latents have no bias, as in Megatron-Core and HF.
        if cfg.q_lora_rank:
            self.linear_q_down_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_layernorm = latent_norm(cfg.q_lora_rank)
            self.linear_q_up_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        else:
            self.linear_q_proj = nn.Linear(hidden, q_out, bias=False)
        self.linear_kv_down_proj = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_layernorm = latent_norm(self.kv_lora_rank)
        self.rope_key_to_heads = nn.Identity()  # the parallel plan's hook (module docstring)
        self.linear_kv_up_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.linear_proj = nn.Linear(heads * self.v_dim, hidden, bias=cfg.add_bias_linear)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: LatentKVCache | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [b, s, hidden] -> [b, s, hidden]. With ``kv_cache``, x continues the cached sequence:
        its latents are stored and its queries attend to the whole prefix."""
        if self.q_lora_rank:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        else:
            q = self.linear_q_proj(x)
        # Heads and the sequence length are read off projection outputs (see Attention.forward).
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.nope_dim + self.rope_dim)
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_layernorm(latent), self.rope_key_to_heads(k_rope)
        if kv_cache is None and use_triton(self.fused_kernels, q):
            kv = self.linear_kv_up_proj(latent)
            q, k, v = _rotated_query_key(q, kv.view(b, s, -1, self.nope_dim + self.v_dim), k_rope, cos, sin, position_ids)
            return self.linear_proj(self.attend(q, k, v, document_ids, padding_mask))
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rotary(deinterleave(q_rope), cos, sin, position_ids, self.fused_kernels)
        k_rope = apply_rotary(deinterleave(k_rope).unsqueeze(2), cos, sin, position_ids, self.fused_kernels)  # one head
        if kv_cache is not None:
            rows = kv_cache.update(self.layer_number, latent, k_rope.squeeze(2))
            if s == 1 and self.absorb_decode:
                return self._absorbed_attention(q_nope, q_rope, rows)
            latent, k_rope = rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :].unsqueeze(2)
        kv = self.linear_kv_up_proj(latent)
        k_nope, v = kv.view(b, kv.shape[1], -1, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return self.linear_proj(self.attend(q, k, v, document_ids, padding_mask))

    def _absorbed_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One new token's attention straight over the cached rows [b, t, latent | rope].

        q_nope . (W_uk c) = (W_uk^T q_nope) . c: each head's query moves into the latent space,
        all heads then share one key (the 576-wide row) and one value (the 512-wide latent), and
        W_uv maps each head's latent output to its value dims. The scores, hence the softmax
        scale, are the plain path's. A single token sees every cached position, so its heads can
        stand in for the queries of one-head attention: each row is read once for all heads.
        """
        w_uk, w_uv = self.linear_kv_up_proj.weight.view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank).split(
            [self.nope_dim, self.v_dim], dim=1
        )
        q = torch.cat((torch.einsum("bshn,hnr->bshr", q_nope, w_uk), q_rope), dim=-1)  # [b, 1, heads, r + rope]
        k = rows.unsqueeze(1)  # [b, 1, t, r + rope]
        sees_all = torch.ones(1, 1, q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        out = self.core_attention(q, k, k[..., : self.kv_lora_rank], sees_all, 0.0)  # [b, 1, heads, r]
        return self.linear_proj(torch.einsum("bshr,hvr->bshv", out, w_uv).flatten(2))


@torch.compiler.disable  # a graph break: the kernels run eagerly inside a compiled block
def _rotated_query_key(q: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``forward``'s reference path from the rotations to the concatenations, in one Triton
    kernel each way (``kernels/triton_mla.py``): q rotated, k assembled, v a view of kv."""
    from meshtron.kernels.triton_mla import MlaQueryKey

    return MlaQueryKey.apply(q, kv, k_rope, cos.contiguous(), sin.contiguous(), position_ids)


def mla_config_errors(cfg: ModelConfig) -> list[str]:
    """What keeps ``cfg``'s MLA and YaRN fields from running, each naming the flag to change."""
    errors = []
    if cfg.rope_scaling == "yarn":
        if cfg.rope_scaling_factor <= 0:
            errors.append(f"--rotary-scaling-factor must be positive for YaRN, got {cfg.rope_scaling_factor}")
        if cfg.rope_original_max_position_embeddings <= 0:
            errors.append(
                "--yarn-original-max-position-embeddings (model.rope_original_max_position_embeddings) must be "
                f"positive for YaRN, got {cfg.rope_original_max_position_embeddings}"
            )
        if not 0 < cfg.rope_beta_slow < cfg.rope_beta_fast:
            errors.append(f"YaRN needs 0 < --yarn-beta-slow < --yarn-beta-fast, got {cfg.rope_beta_slow} and {cfg.rope_beta_fast}")
        if cfg.rope_mscale < 0 or cfg.rope_mscale_all_dim < 0:
            errors.append(f"--mscale and --mscale-all-dim must not be negative, got {cfg.rope_mscale} and {cfg.rope_mscale_all_dim}")
    if not cfg.multi_latent_attention:
        return errors
    for flag, value in (("--kv-lora-rank", cfg.kv_lora_rank), ("--qk-head-dim", cfg.qk_head_dim),
                        ("--qk-pos-emb-head-dim", cfg.qk_pos_emb_head_dim), ("--v-head-dim", cfg.v_head_dim)):  # fmt: skip
        if value <= 0:
            errors.append(f"{flag} must be positive with --multi-latent-attention, got {value}")
    if cfg.q_lora_rank < 0:
        errors.append(f"--q-lora-rank must be 0 (a full query projection) or positive, got {cfg.q_lora_rank}")
    if cfg.qk_pos_emb_head_dim % 2:
        errors.append(f"--qk-pos-emb-head-dim must be even (RoPE rotates pairs), got {cfg.qk_pos_emb_head_dim}")
    if cfg.position_embedding_type != "rope":
        errors.append("--multi-latent-attention needs --position-embedding-type rope (its decoupled RoPE key)")
    if cfg.num_query_groups not in (0, cfg.num_attention_heads):
        errors.append("--multi-latent-attention has no key/value groups: drop --num-query-groups")
    if cfg.kv_channels not in (0, cfg.v_head_dim):  # ROCm's DeepSeek-V3 script passes the v head dim, which Megatron ignores under MLA
        errors.append("--kv-channels does not apply to --multi-latent-attention: set --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim")
    return errors
