"""Read raw records from where a `DatasetSpec` points: local files, folders, or the Hugging Face hub.

Every record comes with `where`, the place a user can look at: ``data.jsonl:12`` (file and 1-based
line) for jsonl / json / csv / txt, ``data.parquet: row 3`` for parquet, and
``hf:org/name[train]: row 3`` for hub datasets.

Supported files:
- ``.jsonl`` / ``.ndjson``: one JSON object per line (blank lines ignored).
- ``.json``: a list of objects, or an object whose ``data`` key holds that list.
- ``.csv``: a header row, then one record per row (a cell holding a JSON list, e.g. a chat, is decoded).
- ``.parquet``: one record per row.
- ``.txt`` / ``.md``: one ``text`` record per paragraph (paragraphs are separated by blank lines).
- a folder: its subfolder named after ``spec.split`` if there is one; else its files named after the
  split (``train.jsonl``, ``train-00000.parquet``); else every supported file in it, recursively,
  in sorted order.
Anything else that is not a local path is passed to ``datasets.load_dataset(path, name, split=split)``.
"""
from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from maximus.errors import DataError

SUPPORTED_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet", ".txt", ".md")


@dataclass
class RawRecord:
    """One record as read from a source, before its format is interpreted."""

    fields: dict
    where: str  # "file:line" or "file: row n", for error messages


@dataclass
class SourceRead:
    """All records of one spec, plus the malformed ones skipped under `on_error: skip`."""

    records: list[RawRecord] = field(default_factory=list)
    skipped: int = 0
    files: list[str] = field(default_factory=list)  # what was read, for error messages


def read_source(spec) -> SourceRead:
    """Read every record of `spec` (a `maximus.config.DatasetSpec`), in file order.

    Raises DataError for a missing path, a malformed line (unless `spec.on_error == "skip"`,
    which counts it in `skipped`), or a hub dataset that cannot be loaded."""
    path = Path(spec.path).expanduser()
    out = SourceRead()
    if path.is_dir():
        files = _files_in_folder(path, spec.split)
        if not files:
            raise DataError(f"no data files in folder {spec.path}",
                            f"put {', '.join(SUPPORTED_SUFFIXES)} files in it, or point `path:` at a file")
        for f in files:
            _read_file(f, spec.on_error, out)
        return out
    if path.is_file():
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise DataError(f"unsupported data file type '{path.suffix}': {spec.path}",
                            f"use one of {', '.join(SUPPORTED_SUFFIXES)}")
        _read_file(path, spec.on_error, out)
        return out
    if _looks_local(spec.path):
        raise DataError(f"dataset not found: {spec.path}",
                        "check the path (relative paths are resolved from the current directory)")
    return _read_hub(spec, out)


def encode_records(source: SourceRead, spec, seed: int, encode: Callable, stats: dict, summary: dict) -> list:
    """[(record.where, document)] of `source`'s records, in a seeded order, until `spec.max_samples`
    documents: `encode(record)` returns the document, or None for a record with nothing to learn
    (counted in `stats["empty"]`); a DataError it raises stops the build, or under
    `on_error: skip` counts the record in `stats["skipped"]` and `summary["skipped"]`.

    The order is seeded per source (not per list position) so that adding or reordering sources
    does not reshuffle, and resample, the others; by the source's file name, not its whole path,
    so that moving the data (or a test's temporary folder) does not change the run."""
    order = list(range(len(source.records)))
    random.Random(f"{seed}:{Path(str(spec.path)).name}:{spec.name}:{spec.split}").shuffle(order)
    documents: list = []
    for i in order:
        if spec.max_samples is not None and len(documents) >= spec.max_samples:
            break
        record = source.records[i]
        try:
            document = encode(record)
        except DataError:
            if spec.on_error != "skip":
                raise
            stats["skipped"] += 1
            summary["skipped"] += 1
            continue
        if document is None:
            stats["empty"] += 1
            continue
        documents.append((record.where, document))
    summary["documents"] = len(documents)
    return documents


def _looks_local(text: str) -> bool:
    """A path that cannot be a hub name: it has a data-file suffix, a drive, or starts like a path."""
    return (text.startswith(("/", "./", "../", "~", "\\")) or text.lower().endswith(SUPPORTED_SUFFIXES)
            or (len(text) > 1 and text[1] == ":") or text.count("/") > 1)


def _files_in_folder(folder: Path, split: str) -> list[Path]:
    if (folder / split).is_dir():
        folder = folder / split
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES)
    named = [p for p in files if p.stem == split or p.stem.startswith((f"{split}-", f"{split}_", f"{split}."))]
    return named or files


def _read_file(path: Path, on_error: str, out: SourceRead) -> None:
    out.files.append(str(path))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        records = _read_jsonl(path, on_error, out)
    elif suffix == ".json":
        records = _read_json(path)
    elif suffix == ".csv":
        records = _read_csv(path, on_error, out)
    elif suffix == ".parquet":
        records = _read_parquet(path)
    else:
        records = _read_text(path)
    out.records.extend(records)


