"""Remove secrets from everything kvdiag writes (reports, copied logs, bundles).

Reports get attached to public bug trackers, so tokens in an engine's
environment, command line or log must never reach them. Two kinds of rules:

- *named* secrets: a value next to a name that says it is secret (``HF_TOKEN``,
  anything ending in ``_TOKEN``/``_API_KEY``/``_SECRET``/``_PASSWORD``, exact
  keys such as ``token`` or ``api_key``), in ``KEY=value``, ``"key": "value"``,
  ``key: value`` and ``--flag value`` forms; ``Authorization`` headers and
  ``Bearer`` tokens; credentials inside URLs;
- *shaped* secrets: strings that look like well-known tokens wherever they
  appear (``hf_…``, ``sk-…``, ``ghp_…``, ``AKIA…``, private key blocks).

Names are matched as whole identifiers, so ``max_num_batched_tokens=2048`` or
``eos_token_id`` survive: a metric about tokens is not a secret.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar, cast

from pydantic import BaseModel

REDACTED = "***REDACTED***"

T = TypeVar("T")

_SECRET_SUFFIXES = ("_TOKEN", "_API_KEY", "_APIKEY", "_SECRET", "_SECRET_KEY", "_PASSWORD", "_PASSWD",
                    "_ACCESS_KEY", "_PRIVATE_KEY", "_AUTH", "_CREDENTIALS")
_SECRET_EXACT = frozenset({
    "TOKEN", "API_KEY", "APIKEY", "SECRET", "SECRET_KEY", "PASSWORD", "PASSWD", "ACCESS_KEY",
    "PRIVATE_KEY", "AUTH", "CREDENTIALS", "COOKIE", "SET_COOKIE",
})
# Tokenizer vocabulary names end in _TOKEN but hold things like "<s>", not credentials.
_NOT_SECRET = re.compile(r"(?:^|_)(?:BOS|EOS|PAD|UNK|SEP|CLS|MASK|IMAGE|VIDEO|AUDIO|START|END|SPECIAL)_TOKEN$")
_EMPTY_VALUES = frozenset({"", "none", "null", "true", "false", "nil", "undefined", "<none>", "''", '""'})

# A candidate name: the last word of it must look secret-ish; is_secret_name decides.
_NAME_TAIL = (r"(?:token|api[_-]?key|secret|secret[_-]key|passw(?:or)?d|access[_-]key|private[_-]key|auth|"
              r"credentials|cookie)")
# Values: a quoted string (escapes allowed) or a bare run up to a separator.
_VALUE = r"""(?P<val>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s"',;&)}\]>\x00]+)"""

_PRIVATE_KEY_BLOCK = re.compile(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*PRIVATE KEY)-----.*?(?:-----END (?P=kind)-----|\Z)", re.DOTALL)
_AUTH_HEADER = re.compile(
    r"""(?i)(?<![\w-])(?P<q>["']?)(?P<name>(?:proxy[-_])?authorization)(?P=q)(?P<sep>\s*[:=]\s*)"""
    r"""(?P<oq>["']?)(?:(?P<scheme>bearer|basic|token|digest|negotiate|apikey)\s+)?"""
    r"""(?P<cred>[^\s"',\x00]+)""")
_BEARER = re.compile(r"(?i)\b(?P<scheme>bearer)\s+(?!\*\*\*|tokens?\b)(?P<cred>[A-Za-z0-9._~+/\-]{4,}=*)")
_URL_CREDS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)"
                        r"(?P<userinfo>[^/?#\s:@'\"<>]+(?::[^/?#\s@'\"<>]*)?|:[^/?#\s@'\"<>]+)@")
# Anchored on the secret-ish word (fast); the callback walks back to the start of the full name.
_NAMED = re.compile(r"(?i)" + _NAME_TAIL + r"(?P<q>[\"']?)(?P<sep>\s*[:=]\s*)" + _VALUE)
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_FLAG = re.compile(
    r"(?i)(?<![\w\-])(?P<flag>--?(?:[A-Za-z0-9][A-Za-z0-9_\-]*?)?" + _NAME_TAIL + r")(?P<sep>\s+)(?!-)" + _VALUE)
_SHAPES = [
    re.compile(r"\bhf_[A-Za-z0-9]{16,}\b"),                    # Hugging Face
    re.compile(r"\bsk-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_\-]{16,}"),  # OpenAI / Anthropic / Stripe style
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"),             # GitHub tokens
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}\b"),
    re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}\b"),               # GitLab
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),               # AWS access key ids
    re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}\b"),          # Slack
    re.compile(r"\bAIza[0-9A-Za-z_\-]{35}\b"),                  # Google API keys
]
_SHAPE = re.compile("|".join(f"(?:{p.pattern})" for p in _SHAPES))
# Searched in lower-cased text: much faster than an IGNORECASE alternation over megabytes of log.
_KEYWORD = re.compile(r"token|key|secret|passw|auth|cookie|credential|bearer")


def normalize_name(name: str) -> str:
    """``--hf-token`` / ``x-api-key`` / ``cfg.hf_token`` → ``HF_TOKEN`` / ``X_API_KEY`` / ``HF_TOKEN``."""
    last = name.rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9]+", "_", last).strip("_").upper()


