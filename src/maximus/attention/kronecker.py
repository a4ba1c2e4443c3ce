"""Kronecker Sketching attention: exact "detail" attention plus a block-causal "sketch" of the rest.

Positions are cut into blocks of `L` tokens. A query at position t lies in block j = t // L and
attends to two sets of keys, merged in one softmax:

* detail (exact): the `n_local` most recent blocks j-n_local+1 .. j (causal mask inside block j)
  plus `n_select` older *completed* blocks chosen by a learned importance score. The score of a
  candidate block i for query block j uses only keys of blocks <= j-1 (the scorer's query is the
  mean key of block j-1), so the choice for every query in block j depends on positions < jL <= t.
* sketch (compressed): every other completed block i <= j-n_local, summarised by the Kronecker
  factorisation A (x) B of the projection from positions to slots. B (`sub_slots` x L, learned)
  maps the L positions of one block to `sub_slots` weighted means; A (fixed log-spaced distance
  buckets with a learned per-bucket scale) adds blocks into `buckets` groups by their distance to
  block j, via prefix sums over blocks. Each slot keeps its token mass m and attends with logit
  q.k_mean*scale + log m + scale_bucket, so a slot that stands for m similar tokens weighs like m of
  them. Every slot seen by block j summarises only blocks < j, i.e. positions < jL <= t.

Cost per head: O(N (W + K) D) time and memory for N positions, W = detail tokens, K = slots, plus
O((N/L)^2 D) for block scoring. When a sequence has at most W // L blocks, every past block is in
the detail set and no slot is populated: the result is exact causal attention.

Masks: `key_valid` (padding, bool [B, Tk]) removes keys everywhere; `doc_start` (start position of
the packed document each token belongs to, long [B, Tk]) keeps every query inside its document;
`sliding_window` (Mistral / Qwen2) keeps keys with kv_pos > q_pos - window. The sketch only uses
blocks that lie wholly inside the query block's document and window, so it never leaks across them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_NEG_INF = float("-inf")
# A slot whose remaining token mass is below this is treated as empty (rounding residue of sums).
_MIN_SLOT_MASS = 1e-3


def _block_mean(keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean over the token axis: keys [..., L, D], weights [..., L] -> [..., D] (fp32)."""
    w = weights.to(torch.float32)
    total = w.sum(-1, keepdim=True).clamp_min(1.0)
    return torch.einsum("...l,...ld->...d", w, keys.to(torch.float32)) / total


