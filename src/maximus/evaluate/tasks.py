"""Task evaluation of a run: greedy completions of held-out examples scored by `eval.metrics`, and
the prompting baseline (`eval.few_shot`, `eval.system_prompt`).

`TaskEval(cfg, tokenizer, data)` goes back from the held-out documents to their records
(`DataSplits.eval_where`), keeps those with a prompt and an answer (`TaskExample`), picks the
K solved training examples of the prompting baseline and checks that everything fits, all before
any training. Then:

- `score(model, device)`: the metrics of the model's greedy completions, each prompt as training
  saw it (the chat template's generation prompt for chat data, the format's prompt otherwise);
- `score_prompted(model, ...)`: the same model (the base) with the K examples in front of each
  prompt: held-out loss of the answers and the same metrics, plus `few_shot` and the examples'
  row ids (`eval.prompted` in run.json).

How the K examples are shown (`Prompter`):

- chat data: the chat template applied to [system turn] + each example's turns and answer + the
  held-out conversation, with the generation prompt; a template without system turns gets the
  system text folded into the first user turn, as training does;
- prompt/completion and alpaca: `[system]\\n\\n` + each example's prompt and answer followed by a
  blank line + the held-out prompt, tokenized as training tokenizes a prompt.

The examples are the first K training documents (in the seeded order of the pipeline, so fixed by
`training.seed`) that have a prompt and an answer and are not held-out rows, nor equal to one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from maximus.errors import ConfigError, DataError

#: run.json's `metrics_note` when `eval.metrics` found no held-out example to score.
NO_PROMPT_NOTE = ("no held-out example has a prompt and an answer (plain text): eval.metrics need "
                  "prompt/completion, alpaca or chat data")


def task_metrics(e) -> list[str]:
    """`eval.metrics`, with `exact_match` added by the `eval.exact_match: N` shorthand."""
    return e.metrics + (["exact_match"] if e.exact_match and "exact_match" not in e.metrics else [])


def task_examples(e) -> int:
    """Held-out examples the task metrics generate for: `eval.exact_match: N`, else `eval.max_examples`."""
    return e.exact_match or e.max_examples


@dataclass
class TaskExample:
    """One record with something to answer: `turns` (chat: the conversation before the answer) or
    `prompt` (the format's prompt text), the `reference` answer, and the record's `columns`."""

    id: str
    reference: str
    prompt: str | None = None
    turns: list[dict] | None = None
    columns: dict = field(default_factory=dict)
    images: list[str] = field(default_factory=list)  #: image files of `turns` (vision-language data), in order

    def key(self) -> tuple:
        """What the example shows a model: two records with the same key are the same example."""
        return (self.prompt, tuple((m["role"], m["content"]) for m in self.turns or ()), self.reference)


def read_examples(specs, wanted: set[str], vision: bool = False) -> dict[str, TaskExample]:
    """The records of `specs` whose `where` is in `wanted`, as TaskExamples (records without a
    prompt and an answer, e.g. plain text, are left out). `vision`: conversations with images
    (`maximus.data.vision`), their image files resolved as training resolved them."""
    from maximus.data.formats import ChatExample, PreferenceExample, PromptCompletion, detect_format, to_example
    from maximus.data.sources import read_source

    found: dict[str, TaskExample] = {}
    for spec in specs:
        source = read_source(spec)
        if not source.records:
            continue
        fmt = detect_format(source.records[0].fields, spec, str(spec.path))
        for record in source.records:
            if record.where not in wanted:
                continue
            if vision:
                task = _image_example(record, spec, fmt)
                if task is not None:
                    found[record.where] = task
                continue
            try:
                example = to_example(record.fields, fmt, spec, record.where)
            except DataError:  # a record training skipped (on_error: skip) is not held out either
                continue
            task = None
            if isinstance(example, PromptCompletion):
                task = TaskExample(record.where, example.completion, prompt=example.prompt)
            elif isinstance(example, PreferenceExample) and isinstance(example.prompt, str) \
                    and isinstance(example.chosen, str):  # SFT on preference data learns the chosen answer
                task = TaskExample(record.where, example.chosen, prompt=example.prompt)
            elif isinstance(example, ChatExample) and len(example.messages) > 1 \
                    and example.messages[-1]["role"] == "assistant":
                task = TaskExample(record.where, example.messages[-1]["content"], turns=example.messages[:-1])
            if task is not None:
                task.columns = dict(record.fields)
                found[record.where] = task
    return found


def _image_example(record, spec, fmt: str) -> TaskExample | None:
    """A conversation with images as a TaskExample: the turns before the last assistant answer."""
    from maximus.data.chat import text_of
    from maximus.data.vision import record_conversation

    try:
        messages, paths = record_conversation(record, spec, fmt)
    except DataError:  # a record training skipped (on_error: skip) is not held out either
        return None
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        return None
    turns = messages[:-1]
    shown = sum(p["type"] == "image" for m in turns for p in m["content"])
    return TaskExample(record.where, text_of(messages[-1]["content"]), turns=turns,
                       columns=dict(record.fields), images=[str(p) for p in paths[:shown]])


class Prompter:
    """Token ids of prompts and loss rows, with or without solved examples in front."""

    def __init__(self, tokenizer):
        from maximus.data.encoding import Encoder

        self.tokenizer = tokenizer
        self.encoder = Encoder(tokenizer)

    def chat_messages(self, example: TaskExample, shots: list[TaskExample], system: str | None) -> list[dict]:
        messages = [{"role": "system", "content": system}] if system else []
        for shot in shots:
            messages += [*shot.turns, {"role": "assistant", "content": shot.reference}]
        return messages + [dict(m) for m in example.turns]

    def text_prompt(self, example: TaskExample, shots: list[TaskExample], system: str | None) -> str:
        head = f"{system}\n\n" if system else ""
        return head + "".join(f"{s.prompt}{s.reference}\n\n" for s in shots) + example.prompt

    def chat_text(self, messages: list[dict]) -> str:
        """The chat template's text of `messages` plus the generation prompt (system turns folded
        into the first user turn where the template cannot show them, as in training)."""
        from maximus.data.chat import fit_system_messages, render

        fitted, _ = fit_system_messages(self.tokenizer, messages)
        return render(self.tokenizer, fitted, add_generation_prompt=True)

    def prompt_ids(self, example: TaskExample, shots: list[TaskExample] = (), system: str | None = None) -> list[int]:
        if example.turns is not None:
            text = self.chat_text(self.chat_messages(example, list(shots), system))
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.encoder.prefix_ids + self.encoder.tokens(self.text_prompt(example, list(shots), system))

    def loss_row(self, example: TaskExample, shots: list[TaskExample], system: str | None, seq_len: int) -> dict:
        """The example as a training row, with the loss on its answer(s) only, after the shots."""
        if example.turns is not None:
            prefix = self.chat_messages(example, list(shots), system)[:-len(example.turns)]
            conversation = prefix + [dict(m) for m in example.turns] + [{"role": "assistant", "content": example.reference}]
            doc = self.encoder.chat(conversation, train_from_message=len(prefix), train_on_inputs=False)
        else:
            doc = self.encoder.prompt_completion(self.prompt_ids(example, shots, system),
                                                 self.encoder.tokens(example.reference) + [self.encoder.eos_id],
                                                 train_on_inputs=False)
        ids, labels = doc.input_ids[:seq_len], doc.labels[:seq_len]
        return {"input_ids": ids, "labels": labels, "position_ids": list(range(len(ids)))}

    def length(self, example: TaskExample, shots: list[TaskExample], system: str | None) -> int:
        return len(self.loss_row(example, shots, system, seq_len=1 << 62)["input_ids"])


class TaskEval:
    """The task metrics and prompting baseline of one run (module doc). Raises ConfigError for an
    `eval.few_shot` that cannot be met (more than the training examples, or over `seq_len`) and
    for a custom metric that cannot be imported."""

    def __init__(self, cfg, tokenizer, data):
        from maximus.evaluate.metrics import load_metrics

        e = cfg.eval
        self.tokenizer = tokenizer
        self.prompter = Prompter(tokenizer)
        self.metrics = load_metrics(task_metrics(e))
        self.max_new_tokens = e.max_new_tokens
        self.few_shot, self.system_prompt = e.few_shot, e.system_prompt
        self.seq_len = cfg.training.seq_len
        rows = data.eval or data.train
        #: the `VisionEncoder` of a vision-language run: prompts go through its processor, with the images
        self.vision = rows[0]["images"].encoder if rows and "images" in rows[0] else None
        if self.vision is not None and self.prompted:
            raise ConfigError("eval.few_shot / eval.system_prompt: the prompting baseline does not show images yet",
                              "leave them out for a vision-language model; eval.metrics and eval.prompts work")
        held = read_examples(e.dataset or cfg.datasets, set(data.eval_where), vision=self.vision is not None)
        #: every held-out example with a prompt (the prompted loss), and those the metrics generate for
        self.held_out = [held[w] for w in dict.fromkeys(data.eval_where) if w in held]
        self.examples = self.held_out[:task_examples(e)]
        self.shots: list[TaskExample] = []
        if e.prompted:
            self.shots = self._pick_shots(cfg, data)

    @property
    def enabled(self) -> bool:
        return bool(self.metrics) or self.prompted

    @property
    def prompted(self) -> bool:
        return bool(self.few_shot or self.system_prompt)

    def _pick_shots(self, cfg, data) -> list[TaskExample]:
        k = self.few_shot
        if not self.held_out:
            raise ConfigError("eval.few_shot / eval.system_prompt: no held-out example has a prompt and an answer",
                              "the prompting baseline needs prompt/completion, alpaca or chat data")
        if not k:
            return []
        held_ids = {x.id for x in self.held_out}
        held_keys = {x.key() for x in self.held_out}
        train = read_examples(cfg.datasets, set(data.train_where))
        candidates = [train[w] for w in dict.fromkeys(data.train_where)
                      if w in train and w not in held_ids and train[w].key() not in held_keys
                      and (train[w].turns is None) == (self.held_out[0].turns is None)]
        fits = self._longest_fitting(candidates[:k])
        if k > len(candidates):
            raise ConfigError(f"eval.few_shot: {k} is more than the {len(candidates)} training examples that can be "
                              f"shown (with a prompt and an answer, not held out)",
                              f"the longest that fits is eval.few_shot: {fits}")
        if fits < k:
            longest = max(self.held_out, key=lambda x: self.prompter.length(x, candidates[:k], self.system_prompt))
            n = self.prompter.length(longest, candidates[:k], self.system_prompt)
            raise ConfigError(f"eval.few_shot: {k} solved examples make held-out example {longest.id} {n} tokens, "
                              f"more than training.seq_len {self.seq_len}",
                              f"the longest that fits is eval.few_shot: {fits} (or raise training.seq_len)")
        return candidates[:k]

    def _longest_fitting(self, shots: list[TaskExample]) -> int:
        """The most of `shots` (a prefix) that keeps every held-out example within seq_len;
        examples already over seq_len alone are cut like training cuts them, so they do not count."""
        fitting = [x for x in self.held_out if self.prompter.length(x, [], self.system_prompt) <= self.seq_len]
        best = 0
        for n in range(1, len(shots) + 1):
            if any(self.prompter.length(x, shots[:n], self.system_prompt) > self.seq_len for x in fitting):
                break
            best = n
        return best

    # ---------------------------------------------------------------------------------- scoring
    def score(self, model, *, device, batch_size: int = 1, shots: list[TaskExample] = (),
              system: str | None = None, complete=None) -> dict:
        """{metric: value} of greedy completions of the held-out examples (plus `metrics_failed`
        and `metrics_note` where they apply); {} without metrics. `complete(prompts) -> texts`
        replaces the Transformers model's greedy decoding (a GGUF file in llama.cpp:
        `maximus.evaluate.deployed`)."""
        from maximus.evaluate import greedy_texts
        from maximus.evaluate.metrics import score_all

        if not self.metrics:
            return {}
        if not self.examples:
            return {**{m.name: None for m in self.metrics}, "metrics_note": NO_PROMPT_NOTE}
        if self.vision is not None:
            prompts = [self.vision.prompt(x.turns, [self.vision.load(p)[0] for p in x.images]) for x in self.examples]
        else:
            prompts = [self.prompter.prompt_ids(x, shots, system) for x in self.examples]
        if complete is not None:
            predictions = complete(prompts)
        else:
            predictions = greedy_texts(model, self.tokenizer, prompts, device=device,
                                       max_new_tokens=self.max_new_tokens, batch_size=batch_size)
        columns = {k: [x.columns.get(k) for x in self.examples] for k in dict.fromkeys(c for x in self.examples for c in x.columns)}
        values, failed = score_all(self.metrics, predictions, [x.reference for x in self.examples], columns)
        result: dict = {**values, "scored": len(self.examples),
                        "samples": [{"id": x.id, "prediction": p, "reference": x.reference}
                                    for x, p in zip(self.examples[:3], predictions)]}
        if failed:
            result["metrics_failed"] = failed
        return result

    @torch.no_grad()
    def score_prompted(self, model, *, device, dtype, batch_size: int) -> dict:
        """The base `model` prompted with the K examples (and the system prompt): held-out loss of
        every held-out answer, the metrics, `few_shot`, `system_prompt`, `examples` (the K row ids), `seconds`."""
        from maximus.evaluate import heldout_loss

        started = time.perf_counter()
        rows = [self.prompter.loss_row(x, self.shots, self.system_prompt, self.seq_len) for x in self.held_out]
        result = heldout_loss(model, rows, pad_token_id=self.tokenizer.pad_token_id, device=device, dtype=dtype,
                              batch_size=batch_size)
        result.update(self.score(model, device=device, batch_size=batch_size, shots=self.shots, system=self.system_prompt))
        result.update(few_shot=self.few_shot, system_prompt=self.system_prompt, examples=[s.id for s in self.shots],
                      seconds=round(time.perf_counter() - started, 3))
        return result


def task_eval_for_run(cfg, tokenizer, data) -> TaskEval | None:
    """The run's TaskEval, or None when it has no task metrics and no prompting baseline (or no
    evaluation, or an objective other than sft: the config refuses these keys there)."""
    e = cfg.eval
    if cfg.objective != "sft" or not e.enabled or not (task_metrics(e) or e.prompted):
        return None
    return TaskEval(cfg, tokenizer, data)