def _read_jsonl(path: Path, on_error: str, out: SourceRead) -> Iterator[RawRecord]:
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                value = json.loads(line)
                if not isinstance(value, dict):
                    raise ValueError(f"expected a JSON object, got {type(value).__name__}")
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                if on_error == "skip":
                    out.skipped += 1
                    continue
                problem = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise DataError(f"{where}: malformed JSON: {problem}",
                                "fix the line, or set `on_error: skip` on the dataset to skip bad records") from None
            yield RawRecord(value, where)


def _read_json(path: Path) -> list[RawRecord]:
    """A JSON list (or {"data": list}); each record's line is the line its object starts on."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()

    def line_of(index: int) -> int:
        return text.count("\n", 0, index) + 1

    def skip_ws(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def fail(msg: str, index: int):
        raise DataError(f"{path}:{line_of(index)}: malformed JSON: {msg}",
                        "a .json file must hold a list of objects or {\"data\": [...]}; use .jsonl for one object per line")

    def parse_value(i: int):
        try:
            return decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            fail(f"{exc.msg} at column {exc.colno}", exc.pos)

    def parse_list(i: int) -> tuple[list[RawRecord], int]:
        records, i = [], skip_ws(i + 1)  # after '['
        if i < len(text) and text[i] == "]":
            return records, i + 1
        while True:
            start = skip_ws(i)
            value, i = parse_value(start)
            if not isinstance(value, dict):
                fail(f"expected a JSON object, got {type(value).__name__}", start)
            records.append(RawRecord(value, f"{path}:{line_of(start)}"))
            i = skip_ws(i)
            if i < len(text) and text[i] == ",":
                i += 1
            elif i < len(text) and text[i] == "]":
                return records, i + 1
            else:
                fail("expected ',' or ']' between list items", i)

    i = skip_ws(0)
    if i < len(text) and text[i] == "[":
        records, i = parse_list(i)
    elif i < len(text) and text[i] == "{":
        obj, _ = parse_value(i)  # validates the whole object first
        if not isinstance(obj.get("data"), list):
            fail(f"an object must hold its records in a 'data' list; keys are {sorted(obj)}", i)
        # Find where the "data" list starts so that records keep their line numbers.
        i, records = skip_ws(i + 1), None
        while records is None:
            key, i = parse_value(i)
            i = skip_ws(skip_ws(i) + 1)  # past ':'
            if key == "data":
                records, i = parse_list(i)
            else:
                _, i = parse_value(i)
                i = skip_ws(skip_ws(i) + 1)  # past ','
    else:
        fail("expected a list of objects or {\"data\": [...]}", i)
    return records


def _read_csv(path: Path, on_error: str, out: SourceRead) -> Iterator[RawRecord]:
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            return
        start = reader.line_num + 1
        for row in reader:
            where = f"{path}:{start}"
            start = reader.line_num + 1
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                if on_error == "skip":
                    out.skipped += 1
                    continue
                raise DataError(f"{where}: malformed CSV row: expected {len(header)} fields, got {len(row)}",
                                "quote cells that contain commas or newlines, or set `on_error: skip`")
            yield RawRecord({k: _maybe_json_list(v) for k, v in zip(header, row)}, where)


def _maybe_json_list(cell: str):
    """CSV cells are strings; a cell that holds a JSON list (a chat, say) becomes that list."""
    text = cell.strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            value = json.loads(text)
        except ValueError:
            return cell
        if isinstance(value, list):
            return value
    return cell


def _read_parquet(path: Path) -> list[RawRecord]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError family for bad files
        raise DataError(f"{path}: cannot read parquet file: {_short(exc)}", "check that the file is a complete parquet file") from None
    return [RawRecord(row, f"{path}: row {i}") for i, row in enumerate(rows, start=1)]


def _read_text(path: Path) -> list[RawRecord]:
    records: list[RawRecord] = []
    paragraph: list[str] = []
    start = 0
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                if not paragraph:
                    start = line_no
                paragraph.append(line.rstrip("\n"))
            elif paragraph:
                records.append(RawRecord({"text": "\n".join(paragraph)}, f"{path}:{start}"))
                paragraph = []
    if paragraph:
        records.append(RawRecord({"text": "\n".join(paragraph)}, f"{path}:{start}"))
    return records


def _read_hub(spec, out: SourceRead) -> SourceRead:
    label = f"hf:{spec.path}[{spec.split}]"
    out.files.append(label)
    try:
        import datasets

        dataset = datasets.load_dataset(spec.path, spec.name, split=spec.split)
    except Exception as exc:  # datasets raises ConnectionError, FileNotFoundError, ValueError, ... for the same user mistake
        raise DataError(f"dataset not found: {spec.path} (not a local file or folder, and Hugging Face datasets "
                        f"could not load it: {_short(exc)})",
                        "check the path or hub name, the `split:` and `name:` keys, and network access "
                        "(or download the dataset and point `path:` at the files)") from None
    out.records.extend(RawRecord(dict(row), f"{label}: row {i}") for i, row in enumerate(dataset, start=1))
    return out


def _short(exc: BaseException) -> str:
    """The first line of an exception message (errors must stay one line)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
