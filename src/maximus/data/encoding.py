"""Turn examples into token ids and labels (`-100` = no loss), one document each.

Rules (labels are not shifted; the trainer shifts them):
- text: `[BOS if the tokenizer adds one] + tokens + EOS`; every token is in the loss.
- prompt / completion (and alpaca): prompt and completion are tokenized separately (as at
  generation time, where the prompt is tokenized alone), `[BOS] + prompt + completion + EOS`; the
  loss covers the completion and EOS, and the prompt too when `train_on_inputs`.
- chat: the chat template's text tokenized once; the loss covers the assistant turns (see
  `maximus.data.chat`), or everything when `train_on_inputs`; EOS is appended when the text does
  not already end with it (whitespace after it aside: ChatML's `<|im_end|>\n` ends with EOS when
  EOS is `<|im_end|>`), in the loss when the last message is the assistant's.
Every document ends with EOS so that packed documents are separated the way the model will see
the end of an answer.
"""
from __future__ import annotations

from dataclasses import dataclass

from maximus.errors import DataError
from maximus.structure import IGNORE_INDEX

from maximus.data.chat import encode_chat_text
from maximus.data.formats import ChatExample, Example, PromptCompletion, TextExample


@dataclass
class Document:
    """One tokenized example: ids and unshifted labels of equal length."""

    input_ids: list[int]
    labels: list[int]
    where: str = ""  # the record it came from ("data.jsonl:12"), set by the pipeline
    dropped_turns: tuple[int, ...] = ()  # chat: messages the template left out of the text

    def has_loss(self) -> bool:
        """Whether some token after the first one is in the loss (the first one is never predicted)."""
        return any(label != IGNORE_INDEX for label in self.labels[1:])


class Encoder:
    """Tokenizes examples for one tokenizer; `train_on_inputs` puts prompts in the loss too."""

    def __init__(self, tokenizer, train_on_inputs: bool = False):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token; documents need one to mark their end",
                            "set tokenizer.eos_token (e.g. to the model's end-of-text token)")
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.train_on_inputs = train_on_inputs
        self.prefix_ids = _special_prefix(tokenizer)

    def tokens(self, text: str) -> list[int]:
        """Ids of `text` without special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, example: Example) -> Document:
        """The document for a text, prompt/completion or chat example."""
        if isinstance(example, TextExample):
            ids = self.prefix_ids + self.tokens(example.text) + [self.eos_id]
            return Document(ids, list(ids))
        if isinstance(example, PromptCompletion):
            return self.prompt_completion(self.prefix_ids + self.tokens(example.prompt),
                                          self.tokens(example.completion) + [self.eos_id])
        if isinstance(example, ChatExample):
            return self.chat(example.messages)
        raise TypeError(f"cannot encode {type(example).__name__} as one document")

    def _ends_with_eos(self, ids: list[int]) -> bool:
        """Whether the rendered conversation already ends with EOS, whitespace after it aside
        (ChatML ends every turn with `<|im_end|>\n`, and `<|im_end|>` is the EOS of Qwen, SmolLM...)."""
        for token in reversed(ids):
            if token == self.eos_id:
                return True
            if self.tokenizer.decode([token]).strip():
                return False
        return False

    def prompt_completion(self, prompt_ids: list[int], completion_ids: list[int],
                          train_on_inputs: bool | None = None) -> Document:
        everything = self.train_on_inputs if train_on_inputs is None else train_on_inputs
        prompt_labels = list(prompt_ids) if everything else [IGNORE_INDEX] * len(prompt_ids)
        return Document(prompt_ids + completion_ids, prompt_labels + list(completion_ids))

    def chat(self, messages, train_from_message: int = 0, train_on_inputs: bool | None = None) -> Document:
        """A conversation; with `train_from_message`, only assistant turns from that index are trained."""
        everything = self.train_on_inputs if train_on_inputs is None else train_on_inputs
        ids, mask, dropped = encode_chat_text(self.tokenizer, messages, train_from_message)
        if not self._ends_with_eos(ids):
            ids.append(self.eos_id)
            mask.append(messages[-1]["role"] == "assistant" and len(messages) - 1 >= train_from_message)
        labels = [tok if (everything or trainable) else IGNORE_INDEX for tok, trainable in zip(ids, mask)]
        return Document(ids, labels, dropped_turns=dropped)


def _special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (BOS for Llama, nothing for Qwen/GPT-2);
    found by comparing a probe with and without special tokens, so suffix tokens are never added."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    special = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(special) - len(plain) + 1):
        if special[start:start + len(plain)] == plain:
            return list(special[:start])
    return []
