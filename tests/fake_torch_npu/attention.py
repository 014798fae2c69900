"""Fake torch_npu kernels: attention (``npu_fusion_attention``, ``npu_fused_infer_attention_score``).

Sources (see ``__init__``); the constraints are checked in the code below, each citing its source:

* [OP-FA] Ascend/op-plugin ``docs/context/torch_npu-npu_fusion_attention.md`` (commits 3ec6c1f, 0d8f401): ``atten_mask``
  **1 (True) = this position does NOT take part** ("取值为1代表该位不参与计算"); ``scale`` defaults to **1**;
  ``inner_precise`` 2 = invalid-row computation; ``sparse_mode`` 7 and 8 are varlen (TND) only.
* [OP-FIA] ``torch_npu-npu_fused_infer_attention_score.md`` (commit 0adf450): inference; contiguous inputs only; the
  mask polarity is [OP-FA]'s (checked on the device by ``benchmarks/npu_check_kernels.py``).
* [TNPU-YAML] / [TNPU-META] the torch-npu 2.13.0 wheel's schemas and meta functions (output shapes and dtypes).
* [FA-BF16-P] the real kernel rounds the softmax weights to the input dtype before the P*V matmul (a Cube operand).

Each computation is one ``torch.library`` custom op, in float32 except for the softmax weights [FA-BF16-P], rounded
once to the input dtype. Variants: ``wrong_polarity``, ``ignores_scale``, ``long_seq_bug`` (no scale beyond Sq 64).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tests.fake_torch_npu.formats import FakeNpuError

_FA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # [OP-FA] query/key/value
_FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")  # [OP-FA] input_layout
_FA_MAX_D = 768  # [OP-FA] D 1..768
_FA_MAX_N = 256  # [OP-FA] Nq 1..256
_FA_MAX_S = 1 << 20  # [OP-FA] S 1..1M
_FA_MAX_B = 2 << 20  # [OP-FA] B 1..2M (non-varlen)
_INT_MAX = 2147483647
_HEAD_CHUNK = 4  # heads per chunk inside the fake's computation (memory only; the result is the same)

_FIA_DTYPES = (torch.float16, torch.bfloat16)  # [OP-FIA] query on A2/A3
_FIA_MAX_D = 512  # [OP-FIA] Q_S > 1
_FIA_MAX_N = 256
_FIA_MAX_B = 65536
_FIA_MAX_GQA = 64


# ----- shared math (BNSD, float32 inside) -----------------------------------------------------------------------------
def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masked: torch.Tensor | None,
    scale: float,
    pre: int,
    nxt: int,
    invalid_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale, masked positions excluded) v for BNSD q/k/v; returns (out fp32, row max, row sum)."""
    nq, nkv = q.shape[1], k.shape[1]
    if nq != nkv:  # GQA: query head h reads kv head h // (nq / nkv)
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    sq, skv = s.shape[-2], s.shape[-1]
    block = torch.zeros(sq, skv, dtype=torch.bool)
    if masked is not None:
        block = block | masked.bool()
    if pre < sq or nxt < skv:  # band, origin top-left ([OP-FA] sparse_mode 0 with pre/next tokens)
        i = torch.arange(sq).unsqueeze(1)
        j = torch.arange(skv).unsqueeze(0)
        block = block | (i - j > pre) | (j - i > nxt)
    s = s.masked_fill(block, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    full = torch.isinf(row_max) & (row_max < 0)  # every position of the row masked
    p = torch.exp(s - torch.where(full, torch.zeros_like(row_max), row_max))
    row_sum = p.sum(dim=-1, keepdim=True)
    # [FA-BF16-P] the flash kernel keeps max/sum in fp32 but feeds the softmax weights to the P*V matmul in the input
    # dtype: round them (normalised, in [0, 1]) to q's dtype before multiplying by V, accumulating in fp32.
    weights = (p / torch.where(full, torch.ones_like(row_sum), row_sum)).to(q.dtype).float()
    out = torch.matmul(weights, v.float())
    # [OP-FA] inner_precise: a fully masked row loses precision unless invalid-row computation (2) is on; the fake
    # makes "undefined" visible as NaN, and zero rows with invalid-row computation.
    out = out.masked_fill(full, 0.0 if invalid_rows else float("nan"))
    return out, row_max, row_sum


def _to_bnsd(x: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    if layout == "SBH":
        x = x.permute(1, 0, 2)
    if layout in ("BSH", "SBH"):
        x = x.reshape(x.shape[0], x.shape[1], n, x.shape[2] // n)
    return x if layout == "BNSD" else x.permute(0, 2, 1, 3)


def _from_bnsd(out: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = out.shape
    if layout == "SBH":
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()
    if layout != "BNSD":
        out = out.permute(0, 2, 1, 3)
    return (out.reshape(b, s, n * d) if layout == "BSH" else out).contiguous()


@torch.library.custom_op("fake_torch_npu::fusion_attention", mutates_args=())
def _fusion_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    atten_mask: torch.Tensor | None,
    layout: str,
    head_num: int,
    kv_heads: int,
    scale: float,
    pre_tockens: int,
    next_tockens: int,
    inner_precise: int,
    mask_where_true: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q = _to_bnsd(query, layout, head_num)
    k = _to_bnsd(key, layout, kv_heads)
    v = _to_bnsd(value, layout, kv_heads)
    masked = None
    if atten_mask is not None:
        m = atten_mask.bool()
        masked = m if mask_where_true else ~m
        if masked.dim() == 4 and masked.shape[1] > 1:  # BNSS: per-head mask, chunked with the heads below
            raise NotImplementedError("fake npu_fusion_attention: BNSS masks are not modelled")
    # Heads in chunks (same result): bounded memory at production shapes (S ~ 4352, B*N 24-48).
    group = head_num // kv_heads
    step = max(group, (_HEAD_CHUNK // group) * group)
    parts = [
        _attend(q[:, h : h + step], k[:, h // group : (h + step) // group], v[:, h // group : (h + step) // group],
                masked, scale, pre_tockens, next_tockens, inner_precise == 2)
        for h in range(0, head_num, step)
    ]  # fmt: skip
    out, row_max, row_sum = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))
    # softmax_max / softmax_sum: [B, N, Sq, 8] float (the kernel stores 8 copies per row); output 3 is reserved.
    stats = [r.expand(*r.shape[:-1], 8).contiguous() for r in (row_max, row_sum)]
    return _from_bnsd(out.to(query.dtype), layout), stats[0], stats[1], query.new_empty((0,))


@_fusion_attention_op.register_fake
def _(query, key, value, atten_mask, layout, head_num, kv_heads, scale, pre, nxt, inner, where_true):
    b, sq = b_sq_skv(query, layout)
    stats = query.new_empty((b, head_num, sq, 8), dtype=torch.float32)
    return torch.empty_like(query), stats, stats.clone(), query.new_empty((0,))


# ----- npu_fusion_attention: documented argument checks ---------------------------------------------------------------
def _fa_shapes(query: torch.Tensor, key: torch.Tensor, head_num: int, layout: str) -> tuple[int, int, int, int, int]:
    """Return (B, Sq, Skv, Nkv, D) or raise [OP-FA]."""
    want_dim = 3 if layout in ("BSH", "SBH") else 4
    if query.dim() != want_dim or key.dim() != want_dim:
        raise FakeNpuError(f"npu_fusion_attention: {layout} needs {want_dim}-D query/key/value [OP-FA]")
    if layout in ("BSND", "BNSD"):
        order = (0, 1, 2, 3) if layout == "BSND" else (0, 2, 1, 3)  # B, S, N, D
        b, sq, nq, d = (query.shape[i] for i in order)
        bk, skv, nkv, dk = (key.shape[i] for i in order)
        if nq != head_num:
            raise FakeNpuError(f"npu_fusion_attention: head_num={head_num} but query has N={nq} ({layout}) [OP-FA]")
    else:
        order = (0, 1, 2) if layout == "BSH" else (1, 0, 2)  # B, S, H
        b, sq, h = (query.shape[i] for i in order)
        bk, skv, hk = (key.shape[i] for i in order)
        if head_num <= 0 or h % head_num:
            raise FakeNpuError(f"npu_fusion_attention: H={h} is not a multiple of head_num={head_num} [OP-FA]")
        d = h // head_num
        if hk % d:
            raise FakeNpuError(f"npu_fusion_attention: key H={hk} is not a multiple of D={d} [OP-FA]")
        nkv, dk = hk // d, d
    if b != bk:
        raise FakeNpuError(f"npu_fusion_attention: batch sizes differ ({b} vs {bk}) [OP-FA]")
    if not 1 <= b <= _FA_MAX_B:
        raise FakeNpuError(f"npu_fusion_attention: B={b} outside 1..2M [OP-FA]")
    if d != dk:
        raise FakeNpuError(f"npu_fusion_attention: Dq={d} != Dk={dk} [OP-FA]")
    if not 1 <= d <= _FA_MAX_D:
        raise FakeNpuError(f"npu_fusion_attention: D={d} outside 1..{_FA_MAX_D} [OP-FA]")
    if not 1 <= head_num <= _FA_MAX_N:
        raise FakeNpuError(f"npu_fusion_attention: Nq={head_num} outside 1..{_FA_MAX_N} [OP-FA]")
    if nkv <= 0 or head_num % nkv:
        raise FakeNpuError(f"npu_fusion_attention: Nq/Nkv = {head_num}/{nkv} is not a non-zero integer [OP-FA]")
    for name, s in (("Sq", sq), ("Skv", skv)):
        if not 1 <= s <= _FA_MAX_S:
            raise FakeNpuError(f"npu_fusion_attention: {name}={s} outside 1..1M [OP-FA]")
    return b, sq, skv, nkv, d


def b_sq_skv(query: torch.Tensor, layout: str) -> tuple[int, int]:
    """(B, Sq) of ``query`` in ``layout``."""
    if layout == "SBH":
        return query.shape[1], query.shape[0]
    if layout == "BNSD":
        return query.shape[0], query.shape[2]
    return query.shape[0], query.shape[1]


def _check_fa_mask(mask: torch.Tensor, b: int, n: int, sq: int, skv: int) -> None:
    if mask.dtype not in (torch.bool, torch.uint8):
        raise FakeNpuError(f"npu_fusion_attention: atten_mask dtype {mask.dtype} is not bool/uint8 [OP-FA]")
    allowed = {"BNSS": (b, n, sq, skv), "B1SS": (b, 1, sq, skv), "11SS": (1, 1, sq, skv), "SS": (sq, skv)}
    if tuple(mask.shape) not in allowed.values():
        raise FakeNpuError(
            f"npu_fusion_attention: atten_mask shape {tuple(mask.shape)} is none of "
            f"{ {k: v for k, v in allowed.items()} } [OP-FA]"
        )


def _make_fusion_attention(*, mask_where_true: bool = True, honour_scale: bool = True, scale_until: int = 0) -> Any:
    """``scale_until`` > 0: WRONG on purpose beyond Sq = scale_until (scale dropped), a long-sequence tiling fault."""

    def npu_fusion_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        head_num: int,
        input_layout: str,
        pse: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None,
        scale: float = 1.0,
        keep_prob: float = 1.0,
        pre_tockens: int = _INT_MAX,
        next_tockens: int = _INT_MAX,
        inner_precise: int = 0,
        prefix: Any = None,
        actual_seq_qlen: Any = None,
        actual_seq_kvlen: Any = None,
        sparse_mode: int = 0,
        gen_mask_parallel: bool = True,
        sync: bool = False,
        softmax_layout: str = "",
        sink: torch.Tensor | None = None,
        dropout_mask: torch.Tensor | None = None,
        seed: int = 0,
        offset: int = 0,
    ) -> tuple[Any, ...]:
        """[OP-FA] Fake: documented result and constraints (see the module docstring); signature [TNPU-YAML]."""
        if sink is not None or dropout_mask is not None:
            raise NotImplementedError("fake npu_fusion_attention: sink / dropout_mask are not modelled")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"npu_fusion_attention: {name} must be a Tensor")
            if t.dtype not in _FA_DTYPES:
                raise FakeNpuError(f"npu_fusion_attention: {name} dtype {t.dtype} not float16/bfloat16/float32 [OP-FA]")
        if not (query.dtype == key.dtype == value.dtype):
            raise FakeNpuError("npu_fusion_attention: query/key/value dtypes must be equal [OP-FA]")
        if input_layout not in _FA_LAYOUTS:
            raise FakeNpuError(f"npu_fusion_attention: input_layout {input_layout!r} not in {_FA_LAYOUTS} [OP-FA]")
        if input_layout == "TND" or actual_seq_qlen is not None or actual_seq_kvlen is not None or prefix is not None:
            raise NotImplementedError("fake npu_fusion_attention: varlen (TND) and prefix are not modelled")
        if padding_mask is not None:
            raise FakeNpuError("npu_fusion_attention: padding_mask is not supported (暂不支持该传参) [OP-FA]")
        if pse is not None:
            raise NotImplementedError("fake npu_fusion_attention: pse is not modelled")
        if not 0.0 < keep_prob <= 1.0:
            raise FakeNpuError(f"npu_fusion_attention: keep_prob={keep_prob} outside (0, 1] [OP-FA]")
        if keep_prob != 1.0:
            raise NotImplementedError("fake npu_fusion_attention: dropout is not modelled")
        if inner_precise not in (0, 1, 2):
            raise FakeNpuError(f"npu_fusion_attention: inner_precise={inner_precise} not in 0/1/2 [OP-FA]")
        # 7 and 8 are the varlen (TND) long-sequence split modes; every other layout takes 0..6 [OP-FA sparse_mode].
        if sparse_mode not in (range(9) if input_layout == "TND" else range(7)):
            raise FakeNpuError(
                f"npu_fusion_attention: sparse_mode={sparse_mode} not in 0..6 for input_layout {input_layout} "
                "(7/8 are varlen/TND only) [OP-FA]"
            )
        if sparse_mode not in (0, 1):
            raise NotImplementedError(f"fake npu_fusion_attention: sparse_mode={sparse_mode} is not modelled")
        if tuple(key.shape) != tuple(value.shape):
            raise FakeNpuError(
                f"npu_fusion_attention: key {tuple(key.shape)} and value {tuple(value.shape)} differ [OP-FA]"
            )
        b, sq, skv, nkv, _d = _fa_shapes(query, key, head_num, input_layout)
        if atten_mask is not None:
            _check_fa_mask(atten_mask, b, head_num, sq, skv)
        elif sparse_mode == 1:
            raise FakeNpuError("npu_fusion_attention: sparse_mode=1 (allMask) needs a full atten_mask [OP-FA]")
        pre, nxt = (
            (pre_tockens, next_tockens) if (sparse_mode == 0 and atten_mask is not None) else (_INT_MAX, _INT_MAX)
        )
        out, smax, ssum, reserved = _fusion_attention_op(
            query,
            key,
            value,
            atten_mask,
            input_layout,
            head_num,
            nkv,
            float(scale)
            if honour_scale and not (scale_until and b_sq_skv(query, input_layout)[1] > scale_until)
            else 1.0,
            int(pre),
            int(nxt),
            int(inner_precise),
            mask_where_true,
        )
        return out, smax, ssum, reserved, 0, 0, 0

    return npu_fusion_attention


# ----- npu_fused_infer_attention_score (a candidate the check script times; the plugin does not call it) --------------
@torch.library.custom_op("fake_torch_npu::fused_infer_attention", mutates_args=())
def _fia_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    atten_mask: torch.Tensor | None,
    layout: str,
    num_heads: int,
    kv_heads: int,
    scale: float,
    inner_precise: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    q = _to_bnsd(query, layout, num_heads)
    k = _to_bnsd(key, layout, kv_heads)
    v = _to_bnsd(value, layout, kv_heads)
    masked = None
    if atten_mask is not None:
        masked = atten_mask.bool()
        if masked.dim() == 3:
            masked = masked.unsqueeze(1)
    out, _, _ = _attend(q, k, v, masked, scale, _INT_MAX, _INT_MAX, inner_precise in (2, 3))
    # softmax_lse: empty unless softmax_lse_flag (not modelled) [TNPU-META] (the page says a [1] zero tensor [OP-FIA])
    return _from_bnsd(out.to(query.dtype), layout), query.new_empty((0,), dtype=torch.float32)


@_fia_op.register_fake
def _(query, key, value, atten_mask, layout, num_heads, kv_heads, scale, inner_precise):
    return torch.empty_like(query), query.new_empty((0,), dtype=torch.float32)


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Any = None,
    actual_seq_lengths_kv: Any = None,
    dequant_scale1: Any = None,
    quant_scale1: Any = None,
    dequant_scale2: Any = None,
    quant_scale2: Any = None,
    quant_offset2: Any = None,
    antiquant_scale: Any = None,
    antiquant_offset: Any = None,
    key_antiquant_scale: Any = None,
    key_antiquant_offset: Any = None,
    value_antiquant_scale: Any = None,
    value_antiquant_offset: Any = None,
    block_table: Any = None,
    query_padding_size: Any = None,
    kv_padding_size: Any = None,
    key_shared_prefix: Any = None,
    value_shared_prefix: Any = None,
    actual_shared_prefix_len: Any = None,
    query_rope: Any = None,
    key_rope: Any = None,
    key_rope_antiquant_scale: Any = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = _INT_MAX,
    next_tokens: int = _INT_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[OP-FIA] Fake: dense full-attention (Q_S > 1) subset of the documented behaviour and constraints."""
    unmodelled = (
        dequant_scale1, quant_scale1, dequant_scale2, quant_scale2, quant_offset2, antiquant_scale, antiquant_offset,
        key_antiquant_scale, key_antiquant_offset, value_antiquant_scale, value_antiquant_offset, block_table,
        query_padding_size, kv_padding_size, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len,
        query_rope, key_rope, key_rope_antiquant_scale,
    )  # fmt: skip
    flags = (block_size, softmax_lse_flag, key_antiquant_mode, value_antiquant_mode)
    if any(v is not None for v in unmodelled) or pse_shift is not None or any(flags):
        raise NotImplementedError("fake npu_fused_infer_attention_score: quantization/paged/pse/prefix not modelled")
    if actual_seq_lengths is not None or actual_seq_lengths_kv is not None:
        raise NotImplementedError("fake npu_fused_infer_attention_score: actual_seq_lengths not modelled")
    if query.dtype not in _FIA_DTYPES:
        raise FakeNpuError(f"npu_fused_infer_attention_score: query dtype {query.dtype} not float16/bfloat16 [OP-FIA]")
    if not (query.dtype == key.dtype == value.dtype):
        raise NotImplementedError("fake npu_fused_infer_attention_score: int8/int4 key/value not modelled")
    for name, t in (("query", query), ("key", key), ("value", value), ("atten_mask", atten_mask)):
        if t is not None and not t.is_contiguous():
            raise FakeNpuError(f"npu_fused_infer_attention_score: {name} must be contiguous [OP-FIA]")
    if input_layout not in ("BSH", "BSND", "BNSD"):
        raise NotImplementedError(f"fake npu_fused_infer_attention_score: layout {input_layout!r} not modelled")
    if tuple(key.shape) != tuple(value.shape):
        raise FakeNpuError("npu_fused_infer_attention_score: key and value shapes must be equal [OP-FIA]")
    nkv = num_key_value_heads or num_heads
    if num_heads <= 0 or num_heads % nkv or num_heads // nkv > _FIA_MAX_GQA:
        raise FakeNpuError(
            f"npu_fused_infer_attention_score: num_heads={num_heads} / num_key_value_heads={nkv} must be an integer "
            f"<= {_FIA_MAX_GQA} [OP-FIA]"
        )
    if input_layout == "BSH":
        b, sq, h = query.shape
        skv = key.shape[1]
        d = h // num_heads
        if h % num_heads or key.shape[2] != nkv * d:
            raise FakeNpuError("npu_fused_infer_attention_score: H / num_heads / num_key_value_heads mismatch [OP-FIA]")
    else:
        if input_layout == "BSND":
            b, sq, nq, d = query.shape
            skv, nk = key.shape[1], key.shape[2]
        else:
            b, nq, sq, d = query.shape
            nk, skv = key.shape[1], key.shape[2]
        if nq != num_heads or nk != nkv:
            raise FakeNpuError(
                f"npu_fused_infer_attention_score: num_heads={num_heads}/num_key_value_heads={nkv} do not match the "
                f"query/key N ({nq}/{nk}) [OP-FIA]"
            )
    if sq > 1:
        if b > _FIA_MAX_B or num_heads > _FIA_MAX_N or d > _FIA_MAX_D or d % 16:
            raise FakeNpuError(
                f"npu_fused_infer_attention_score: B={b} (<= 65536), N={num_heads} (<= 256), D={d} (<= 512, 16-aligned) "
                "[OP-FIA]"
            )
        if sparse_mode not in range(5):
            raise FakeNpuError(f"npu_fused_infer_attention_score: sparse_mode={sparse_mode} not in 0..4 [OP-FIA]")
    else:
        raise NotImplementedError("fake npu_fused_infer_attention_score: the Q_S == 1 (incremental) branch")
    if sparse_mode not in (0, 1) or pre_tokens != _INT_MAX or next_tokens != _INT_MAX:
        raise NotImplementedError("fake npu_fused_infer_attention_score: sparse modes / bands not modelled")
    if inner_precise not in range(4):
        raise FakeNpuError(f"npu_fused_infer_attention_score: inner_precise={inner_precise} not in 0..3 [OP-FIA]")
    if atten_mask is not None:
        if atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
            raise FakeNpuError(f"npu_fused_infer_attention_score: atten_mask dtype {atten_mask.dtype} [OP-FIA]")
        allowed = [(sq, skv), (b, sq, skv), (1, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv)]
        if tuple(atten_mask.shape) not in allowed:
            raise FakeNpuError(
                f"npu_fused_infer_attention_score: atten_mask shape {tuple(atten_mask.shape)} not in {allowed} [OP-FIA]"
            )
    elif sparse_mode == 1:
        raise FakeNpuError("npu_fused_infer_attention_score: sparse_mode=1 needs a full atten_mask [OP-FIA]")
    return _fia_op(query, key, value, atten_mask, input_layout, num_heads, nkv, float(scale), int(inner_precise))


#: kernel name -> {variant: implementation}; "correct" follows the documentation.
VARIANTS: dict[str, dict[str, Any]] = {
    "npu_fusion_attention": {
        "correct": _make_fusion_attention(),
        "wrong_polarity": _make_fusion_attention(mask_where_true=False),
        "ignores_scale": _make_fusion_attention(honour_scale=False),
        "long_seq_bug": _make_fusion_attention(scale_until=64),
    },
    "npu_fused_infer_attention_score": {
        "correct": npu_fused_infer_attention_score,
        "ignores_scale": functools.wraps(npu_fused_infer_attention_score)(
            lambda *a, **k: npu_fused_infer_attention_score(*a, **{**k, "scale": 1.0})
        ),
    },
}
