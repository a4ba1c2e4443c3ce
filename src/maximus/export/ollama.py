"""An Ollama Modelfile for an exported GGUF: FROM, TEMPLATE (the chat template, in Go template
syntax) and the stop tokens.

Ollama renders prompts with Go templates, not Jinja. The chat template is translated by observing it:
it is rendered on conversations with sentinel contents, and from the text around each sentinel we
read each role's prefix and suffix (separately for a conversation's first message, which may
carry a BOS or a default system prompt), and the generation prompt. The pieces are then re-rendered
on other conversations and must reproduce the Jinja output exactly; a template that is not such a
per-message wrap (it reorders, counts or edits messages) is refused with a one-line error.
"""
from __future__ import annotations

from dataclasses import dataclass

from maximus.errors import ExportError

_S, _U1, _A1, _U2, _A2 = "\x02SYS\x03", "\x02USR1\x03", "\x02AST1\x03", "\x02USR2\x03", "\x02AST2\x03"


@dataclass
class ChatPieces:
    """Literal text around each message's content; `first_*` for the conversation's first message."""
    first_system: tuple[str, str]
    first_user: tuple[str, str]
    user: tuple[str, str]
    assistant: tuple[str, str]
    generation: str

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        out = []
        for i, m in enumerate(messages):
            role = m["role"]
            pre, post = (self.first_system if role == "system" else self.first_user if i == 0 and role == "user"
                         else self.user if role == "user" else self.assistant)
            out.append(pre + m["content"] + post)
        if add_generation_prompt:
            out.append(self.generation)
        return "".join(out)


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _split(segment: str, sentinel: str, what: str) -> tuple[str, str]:
    if segment.count(sentinel) != 1:
        raise ExportError(f"the chat template does not render each {what} message once, in place",
                          "Ollama needs a per-message template; use --format gguf (it keeps the Jinja template)")
    pre, post = segment.split(sentinel)
    return pre, post


def chat_pieces(tokenizer, strip_bos: bool) -> ChatPieces:
    """Read a per-message chat template into its pieces; ExportError when it is not one."""
    conv = [{"role": "system", "content": _S}, {"role": "user", "content": _U1}, {"role": "assistant", "content": _A1},
            {"role": "user", "content": _U2}, {"role": "assistant", "content": _A2}]
    try:
        chain = [_render(tokenizer, conv[:k]) for k in range(1, len(conv) + 1)]
        user_first = _render(tokenizer, conv[1:2])
        prompt = _render(tokenizer, conv[:4], add_generation_prompt=True)
    except Exception as exc:  # a template that raises on a plain conversation (e.g. no system role)
        raise ExportError(f"the chat template cannot render a system/user/assistant conversation ({exc})",
                          "use --format gguf (it keeps the Jinja template)")
    not_growing = ExportError("the chat template re-renders earlier messages when one is added",
                              "Ollama needs a per-message template; use --format gguf (it keeps the Jinja template)")
    segments, previous = [], ""
    for text in chain:
        if not text.startswith(previous):
            raise not_growing
        segments.append(text[len(previous):])
        previous = text
    if not prompt.startswith(chain[3]):
        raise not_growing
    bos = tokenizer.bos_token if strip_bos else None

    def first(pair):
        return (pair[0][len(bos):] if bos and pair[0].startswith(bos) else pair[0]), pair[1]

    pieces = ChatPieces(first_system=first(_split(segments[0], _S, "system")),
                        first_user=first(_split(user_first, _U1, "user")),
                        user=_split(segments[3], _U2, "user"), assistant=_split(segments[4], _A2, "assistant"),
                        generation=prompt[len(chain[3]):])
    checks = [([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "2+2?"}], True),
              ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}], True),
              ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)]
    for messages, gen in checks:
        expected = _render(tokenizer, messages, gen)
        if bos and expected.startswith(bos):
            expected = expected[len(bos):]
        if pieces.render(messages, gen) != expected:
            raise ExportError("the chat template is not a plain wrap of each message (a longer conversation renders "
                              "differently)", "use --format gguf (it keeps the Jinja template)")
    return pieces


def _go_literal(text: str) -> str:
    if "{{" in text or "}}" in text or '"""' in text:
        raise ExportError("the chat template's literal text contains '{{', '}}' or '\"\"\"'",
                          "Ollama's template syntax cannot hold it; use --format gguf")
    return text


def go_template(pieces: ChatPieces) -> str:
    """The pieces as an Ollama (Go text/template) TEMPLATE over .Messages. No whitespace trimming:
    every character of the pieces is literal."""
    g = _go_literal

    def wrap(pair):
        return g(pair[0]) + "{{ .Content }}" + g(pair[1])

    return ('{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}'
            '{{ if eq .Role "system" }}' + wrap(pieces.first_system)
            + '{{ else if eq .Role "user" }}{{ if eq $i 0 }}' + wrap(pieces.first_user) + '{{ else }}'
            + wrap(pieces.user) + '{{ end }}'
            + '{{ else if eq .Role "assistant" }}' + wrap(pieces.assistant) + '{{ end }}'
            + '{{ if and $last (ne .Role "assistant") }}' + g(pieces.generation) + '{{ end }}{{ end }}')


def stop_tokens(tokenizer, pieces: ChatPieces | None) -> list[str]:
    """EOS and any special token that ends an assistant turn (e.g. <|im_end|>)."""
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    if pieces is not None:
        tail = pieces.assistant[1].strip()
        specials = set(tokenizer.all_special_tokens)
        for token in sorted(specials, key=len, reverse=True):
            if tail.endswith(token) and token not in stops:
                stops.append(token)
    return stops


def modelfile(gguf_name: str, tokenizer, add_bos: bool) -> str:
    """The Modelfile text for `FROM ./gguf_name`."""
    lines = [f"FROM ./{gguf_name}", ""]
    pieces = chat_pieces(tokenizer, strip_bos=add_bos) if tokenizer.chat_template else None
    if pieces is not None:
        lines += [f'TEMPLATE """{go_template(pieces)}"""', ""]
    else:
        lines += ['TEMPLATE """{{ .Prompt }}"""', ""]
    lines += [f'PARAMETER stop "{s}"' for s in stop_tokens(tokenizer, pieces)]
    return "\n".join(lines) + "\n"
