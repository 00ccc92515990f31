import pytest

from phantomclip.models.prompts import (
    PromptError,
    bundled_prompts,
    encode_prompts,
    read_prompts,
)


def test_bundled_prompts():
    prompts = bundled_prompts()
    assert len(prompts) == 64 and len(set(prompts)) == 64 and all(len(p) < 120 for p in prompts)


def test_plain_and_jsonl(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("first\n\n  second  \n")
    assert read_prompts(plain) == ["first", "second"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a b"}\n{"prompt": "c", "id": 2}\n')
    assert read_prompts(jsonl) == ["a b", "c"]


@pytest.mark.parametrize(
    "content, message",
    [("", "is empty"), ("\n  \n", "is empty"), ('{"prompt": "ok"}\n{"prompt": \n', "line 2: not valid JSON"),
     ('{"text": "x"}\n', 'needs a non-empty string field "prompt"')],
)
def test_bad_files(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(PromptError, match=message):
        read_prompts(f)


def test_missing_file(tmp_path):
    with pytest.raises(PromptError, match="does not exist"):
        read_prompts(tmp_path / "none.txt")


def test_chat_template_applied(tiny):
    ids = encode_prompts(tiny.tokenizer, ["hi"])[0]
    text = tiny.tokenizer.decode(ids)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
