"""The user's own prompts: clean and corrupt texts, the answer, and role spans, one JSON per line.

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupt": "When Mary and John went to the store, Mary gave a drink to",
     "answer": " Mary", "roles": {"value": [5, 9], "key": [38, 42], "query": [56, 58]}}

`roles` maps key, value, query and divider (any of them; every line the same ones) to a
character span ``[start, end)`` of the clean text; the role's position is the span's *last*
token (where a causal model has read the whole span). A span must be token-aligned: it starts
where a token's text starts (its leading space aside) and ends where a token ends. Without a
``query`` span, the query is the clean text's last token. The answer must be one token (with
its leading space: ``" Paris"``); clean and corrupt must tokenize to as many tokens. Texts are
tokenized as written: no BOS unless the line holds it (``<|endoftext|>`` …) or the ``bos``
option asks for one. Blank lines are skipped; lines keep their numbers in errors.

`sample(n, seed)` returns the first n prompts in file order (the seed chooses nothing).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import HookmechError, UsageError
from ..fileio import sha256_of
from .batch import Batch
from .tokenized import TokenizerTask, text_rows
from .tokenizer import Span

FIELDS = ("clean", "corrupt", "answer", "roles")
ROLES = ("key", "value", "query", "divider")


class Prompts(TokenizerTask):
    """The prompts of the JSONL file `data` (module docstring); `data_sha256`, where given (a
    spec's record), must be the file's."""

    name = "prompts"
    roles = ROLES

    def __init__(
        self,
        data: str | None = None,
        tokenizer: str | None = None,
        tokenizer_sha256: str | None = None,
        data_sha256: str | None = None,
        bos: bool | str = False,
    ):
        super().__init__(tokenizer, tokenizer_sha256, bos)
        if data is None:
            raise UsageError("prompts: needs its file: --data FILE.jsonl (or data=FILE.jsonl)")
        path = Path(data).expanduser().resolve()
        if not path.is_file():
            raise HookmechError(f"{data}: no such prompts file")
        self.data, self.data_sha256 = path, sha256_of(path)
        if data_sha256 is not None and data_sha256 != self.data_sha256:
            raise HookmechError(
                f"{path}: its sha256 is {self.data_sha256[:12]}…, the task spec records {data_sha256[:12]}…: the "
                "prompts changed since the spec was made"
            )
        self._batch = self._read()
        self.n_rows = len(self._batch)

    @property
    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "data": str(self.data), "data_sha256": self.data_sha256, **self.tokenizer_spec()}

    @property
    def n_ctx(self) -> int:
        return int(self._batch.tokens.shape[1])

    def sample(self, n: int, seed: int | Sequence[int]) -> Batch:
        """Return the first `n` prompts (the seed chooses nothing: the rows are the file's)."""
        if n < 1:
            raise UsageError(f"prompts: number of examples must be >= 1, got {n}")
        if n > len(self._batch):
            raise UsageError(f"prompts: {self.data} holds {len(self._batch)} prompts, {n} asked (--n)")
        return self._batch.select(slice(0, n)).trimmed()

    def _read(self) -> Batch:
        """Return the file's prompts as a Batch; a HookmechError naming the line of the first problem."""
        lines: list[int] = []
        clean, corrupt, answer_texts = [], [], []
        marked: list[dict[str, Span]] = []
        for number, line in enumerate(self.data.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            prompt = self._parse(line, number)
            if marked and set(prompt["roles"]) != set(marked[0]):
                raise HookmechError(
                    f"{self.where(number)}: roles {', '.join(sorted(prompt['roles'])) or 'none'} differ from line "
                    f"{lines[0]}'s {', '.join(sorted(marked[0])) or 'none'} (every line marks the same roles)"
                )
            lines.append(number)
            clean.append(prompt["clean"])
            corrupt.append(prompt["corrupt"])
            answer_texts.append(prompt["answer"])
            marked.append(prompt["roles"])
        if not lines:
            raise HookmechError(f"{self.data}: holds no prompts")
        answers = [self._answer_id(text, lines[i]) for i, text in enumerate(answer_texts)]
        # a role's span on every line; an unmarked query is each row's last token (None)
        spans: dict[str, list[Span | None]] = {role: [row.get(role) for row in marked] for role in marked[0]}
        spans.setdefault("query", [None] * len(marked))
        return text_rows(self, clean, corrupt, answers, spans, lambda i: self.where(lines[i]))

    def where(self, line: int) -> str:
        """Return ``FILE line N``, how an error names a prompt."""
        return f"{self.data} line {line}"

    def _parse(self, line: str, number: int) -> dict[str, Any]:
        """Return one line's prompt, its spans as tuples; a HookmechError naming the line otherwise."""
        try:
            prompt = json.loads(line)
        except ValueError as error:
            raise HookmechError(f"{self.where(number)}: not valid JSON ({error})") from None
        if not isinstance(prompt, dict):
            raise HookmechError(f"{self.where(number)}: expected a JSON object with {', '.join(FIELDS)}")
        unknown = sorted(set(prompt) - set(FIELDS))
        missing = [name for name in FIELDS[:3] if not isinstance(prompt.get(name), str)]
        if unknown or missing:
            problem = f"unknown fields {unknown}" if unknown else f"{', '.join(missing)} missing or not text"
            raise HookmechError(f"{self.where(number)}: {problem} (fields: {', '.join(FIELDS)})")
        roles = prompt.get("roles", {})
        if not isinstance(roles, dict):
            raise HookmechError(f"{self.where(number)}: roles must map a role to [start, end]")
        parsed: dict[str, Span] = {}
        for role, span in roles.items():
            if role not in ROLES:
                raise HookmechError(f"{self.where(number)}: unknown role {role!r} (roles: {', '.join(ROLES)})")
            if not (isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)):
                raise HookmechError(f"{self.where(number)}: role {role!r} must be [start, end] (two integers)")
            parsed[role] = (span[0], span[1])
        return {**prompt, "roles": parsed}

    def _answer_id(self, text: str, line: int) -> int:
        """Return the answer's one token id; a HookmechError naming the line when it is not one token."""
        ids = self.text_tokenizer.encode([text])[0].ids
        if len(ids) != 1:
            pieces = " | ".join(repr(self.text_tokenizer.decode([i])) for i in ids)
            raise HookmechError(
                f"{self.where(line)}: answer {text!r} is {len(ids)} tokens ({pieces or 'none'}); it must be one token"
            )
        return ids[0]


__all__ = ["Prompts"]
