"""`build_datasets`: specs -> records -> examples -> documents -> shuffled split -> rows.

Order of operations (all deterministic given `seed`):
1. each spec: read every record (malformed lines error or are skipped), shuffle the records,
   interpret and tokenize them in that order until `max_samples` documents are kept; each record
   read is described for the data check (`maximus.data.records.RecordInfo`);
2. concatenate all specs' documents; with `dedupe`, drop duplicates (the first copy in file order
   stays, `maximus.data.duplicates`); with `drop_untrainable`, drop SFT documents whose trained
   tokens all lie past seq_len; then shuffle them together;
3. hold out `eval_split` of the documents (at least 1 when eval_split > 0 and there are >= 2
   documents; never all of them), before packing, so no document is in both splits;
4. pack (or truncate) each split into rows (see `maximus.data.packing`).
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Callable

from jinja2 import TemplateError

from maximus.errors import DataError

from maximus.data.encoding import IGNORE_INDEX, Document, Encoder
from maximus.data.splits import DataSplits, eval_count
from maximus.data.formats import ChatExample, PairExample, PreferenceExample, PromptCompletion, detect_format, to_example
from maximus.data.packing import RowStats, pack_documents, truncate_documents
from maximus.data.duplicates import DuplicateIndex, Fingerprint, boilerplate
from maximus.data.pairs import encode_pair, fit_pair_row
from maximus.data.prompts import check_prompt_format, encode_prompt, fit_prompt_rows, to_prompt_example
from maximus.data.preference import PreferencePair, chat_prompt_and_answers, encode_preference, fit_pair
from maximus.data.records import DEDUPED, EMPTY, EVAL, SKIPPED, TRAIN, UNTRAINABLE, RecordInfo, describe, measure
from maximus.data.sources import encode_records, read_source
from maximus.data.templates import ensure_chat_template

if TYPE_CHECKING:
    from maximus.model_source import ModelSource

OBJECTIVES = ("sft", "dpo", "contrastive", "grpo")
DEDUPE_MODES = ("off", "exact", "near")
PREVIEW_DOCUMENTS = 3  # training documents kept whole for the template preview


#: Record formats that are conversations: a run trained on one generates from chat-templated prompts.
CHAT_FORMATS = ("chat", "sharegpt")


def trains_on_chat(stats: dict) -> bool:
    """Whether a run's data (`DataSplits.stats`, or run.json's `data`) has a conversation source."""
    return any(source.get("format") in CHAT_FORMATS for source in stats.get("sources", []))


def build_datasets(specs, tokenizer, *, seq_len: int, packing: bool = True, train_on_inputs: bool = False,
                   seed: int = 0, eval_split: float = 0.05, objective: str = "sft", dedupe: str = "off",
                   drop_untrainable: bool = False) -> DataSplits:
    """Build training and evaluation rows from dataset specs.

    Args:
        specs: `maximus.config.DatasetSpec` list (a single spec is accepted too); sources are concatenated.
        tokenizer: a Transformers tokenizer with an EOS token (a fast one gives exact chat masks).
        seq_len: maximum tokens per row (per side of a preference pair).
        packing: pack SFT documents into seq_len rows (ignored for dpo: one pair per row).
        train_on_inputs: SFT loss on prompt / user tokens too.
        seed: shuffling seed.
        eval_split: fraction of documents held out, in [0, 1).
        objective: "sft" (rows of input_ids / labels / position_ids), "dpo" (preference rows),
            "contrastive" (query / positive rows, see `maximus.data.pairs`; no packing) or "grpo"
            (prompt rows, see `maximus.data.prompts`; no packing).
        dedupe: "off", "exact" or "near": drop duplicate documents, keeping the first in file order.
        drop_untrainable: drop SFT documents whose trained tokens all lie past seq_len.

    Raises DataError for missing or malformed data, and for a dataset empty after filtering.
    """
    _check_arguments(objective, seq_len, eval_split, dedupe)
    specs = list(specs) if isinstance(specs, (list, tuple)) else [specs]
    encoder = Encoder(tokenizer, train_on_inputs)
    stats = {"records": 0, "skipped": 0, "empty": 0, "documents": 0, "truncated": 0,
             "chat_template_fallback": False, "sources": []}

    documents: list = []
    infos: list[RecordInfo] = []  # the record of each document
    records: list[RecordInfo] = []  # every record read
    for index, spec in enumerate(specs):
        read = _read_spec(spec, encoder, objective, seed, stats, (index, records, seq_len, packing))
        documents.extend(document for document, _ in read)
        infos.extend(info for _, info in read)
    if dedupe != "off":
        documents, infos = _drop_duplicates(documents, infos, near=dedupe == "near")
        stats["deduped"] = sum(r.split == DEDUPED for r in records)
    if drop_untrainable and objective == "sft":
        documents, infos = _keep(documents, infos, [r.kept_loss_tokens > 0 for r in infos], UNTRAINABLE)
        stats["untrainable_dropped"] = sum(r.split == UNTRAINABLE for r in records)
    if not documents:
        paths = ", ".join(str(s.path) for s in specs)
        raise DataError(f"dataset is empty after filtering: {paths} ({stats['records']} records read, "
                        f"{stats['skipped']} skipped as malformed, {stats['empty']} with nothing to learn)",
                        "check the files, the format and field names, and max_samples")
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)  # the permutation shuffling `documents` itself would make
    documents, infos = [documents[i] for i in order], [infos[i] for i in order]
    n_eval = eval_count(len(documents), eval_split)
    eval_docs, train_docs = documents[:n_eval], documents[n_eval:]
    for k, info in enumerate(infos):
        info.split = EVAL if k < n_eval else TRAIN
    stats.update(documents=len(documents), train_documents=len(train_docs), eval_documents=len(eval_docs))

    to_rows = _row_builder(objective, seq_len, packing, seed)
    train, train_stats = to_rows(train_docs)
    evaluation, eval_stats = to_rows(eval_docs)
    stats.update(rows=train_stats.rows, eval_rows=eval_stats.rows, tokens=train_stats.tokens,
                 eval_tokens=eval_stats.tokens, loss_tokens=train_stats.loss_tokens,
                 eval_loss_tokens=eval_stats.loss_tokens, split=train_stats.split + eval_stats.split,
                 truncated=train_stats.truncated + eval_stats.truncated,
                 dropped_rows=train_stats.dropped_rows + eval_stats.dropped_rows,
                 fill=round(train_stats.tokens / (train_stats.rows * seq_len), 4) if train_stats.rows else 0.0)
    if not train:
        paths = ", ".join(str(s.path) for s in specs)
        raise DataError(f"dataset is empty after filtering: {paths}: no training row has a token in the loss "
                        f"({len(train_docs)} training documents)",
                        "check train_on_inputs, the format (is there a completion or assistant turn?) and seq_len")
    return DataSplits(train, evaluation, stats, train_where=_where(train_docs), eval_where=_where(eval_docs),
                      records=records, preview=[d for d in train_docs if isinstance(d, Document)][:PREVIEW_DOCUMENTS])


def _check_arguments(objective: str, seq_len: int, eval_split: float, dedupe: str) -> None:
    """Raise DataError for an unknown objective or dedupe mode, seq_len < 2 or eval_split outside [0, 1)."""
    if objective not in OBJECTIVES:
        raise DataError(f"unknown objective '{objective}'", f"use one of {', '.join(OBJECTIVES)}")
    if seq_len < 2:
        raise DataError(f"seq_len must be at least 2 tokens, got {seq_len}", "set training.seq_len")
    if not 0 <= eval_split < 1:
        raise DataError(f"eval_split must be in [0, 1), got {eval_split}", "set eval.split")
    if dedupe not in DEDUPE_MODES:
        raise DataError(f"unknown dedupe mode '{dedupe}'", f"set data.dedupe to one of {', '.join(DEDUPE_MODES)}")


def _row_builder(objective: str, seq_len: int, packing: bool, seed: int) -> Callable[[list], tuple[list[dict], RowStats]]:
    """The function turning one split's documents into `(rows, RowStats)` for `objective`."""
    if objective == "dpo":
        return lambda docs: _pair_rows(docs, seq_len)
    if objective == "contrastive":
        return lambda docs: _contrastive_rows(docs, seq_len)
    if objective == "grpo":
        return lambda docs: _prompt_rows(docs, seq_len)
    if packing:
        return lambda docs: pack_documents(docs, seq_len, seed)
    return lambda docs: truncate_documents(docs, seq_len)


