"""flowsched.tls: contexts from PEM files, errors naming the setting, reloading on change."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from flowsched import tls


def _encrypted_copy(key: Path, folder: Path) -> Path:
    target = folder / "encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(key), "-aes256", "-passout", "pass:secret",
         "-out", str(target)],
        check=True, capture_output=True,
    )  # fmt: skip
    return target


@pytest.mark.parametrize(
    ("cert", "key", "ca", "field", "words"),
    [
        ("server_cert", None, None, "tls_key", "missing"),
        (None, "server_key", None, "tls_cert", "missing"),
        ("server_cert", "client_key", None, "tls_key", "is not the private key"),
        ("missing", "server_key", None, "tls_cert", "cannot read"),
        ("server_cert", "missing", None, "tls_key", "cannot read"),
        ("server_cert", "encrypted", None, "tls_key", "is encrypted"),
        ("server_cert", "server_key", "server_key", "tls_client_ca", "is not a PEM CA bundle"),
        ("server_key", "server_key", None, "tls_cert", "is not a PEM certificate"),
        ("server_cert", "server_cert", None, "tls_key", "is not a PEM private key"),
        ("server_cert", "server_key", "missing", "tls_client_ca", "cannot read"),
    ],
)
def test_server_context_refusals_name_the_setting(
    tls_files: Any, tmp_path: Path, cert: str | None, key: str | None, ca: str | None,
    field: str, words: str,
) -> None:  # fmt: skip
    files = {k: str(v) for k, v in vars(tls_files).items()}
    files["missing"] = str(tmp_path / "missing.pem")
    files["encrypted"] = str(_encrypted_copy(tls_files.server_key, tmp_path))
    with pytest.raises(tls.TlsConfigError) as refused:
        tls.check_pair(files.get(cert or ""), files.get(key or ""))
        tls.server_context(files[cert or ""], files[key or ""], files[ca] if ca else None)
    assert refused.value.field == field and words in refused.value.problem


def test_client_context_verifies_against_the_given_ca_and_presents_the_certificate(
    tls_files: Any,
) -> None:
    context = tls.client_context(
        str(tls_files.ca), str(tls_files.client_cert), str(tls_files.client_key)
    )
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert [c["subject"] for c in context.get_ca_certs()] == [  # the given CA alone
        ((("commonName", "flowsched test ca"),),)
    ]
    with pytest.raises(tls.TlsConfigError) as refused:
        tls.client_context(str(tls_files.client_key))
    assert refused.value.field == "tls_ca"


def test_a_reloading_context_follows_its_files_and_keeps_the_last_good_one(
    tls_files: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls, "CHECK_INTERVAL", 0.0)  # every call looks at the files
    ca = tmp_path / "ca.pem"
    shutil.copy(tls_files.ca, ca)
    reloading = tls.reloading_client(str(ca))
    first = reloading.current()
    assert reloading.current() is first  # unchanged files: the same context
    shutil.copy(tls_files.other_ca, ca)
    os.utime(ca, ns=(1, 1))  # a different stamp even within the clock's resolution
    second = reloading.current()
    assert second is not first
    assert "other-ca" in str(second.get_ca_certs()) or second.get_ca_certs() != first.get_ca_certs()
    ca.write_text("not a certificate\n")
    assert reloading.current() is second  # a broken file keeps the last good context


def test_the_coordinator_trusts_the_client_ca_alone(tls_files: Any) -> None:
    # a context made by create_default_context would also take client certificates from
    # every CA of the system's store
    context = tls.server_context(
        str(tls_files.server_cert), str(tls_files.server_key), str(tls_files.ca)
    )
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert [c["subject"] for c in context.get_ca_certs()] == [
        ((("commonName", "flowsched test ca"),),)
    ]
    assert tls.server_context(
        str(tls_files.server_cert), str(tls_files.server_key)
    ).verify_mode == (ssl.CERT_NONE)
