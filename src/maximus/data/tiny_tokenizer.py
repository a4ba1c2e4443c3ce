"""A small real tokenizer built offline in milliseconds, for tests and the quickstart example.

It is a byte-level BPE (GPT-2 style: any text encodes, nothing is unknown) trained with the
`tokenizers` library on a built-in English corpus (or on `texts`), wrapped in Transformers'
`PreTrainedTokenizerFast` so it saves, loads and applies chat templates like a hub tokenizer.

Special tokens (fixed ids): 0 `<|endoftext|>` (EOS), 1 `<|pad|>` (PAD), 2 `<|im_start|>`,
3 `<|im_end|>` (for ChatML templates). No BOS, no chat template unless `chat_template` is given.
Training is deterministic: the same texts and vocab_size give the same vocabulary.
"""
from __future__ import annotations

from collections.abc import Iterable

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")

_DEFAULT_CORPUS = """\
Below is an instruction that describes a task. Write a response that appropriately completes the request.
### Instruction:
### Input:
### Response:
### System:
### User:
### Assistant:
You are a helpful assistant. Answer the question in one short sentence.
The quick brown fox jumps over the lazy dog. A small model learns to count, add and reverse words.
What is the capital of France? The capital of France is Paris. What is two plus two? Two plus two is four.
Translate the sentence into French. Summarize the text. Write a poem about the sea and the sky.
The answer is 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 100 1000.
user assistant system human gpt prompt completion chosen rejected question answer good bad yes no
Once upon a time there was a little cat who lived in a house near the river with her friends.
She liked to play in the garden, read books, and watch the birds fly over the trees every morning.
Numbers, letters and punctuation: a b c d e f g h i j k l m n o p q r s t u v w x y z , . ; : ! ? ( ) [ ] { } = + - * /
"""


def build_tiny_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 512, chat_template: str | None = None):
    """Train a byte-level BPE tokenizer and return it as a `transformers.PreTrainedTokenizerFast`.

    Args:
        texts: training corpus (strings); default: a built-in English paragraph set.
        vocab_size: upper bound on the vocabulary (tokens), including the 256 byte tokens and the
            4 special tokens; the result may be smaller when the corpus has few merges to offer.
        chat_template: Jinja chat template to set (e.g. `maximus.data.templates.CHATML_TEMPLATE`);
            default None (the data pipeline then installs its fallback template).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = list(texts) if texts is not None else _DEFAULT_CORPUS.splitlines() * 4
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(CHAT_TOKENS),
    )
    tokenizer.model_max_length = 1_000_000  # no model limit; the pipeline truncates to seq_len itself
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
