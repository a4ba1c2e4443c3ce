"""Text embeddings from a causal LM's final hidden states, with nested (Matryoshka) prefixes.

``embed(model, tokenizer, texts, dim=64)`` runs the decoder only (no logits), pools each text's
final hidden states (the ones the output head reads), keeps the first ``dim`` dimensions and
L2-normalises them. Because truncation happens before normalisation, the ``dim``-d embedding is
exactly ``normalise(full_unnormalised[:, :dim])``: a model trained with the Matryoshka loss
(``optimization.matryoshka``) makes that short prefix useful on its own.

Training an embedding model (``objective: contrastive``, :mod:`maximus.train.objectives.contrastive`) uses
the same tokenization (:func:`maximus.data.pairs.embedding_ids`), the same pooling
(:func:`pool`) and the same prefix normalisation (:func:`nested_prefix`) as this module.

``search`` is coarse-to-fine retrieval: score the whole index with the 64-d prefix, keep a
shortlist, rerank the shortlist with the full vectors.

torch is imported inside the functions so that ``import maximus`` (which exports ``embed``)
stays free of it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from maximus.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

Pooling = Literal["mean", "last"]

#: Queries scored against the whole index at once; bounds the ``queries x index`` score matrix
#: (1,024 x 1M float32 = 4 GiB would be too much; 256 x 1M = 1 GiB).
QUERY_BLOCK = 256

#: Queries reranked at once; bounds the gathered ``queries x shortlist x hidden`` candidates
#: (32 x 100 x 4,096 float32 = 52 MB).
RERANK_BLOCK = 32


def embed(model, tokenizer, texts: Sequence[str], dim: int | None = None, pooling: Pooling = "mean",
          batch_size: int = 16, max_length: int = 512) -> "torch.Tensor":
    """L2-normalised embeddings ``[len(texts), dim]`` (float32, CPU) of ``texts``.

    Args:
        model: a Transformers ``*ForCausalLM``, or a PEFT model around one (its adapters apply).
        tokenizer: the model's tokenizer; texts are padded here (on the right), so it needs no
            pad token.
        texts: the strings to embed; each must tokenize to at least one token.
        dim: keep the first ``dim`` hidden dimensions (a nested prefix) before normalising;
            ``None`` = the full hidden size.
        pooling: ``"mean"`` over the text's tokens, or ``"last"``: the last token's state (the
            only one that has seen the whole text under causal attention).
        batch_size: texts per forward pass.
        max_length: texts are truncated to this many tokens.

    Raises:
        ConfigError: unknown pooling, or ``dim`` outside ``1..hidden_size``.
        DataError: a text that tokenizes to nothing.
    """
    pooled = pooled_hidden_states(model, tokenizer, texts, pooling=pooling, batch_size=batch_size,
                                  max_length=max_length)
    return nested_prefix(pooled, dim)


def nested_prefix(vectors: "torch.Tensor", dim: int | None) -> "torch.Tensor":
    """``vectors[:, :dim]`` L2-normalised per row (the full width when ``dim`` is None)."""
    from maximus.losses.matryoshka import normalized_prefix

    width = vectors.shape[-1]
    if dim is not None and not 1 <= dim <= width:
        raise ConfigError(f"embedding dim {dim} is outside 1..{width} (the model's hidden size)",
                          hint=f"use a prefix size such as 64, or omit dim for all {width}")
    return normalized_prefix(vectors, dim)


def pooled_hidden_states(model, tokenizer, texts: Sequence[str], pooling: Pooling = "mean",
                         batch_size: int = 16, max_length: int = 512) -> "torch.Tensor":
    """Unnormalised pooled final hidden states ``[len(texts), hidden_size]`` (float32, CPU)."""
    import torch

    from maximus.data.pairs import embedding_ids
    from maximus.structure import causal_lm_of, compute_device

    check_pooling(pooling)
    if isinstance(texts, str):
        texts = [texts]
    lm = causal_lm_of(model)
    decoder = lm.get_decoder()
    device = compute_device(lm)
    token_lists = embedding_ids(tokenizer, texts, max_length)
    for i, ids in enumerate(token_lists):
        if not ids:
            raise DataError(f"text {i} is empty after tokenization", hint="remove empty texts before embedding")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = torch.empty(len(token_lists), lm.config.get_text_config().hidden_size, dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(token_lists), batch_size):
                batch = token_lists[start:start + batch_size]
                out[start:start + len(batch)] = _pool_batch(decoder, batch, pad_id, pooling, device).cpu()
    finally:
        model.train(was_training)
    return out


def _pool_batch(decoder, token_lists: list[list[int]], pad_id: int, pooling: str, device) -> "torch.Tensor":
    """One right-padded forward pass; padding never reaches a real token (causal attention plus
    the mask) and is excluded from the mean."""
    import torch

    lengths = torch.tensor([len(ids) for ids in token_lists])
    width = int(lengths.max())
    input_ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    for row, ids in enumerate(token_lists):
        input_ids[row, :len(ids)] = torch.tensor(ids)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    out = decoder(input_ids=input_ids.to(device), attention_mask=mask.long().to(device), use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return pool(hidden, lengths.to(device), pooling)


def check_pooling(pooling: str) -> None:
    """Raises ConfigError for a pooling other than ``mean`` / ``last``."""
    if pooling not in ("mean", "last"):
        raise ConfigError(f"unknown pooling {pooling!r}", hint="use 'mean' or 'last'")


def pool(hidden: "torch.Tensor", lengths: "torch.Tensor", pooling: Pooling = "mean") -> "torch.Tensor":
    """One vector per right-padded row, float32 ``[B, H]``, of final hidden states ``[B, T, H]``.

    ``lengths`` ``[B]``: real tokens per row (the rest is padding, never pooled). ``mean``: the
    average over the real tokens; ``last``: the state of the last real token. Differentiable
    (training pools with this too)."""
    import torch

    hidden = hidden.float()
    if pooling == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    mask = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]
    return (hidden * mask[..., None]).sum(dim=1) / lengths[:, None].to(hidden.dtype)


def exact_search(query_vecs: "torch.Tensor", index_vecs: "torch.Tensor", k: int = 10) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Top-``k`` inner products of each query against the whole index: ``(scores, indices)``,
    both ``[num_queries, min(k, index size)]``, best first. For L2-normalised vectors (what
    :func:`embed` returns) the score is the cosine similarity."""
    import torch

    k = min(k, index_vecs.shape[0])
    scores = [query_vecs.new_empty(0, k)]
    indices = [torch.empty(0, k, dtype=torch.long, device=query_vecs.device)]
    for start in range(0, query_vecs.shape[0], QUERY_BLOCK):
        block = query_vecs[start:start + QUERY_BLOCK] @ index_vecs.T
        s, i = block.topk(k, dim=1)
        scores.append(s)
        indices.append(i)
    return torch.cat(scores), torch.cat(indices)