def is_secret_name(name: str) -> bool:
    """True when a variable, key, header or flag called ``name`` holds a secret."""
    norm = normalize_name(name)
    if not norm:
        return False
    if norm in _SECRET_EXACT or norm in ("AUTHORIZATION", "PROXY_AUTHORIZATION"):
        return True
    if _NOT_SECRET.search(norm):
        return False
    return norm.endswith(_SECRET_SUFFIXES)


def _is_placeholder(value: str) -> bool:
    v = value.strip().strip("\"'")
    return (v.lower() in _EMPTY_VALUES or REDACTED in v or v.startswith("$") or set(v) <= {"*"})


def _requote(raw: str) -> str:
    """Replace a value but keep the quotes it came with, so JSON/YAML stay well-formed."""
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return f"{raw[0]}{REDACTED}{raw[0]}"
    return REDACTED


def _sub_auth(m: re.Match[str]) -> str:
    cred = m.group("cred")
    if REDACTED in cred:
        return m.group(0)
    start, end = m.span("cred")
    base = m.start(0)
    whole = m.group(0)
    return whole[: start - base] + REDACTED + whole[end - base:]


def _sub_bearer(m: re.Match[str]) -> str:
    return f"{m.group('scheme')} {REDACTED}"


def _sub_named(m: re.Match[str]) -> str:
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
    whole = m.group(0)
    return whole[: m.start("val") - m.start(0)] + _requote(val)


def _sub_flag(m: re.Match[str]) -> str:
    if not is_secret_name(m.group("flag")) or _is_placeholder(m.group("val")):
        return m.group(0)
    return f"{m.group('flag')}{m.group('sep')}{_requote(m.group('val'))}"


def _redact_named_line(line: str) -> str:
    line = _AUTH_HEADER.sub(_sub_auth, line)
    line = _BEARER.sub(_sub_bearer, line)
    line = _NAMED.sub(_sub_named, line)
    return _FLAG.sub(_sub_flag, line)


def redact_text(s: str) -> str:
    """Return ``s`` with every secret replaced by ``***REDACTED***`` (URL credentials by ``***``).

    Idempotent: redacting twice gives the same text.
    """
    if not s:
        return s
    out = s
    if "PRIVATE KEY-----" in out:
        out = _PRIVATE_KEY_BLOCK.sub(lambda m: f"-----BEGIN {m.group('kind')}----- {REDACTED}", out)
    if "://" in out:
        out = _URL_CREDS.sub(lambda m: f"{m.group('scheme')}***@", out)
    # The name-based rules are the expensive ones; only lines naming a secret-ish word need them
    # (quoted values never span lines), which keeps multi-megabyte logs fast.
    if _KEYWORD.search(out.lower()):
        lines = out.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if _KEYWORD.search(line.lower()):
                lines[i] = _redact_named_line(line)
        out = "".join(lines)
    return _SHAPE.sub(REDACTED, out)


def redact_shapes(s: str) -> str:
    """Only the shape rules (token formats, Bearer, URL credentials).

    Safe on already-rendered markup such as HTML, where the named rules could
    not see through entity-escaped quotes; used there as a last line of defence.
    """
    out = _URL_CREDS.sub(lambda m: f"{m.group('scheme')}***@", s) if "://" in s else s
    out = _BEARER.sub(_sub_bearer, out)
    return _SHAPE.sub(REDACTED, out)


def _redact_list(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    redact_next = False
    for item in items:
        if redact_next and isinstance(item, str) and not _is_placeholder(item) and not item.startswith("-"):
            out.append(REDACTED)
            redact_next = False
            continue
        redact_next = False
        # argv form: ["--api-key", "X"] — the secret is the next element.
        if isinstance(item, str) and re.fullmatch(r"--?[A-Za-z0-9][A-Za-z0-9_\-]*", item) and is_secret_name(item):
            redact_next = True
        out.append(_redact_any(item))
    return out


def _redact_mapping(obj: Mapping[Any, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in obj.items():
        new_key = redact_text(key) if isinstance(key, str) else key
        if (isinstance(key, str) and is_secret_name(key) and isinstance(value, (str, int, float))
                and not isinstance(value, bool)):
            if isinstance(value, str) and _is_placeholder(value):
                out[new_key] = value
            else:
                out[new_key] = REDACTED
            continue
        out[new_key] = _redact_any(value)
    return out


def _redact_any(obj: Any) -> Any:
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, BaseModel):
        data = _redact_mapping(obj.model_dump(mode="python"))
        return type(obj).model_validate(data)
    if isinstance(obj, Mapping):
        return _redact_mapping(obj)
    if isinstance(obj, list):
        return _redact_list(obj)
    if isinstance(obj, tuple):
        return tuple(_redact_list(list(obj)))
    return obj


def redact_obj(obj: T) -> T:
    """Redact every string in ``obj`` (dicts, lists, tuples, pydantic models), recursively.

    Dict values under a secret key (``{"HF_TOKEN": "..."}``) and argv elements
    after a secret flag (``["--api-key", "..."]``) are replaced whole; keys are
    redacted too (engine names end up as keys). Returns a new object of the
    same type; the input is not modified.
    """
    return cast(T, _redact_any(obj))
