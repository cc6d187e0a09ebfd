"""Chat templates in every form checkpoints ship, picked as transformers picks them: a
`chat_template.jinja` file (first), a processor's `chat_template.json`, a string in
tokenizer_config.json, the list of named templates (the one named "default"); and
`--chat-template FILE`, which replaces whichever the checkpoint has."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.api.chat_template import ChatTemplate, read_template_file
from services.api.errors import ApiError
from shared.model_source import _hf_tokenizer
from shared.specs.base import DeploymentError
from tests.checkpoints import make_tokenizer
from tests.reference import hf_tokenizer
from tests.servers import REPO, service_env

STRING = "STRING:{% for m in messages %}{{ m['content'] }};{% endfor %}"
JINJA = "JINJA:{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
PROCESSOR = "PROCESSOR:{{ messages | length }}"
DEFAULT = ("DEFAULT:{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL_USE = "TOOL_USE:{{ tools }}"
LISTED = [{"name": "tool_use", "template": TOOL_USE}, {"name": "default", "template": DEFAULT}]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return path


@pytest.fixture()
def folder(tok_files, tmp_path):
    """A tokenizer-only folder; `set_config(chat_template)` rewrites its template entry."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_files / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


def set_config(folder, template) -> None:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    if template is None:
        cfg.pop("chat_template", None)
    else:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def template_of(folder) -> str | None:
    return _hf_tokenizer(folder, {}).chat_template


def test_string_in_tokenizer_config(folder):
    set_config(folder, STRING)
    assert template_of(folder) == STRING == hf_tokenizer(str(folder)).get_chat_template()


def test_jinja_file_takes_precedence(folder):
    set_config(folder, STRING)
    (folder / "chat_template.jinja").write_text(JINJA)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": PROCESSOR}))
    assert template_of(folder) == JINJA == hf_tokenizer(str(folder)).get_chat_template()


def test_list_of_named_templates_picks_default(folder):
    set_config(folder, LISTED)
    assert template_of(folder) == DEFAULT == hf_tokenizer(str(folder)).get_chat_template()
    # ...and it renders (this list was a TypeError at api start before).
    assert ChatTemplate(template_of(folder)).render(MESSAGES) == "DEFAULT:<user>hi<assistant>"


def test_list_without_default_refuses_chat_with_the_reason(folder):
    set_config(folder, [{"name": "tool_use", "template": TOOL_USE}, {"name": "rag", "template": STRING}])
    template = ChatTemplate(template_of(folder))
    with pytest.raises(ApiError) as info:
        template.render(MESSAGES)
    assert info.value.status == 400
    message = info.value.body()["error"]["message"]
    assert "['rag', 'tool_use']" in message and "none named 'default'" in message and "--chat-template" in message


def test_malformed_list_is_a_deployment_error(folder):
    set_config(folder, [{"template": DEFAULT}])
    with pytest.raises(DeploymentError, match=r"tokenizer_config\.json"):
        template_of(folder)
    set_config(folder, 42)
    with pytest.raises(DeploymentError, match="neither a template string"):
        template_of(folder)


def test_chat_template_json(folder):
    set_config(folder, STRING)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": PROCESSOR}))
    assert template_of(folder) == PROCESSOR
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": LISTED}))
    assert template_of(folder) == DEFAULT
    (folder / "chat_template.json").write_text(json.dumps({"something_else": 1}))
    assert template_of(folder) == STRING  # no template in it: tokenizer_config's


def test_no_template(folder):
    set_config(folder, None)
    assert template_of(folder) is None


def test_chat_template_file(tmp_path):
    (tmp_path / "t.jinja").write_text(JINJA)
    assert read_template_file(str(tmp_path / "t.jinja")) == JINJA
    with pytest.raises(ValueError, match=r"chat template file .*missing\.jinja: No such file"):
        read_template_file(str(tmp_path / "missing.jinja"))
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"broken\.jinja: line 1"):
        read_template_file(str(tmp_path / "broken.jinja"))


def test_api_refuses_a_missing_chat_template_file(folder, tmp_path):
    """`python -m services.api --chat-template FILE`: a missing file stops the api at
    start with one clear line (exit 2), before it binds anything."""
    missing = tmp_path / "nope.jinja"
    out = subprocess.run([sys.executable, "-m", "services.api", "--model", str(folder), "--chat-template", str(missing),
                          "--port", "1", "--api-addr", f"ipc://{tmp_path}/api.sock"],
                         env=service_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"chat template file {missing}: No such file or directory" in out.stderr