def _drop_duplicates(documents: list, infos: list[RecordInfo], near: bool) -> tuple[list, list[RecordInfo]]:
    """Documents without the copies of earlier ones (in file order: source, then position)."""
    fingerprints = [Fingerprint.of(info.content) for info in infos]
    index = DuplicateIndex(near=near, common=boilerplate(fingerprints) if near else frozenset())
    first_order = sorted(range(len(infos)), key=lambda i: (infos[i].source, infos[i].position))
    keep = [True] * len(infos)
    for i in first_order:
        keep[i] = index.add(i, fingerprints[i]) is None
    return _keep(documents, infos, keep, DEDUPED)


def _keep(documents: list, infos: list[RecordInfo], keep: list[bool], dropped_as: str) -> tuple[list, list[RecordInfo]]:
    for info, kept in zip(infos, keep):
        if not kept:
            info.split = dropped_as
    return ([d for d, k in zip(documents, keep) if k], [info for info, k in zip(infos, keep) if k])


def _where(documents: list) -> list[str]:
    return [d.where for d in documents if isinstance(d, Document)]


def _read_spec(spec, encoder: Encoder, objective: str, seed: int, stats: dict, log: tuple) -> list[tuple]:
    """[(document, its RecordInfo)] of one spec; every record interpreted is appended to the log's
    list (log: source index, records list, seq_len, packing)."""
    source_index, described_records, seq_len, packing = log
    source = read_source(spec)
    records = source.records
    stats["records"] += len(records) + source.skipped
    stats["skipped"] += source.skipped
    summary = {"path": str(spec.path), "format": spec.format, "records": len(records) + source.skipped,
               "skipped": source.skipped, "documents": 0}
    stats["sources"].append(summary)
    if not records:
        return []
    fmt = detect_format(records[0].fields, spec, source.files[0] if len(source.files) == 1 else str(spec.path)) \
        if objective != "grpo" or spec.format != "auto" else "prompt"
    summary["format"] = fmt
    if (objective == "grpo") != (fmt == "prompt"):
        if objective == "grpo":
            check_prompt_format(fmt, spec.path)
        raise DataError(f"format prompt (prompts without answers to learn) is for objective grpo; {spec.path} is used "
                        f"with objective {objective}", "set `objective: grpo` and grpo.rewards to learn from rewards")
    if objective == "dpo" and fmt != "preference":
        raise DataError(f"objective dpo needs preference records (prompt, chosen, rejected); {spec.path} has format {fmt}",
                        "use a dataset with chosen/rejected fields, or set `format: preference` and the field names")
    if (objective == "contrastive") != (fmt == "pairs"):
        if objective == "contrastive":
            raise DataError(f"objective contrastive needs pairs records (query, positive); {spec.path} has format {fmt}",
                            "use a dataset with query/positive fields, or set `format: pairs`, query_field and positive_field")
        raise DataError(f"format pairs (query, positive) is for objective contrastive; {spec.path} is used with "
                        f"objective {objective}", "set `objective: contrastive` to train an embedding model")
    def interpret(record):
        if fmt == "prompt":
            return to_prompt_example(record.fields, spec, record.where)
        example = to_example(record.fields, fmt, spec, record.where)
        if isinstance(example, PreferenceExample) and objective == "sft":
            example = _chosen_as_sft(example)  # SFT on preference data learns the chosen answers
        return example

    def tokenize(example, where: str):
        if fmt == "prompt":
            return encode_prompt(encoder, example)
        if isinstance(example, ChatExample) or (isinstance(example, PreferenceExample) and _is_chat_pair(example)):
            stats["chat_template_fallback"] |= ensure_chat_template(encoder.tokenizer)
        return _encode(example, encoder, where)

    position = {record.where: i for i, record in enumerate(records)}
    described: dict[str, RecordInfo] = {}

    def encode(record):
        example = None
        try:
            example = interpret(record)
            document = tokenize(example, record.where)
        except DataError as exc:
            info = (describe(example, record.where, source_index, position[record.where], record.fields)
                    if example is not None else RecordInfo(record.where, source_index, position[record.where]))
            info.split, info.problem = SKIPPED, exc.message
            described_records.append(info)
            raise
        info = describe(example, record.where, source_index, position[record.where], record.fields)
        if document is not None:
            measure(info, document, seq_len, packing)
        info.split = EMPTY if document is None else TRAIN
        described_records.append(info)
        described[record.where] = info
        return document

    documents = []
    for where, document in encode_records(source, spec, seed, encode, stats, summary):
        if isinstance(document, Document):
            document.where = where
        documents.append((document, described[where]))
    return documents


