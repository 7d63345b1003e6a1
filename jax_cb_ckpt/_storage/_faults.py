"""What went wrong with a storage, told apart where the storage is known: the error
classification every stage asks, so that none outside `_storage/` needs to know which
storage engine (TensorStore, a POSIX file system) raised an error.

- `StorageError`: an operation on object storage failed (after its retries).
- `out_of_reach(e)`: the storage could not be reached (a cleanup would only wait again).
- `is_damage(e)`: a file of a step still there is not what was written (told by
  TensorStore's status code, never by the words of its message).
- `scrub(text)`, `scrubbed(e)`: an error's text without the credentials a server's
  answer may echo (S3's 403 for a wrong secret names the key id and repeats what was
  signed): every text of a storage's error that goes into one of ours goes through it.

Standard library only; any thread.
"""

from __future__ import annotations

import os
import re


class StorageError(OSError):
    """An operation on object storage failed (after TensorStore's retries)."""


# -- what a server said, without the credentials it may echo ------------------------------

_REMOVED = "(removed)"
# TensorStore's payload with the server's answer: [http_response_body='...'], the body
# C-escaped (\' and \" inside) and cut after a few hundred bytes.
_BODY = re.compile(r"\[http_response_body='((?:[^'\\]|\\.)*)'\]", re.DOTALL)
# What of a body is kept: S3's <Code> and <Message>; GCS's JSON "code", "reason",
# "message" (each scrubbed below like the rest of the text).
_KEPT_XML = re.compile(r"<(Code|Message)>([^<]*)</\1>")
_KEPT_JSON = re.compile(r'\\?"(code|reason|message)\\?"\s*:\s*(\\?"(?:[^"\\]|\\[^"])*\\?"|\d+)')
# Anywhere in a text: XML elements that hold credentials or what was signed with them
# (S3's SignatureDoesNotMatch error echoes these), closed or cut off by the truncation.
_SECRET_XML = re.compile(
    r"<(AWSAccessKeyId|AccessKeyId|SecretAccessKey|SessionToken|SecurityToken|Token|"
    r"StringToSign|StringToSignBytes|SignatureProvided|Signature|CanonicalRequest|"
    r"CanonicalRequestBytes|Authorization|Credential)>(?:.*?</\1>|[^']*)",
    re.DOTALL | re.IGNORECASE,
)
# URL query parameters and form fields of signed URLs and tokens.
_SECRET_PARAMETER = re.compile(
    r"\b(X-Amz-Credential|X-Amz-Signature|X-Amz-Security-Token|X-Goog-Credential|"
    r"X-Goog-Signature|X-Goog-Security-Token|GoogleAccessId|AWSAccessKeyId|Signature|"
    r"Credential|access_token|id_token|refresh_token|client_secret|token)=[^&\s'\"<>\\]+",
    re.IGNORECASE,
)
# HTTP headers and JSON fields that carry credentials, and bearer tokens.
_SECRET_HEADER = re.compile(
    r"\b(authorization|x-amz-security-token|x-goog-iam-authorization-token|cookie)"
    r"(\s*:\s*)[^\n'\"<>\]\\]+",
    re.IGNORECASE,
)
_SECRET_JSON = re.compile(
    r'(\\?"(?:access_token|id_token|refresh_token|token|client_secret|private_key|'
    r'private_key_id|secret|AccessKeyId|SecretAccessKey|SessionToken)\\?"\s*:\s*)'
    r'\\?"(?:[^"\\]|\\[^"])*\\?"',
    re.IGNORECASE,
)
_BEARER = re.compile(r"\b(Bearer|AWS4-HMAC-SHA256)\s+[^\s'\"<>\\]+", re.IGNORECASE)
# Credentials of the environment, wherever they appear (the shortest AWS key id has
# 16 characters; shorter values are too likely to be words of the message).
_SECRET_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
)


