"""The one redactor: remove secrets from everything that enters an output folder.

Bundles and reports get attached to public bug trackers, so a token on an
engine's command line, in its environment or in its log must never reach
them. This module is the single place that decides what a secret is; capture
writes raw tool outputs through :func:`write_redacted`, the bundle writer
passes the bundle through :func:`redact_obj`, log copies go through
:func:`copy_redacted`, and ``kvdiag redact DIR`` scans with :func:`scan_text`
using the very same rules. Every function can count what it removed into a
:class:`Tally` (kinds and counts, never values) for the report's redaction
summary.

Rules, each with the kind it is counted as:

- ``secret_flag``: the value after any command-line flag whose name contains
  key, token, secret, password, passwd, auth or credential (``--flag VALUE``
  and ``--flag=VALUE``); flags that name counts or tokenizers
  (``--max-num-batched-tokens``, ``--tokenizer``) are not secrets;
- ``secret_name``: a value next to a name that says it is secret (``HF_TOKEN``,
  anything ending in ``_TOKEN``/``_API_KEY``/``_SECRET``/``_PASSWORD``, exact
  keys such as ``token`` or ``api_key``) in ``KEY=value``, ``"key": "value"``
  and ``key: value`` forms; names are matched as whole identifiers, so
  ``max_num_batched_tokens=2048`` or ``eos_token_id`` survive;
- ``auth_header`` / ``bearer``: ``Authorization`` headers and ``Bearer`` tokens;
- ``url_userinfo``: ``user:password@`` inside URLs;
- ``private_key_block``: PEM private key blocks;
- shaped secrets wherever they appear: ``hugging_face`` (``hf_…``), ``openai``
  (``sk-…``), ``github`` (``ghp_…``, ``github_pat_…``), ``gitlab`` (``glpat-…``),
  ``aws_key_id`` (``AKIA…``), ``slack`` (``xox…-``), ``google_api`` (``AIza…``),
  ``jwt``.

Kind names are never secret-looking names themselves, so a summary
``{"github": 1}`` passes through the redactor unchanged.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar, cast

from pydantic import BaseModel

# The marker that replaces a secret. Plain letters only, so a redacted file stays well-formed and
# means the same in every syntax a bundle holds: a YAML plain scalar (``*`` would start an alias,
# ``<``/``[``/``{`` or ``:`` break block or flow scalars), a shell word (no glob, redirection or
# quoting), a JSON string, URL userinfo, HTML (escaping leaves it unchanged) and Markdown (no
# emphasis). A re-run of the scenario copy then runs with the literal value ``REDACTED``.
REDACTED = "REDACTED"
URL_REDACTED = REDACTED
# What earlier versions wrote; still recognised where bundles are loaded and scanned, so an old
# bundle counts as clean.
OLD_MARKERS = ("***REDACTED***", "***")
# The marker as a whole word (``REDACTED``, ``***REDACTED***``, ``REDACTED;``), not inside a longer word.
_MARKER_WORD = re.compile(r"(?<![A-Za-z0-9])REDACTED(?![A-Za-z0-9])")

T = TypeVar("T")


class Tally:
    """Counts of redacted values per kind (thread-safe). Never holds a value."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, kind: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[kind] += n

    def merge(self, counts: Mapping[str, int]) -> None:
        with self._lock:
            for kind, n in counts.items():
                if n:
                    self._counts[kind] += n

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._counts.items()))

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def __bool__(self) -> bool:
        return self.total > 0


_SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_API_KEY", "_APIKEY", "_SECRET", "_SECRET_KEY", "_PASSWORD", "_PASSWD",
                    "_ACCESS_KEY", "_PRIVATE_KEY", "_AUTH", "_CREDENTIALS", "_CREDENTIAL")
_SECRET_EXACT = frozenset({
    "TOKEN", "API_KEY", "APIKEY", "SECRET", "SECRET_KEY", "PASSWORD", "PASSWD", "ACCESS_KEY",
    "PRIVATE_KEY", "AUTH", "CREDENTIALS", "CREDENTIAL", "COOKIE", "SET_COOKIE",
})
# Tokenizer vocabulary names end in _TOKEN but hold things like "<s>", not credentials.
_NOT_SECRET = re.compile(r"(?:^|_)(?:BOS|EOS|PAD|UNK|SEP|CLS|MASK|IMAGE|VIDEO|AUDIO|START|END|SPECIAL)_TOKEN$")
_EMPTY_VALUES = frozenset({"", "none", "null", "true", "false", "nil", "undefined", "<none>", "''", '""'})

