"""The flex block mask of packed documents, checked on the CPU with flex attention's eager
path against the dense-mask reference (the compiled kernel is checked on a GPU in
tests/gpu/test_document_attention_gpu.py), and when ``CoreAttention`` takes the flex path."""

import warnings

import pytest
import torch

from meshtron.layers.attention import attention_mask, math_attention
from meshtron.layers.document_attention import document_block_mask, flex_attention, uses_flex


@pytest.mark.skipif(flex_attention is None, reason="flex attention needs torch >= 2.5")
def test_block_mask_is_causal_within_documents():
    torch.manual_seed(0)
    b, heads, kv_heads, s, d = 2, 4, 2, 200, 16
    q, k, v = torch.randn(b, heads, s, d), torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    docs = torch.stack([torch.repeat_interleave(torch.arange(5), torch.tensor([30, 70, 1, 60, 39])),
                        torch.repeat_interleave(torch.arange(3), torch.tensor([150, 20, 30]))])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is unfused
        out = flex_attention(q, k, v, block_mask=document_block_mask(docs), enable_gqa=True)
    torch.testing.assert_close(out, math_attention(q, k, v, attention_mask(s, s, docs)), rtol=1e-5, atol=1e-5)
    assert document_block_mask(docs) is document_block_mask(docs)  # the layers of one forward share it


def test_flex_only_for_packed_causal_attention_on_cuda():
    q = k = v = torch.zeros(1, 8, 2, 4)
    docs = torch.zeros(1, 8, dtype=torch.long)
    assert not uses_flex("auto", True, 0.0, q, k, v, docs)  # the CPU keeps the dense reference
    if torch.cuda.is_available():
        q = k = v = q.cuda()
        docs = docs.cuda()
        assert uses_flex("auto", True, 0.0, q, k, v, docs)
        for args in (("math", True, 0.0, q, k, v, docs), ("auto", False, 0.0, q, k, v, docs), ("auto", True, 0.1, q, k, v, docs),
                     ("auto", True, 0.0, q, k, v, None), ("auto", True, 0.0, q, torch.cat([k, k], 1), v, docs)):  # fmt: skip
            assert not uses_flex(*args)
