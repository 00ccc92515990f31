"""Prompt sets: the bundled 64 short prompts, or a user's file (one prompt per line, or JSONL with "prompt")."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..base.errors import PhantomclipError
from ..base.files import json_reason, special_kind


class PromptError(PhantomclipError):
    """A prompts file that is missing, empty or malformed."""


def bundled_prompts() -> list[str]:
    """The 64 varied short prompts shipped with the package."""
    text = resources.files("phantomclip").joinpath("data/prompts.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from `path`: JSONL (each line an object with a string "prompt") or plain text, one per line. With
    `limit`, only the first `limit` prompts are read (the file is streamed: diagnose --n 2 on a 500,000-line file
    reads two lines). Every refusal is one PromptError line naming the file (and line)."""
    path = Path(path)
    _check_regular(path)
    prompts: list[str] = []
    jsonl = None
    try:
        # utf-8-sig: a byte-order mark must not hide the JSON object on the first line
        with open(path, encoding="utf-8-sig") as f:
            for i, line in enumerate((line for line in f if line.strip()), 1):
                if jsonl is None:
                    jsonl = line.lstrip().startswith("{")
                prompts.append(_jsonl_prompt(path, i, line) if jsonl else _text(path, i, line.strip()))
                if limit is not None and len(prompts) >= limit:
                    break
    except UnicodeDecodeError:
        raise PromptError(f"prompts file {path} is not UTF-8 text: save it as UTF-8") from None
    except OSError as e:
        raise PromptError(f"cannot read prompts file {path} ({e.strerror}): check its permissions") from None
    if not prompts:
        raise PromptError(f"prompts file {path} is empty: put one prompt per line")
    return prompts


def _check_regular(path: Path) -> None:
    """A prompts file must be a regular file: a FIFO would block, /dev/zero never ends, and none can be hashed for
    resume's check that the prompts did not change."""
    if path.is_dir():
        raise PromptError(f"prompts file {path} is a directory: give a text file (one prompt per line) or JSONL")
    if not path.exists():
        raise PromptError(f"prompts file {path} does not exist: give a text file (one prompt per line) or JSONL")
    if not path.is_file():
        raise PromptError(f"prompts file {path} is {special_kind(path.stat().st_mode)}, not a regular file: save "
                          "the prompts to a file and give its path")


def _jsonl_prompt(path: Path, i: int, line: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptError(f"{path}, non-empty line {i}: not valid JSON ({e.msg}): one object per line") from None
    except RecursionError:
        raise PromptError(f"{path}, non-empty line {i}: JSON nested too deep: one flat object per line") from None
    except ValueError as e:  # not the decoder's: int()'s digit limit
        raise PromptError(f"{path}, non-empty line {i}: not valid JSON ({json_reason(e)}): one object per line"
                          ) from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise PromptError(f'{path}, non-empty line {i}: needs a non-empty string field "prompt"')
    return _text(path, i, row["prompt"])


def _text(path: Path, i: int, text: str) -> str:
    """`text`, refused when it is not valid Unicode: JSON's "\\ud800" escape decodes to a lone surrogate, which no
    tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{path}, non-empty line {i}: holds {text[e.start:e.end]!r}, a lone UTF-16 surrogate (not "
                          "a character): fix the escape in that line") from None
    return text


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids per prompt, through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        out = []
        for p in prompts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out
    return [tokenizer(p).input_ids for p in prompts]


def encode_within(tokenizer, prompts: list[str], max_tokens: int, limit: int,
                  what: str = "the model's context") -> list[list[int]]:
    """`encode_prompts`, refusing a prompt whose tokens plus `max_tokens` exceed `limit` (positions), before any
    engine starts. A prompt longer in characters than `limit` × the longest vocabulary entry cannot fit (no token
    covers more characters than its own string has), so it is refused before tokenizing: a 5M-character line would
    otherwise take minutes to encode."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    for text in prompts:
        if len(text) > limit * longest:
            raise PromptError(f"a prompt of {len(text):,} characters ({text[:40]!r}...) cannot fit {what} of {limit} "
                              "tokens: shorten it")
    ids = encode_prompts(tokenizer, prompts)
    for text, row in zip(prompts, ids):
        if len(row) + max_tokens > limit:
            raise PromptError(f"a prompt of {len(row)} tokens plus --max-tokens {max_tokens} exceeds {what} of {limit} "
                              f"tokens ({text[:40]!r}...): shorten the prompt or lower --max-tokens")
    return ids