# Flags: a word of the flag's name containing one of these makes its value secret ...
_FLAG_SECRET_PARTS = ("key", "token", "secret", "password", "passwd", "auth", "credential")
# ... unless the word is one of these (counts, tokenizers, authorship: not credentials).
_FLAG_PLAIN_WORDS = frozenset({"tokens", "tokenizer", "tokenizers", "tokenize", "tokenization", "detokenize",
                               "author", "authors"})

# A candidate name: the last word of it must look secret-ish; is_secret_name decides.
_NAME_TAIL = (r"(?:token|api[_-]?key|secret|secret[_-]key|passw(?:or)?d|access[_-]key|private[_-]key|auth|"
              r"credentials?|cookie)")
# Values: a quoted string (escapes allowed) or a bare run up to a separator.
_VALUE = r"""(?P<val>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s"',;&)}\]>\x00]+)"""

_PRIVATE_KEY_BLOCK = re.compile(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*PRIVATE KEY)-----.*?(?:-----END (?P=kind)-----|\Z)", re.DOTALL)
_AUTH_HEADER = re.compile(
    r"""(?i)(?<![\w-])(?P<q>["']?)(?P<name>(?:proxy[-_])?authorization)(?P=q)(?P<sep>\s*[:=]\s*)"""
    r"""(?P<oq>["']?)(?:(?P<scheme>bearer|basic|token|digest|negotiate|apikey)\s+)?"""
    r"""(?P<cred>[^\s"',\x00]+)""")
_BEARER = re.compile(r"(?i)\b(?P<scheme>bearer)\s+(?!\*\*\*|REDACTED\b|tokens?\b)(?P<cred>[A-Za-z0-9._~+/\-]{4,}=*)")
_URL_CREDS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)"
                        r"(?P<userinfo>[^/?#\s:@'\"<>]+(?::[^/?#\s@'\"<>]*)?|:[^/?#\s@'\"<>]+)@")
# Anchored on the secret-ish word (fast); the callback walks back to the start of the full name.
_NAMED = re.compile(r"(?i)" + _NAME_TAIL + r"(?P<q>[\"']?)(?P<sep>\s*[:=]\s*)" + _VALUE)
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
# A flag name with a secret-ish part somewhere in it (the lookahead keeps `--port 8000` from ever
# reaching the callback); is_secret_flag decides.
_FLAG_NAME = r"(?=[A-Za-z0-9_.\-]*?(?i:key|token|secret|passw|auth|credential))[A-Za-z0-9][A-Za-z0-9_.\-]*"
# Any such flag followed by a value (`--flag VALUE`, `--flag=VALUE`, and the next item of a one-line
# list: `"--flag", "VALUE"` in JSON, `[--flag, VALUE]` in a YAML flow list).
_FLAG = re.compile(
    r"(?<![\w\-])(?P<flag>--?" + _FLAG_NAME + r")(?P<sep>=|[ \t]+|[\"']?[ \t]*,[ \t]*)(?!-|[\"']-)" + _VALUE)
# The same across a line break, in list layouts only: a YAML block list (`- --api-key` / `- VALUE`)
# and a pretty-printed JSON or Python list (`"--api-key",` / `"VALUE"`).
_FLAG_LIST_ML = re.compile(
    r"(?<![\w\-])(?P<flag>--?" + _FLAG_NAME + r")"
    r"(?P<sep>[\"']?[ \t]*,[ \t]*\r?\n[ \t]*[\"']?|[\"']?[ \t]*\r?\n[ \t]*-[ \t]+[\"']?)"
    r"(?!-)(?P<val>[^\s\"',;&)}\]>\x00]+)")