def scrub(text: str) -> str:
    """`text` (an error of TensorStore, what a server answered) without any credential,
    key id, token or signed URL it may carry: of a server's answer (TensorStore's
    `http_response_body` payload) only the error's code and message are kept, and
    everywhere credential-bearing XML elements, query parameters, headers, JSON
    fields, bearer tokens and the environment's own keys are replaced by
    "(removed)". The HTTP status and the error's code stay: the message still says
    what is wrong."""
    text = _BODY.sub(_kept_of_body, text)
    text = _SECRET_XML.sub(lambda m: f"<{m.group(1)}>{_REMOVED}</{m.group(1)}>", text)
    text = _SECRET_PARAMETER.sub(lambda m: f"{m.group(1)}={_REMOVED}", text)
    text = _SECRET_HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{_REMOVED}", text)
    text = _SECRET_JSON.sub(lambda m: f'{m.group(1)}"{_REMOVED}"', text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {_REMOVED}", text)
    for name in _SECRET_VARIABLES:
        value = os.environ.get(name, "")
        if len(value) >= 16:
            text = text.replace(value, _REMOVED)
    return text


def _kept_of_body(match: re.Match[str]) -> str:
    body = match.group(1)
    kept = [f"<{m.group(1)}>{m.group(2)}</{m.group(1)}>" for m in _KEPT_XML.finditer(body)]
    kept += [f"{m.group(1)}: {m.group(2)}" for m in _KEPT_JSON.finditer(body)]
    shown = " ".join(kept) + " " if kept else ""
    return f"[http_response_body='{shown}(the rest not shown: it may echo credentials)']"


def scrubbed(e: BaseException) -> BaseException:
    """`e` itself when neither its text nor that of an exception it was raised from
    (`__cause__`, `__context__`) needs `scrub`; else a `StorageError` of its scrubbed
    text, raised from nothing: a traceback prints every exception of the chain."""
    seen, link = set(), e
    clean = True
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        clean = clean and scrub(str(link)) == str(link)
        link = link.__cause__ or link.__context__
    if clean:
        return e
    return StorageError(scrub(f"{type(e).__name__}: {e}"))


# The canonical status codes (absl::StatusCode) TensorStore's errors begin with: the type
# of an error, which the rest of its text explains in words a release may change.
_STATUS_CODES = frozenset(
    {
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    }
)


def status(e: BaseException) -> str | None:
    """The status code of a TensorStore error (`"DATA_LOSS"`, ...), of `e` or of an
    error it was raised from (`__cause__`, `__context__`: Orbax re-raises them); None
    for any other error. TensorStore's Python errors carry no code attribute: the code
    is the first word of their text, which absl writes as "CODE: message"."""
    seen, link = set(), e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        code = str(link).partition(": ")[0] if isinstance(link, Exception) else ""
        if code in _STATUS_CODES:
            return code
        link = link.__cause__ or link.__context__
    return None


# The status codes of TensorStore's errors that say a file of a step still there is not
# what was written (classified by code, never by the words of the message): DATA_LOSS
# (a CRC-32C or a length that does not hold), OUT_OF_RANGE (a file shorter than its
# index says), NOT_FOUND (a file gone from the step), FAILED_PRECONDITION (a value that
# does not decode: a zstd frame, a raw chunk of the wrong length). Any other code (the
# storage out of reach, a refused permission, a fault of ours) is not damage.
DAMAGE_CODES = frozenset({"DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION"})


def out_of_reach(e: BaseException) -> bool:
    """`e` says the storage could not be reached (after the retries): a cleanup that
    needs it would only wait again."""
    text = str(e)
    return (
        isinstance(e, StorageError)
        or status(e) in ("DEADLINE_EXCEEDED", "UNAVAILABLE")
        or any(mark in text for mark in ("CURL error", "retry attempts failed"))
    )


def is_damage(e: BaseException) -> bool:
    """`e` (of TensorStore, or raised from one of its errors) says a file of a step still
    there is not what was written (`DAMAGE_CODES`)."""
    return status(e) in DAMAGE_CODES
