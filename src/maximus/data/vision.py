"""Image + text conversations for vision-language models: records -> rows -> batches.

Data formats (docs/vision.md):

- chat rows whose message content is a list of parts, ``{"type": "image", "image": "cat.png"}``
  and ``{"type": "text", "text": "..."}`` (the Transformers / TRL convention); ShareGPT rows
  (``from`` / ``value``) likewise;
- an ``images`` column (`images_field`) listing the files, and ``<image>`` placeholders in the
  message text where they go (the LLaMA-Factory convention; no placeholder at all = the images
  open the first user message).

Image paths are relative to the data file. A missing or unreadable image is a one-line DataError
naming the row and the path, or, with ``on_error: skip``, the row is skipped and counted. With
``vision.image_root``, an image that resolves (links followed) outside that folder is refused the
same way before it is opened (`maximus ui` confines a browser's runs to its ``--data-root`` so).

Encoding: the processor's chat template renders the conversation; the assistant turns' spans are
found as for text chats (`maximus.data.chat.assistant_spans`); the text is cut at those spans and
each piece goes through the processor, which expands an image placeholder into the model's image
tokens (and markers) for that image. Labels are the assistant pieces' tokens; the prompt, the image
tokens and the vision markers never are (not even with ``train_on_inputs``). Rows are one
conversation each: never packed, and a row whose image tokens would not fit ``seq_len`` is an
error (cutting image tokens breaks the model), a longer text is cut after the images.

Images larger than ``vision.max_pixels`` are resized (aspect kept, bicubic) before the processor
sees them, at encoding and again, identically, at collation; ``stats["vision"]`` counts them.
Batches (`collate_vision`) are padded on the right with an attention mask, no position ids, and the
image processor's tensors (`maximus.vision.MEDIA_KEYS`) of the rows' images in order.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jinja2 import TemplateError

from maximus.data.chat import assistant_spans, text_of
from maximus.data.encoding import IGNORE_INDEX
from maximus.data.formats import detect_format
from maximus.data.sources import encode_records, read_source
from maximus.data.splits import DataSplits, eval_count
from maximus.errors import ConfigError, DataError
from maximus.vision import MEDIA_KEYS

IMAGE_PLACEHOLDER = "<image>"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
          "model": "assistant"}
#: Added tokens that belong to an image's expansion (image pads, begin/end markers, tile tags).
_VISION_TOKEN = re.compile(r"image|vision|img|fake_token|<row_\d+_col_\d+>", re.IGNORECASE)


def open_image(path: Path, max_pixels: int | None):
    """(RGB PIL image, resized?) of `path`, shrunk to at most `max_pixels` pixels (aspect kept).
    Raises OSError / ValueError from PIL for a missing or unreadable file."""
    from PIL import Image

    with Image.open(path) as im:
        image = im.convert("RGB")
    width, height = image.size
    if max_pixels is None or width * height <= max_pixels:
        return image, False
    scale = math.sqrt(max_pixels / (width * height))
    size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC), True


class VisionEncoder:
    """A processor, the image cap, and what the processor writes for an image: turns conversations
    into rows and rows' images into tensors."""

    def __init__(self, processor, max_pixels: int | None = None, train_on_inputs: bool = False,
                 image_root: str | None = None):
        self.processor = processor
        self.image_root = Path(image_root).resolve() if image_root is not None else None
        self.tokenizer = processor.tokenizer
        self.max_pixels = max_pixels
        self.train_on_inputs = train_on_inputs
        self.placeholder = self._placeholder()
        self.vision_ids = self._vision_token_ids()
        #: The processor's per-token image marks that the model reads (Gemma 3's `token_type_ids`:
        #: image tokens attend bidirectionally; Qwen2-VL's `mm_token_type_ids`: its 3-D positions),
        #: found on the first image; None for models without them (LLaVA, Idefics3).
        self.type_key: str | None = None
        self.resized = 0

    def _placeholder(self) -> str:
        """The text the chat template writes for one image part (which the processor expands)."""
        probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
        try:
            text = self.processor.apply_chat_template(probe, tokenize=False)
        except (TemplateError, ValueError, TypeError) as exc:
            raise DataError(f"the processor's chat template cannot render an image part: {str(exc).splitlines()[0]}",
                            "give the model a chat template that writes image parts") from None
        for candidate in (getattr(self.processor, "boi_token", None), getattr(self.processor, "image_token", None),
                          IMAGE_PLACEHOLDER):
            if candidate and candidate in text:
                return candidate
        raise DataError("the processor's chat template writes no image token for an image part",
                        "use the model's own chat template (it must write the processor's image token)")

    def _vision_token_ids(self) -> set[int]:
        ids = {getattr(self.processor, "image_token_id", None)}
        for token_id, token in self.tokenizer.added_tokens_decoder.items():
            if _VISION_TOKEN.search(str(token)):
                ids.add(int(token_id))
        return {i for i in ids if i is not None}

    def load(self, path: str):
        """(RGB image, resized?) of the file `path`. Raises DataError for a file outside
        `image_root`, OSError / ValueError for one that cannot be read."""
        if self.image_root is not None and not Path(path).resolve().is_relative_to(self.image_root):
            raise DataError(f"image {path} is outside vision.image_root {self.image_root}",
                            "put the images under that folder, or change vision.image_root")
        image, resized = open_image(Path(path), self.max_pixels)
        return image, resized

    def _type_ids(self, out) -> list[int] | None:
        if self.type_key is None:
            names = set(self.processor.model_input_names)
            self.type_key = next((k for k in ("token_type_ids", "mm_token_type_ids")
                                  if k in out and k in names and any(out[k][0])), None)
        return list(out[self.type_key][0]) if self.type_key in out else None

    def _tokens(self, pieces: list[tuple[str, bool]], images: list) -> tuple[list[int], list[int], list[int]]:
        """(input_ids, labels, image marks) of text pieces (text, trainable) whose placeholders take
        `images` in order; the processor expands a piece's placeholders into the image tokens."""
        proc = self.processor
        ids: list[int] = []
        labels: list[int] = []
        types: list[int] = []
        remaining = list(images)
        for text, trainable in pieces:
            if not text:
                continue
            k = text.count(self.placeholder)
            if k:
                out = proc(text=[text], images=[remaining[:k]], add_special_tokens=False)
                piece = list(out["input_ids"][0])
                types += self._type_ids(out) or [0] * len(piece)
                remaining = remaining[k:]
            else:
                piece = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                types += [0] * len(piece)
            ids += piece
            keep = trainable or self.train_on_inputs
            labels += [t if keep and t not in self.vision_ids else IGNORE_INDEX for t in piece]
        if remaining:
            raise ValueError(f"{len(images)} images but the template wrote {len(images) - len(remaining)} image tokens")
        return ids, labels, types

    def encode(self, messages: list[dict], images: list) -> tuple[list[int], list[int], list[int]]:
        """(input_ids, labels, image marks) of one conversation whose image parts are `images`
        (PIL, in order); the labels are the assistant spans' tokens, never an image token."""
        full = self.processor.apply_chat_template(messages, tokenize=False)
        spans = assistant_spans(self.processor, messages, full)
        pieces, cursor = [], 0
        for start, end in spans:
            pieces += [(full[cursor:start], False), (full[start:end], True)]
            cursor = end
        pieces.append((full[cursor:], False))
        return self._tokens(pieces, images)

    def prompt(self, messages: list[dict], images: list) -> dict:
        """Model inputs (batch of one) to generate the assistant's reply to `messages`: the chat
        template with its generation prompt, the image tokens and the image tensors."""
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids, _, types = self._tokens([(text, False)], images)
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        if images:
            inputs.update(self.pixel_tensors([images]))
        if self.type_key is not None:
            inputs[self.type_key] = torch.tensor([types])
        return inputs

    def prompt_for(self, prompt) -> dict:
        """`prompt` (a string, or a `maximus.config.ImagePrompt`: images, then text) as one user
        turn, the model inputs of `prompt`. Raises ConfigError for an image that cannot be read."""
        files = [] if isinstance(prompt, str) else prompt.images
        text = prompt if isinstance(prompt, str) else prompt.text
        images = []
        for file in files:
            try:
                images.append(self.load(file)[0])
            except (OSError, ValueError) as exc:
                reason = "no such file" if not Path(file).exists() else str(exc).splitlines()[0]
                raise ConfigError(f"eval.prompts: cannot read image {file}: {reason}",
                                  "image paths of eval.prompts are relative to the working directory") from None
        content = [{"type": "image", "image": f} for f in files] + [{"type": "text", "text": text}]
        return self.prompt([{"role": "user", "content": content}], images)

    def pixel_tensors(self, per_row: list[list]) -> dict[str, torch.Tensor]:
        """The image processor's tensors for rows of PIL images, in row order (rows without images
        are left out)."""
        per_row = [images for images in per_row if images]
        if not per_row:
            return {}
        outs = [self.processor.image_processor(images=[images], return_tensors="pt") for images in per_row]
        batch: dict[str, torch.Tensor] = {}
        for key in MEDIA_KEYS:
            tensors = [o[key] for o in outs if key in o]
            if not tensors:
                continue
            if tensors[0].ndim >= 4:  # Idefics3: (1, tiles, ...) per row; pad the tile axis with empty tiles
                most = max(t.shape[1] for t in tensors)
                tensors = [torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, most - t.shape[1])) for t in tensors]
            batch[key] = torch.cat(tensors, dim=0)
        return batch

    def pixel_inputs(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """The image processor's tensors for every image of `rows`, in row order."""
        return self.pixel_tensors([[self.load(p)[0] for p in row["images"].paths] for row in rows])


@dataclass
class RowImages:
    """The image files of one row and the encoder that turns them into tensors at collation."""

    paths: list[str]
    encoder: VisionEncoder = field(repr=False)
    where: str = ""  #: the record (`data.jsonl:3`), for evaluation to go back to it
    token_types: list[int] | None = None  #: the processor's image marks per token (`VisionEncoder.type_key`)


def collate_vision(rows: list[dict], pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `labels`, `attention_mask`, and the image tensors of the rows."""
    longest = max(len(r["input_ids"]) for r in rows)
    if pad_to_multiple_of and pad_to_multiple_of > 1:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row["labels"])
        attention_mask[i, :n] = 1
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    encoder = next((r["images"].encoder for r in rows), None)
    if encoder is not None:
        batch.update(encoder.pixel_inputs(rows))
        if encoder.type_key is not None:
            types = torch.zeros((len(rows), longest), dtype=torch.long)
            for i, row in enumerate(rows):
                marks = row["images"].token_types or []
                types[i, :len(marks)] = torch.tensor(marks, dtype=torch.long)
            batch[encoder.type_key] = types
    return batch


# ------------------------------------------------------------------------------------- records
def _parts(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise DataError(f"{where}: message content must be a string or a list of parts, got {type(content).__name__}",
                        'use [{"type": "image", "image": "file.png"}, {"type": "text", "text": "..."}]')
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            path = part.get("image", part.get("path", part.get("url")))
            if not isinstance(path, str) or not path:
                raise DataError(f"{where}: an image part names no file", 'write {"type": "image", "image": "file.png"}')
            parts.append({"type": "image", "image": path})
        else:
            raise DataError(f"{where}: unknown message part {part!r:.60}", 'parts are {"type": "text", "text": ...} '
                            'or {"type": "image", "image": "file.png"}')
    return parts


def conversation(fields: dict, spec, fmt: str, where: str) -> list[dict]:
    """The record's messages with list-of-parts contents, image paths as written in the data.
    An `images` column fills the `<image>` placeholders in order."""
    key = spec.messages_field or ("conversations" if fmt == "sharegpt" else "messages")
    raw = fields.get(key)
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: field '{key}' must be a non-empty list of messages", "set messages_field")
    messages = []
    for m in raw:
        if not isinstance(m, dict):
            raise DataError(f"{where}: a message must be a mapping, got {type(m).__name__}", "fix the record")
        role = _ROLES.get(str(m.get("role", m.get("from", ""))).lower())
        if role is None:
            raise DataError(f"{where}: unknown role {m.get('role', m.get('from'))!r}", "roles: system, user, assistant")
        messages.append({"role": role, "content": _parts(m.get("content", m.get("value", "")), where)})
    column = fields.get(spec.images_field)
    if column is None:
        return messages
    files = [column] if isinstance(column, str) else list(column)
    if not all(isinstance(f, str) for f in files):
        raise DataError(f"{where}: field '{spec.images_field}' must list image file names", "e.g. \"images\": [\"cat.png\"]")
    placed = 0
    for m in messages:
        new = []
        for part in m["content"]:
            if part["type"] != "text" or IMAGE_PLACEHOLDER not in part["text"]:
                new.append(part)
                continue
            for i, piece in enumerate(part["text"].split(IMAGE_PLACEHOLDER)):
                if i:
                    if placed >= len(files):
                        raise DataError(f"{where}: more {IMAGE_PLACEHOLDER} placeholders than the {len(files)} images "
                                        f"in '{spec.images_field}'", "one placeholder per image")
                    new.append({"type": "image", "image": files[placed]})
                    placed += 1
                if piece:
                    new.append({"type": "text", "text": piece})
        m["content"] = new
    if placed == 0 and files:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise DataError(f"{where}: images but no user message to show them in", "add a user turn")
        first_user["content"] = [{"type": "image", "image": f} for f in files] + first_user["content"]
    elif placed != len(files):
        raise DataError(f"{where}: {len(files)} images in '{spec.images_field}' but {placed} {IMAGE_PLACEHOLDER} "
                        "placeholders", "one placeholder per image, or none (the images open the first user turn)")
    return messages


def _image_paths(messages: list[dict], base: Path) -> list[Path]:
    out = []
    for m in messages:
        for part in m["content"]:
            if part["type"] == "image":
                p = Path(part["image"]).expanduser()
                out.append(p if p.is_absolute() else base / p)
    return out


# ------------------------------------------------------------------------------------- datasets
def build_vision_datasets(cfg, processor, *, eval_split: float, model_name: str | None = None, specs=None):
    """`DataSplits` of image + text conversations for a vision-language model (see the module
    docstring), from `specs` (default: `cfg.datasets`). Raises DataError for a text format, a bad
    record or image (unless on_error: skip),
    a row whose image tokens pass seq_len, and an empty dataset."""
    seq_len = cfg.training.seq_len
    encoder = VisionEncoder(processor, cfg.vision.max_pixels, cfg.training.train_on_inputs, cfg.vision.image_root)
    stats = {"records": 0, "skipped": 0, "empty": 0, "documents": 0, "truncated": 0, "split": 0,
             "chat_template_fallback": False, "sources": [], "packing": False,
             "vision": {"images": 0, "resized": 0, "max_pixels": cfg.vision.max_pixels}}
    documents: list[dict] = []
    specs = cfg.datasets if specs is None else specs
    for spec in specs:
        documents += _read_vision_spec(spec, encoder, seq_len, cfg.training.seed, stats, model_name or cfg.model)
    if not documents:
        raise DataError(f"dataset is empty after filtering: {', '.join(str(s.path) for s in specs)} "
                        f"({stats['records']} records read, {stats['skipped']} skipped, {stats['empty']} with "
                        "nothing to learn)", "check the files, the image paths and the assistant turns")
    random.Random(cfg.training.seed).shuffle(documents)
    n_eval = eval_count(len(documents), eval_split)
    evaluation, train = documents[:n_eval], documents[n_eval:]
    count = lambda rows, what: sum(len(r[what]) if what == "input_ids" else  # noqa: E731
                                   sum(t != IGNORE_INDEX for t in r["labels"]) for r in rows)
    stats.update(documents=len(documents), train_documents=len(train), eval_documents=len(evaluation),
                 rows=len(train), eval_rows=len(evaluation), tokens=count(train, "input_ids"),
                 eval_tokens=count(evaluation, "input_ids"), loss_tokens=count(train, "labels"),
                 eval_loss_tokens=count(evaluation, "labels"), dropped_rows=0,
                 fill=round(count(train, "input_ids") / (len(train) * seq_len), 4) if train else 0.0)
    stats["vision"]["resized"] = encoder.resized
    return DataSplits(train, evaluation, stats, train_where=[r["images"].where for r in train],
                      eval_where=[r["images"].where for r in evaluation])


def _read_vision_spec(spec, encoder: VisionEncoder, seq_len: int, seed: int, stats: dict, model: str) -> list[dict]:
    source = read_source(spec)
    summary = {"path": str(spec.path), "format": spec.format, "records": len(source.records) + source.skipped,
               "skipped": source.skipped, "documents": 0}
    stats["records"] += summary["records"]
    stats["skipped"] += source.skipped
    stats["sources"].append(summary)
    if not source.records:
        return []
    fmt = detect_format(source.records[0].fields, spec, str(spec.path))
    summary["format"] = fmt
    if fmt not in ("chat", "sharegpt"):
        raise DataError(f"{spec.path}: format {fmt} cannot carry images, and {model} is a vision-language model: it "
                        "needs format: chat (messages whose content lists image and text parts) or sharegpt",
                        "write messages with {\"type\": \"image\", \"image\": \"file.png\"} parts, or an images "
                        "column with <image> placeholders (docs/vision.md)")
    encode = lambda record: _encode_record(record, spec, fmt, encoder, seq_len, stats)  # noqa: E731
    return [row for _, row in encode_records(source, spec, seed, encode, stats, summary)]


def record_conversation(record, spec, fmt: str) -> tuple[list[dict], list[Path]]:
    """(messages with list-of-parts contents, the image files in order, resolved against the
    data file's folder) of one record. Raises DataError for a malformed record."""
    where = record.where
    messages = conversation(record.fields, spec, fmt, where)
    base = Path(where.rsplit(":", 1)[0]).parent if ":" in where else Path(str(spec.path)).parent
    return messages, _image_paths(messages, base)


def _encode_record(record, spec, fmt: str, encoder: VisionEncoder, seq_len: int, stats: dict) -> dict | None:
    where = record.where
    messages, paths = record_conversation(record, spec, fmt)
    images = []
    for path in paths:
        try:
            image, resized = encoder.load(str(path))
        except DataError as exc:  # outside vision.image_root
            raise DataError(f"{where}: {exc.message}", exc.hint) from None
        except (OSError, ValueError) as exc:
            reason = "no such file" if not path.exists() else str(exc).splitlines()[0]
            raise DataError(f"{where}: cannot read image {path}: {reason}",
                            "image paths are relative to the data file; fix it, or set on_error: skip") from None
        encoder.resized += resized
        images.append(image)
    try:
        ids, labels, types = encoder.encode(messages, images)
    except (TemplateError, ValueError) as exc:
        raise DataError(f"{where}: cannot tokenize record: {str(exc).strip().splitlines()[0]}",
                        "fix the record, or set on_error: skip") from None
    if len(ids) > seq_len:
        last_image = max((i for i, t in enumerate(ids) if t in encoder.vision_ids), default=-1)
        if last_image >= seq_len:
            raise DataError(f"{where}: the image tokens reach token {last_image + 1}, past training.seq_len={seq_len}",
                            "raise training.seq_len or lower vision.max_pixels")
        ids, labels, types = ids[:seq_len], labels[:seq_len], types[:seq_len]
        stats["truncated"] += 1
    if all(t == IGNORE_INDEX for t in labels[1:]):
        return None
    stats["vision"]["images"] += len(images)
    return {"input_ids": ids, "labels": labels,
            "images": RowImages([str(p) for p in paths], encoder, where, types if any(types) else None)}