def search(query_vecs_full: "torch.Tensor", index_full: "torch.Tensor", k: int = 10, shortlist_dim: int = 64,
           shortlist: int = 100, *, index_prefix: "torch.Tensor | None" = None) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Coarse-to-fine search: shortlist with the ``shortlist_dim`` prefix, rerank with full vectors.

    Args:
        query_vecs_full: ``[Q, H]`` full query embeddings (``embed(..., dim=None)``).
        index_full: ``[N, H]`` full index embeddings.
        k: results per query.
        shortlist_dim: prefix size of the coarse pass (prefixes are re-normalised, as
            ``embed(..., dim=shortlist_dim)`` would return them).
        shortlist: candidates per query kept for the full-width rerank.
        index_prefix: the index's ``[N, shortlist_dim]`` normalised prefix, if already computed
            (store it once: it is the small index that the coarse pass scans).

    Returns:
        ``(scores, indices)``, ``[Q, min(k, shortlist, N)]``: full-width inner products and row
        numbers of ``index_full``, best first. With ``shortlist >= N`` this is exactly
        :func:`exact_search`.
    """
    import torch

    if index_prefix is None:
        index_prefix = nested_prefix(index_full, shortlist_dim)
    _, candidates = exact_search(nested_prefix(query_vecs_full, shortlist_dim), index_prefix, k=shortlist)
    keep = min(k, candidates.shape[1])
    scores = [query_vecs_full.new_empty(0, keep)]
    indices = [candidates.new_empty(0, keep)]
    for start in range(0, candidates.shape[0], RERANK_BLOCK):
        block = candidates[start:start + RERANK_BLOCK]
        # [q, S, H] gathered candidate vectors, scored with the full width.
        full_scores = torch.einsum("qh,qsh->qs", query_vecs_full[start:start + RERANK_BLOCK], index_full[block])
        s, order = full_scores.topk(keep, dim=1)
        scores.append(s)
        indices.append(block.gather(1, order))
    return torch.cat(scores), torch.cat(indices)
