"""The checkpoint's chat template, rendered the way transformers' `apply_chat_template` does.

The same prompt a user gets from `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)` must reach the model, or a chat model answers a conversation
it was not trained on. So this follows transformers' `_compile_jinja_template` /
`render_jinja_template`: an `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with the loop-controls extension, a no-op `{% generation %}` block
(transformers' assistant-mask tag), the globals `raise_exception`, `strftime_now`, and
a `tojson` filter that does not HTML-escape; rendered with `messages`, `tools=None`,
`documents=None`, `add_generation_prompt=True` and the `bos_token` / `eos_token` strings.

The rendered text already holds the template's special tokens (a BOS, `<|im_start|>`),
so it is sent with `add_special_tokens=False`, as transformers tokenizes it.

Templates from a checkpoint are untrusted code: the sandbox is why they can be run at all.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.api.errors import ApiError, internal_error
from shared.errors import ErrorKind

log = logging.getLogger("mstar.api.chat")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it only
    to compute an assistant-token mask for training)."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension API is a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """Compile like transformers; raises jinja2.TemplateSyntaxError on a broken template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def read_template_file(path: str) -> str:
    """`--chat-template FILE`: the file's text, which replaces the checkpoint's template.
    A missing or unreadable file, or one that does not compile, is a ValueError with a
    one-line reason (a start-up error, not a chat route that answers 500 later)."""
    try:
        source = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"chat template file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"chat template file {path}: not UTF-8 text ({exc.reason})") from None
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template file {path}: line {exc.lineno}: {exc.message}") from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template file {path}: {exc}") from None
    return source


class ChatTemplate:
    """One model's template; `render(messages)` is the prompt text for the engine."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: jinja2.Template | None = None
        self._broken: Exception | None = None
        try:
            self._template = compile_template(source)
        except jinja2.TemplateError as exc:  # keep serving the other routes; chat answers 500
            log.error("the model's chat template does not compile: %s", exc)
            self._broken = exc

    def _specials(self) -> dict[str, str]:
        """Special-token strings the template may use; an absent one stays undefined, as in
        transformers (whose special_tokens_map leaves out tokens that are None)."""
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return {k: v for k, v in specials.items() if v is not None}

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
               extra: dict[str, Any] | None = None) -> str:
        """The prompt; raises ApiError 400 when the template refuses the conversation
        (its `raise_exception`, e.g. roles that do not alternate), 500 on a template bug.
        `continue_final_message` (`/tokenize`) ends the text right after the last message's
        content, so the model would continue it, as transformers cuts it."""
        if self._template is None:
            raise internal_error("rendering the chat template (it did not compile)", self._broken)
        try:
            text = self._template.render(**(extra or {}), messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._specials())
        except jinja2.TemplateError as exc:
            raise ApiError(ErrorKind.INVALID, f"the model's chat template refused these messages: {exc}",
                           "messages") from None
        except Exception as exc:
            raise internal_error("rendering the chat template", exc) from None
        return _cut_after_final(text, messages[-1].get("content") or "") if continue_final_message else text


def _cut_after_final(text: str, final: str) -> str:
    """`text` up to the end of the final message's content (transformers'
    `continue_final_message`: trailing whitespace the template trimmed stays trimmed)."""
    at = text.rfind(final.strip())
    if at < 0:
        raise ApiError(ErrorKind.INVALID, "continue_final_message is set but the final message's content does not "
                       "appear in the rendered chat", "continue_final_message")
    if text[at:at + len(final.lstrip())] == final:
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]