def _is_chat_pair(example: PreferenceExample) -> bool:
    return any(isinstance(x, list) for x in (example.prompt, example.chosen, example.rejected))


def _encode(example, encoder: Encoder, where: str):
    """A Document, a PreferencePair, a pair row, or None when there is nothing to learn."""
    if isinstance(example, PairExample):  # cut to seq_len by _contrastive_rows
        return encode_pair(encoder.tokenizer, example)
    try:
        if isinstance(example, PreferenceExample):
            pair = encode_preference(encoder, example)
            return pair if pair.chosen.has_loss() and pair.rejected.has_loss() else None
        if getattr(example, "text", None) is not None and not example.text.strip():
            return None
        document: Document = encoder.encode(example)
    except (TemplateError, ValueError) as exc:  # the chat template rejects the conversation (raise_exception)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where}: cannot tokenize record: {message}",
                        "fix the record (e.g. roles the chat template accepts), or set `on_error: skip`") from None
    return document if document.has_loss() else None


def _chosen_as_sft(example: PreferenceExample):
    if not _is_chat_pair(example):
        return PromptCompletion(example.prompt, example.chosen, example.where)
    prompt, chosen, _ = chat_prompt_and_answers(example.prompt, example.chosen, example.rejected)
    return ChatExample(prompt + chosen, example.where)