def _segment_prefix(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums along dim 2 that restart at every segment start.

    x: [B, H, n, ...]; starts: bool [B, n] (True at index 0 and where a document's whole blocks
    begin). Returns [B, H, n + 1, ...] with out[i] = sum of x[s .. i-1], s the segment start of i
    (0 where i is a start). Sums never cross a segment start, so a document's slots are built
    from its own blocks only, bit for bit; the scan order depends on positions, never on values.
    """
    n = x.shape[2]
    flag = starts.view(starts.shape[0], 1, n, *([1] * (x.dim() - 3)))
    if not bool(starts[:, 1:].any()):
        inc = x.cumsum(2)
    else:  # Hillis-Steele segmented scan: log2(n) shifted adds
        inc, f, d = x, flag, 1
        while d < n:
            shifted = F.pad(inc.narrow(2, 0, n - d), [0, 0] * (x.dim() - 3) + [d, 0])
            inc = torch.where(f, inc, inc + shifted)
            f = f | F.pad(f.narrow(2, 0, n - d), [0, 0] * (x.dim() - 3) + [d, 0])
            d *= 2
    prev = F.pad(inc, [0, 0] * (x.dim() - 3) + [1, 0])  # prev[i] = inc[i-1]
    start_pad = F.pad(flag, [0, 0] * (x.dim() - 3) + [0, 1])  # index n is never a start
    return torch.where(start_pad, torch.zeros_like(prev), prev)


def kronecker_sketch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sketch,
    *,
    scaling: float,
    key_valid: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Detail + sketch attention of the last Tq positions over Tk cached/current positions.

    One function of sections (key side, query side, importance scores, detail path, sketch path,
    one softmax) rather than several: every section reads the block layout and the masks the
    sections before it built, and autograd keeps their intermediates in one graph that the
    memory coefficients (`maximus.memory.coefficients.KRONECKER_COEF`) were measured on.

    Args:
        query: [B, H, Tq, D]; the queries sit at positions Tk-Tq .. Tk-1.
        key, value: [B, Hkv, Tk, D] with H a multiple of Hkv (grouped-query attention).
        sketch: the layer's `KroneckerSketch` (or anything with its attributes): ``block`` (L,
            tokens per block); ``local_blocks``, ``select_blocks`` (detail budget in blocks: recent
            ones, learned-selected ones); ``sub_slot_logits`` [S, L] (the B factor: softmax over
            the L positions of a block); ``bucket_log_scale`` [M] (the learned scale of the A
            factor's M distance buckets); ``score_query``, ``score_key`` [D, D] and
            ``score_prior`` [D] (the importance scorer).
        scaling: logit scale (head_dim ** -0.5 for the models we support).
        key_valid: bool [B, Tk], False for padding; None = all valid.
        doc_start: long [B, Tk], first position of each token's packed document; None = 0.
        sliding_window: keys with kv_pos <= q_pos - window are invisible; None = no window.
        dropout_p: attention dropout on the merged probabilities.

    Returns:
        [B, H, Tq, D] in the dtype of `value`. Rows with no visible key are 0.
    """
    block, local_blocks, select_blocks = sketch.block, sketch.local_blocks, sketch.select_blocks
    sub_slot_logits, bucket_log_scale = sketch.sub_slot_logits, sketch.bucket_log_scale
    score_query, score_key, score_prior = sketch.score_query, sketch.score_key, sketch.score_prior
    bsz, n_heads, tq, dim = query.shape
    n_kv, tk = key.shape[1], key.shape[2]
    groups = n_heads // n_kv
    L = block
    dev = query.device
    q0 = tk - tq

    # ---- key side: pad to whole blocks ------------------------------------------------------
    nbk = -(-tk // L)
    pad_k = nbk * L - tk
    kb = F.pad(key, (0, 0, 0, pad_k)).view(bsz, n_kv, nbk, L, dim)
    vb = F.pad(value, (0, 0, 0, pad_k)).view(bsz, n_kv, nbk, L, dim)
    if key_valid is None:
        key_valid = torch.ones(bsz, tk, dtype=torch.bool, device=dev)
    valid = F.pad(key_valid.to(torch.bool), (0, pad_k), value=False)  # [B, nbk*L]
    if doc_start is None:
        doc = torch.zeros(bsz, nbk * L, dtype=torch.long, device=dev)
    else:
        doc = F.pad(doc_start.to(torch.long), (0, pad_k), mode="replicate") if pad_k else doc_start.to(torch.long)
    pos = torch.arange(nbk * L, device=dev)

    # ---- query side: the blocks that hold the Tq queries, padded to whole blocks -------------
    j0, j1 = q0 // L, (tk - 1) // L
    nbq = j1 - j0 + 1
    front = q0 - j0 * L
    qg = F.pad(query, (0, 0, front, nbq * L - front - tq)).view(bsz, n_kv, groups, nbq, L, dim)
    qblocks = torch.arange(j0, j1 + 1, device=dev)  # [nbq]
    qpos = (qblocks[:, None] * L + torch.arange(L, device=dev)).view(-1)  # [nbq*L]
    q_doc = doc[:, qpos].view(bsz, nbq, L)  # document start of every query
    blk_doc = doc[:, qblocks * L]  # [B, nbq]: document active at each query block's start
    window = sliding_window if sliding_window else None

    # Lowest position the query block may use: its document start (and the window's reach).
    sel_lo = blk_doc
    sketch_lo = blk_doc
    if window is not None:
        sel_lo = torch.maximum(sel_lo, (qblocks * L - window + 1).clamp_min(0)[None])
        sketch_lo = torch.maximum(sketch_lo, (qblocks * L + L - window).clamp_min(0)[None])
    first_cand = torch.div(sel_lo, L, rounding_mode="floor")  # [B, nbq] may be a partial block
    first_sketch = -torch.div(-sketch_lo, L, rounding_mode="floor")  # ceil: whole blocks only
    last_past = qblocks - local_blocks  # newest block outside the local window  [nbq]

    bi = torch.arange(bsz, device=dev)[:, None, None, None]
    hi = torch.arange(n_kv, device=dev)[None, :, None, None]

    # ---- importance scores of completed blocks (learned, causal) ------------------------------
    n_sel = min(select_blocks, nbk)
    st_bias = None
    if n_sel > 0:
        valid_b = valid.view(bsz, nbk, L)
        pos_b = pos.view(nbk, L)
        key_mean = _block_mean(kb, valid_b[:, None])  # [B, Hkv, nbk, D]
        # Scorer query of block j: mean key of block j-1, restricted to the block's document.
        prev = (qblocks - 1).clamp_min(0)
        prev_w = valid_b[:, prev] & (pos_b[prev][None] >= blk_doc[..., None]) & (qblocks[None, :, None] >= 1)
        r = _block_mean(kb[:, :, prev], prev_w[:, None])  # [B, Hkv, nbq, D]
        rq = r @ score_query.float()
        prior = key_mean @ score_prior.float()  # [B, Hkv, nbk]
        scores = torch.einsum("bhjd,bhid->bhji", rq, key_mean @ score_key.float()) / math.sqrt(dim)
        scores = scores + prior[:, :, None, :]
        # The first candidate may straddle the document start: score it on its in-document keys
        # only, so another document's tokens never steer the choice.
        b_q = torch.arange(bsz, device=dev)[:, None]
        part_w = valid_b[b_q, first_cand] & (pos_b[first_cand] >= blk_doc[..., None])  # [B, nbq, L]
        part_keys = kb[b_q[:, :, None], torch.arange(n_kv, device=dev)[None, :, None], first_cand[:, None]]
        part_mean = _block_mean(part_keys, part_w[:, None])  # [B, Hkv, nbq, D]
        part_score = (rq * (part_mean @ score_key.float())).sum(-1) / math.sqrt(dim) + part_mean @ score_prior.float()
        cand_i = torch.arange(nbk, device=dev)
        is_first = cand_i[None, None, :] == first_cand[..., None]  # [B, nbq, nbk]
        scores = torch.where(is_first[:, None], part_score[..., None], scores)
        cand = (cand_i[None, None, :] >= first_cand[..., None]) & (cand_i[None, :] <= last_past[:, None])[None]
        cand = cand & valid_b.any(-1)[:, None, :]
        scores = scores.masked_fill(~cand[:, None], _NEG_INF)
        top, sel_idx = scores.topk(n_sel, dim=-1)  # [B, Hkv, nbq, n_sel]
        sel_ok = torch.isfinite(top)
        sel_idx = torch.where(sel_ok, sel_idx, torch.zeros_like(sel_idx))
        top0 = top.masked_fill(~sel_ok, 0.0)
        # Straight-through: adds exactly 0 to the logits but lets the attention loss train the scorer.
        st_bias = top0 - top0.detach()
    else:
        sel_idx = torch.zeros(bsz, n_kv, nbq, 0, dtype=torch.long, device=dev)
        sel_ok = torch.zeros(bsz, n_kv, nbq, 0, dtype=torch.bool, device=dev)

    # ---- detail path: keys of the local blocks (shifted views) and the selected blocks (gather) --
    local = qblocks[:, None] - torch.arange(local_blocks - 1, -1, -1, device=dev)[None]  # [nbq, n_local]
    lead = max(0, local_blocks - 1 - j0)  # local blocks before block 0 do not exist: zero-padded, masked
    kb_l = F.pad(kb, (0, 0, 0, 0, lead, 0)) if lead else kb
    vb_l = F.pad(vb, (0, 0, 0, 0, lead, 0)) if lead else vb
    first = j0 - (local_blocks - 1) + lead
    k_parts = [kb_l[:, :, first + a:first + a + nbq] for a in range(local_blocks)]
    v_parts = [vb_l[:, :, first + a:first + a + nbq] for a in range(local_blocks)]
    if sel_idx.shape[-1]:
        k_parts.append(kb[bi, hi, sel_idx].flatten(3, 4))
        v_parts.append(vb[bi, hi, sel_idx].flatten(3, 4))
    det_idx = torch.cat([local.clamp_min(0).expand(bsz, n_kv, nbq, local_blocks), sel_idx], -1)
    det_ok = torch.cat([(local >= 0).expand(bsz, n_kv, nbq, local_blocks), sel_ok], -1)  # [B, Hkv, nbq, n_det]
    n_det = det_idx.shape[-1]
    kpos = (det_idx[..., None] * L + torch.arange(L, device=dev)).reshape(bsz, n_kv, nbq, 1, n_det * L)
    kvalid = valid.gather(1, kpos.reshape(bsz, -1)).view_as(kpos)
    qp = qpos.view(1, 1, nbq, L, 1)
    det_mask = (
        (kpos <= qp)
        & kvalid
        & det_ok.repeat_interleave(L, -1)[:, :, :, None, :]
        & (kpos >= q_doc[:, None, :, :, None])
    )
    if window is not None:
        det_mask = det_mask & (kpos > qp - window)
    bias_parts = []
    if st_bias is not None and torch.is_grad_enabled() and st_bias.requires_grad:
        zeros = st_bias.new_zeros(bsz, n_kv, nbq, local_blocks)
        bias_parts.append(torch.cat([zeros, st_bias], -1).repeat_interleave(L, -1))
    else:
        bias_parts.append(torch.zeros(bsz, n_kv, nbq, n_det * L, device=dev))
    masks = [det_mask]

    # ---- sketch path: Kronecker-factored slots over the remaining completed blocks -------------
    sub_slots, n_buckets = sub_slot_logits.shape[0], bucket_log_scale.shape[0]
    if nbk:
        # B factor: each block -> `sub_slots` weighted sums, weights summing to ~1 token per position.
        w = torch.softmax(sub_slot_logits.float(), dim=-1) * (L / sub_slots)  # [S, L]
        vmask = valid.view(bsz, nbk, L).float()
        mass = torch.einsum("sl,bil->bis", w, vmask)[:, None]  # [B, 1, nbk, S]
        wv = w[None, None] * vmask[:, :, None, :]  # [B, nbk, S, L]
        ksum = wv[:, None] @ kb.float()  # [B, Hkv, nbk, S, D]
        vsum = wv[:, None] @ vb.float()
        # A factor: log-spaced distance buckets, evaluated as differences of prefix sums over blocks.
        blk = torch.arange(nbk, device=dev)
        seg_start = (blk == 0)[None] | (-torch.div(-doc[:, blk * L], L, rounding_mode="floor") == blk[None])
        pm = _segment_prefix(mass, seg_start)  # [B, 1, nbk+1, S]
        pk = _segment_prefix(ksum, seg_start)  # [B, Hkv, nbk+1, S, D]
        pv = _segment_prefix(vsum, seg_start)
        m = torch.arange(n_buckets, device=dev)
        hi_b = last_past[:, None] + 2 - (2**m)[None]  # exclusive upper block  [nbq, M]
        lo_b = last_past[:, None] + 2 - (2 ** (m + 1))[None]
        lo_b[:, -1] = 0  # the last bucket holds everything older
        lo_b = torch.maximum(lo_b[None], first_sketch[..., None])  # [B, nbq, M]
        hi_b = torch.maximum(hi_b[None].expand_as(lo_b), lo_b)
        lo_b, hi_b = lo_b.clamp(0, nbk), hi_b.clamp(0, nbk)
        b2 = torch.arange(bsz, device=dev)[:, None, None]
        s_mass = (pm[:, 0][b2, hi_b] - pm[:, 0][b2, lo_b])[:, None]  # [B, 1, nbq, M, S]
        pk_t, pv_t = pk.transpose(1, 2), pv.transpose(1, 2)  # [B, nbk+1, Hkv, S, D]
        s_k = (pk_t[b2, hi_b] - pk_t[b2, lo_b]).permute(0, 3, 1, 2, 4, 5)  # [B, Hkv, nbq, M, S, D]
        s_v = (pv_t[b2, hi_b] - pv_t[b2, lo_b]).permute(0, 3, 1, 2, 4, 5)
        count = (hi_b - lo_b)[:, None].expand(bsz, n_kv, nbq, n_buckets)  # whole blocks per bucket
        if sel_idx.shape[-1]:
            # Blocks in the detail set are not summarised again: take them out of their bucket.
            dist = last_past[None, None, :, None] - sel_idx  # >= 0 for every real selection
            # floor(log2(dist + 1)) in exact integer arithmetic.
            bucket = (((dist + 1)[..., None] >= (2**m)).sum(-1) - 1).clamp(0, n_buckets - 1)
            inside = sel_ok & (sel_idx >= first_sketch[:, None, :, None])
            onehot = F.one_hot(bucket, n_buckets).float() * inside[..., None].float()  # [B,Hkv,nbq,nsel,M]
            sel_mass = mass.expand(bsz, n_kv, nbk, sub_slots)[bi, hi, sel_idx]  # [B, Hkv, nbq, nsel, S]
            s_mass = s_mass - torch.einsum("bhjtm,bhjts->bhjms", onehot, sel_mass)
            s_k = s_k - torch.einsum("bhjtm,bhjtsd->bhjmsd", onehot, ksum[bi, hi, sel_idx])
            s_v = s_v - torch.einsum("bhjtm,bhjtsd->bhjmsd", onehot, vsum[bi, hi, sel_idx])
            count = count - onehot.sum(3).long()
        s_mass = s_mass.expand(bsz, n_kv, nbq, n_buckets, sub_slots)
        present = (count[..., None] > 0) & (s_mass > _MIN_SLOT_MASS)
        safe_mass = s_mass.clamp_min(_MIN_SLOT_MASS)
        k_parts.append((s_k / safe_mass[..., None]).flatten(3, 4).to(key.dtype))  # [B, Hkv, nbq, K, D]
        v_parts.append((s_v / safe_mass[..., None]).flatten(3, 4).to(value.dtype))
        # Slot logit = q.k_mean*scale + log(token mass) + learned bucket scale.
        bias_parts.append((safe_mass.log() + bucket_log_scale.float()[:, None]).flatten(3, 4))
        # A query sees the slots only if it belongs to the document its block started in.
        sees = (q_doc == blk_doc[..., None])[:, None, :, :, None]  # [B, 1, nbq, L, 1]
        masks.append(present.flatten(3, 4)[:, :, :, None, :] & sees)

    # ---- one softmax over detail keys and sketch slots ----------------------------------------
    k_all = torch.cat(k_parts, 3)  # [B, Hkv, nbq, W + K, D]
    v_all = torch.cat(v_parts, 3)
    # One additive term per (query, key) column, shared by the G heads of a group: the learned
    # biases where visible, float32 min where masked. min + any logit rounds back to min, so
    # exp underflows to exactly 0: masked keys get exactly zero weight and zero gradient, and rows
    # that see nothing (padding queries, zeroed below) stay finite.
    bias = torch.cat(bias_parts, -1)[:, :, :, None, :]  # [B, Hkv, nbq, 1, W + K]
    mask = torch.cat(masks, -1)  # [B, Hkv, nbq, L, W + K]
    bias = bias.masked_fill(~mask, torch.finfo(torch.float32).min)[:, :, :, None]  # [B, Hkv, nbq, 1, L, W+K]
    qs = (qg * scaling).permute(0, 1, 3, 2, 4, 5).reshape(bsz, n_kv, nbq, groups * L, dim)
    logits = (qs @ k_all.transpose(-1, -2)).float().view(bsz, n_kv, nbq, groups, L, -1) + bias
    probs = torch.softmax(logits, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = probs.to(v_all.dtype).view(bsz, n_kv, nbq, groups * L, -1) @ v_all  # [B, Hkv, nbq, G*L, D]
    q_valid = valid[:, qpos].view(bsz, 1, nbq, 1, L, 1)  # padding queries see nothing: output 0
    out = out.view(bsz, n_kv, nbq, groups, L, dim) * q_valid.to(out.dtype)
    out = out.permute(0, 1, 3, 2, 4, 5).reshape(bsz, n_heads, nbq * L, dim)
    return out[:, :, front:front + tq]
