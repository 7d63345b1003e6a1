"""`_faults.scrub`: what a server answered, without the credentials it may echo (the
texts are TensorStore's errors as seen against a server that echoes them, tcp_proxy.py's
deny mode; end-to-end: test_storage.py)."""

import pytest

from jax_cb_ckpt._storage import _faults

KEY_ID = "AKIAECHOED7F3A2KEYID"
SIGNATURE = "13be9b5784af8b0e9a57e072642df869721d565833ccbb609b2e0f789f0768bf"
TOKEN = "ya29.echoed-token-5d1b77"

S3 = (
    "PERMISSION_DENIED: SignatureDoesNotMatch: The request signature we calculated does "
    "not match the signature you provided. Check your key and signing method. "
    f"(https://bucket.s3.amazonaws.com/b/run/1?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-"
    f"Credential={KEY_ID}%2F20261202/us-east-1/s3/aws4_request&X-Amz-Signature={SIGNATURE}"
    ") [http_response_code='403'] [x-amzn-requestid='R1'] [http_response_body='<?xml "
    'version=\\"1.0\\" encoding=\\"UTF-8\\"?>\\n<Error><Code>SignatureDoesNotMatch</Code>'
    "<Message>Check your key.</Message><AWSAccessKeyId>"
    f"{KEY_ID}</AWSAccessKeyId><StringToSign>AWS4-HMAC-SHA256\\n20261202T000000Z\\n"
    f"20261202/us-east-1/s3/aws4_request</StringToSign><SignatureProvided>{SIGNATURE}"
    "</SignatureProvided><CanonicalRequest>GET /b/run/1 HTTP/1.1\\nauthorization:AWS4-H"
    "']"
)
GCS = (
    f"PERMISSION_DENIED: Permission denied: access_token={TOKEN} for https://storage."
    f"googleapis.com/storage/v1/b/b/o/x?alt=media?GoogleAccessId=sa&Signature={TOKEN} "
    '[http_response_body=\'{\\"error\\": {\\"code\\": 403, \\"message\\": \\"Permission '
    f'denied\\", \\"errors\\": [{{\\"reason\\": \\"forbidden\\", \\"message\\": '
    f'\\"Authorization: Bearer {TOKEN}\\"}}], \\"access_token\\": \\"{TOKEN}'
    "'] [http_response_code='403']"
)
LOOSE = (  # not TensorStore's payload form: what a proxy or another client may say
    f"<AWSAccessKeyId>{KEY_ID}</AWSAccessKeyId> Authorization: AWS4-HMAC-SHA256 "
    f"Credential={KEY_ID}/20261202/us-east-1/s3/aws4_request, Signature={SIGNATURE}; "
    f'{{"access_token": "{TOKEN}", "token_type": "Bearer"}} Bearer {TOKEN}'
)


@pytest.fixture(autouse=True)
def no_environment_keys(monkeypatch):
    """The patterns alone (the environment's own keys are a second net)."""
    for name in _faults._SECRET_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("text", [S3, GCS, LOOSE], ids=["s3", "gcs", "loose"])
def test_scrub_removes_every_credential(text):
    scrubbed = _faults.scrub(text)
    for secret in (KEY_ID, SIGNATURE, TOKEN):
        assert secret not in scrubbed, scrubbed
    assert "(removed)" in scrubbed


def test_scrub_keeps_what_says_what_is_wrong():
    s3 = _faults.scrub(S3)
    assert s3.startswith("PERMISSION_DENIED: SignatureDoesNotMatch: The request signature")
    assert "[http_response_code='403']" in s3 and "x-amzn-requestid='R1'" in s3
    assert "<Code>SignatureDoesNotMatch</Code> <Message>Check your key.</Message>" in s3
    assert "https://bucket.s3.amazonaws.com/b/run/1?" in s3
    gcs = _faults.scrub(GCS)
    assert "[http_response_code='403']" in gcs and "code: 403" in gcs
    assert 'reason: \\"forbidden\\"' in gcs


def test_scrub_leaves_a_text_without_credentials_as_it_is():
    text = (
        'NOT_FOUND: Error reading "key/0" in OCDBT database at gs://b/run/1/state/: '
        "[http_response_code='404'] [key='run/1/state/manifest.ocdbt']"
    )
    assert _faults.scrub(text) == text
    error = ValueError(text)
    assert _faults.scrubbed(error) is error


def test_scrubbed_replaces_an_error_whose_chain_leaks(monkeypatch):
    try:
        try:
            raise ValueError(S3)
        except ValueError as inner:
            raise OSError("writing the arrays failed") from inner
    except OSError as e:
        outer = e
    replaced = _faults.scrubbed(outer)
    assert replaced is not outer and isinstance(replaced, _faults.StorageError)
    assert replaced.__cause__ is None and replaced.__context__ is None
    assert str(replaced) == "OSError: writing the arrays failed"


def test_the_environments_keys_are_removed_wherever_they_appear(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    text = "the server said: wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY is wrong"
    assert _faults.scrub(text) == "the server said: (removed) is wrong"