_SHAPES: list[tuple[str, str]] = [
    ("hugging_face", r"\bhf_[A-Za-z0-9]{16,}\b"),
    ("openai", r"\bsk-(?:proj-|ant-|live-|test-|svcacct-|admin-)?[A-Za-z0-9_\-]{16,}"),
    ("github", r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"),
    ("github", r"\bgithub_pat_[A-Za-z0-9_]{20,}\b"),
    ("gitlab", r"\bglpat-[A-Za-z0-9_\-]{20,}\b"),
    ("aws_key_id", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    ("slack", r"\bxox[a-z]-[A-Za-z0-9\-]{10,}"),
    ("google_api", r"\bAIza[0-9A-Za-z_\-]{35}\b"),
    ("jwt", r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
]
_SHAPE = re.compile("|".join(f"(?P<s{i}>{p})" for i, (_, p) in enumerate(_SHAPES)))
# Literal prefixes of the shapes: a line holding none of them cannot match, and substring tests are
# much cheaper than the alternation over megabytes of log.
_SHAPE_HINTS = ("hf_", "sk-", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "glpat-", "AKIA", "ASIA",
                "xox", "AIza", "eyJ")
_SHAPE_KINDS = {f"s{i}": kind for i, (kind, _) in enumerate(_SHAPES)}
# Searched in lower-cased text: much faster than an IGNORECASE alternation over megabytes of log.
_KEYWORD = re.compile(r"token|key|secret|passw|auth|cookie|credential|bearer")

KINDS = ("secret_flag", "secret_name", "auth_header", "bearer", "url_userinfo", "private_key_block",
         *dict.fromkeys(k for k, _ in _SHAPES))


def normalize_name(name: str) -> str:
    """``--hf-token`` / ``x-api-key`` / ``cfg.hf_token`` → ``HF_TOKEN`` / ``X_API_KEY`` / ``HF_TOKEN``."""
    last = name.rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9]+", "_", last).strip("_").upper()


@functools.lru_cache(maxsize=16384)
def is_secret_name(name: str) -> bool:
    """True when a variable, key or header called ``name`` holds a secret (asked for every key of every
    mapping in a bundle: the same few hundred names, cached)."""
    norm = normalize_name(name)
    if not norm:
        return False
    if norm in _SECRET_EXACT or norm in ("AUTHORIZATION", "PROXY_AUTHORIZATION"):
        return True
    if _NOT_SECRET.search(norm):
        return False
    return norm.endswith(_SECRET_SUFFIXES)


def is_secret_flag(flag: str) -> bool:
    """True when command-line flag ``flag`` (``--hf-token``, ``--db-password-file``) takes a secret.

    A flag is secret when a word of its name contains key, token, secret, password,
    passwd, auth or credential; words that name counts or tokenizers are not.
    """
    if not flag.startswith("-"):
        return False
    for word in re.split(r"[-_.]+", flag.lstrip("-").lower()):
        if word and word not in _FLAG_PLAIN_WORDS and any(p in word for p in _FLAG_SECRET_PARTS):
            return True
    return False


def _is_placeholder(value: str) -> bool:
    """A value that is no secret: empty, a ``$VAR`` reference, or a marker (this one or an old one)."""
    v = value.strip().strip("\"'")
    return (v.lower() in _EMPTY_VALUES or _MARKER_WORD.search(v) is not None or v.startswith("$")
            or set(v) <= {"*"})


def _requote(raw: str) -> str:
    """Replace a value but keep the quotes it came with, so JSON/YAML stay well-formed."""
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return f"{raw[0]}{REDACTED}{raw[0]}"
    return REDACTED


class _Pass:
    """One redaction pass over a text; counts what it replaces."""

    def __init__(self, tally: Tally | None) -> None:
        self.counts: Counter[str] = Counter()
        self.tally = tally

    def done(self) -> None:
        if self.tally is not None and self.counts:
            self.tally.merge(self.counts)

    def auth(self, m: re.Match[str]) -> str:
        if _is_placeholder(m.group("cred")):
            return m.group(0)
        self.counts["auth_header"] += 1
        start, end = m.span("cred")
        base = m.start(0)
        whole = m.group(0)
        return whole[: start - base] + REDACTED + whole[end - base:]

    def bearer(self, m: re.Match[str]) -> str:
        self.counts["bearer"] += 1
        return f"{m.group('scheme')} {REDACTED}"

    def named(self, m: re.Match[str]) -> str:
        text, start = m.string, m.start()
        while start > 0 and text[start - 1] in _NAME_CHARS:
            start -= 1
        name, val, quote = text[start:m.start("q")], m.group("val"), m.group("q")
        if quote and (start == 0 or text[start - 1] != quote):
            return m.group(0)  # `token"=` without an opening quote is not a quoted key
        norm = normalize_name(name)
        # Authorization values are handled (scheme-aware) by _AUTH_HEADER.
        if norm in ("AUTHORIZATION", "PROXY_AUTHORIZATION") or not is_secret_name(name) or _is_placeholder(val):
            return m.group(0)
        self.counts["secret_name"] += 1
        whole = m.group(0)
        return whole[: m.start("val") - m.start(0)] + _requote(val)

    def flag(self, m: re.Match[str]) -> str:
        if not is_secret_flag(m.group("flag")) or _is_placeholder(m.group("val")):
            return m.group(0)
        self.counts["secret_flag"] += 1
        return f"{m.group('flag')}{m.group('sep')}{_requote(m.group('val'))}"

    def url(self, m: re.Match[str]) -> str:
        if m.group("userinfo").lstrip(":") in (URL_REDACTED, *OLD_MARKERS):
            return m.group(0)
        self.counts["url_userinfo"] += 1
        return f"{m.group('scheme')}{URL_REDACTED}@"

    def private_key(self, m: re.Match[str]) -> str:
        if REDACTED in m.group(0)[:200]:   # already redacted (this marker or the old one)
            return m.group(0)
        self.counts["private_key_block"] += 1
        return f"-----BEGIN {m.group('kind')}----- {REDACTED}"

    def shape(self, m: re.Match[str]) -> str:
        self.counts[_SHAPE_KINDS[m.lastgroup or "s0"]] += 1
        return REDACTED

    def named_line(self, line: str) -> str:
        line = _AUTH_HEADER.sub(self.auth, line)
        line = _BEARER.sub(self.bearer, line)
        line = _NAMED.sub(self.named, line)
        return _FLAG.sub(self.flag, line)

    def text(self, s: str) -> str:
        out = s
        if "PRIVATE KEY-----" in out:
            out = _PRIVATE_KEY_BLOCK.sub(self.private_key, out)
        if "://" in out:
            out = _URL_CREDS.sub(self.url, out)
        # The name-based rules are the expensive ones; only lines naming a secret-ish word need them
        # (quoted values never span lines), which keeps multi-megabyte logs fast.
        if _KEYWORD.search(out.lower()):
            if "\n" in out:
                out = _FLAG_LIST_ML.sub(self.flag, out)
            lines = out.splitlines(keepends=True)
            for i, line in enumerate(lines):
                if _KEYWORD.search(line.lower()):
                    lines[i] = self.named_line(line)
            out = "".join(lines)
        return self.shapes(out)

    def shapes(self, s: str) -> str:
        if not any(h in s for h in _SHAPE_HINTS):
            return s
        lines = s.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if any(h in line for h in _SHAPE_HINTS):
                lines[i] = _SHAPE.sub(self.shape, line)
        return "".join(lines)


# Texts a pass left unchanged (nothing counted): a bundle holds the same frame names, paths and log
# lines many times over, and is redacted at every stage it passes. Bounded; cleared when full.
_CLEAN: set[str] = set()
_CLEAN_MAX = 200_000


def redact_text(s: str, tally: Tally | None = None) -> str:
    """Return ``s`` with every secret replaced by :data:`REDACTED` (URL credentials too).

    Idempotent: redacting twice gives the same text (and counts nothing the second time).
    """
    if not s or s in _CLEAN:
        return s
    p = _Pass(tally)
    out = p.text(s)
    p.done()
    if out == s and not p.counts:
        if len(_CLEAN) >= _CLEAN_MAX:
            _CLEAN.clear()
        _CLEAN.add(s)
    return out


def redact_shapes(s: str, tally: Tally | None = None) -> str:
    """Only the shape rules (token formats, Bearer, URL credentials).

    Safe on already-rendered markup such as HTML, where the named rules could
    not see through entity-escaped quotes.
    """
    p = _Pass(tally)
    out = _URL_CREDS.sub(p.url, s) if "://" in s else s
    out = _BEARER.sub(p.bearer, out)
    out = p.shapes(out)
    p.done()
    return out


_FLAG_ONLY = re.compile(r"--?[A-Za-z0-9][A-Za-z0-9_.\-]*")


def _redact_list(items: list[Any], tally: Tally | None) -> list[Any]:
    out: list[Any] = []
    redact_next = False
    for item in items:
        if redact_next and isinstance(item, str) and not _is_placeholder(item) and not item.startswith("-"):
            out.append(REDACTED)
            if tally is not None:
                tally.add("secret_flag")
            redact_next = False
            continue
        redact_next = False
        # argv form: ["--api-key", "X"] — the secret is the next element.
        if isinstance(item, str) and _FLAG_ONLY.fullmatch(item) and (is_secret_flag(item) or is_secret_name(item)):
            redact_next = True
        out.append(_redact_any(item, tally))
    return out


def _redact_mapping(obj: Mapping[Any, Any], tally: Tally | None) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in obj.items():
        new_key = redact_text(key, tally) if isinstance(key, str) else key
        if (isinstance(key, str) and is_secret_name(key) and isinstance(value, (str, int, float))
                and not isinstance(value, bool)):
            if isinstance(value, str) and _is_placeholder(value):
                out[new_key] = value
            else:
                out[new_key] = REDACTED
                if tally is not None:
                    tally.add("secret_name")
            continue
        out[new_key] = _redact_any(value, tally)
    return out


def _redact_any(obj: Any, tally: Tally | None) -> Any:
    if isinstance(obj, str):
        return redact_text(obj, tally)
    if isinstance(obj, BaseModel):
        data = _redact_mapping(obj.model_dump(mode="python"), tally)
        return type(obj).model_validate(data)
    if isinstance(obj, Mapping):
        return _redact_mapping(obj, tally)
    if isinstance(obj, list):
        return _redact_list(obj, tally)
    if isinstance(obj, tuple):
        return tuple(_redact_list(list(obj), tally))
    return obj


def redact_obj(obj: T, tally: Tally | None = None) -> T:
    """Redact every string in ``obj`` (dicts, lists, tuples, pydantic models), recursively.

    Dict values under a secret key (``{"HF_TOKEN": "..."}``) and argv elements
    after a secret flag (``["--api-key", "..."]``) are replaced whole; keys are
    redacted too (engine names end up as keys). Returns a new object of the
    same type; the input is not modified.
    """
    return cast(T, _redact_any(obj, tally))


def redact_argv(argv: Iterable[str], tally: Tally | None = None) -> list[str]:
    """A command line (``/proc/PID/cmdline`` split on NUL) with secret values replaced."""
    return cast(list[str], _redact_list(list(argv), tally))


# ---------------------------------------------------------------- scanning (kvdiag redact DIR)


def scan_text(text: str) -> list[tuple[int, str]]:
    """(line number, kind) of every secret the redactor would still remove from ``text``."""
    out: list[tuple[int, str]] = []
    if "PRIVATE KEY-----" in text:
        for m in _PRIVATE_KEY_BLOCK.finditer(text):
            if REDACTED not in m.group(0)[:200]:   # this marker and the old one alike
                out.append((text.count("\n", 0, m.start()) + 1, "private_key_block"))
    if "\n" in text and _KEYWORD.search(text.lower()):
        for m in _FLAG_LIST_ML.finditer(text):
            if is_secret_flag(m.group("flag")) and not _is_placeholder(m.group("val")):
                out.append((text.count("\n", 0, m.start("val")) + 1, "secret_flag"))
    for no, line in enumerate(text.splitlines(), 1):
        p = _Pass(None)
        if "://" in line:
            _URL_CREDS.sub(p.url, line)
        if _KEYWORD.search(line.lower()):
            p.named_line(line)
        p.shapes(line)
        out.extend((no, kind) for kind in sorted(p.counts))
    return out
