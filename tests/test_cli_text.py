"""Text through the command line and the Python API: ``mooncake-jax generate --prompt`` (text, and token ids with
``--token-ids``), ``mooncake-jax chat`` (a loop over piped user turns, the reply streamed as it is sampled, the
history kept), ``mj.LLM.stream_chat``, and the model id a gateway serves (``--served-model-name``, default the
folder's name). The CLI runs in this process through ``main(argv)``; its output is compared with ``mj.LLM``."""

import io
import json

import pytest
from test_gateway_support import FakeBackend, call_http

from mooncake_jax.cli import main
from mooncake_jax.gateway import GatewayServer
from mooncake_jax.gateway.core import default_model_name

# Short, so a whole conversation fits in two KV pages: few step shapes to compile.
TEMPLATE = ("{% for m in messages %}{{ m.role[0] }}:{{ m.content }}|{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture
def same_llm(llm, monkeypatch):
    """The CLI builds its engine with ``mj.LLM(model, ...)``: hand it the module's tiny engine (compiled once)."""
    import mooncake_jax.llm

    def build(model, **options):
        assert model == "tiny"
        return llm

    monkeypatch.setattr(mooncake_jax.llm, "LLM", build)
    return llm


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_generate_cli_takes_text_and_token_ids(same_llm, capsys):
    llm = same_llm
    assert main(["generate", "--model", "tiny", "--prompt", "Once upon", "--prompt", "a time",
                 "--max-new-tokens", "5"]) == 0
    out = json_lines(capsys.readouterr().out)
    assert out == [{"prompt": p, "text": t} for p, t in zip(["Once upon", "a time"],
                                                           llm.generate(["Once upon", "a time"], max_new_tokens=5))]
    assert main(["generate", "--model", "tiny", "--token-ids", "--prompt", "1,5,9", "--prompt", "1, 7",
                 "--max-new-tokens", "5"]) == 0
    out = json_lines(capsys.readouterr().out)
    expected = llm.generate([[1, 5, 9], [1, 7]], max_new_tokens=5)
    assert out == [{"prompt_tokens": 3, "new_tokens": expected[0]}, {"prompt_tokens": 2, "new_tokens": expected[1]}]
    assert main(["generate", "--model", "tiny", "--token-ids", "--prompt", "1,x"]) == 2
    assert "comma-separated integer token ids" in capsys.readouterr().err


def test_chat_cli_streams_each_reply_and_keeps_the_history(same_llm, template, capsys, monkeypatch):
    llm = same_llm
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n\nyo\n/exit\nnot read\n"))
    assert main(["chat", "--model", "tiny", "--chat-template", str(template), "--max-new-tokens", "3",
                 "--system", "s"]) == 0
    out = capsys.readouterr().out
    system = {"role": "system", "content": "s"}
    first = llm.chat([system, {"role": "user", "content": "hi"}], max_new_tokens=3, chat_template=template)
    second = llm.chat([system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "yo"}], max_new_tokens=3, chat_template=template)
    assert out == f"{first}\n{second}\n"  # no prompt echoed on a pipe, the empty line skipped, /exit ends it
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "--model", "tiny"]) == 2  # a preset has no chat template of its own
    assert "no chat template" in capsys.readouterr().err


def test_chat_cli_a_turn_the_template_refuses_is_dropped_not_fatal(same_llm, tmp_path, capsys, monkeypatch):
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[-1].content == 'bad' %}{{ raise_exception('no bad words') }}{% endif %}"
                      + TEMPLATE)
    monkeypatch.setattr("sys.stdin", io.StringIO("bad\nhi\n"))
    assert main(["chat", "--model", "tiny", "--chat-template", str(strict), "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert "no bad words" in captured.err
    expected = same_llm.chat([{"role": "user", "content": "hi"}], max_new_tokens=3, chat_template=strict)
    assert captured.out == f"{expected}\n"  # the refused turn left no trace in the conversation


def test_stream_chat_yields_pieces_as_sampled_and_frees_pages_when_closed(llm, template):
    messages = [{"role": "user", "content": "go"}]
    pieces = list(llm.stream_chat(messages, max_new_tokens=8, chat_template=template, ignore_eos=True))
    assert len(pieces) > 1 and "".join(pieces) == llm.chat(messages, max_new_tokens=8, chat_template=template,
                                                           ignore_eos=True)
    free = llm.engine.free_pages
    stream = llm.stream_chat(messages, max_new_tokens=8, chat_template=template, ignore_eos=True)
    next(stream)
    assert llm.scheduler.has_work  # the sequence is still running after its first piece
    stream.close()
    assert not llm.scheduler.has_work and llm.engine.free_pages == free


def test_the_served_model_id_is_the_folder_name_or_the_given_one(tmp_path):
    folder = tmp_path / "Llama-Tiny-Instruct"
    folder.mkdir()
    assert default_model_name("tiny") == "tiny"
    assert default_model_name(str(folder) + "/") == "Llama-Tiny-Instruct"
    backend = FakeBackend()
    backend.model_name = str(folder)
    for given, expected in ((None, "Llama-Tiny-Instruct"), ("my-model", "my-model")):
        with GatewayServer(backend, grpc_port=None, tokenizer="bytes", model_name=given) as gw:
            status, _, body = call_http(gw.http_port, "GET", "/v1/models")
            assert status == 200 and [m["id"] for m in body["data"]] == [expected]