def _pair_rows(pairs: list[PreferencePair], seq_len: int) -> tuple[list[dict], RowStats]:
    stats = RowStats()
    rows = []
    for pair in pairs:
        fitted, truncated = fit_pair(pair, seq_len)
        stats.truncated += truncated
        if not (fitted.chosen.has_loss() and fitted.rejected.has_loss()):
            stats.dropped_rows += 1
            continue
        rows.append(fitted.row())
        stats.rows += 1
        stats.tokens += len(fitted.chosen.input_ids) + len(fitted.rejected.input_ids)
        stats.loss_tokens += sum(l != IGNORE_INDEX for d in (fitted.chosen, fitted.rejected) for l in d.labels)
    return rows, stats


def _prompt_rows(rows: list[dict], seq_len: int) -> tuple[list[dict], RowStats]:
    """Prompt rows cut to their last seq_len tokens (`maximus.data.prompts.fit_prompt_rows`)."""
    fitted, truncated, tokens = fit_prompt_rows(rows, seq_len)
    return fitted, RowStats(rows=len(fitted), tokens=tokens, truncated=truncated)


def _contrastive_rows(pairs: list[dict], seq_len: int) -> tuple[list[dict], RowStats]:
    """Each (query, positive) pair as one row, each side cut to seq_len tokens (as `maximus.embed`
    cuts at max_length); `truncated` counts the pairs cut."""
    stats = RowStats()
    rows = []
    for pair in pairs:
        row, truncated = fit_pair_row(pair, seq_len)
        stats.truncated += truncated
        rows.append(row)
        stats.rows += 1
        stats.tokens += sum(len(v) for v in row.values())
    return rows, stats


def build_run_datasets(cfg, tokenizer, *, eval_split: float | None = None, objective: str | None = None,
                       source: ModelSource | None = None) -> DataSplits:
    """`build_datasets` with every setting taken from a run's `maximus.config.Config`: the one place
    that maps config keys to the pipeline, for training and for `maximus eval` alike.
    `eval_split` defaults to `eval.split` (0 when evaluation is off); `objective` to `cfg.objective`.

    With `eval.dataset` (and evaluation on) the training data is not split: every document trains,
    and the held-out rows are `eval.dataset`'s, built the same way. An `eval.dataset` that is
    missing or empty after filtering raises DataError naming it, before anything trains.

    `source`: the run's resolved model (`maximus.model_source`): a vision-language model's data is
    built with its processor. Without it (a command that reads the data but loads no model:
    `maximus plan`, `maximus data check`) the model's config.json is looked at."""
    settings = dict(seq_len=cfg.training.seq_len, packing=cfg.training.packing,
                    train_on_inputs=cfg.training.train_on_inputs, seed=cfg.training.seed,
                    objective=objective or cfg.objective, dedupe=cfg.data.dedupe,
                    drop_untrainable=cfg.data.drop_untrainable)
    held_out = cfg.eval.dataset if cfg.eval.enabled else None
    if eval_split is None:
        eval_split = cfg.eval.split if cfg.eval.enabled and not held_out else 0.0
    from maximus.vision import load_processor, model_is_vision

    vision = source.vision if source is not None else model_is_vision(cfg.model, cfg.trust_remote_code)
    if settings["objective"] == "sft" and vision:
        from maximus.data.vision import build_vision_datasets

        processor = load_processor(cfg.tokenizer or cfg.model, cfg.trust_remote_code)
        build = lambda specs, split: build_vision_datasets(cfg, processor, eval_split=split, specs=specs)  # noqa: E731
    else:
        build = lambda specs, split: build_datasets(specs, tokenizer, eval_split=split, **settings)  # noqa: E731
    if not held_out:
        return build(cfg.datasets, eval_split)
    try:
        evaluation = build(held_out, 0.0)
    except DataError as exc:
        paths = ", ".join(str(s.path) for s in held_out)
        message = exc.message.replace("training row", "row").replace(" training documents", " documents")
        raise DataError(f"eval.dataset: {message}" + ("" if paths in message else f" ({paths})"), exc.hint) from None
    splits = build(cfg.datasets, 0.0)
    e = evaluation.stats
    splits.stats.update(eval_documents=e["documents"], eval_rows=e["rows"], eval_tokens=e["tokens"],
                        eval_loss_tokens=e["loss_tokens"], eval_sources=e["sources"])
    splits.stats["chat_template_fallback"] |= e["chat_template_fallback"]
    for info in evaluation.records:  # numbered after the training sources, and held out
        info.source += len(cfg.datasets)
        info.split = EVAL if info.split == TRAIN else info.split
    return DataSplits(splits.train, evaluation.train, splits.stats, train_where=splits.train_where,
                      eval_where=evaluation.train_where, records=splits.records + evaluation.records,
                      preview=splits.preview)
