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
        ("empty", "server_key", None, "tls_cert", "is not a PEM certificate (empty)"),
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
    (tmp_path / "empty.pem").write_bytes(b"")
    files["empty"] = str(tmp_path / "empty.pem")
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


def _replace(path: Path, content: bytes, how: str) -> None:
    """Give ``path`` ``content`` as ``how`` does, keeping its size and modification time."""
    times = os.stat(path)
    if how == "in-place":  # as cp -p onto the file
        path.write_bytes(content)
    elif how == "renamed-over":
        aside = path.with_suffix(".new")
        aside.write_bytes(content)
        os.utime(aside, ns=(times.st_atime_ns, times.st_mtime_ns))
        os.replace(aside, path)
        return
    else:  # "symlink-swapped": path -> data/FILE, data -> a new directory
        fresh = path.parent / "v2"
        fresh.mkdir()
        (fresh / "file").write_bytes(content)
        os.utime(fresh / "file", ns=(times.st_atime_ns, times.st_mtime_ns))
        (path.parent / "data.new").symlink_to("v2")
        os.replace(path.parent / "data.new", path.parent / "data")
        return
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


@pytest.mark.parametrize("how", ["in-place", "renamed-over", "symlink-swapped"])
def test_a_file_replaced_with_the_same_size_and_mtime_is_noticed(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls, "CHECK_INTERVAL", 0.0)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "file").write_bytes(b"A" * 64)
    (tmp_path / "data").symlink_to("v1")
    path = tmp_path / "file.pem"
    path.symlink_to(Path("data") / "file")
    if how != "symlink-swapped":  # a plain file, not the link
        path.unlink()
        path.write_bytes(b"A" * 64)
    builds: list[bytes] = []

    def build() -> ssl.SSLContext:
        builds.append(path.read_bytes())
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)

    reloading = tls.ReloadingContext(build, [str(path)])
    first = reloading.current()
    _replace(path, b"B" * 64, how)
    assert reloading.current() is not first
    assert builds == [b"A" * 64, b"B" * 64]


def test_without_a_ca_file_the_system_trust_store_is_followed(
    tls_files: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls, "CHECK_INTERVAL", 0.0)
    store = tmp_path / "system.pem"  # OpenSSL's default CA file, as SSL_CERT_FILE names it
    shutil.copy(tls_files.ca, store)
    monkeypatch.setenv("SSL_CERT_FILE", str(store))
    reloading = tls.reloading_client(None)
    first = reloading.current()
    shutil.copy(tls_files.other_ca, store)
    second = reloading.current()
    assert second is not first
    assert "other-ca" in str(second.get_ca_certs()), second.get_ca_certs()


def test_a_set_that_fails_to_load_is_logged_once_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tls, "CHECK_INTERVAL", 0.0)
    path = tmp_path / "key.pem"
    path.write_text("good")

    def build() -> ssl.SSLContext:
        if path.read_text() != "good":
            raise tls.TlsConfigError("tls_key", f"{path} is not the private key")
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)

    reloading = tls.ReloadingContext(build, [str(path)], names={"tls_key": "--etcd-key"})
    first = reloading.current()
    path.write_text("broken, and longer")
    assert [reloading.current() for _ in range(3)] == [first] * 3
    kept = [r.getMessage() for r in caplog.records if "kept the previous" in r.getMessage()]
    assert kept == [f"kept the previous TLS settings: --etcd-key: {path} is not the private key"]


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


def test_the_coordinator_refuses_renegotiation(tls_files: Any) -> None:
    # a TLS 1.2 peer's renegotiation would be a handshake outside the coordinator's pacing
    context = tls.server_context(str(tls_files.server_cert), str(tls_files.server_key))
    assert context.options & ssl.OP_NO_RENEGOTIATION


def _vanish_after_check(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove ``path`` right after the loader checked that it reads (a renewal deleting it
    between the check and the load)."""
    check = tls._check_readable

    def check_then_vanish(field_name: str, checked: str) -> None:
        check(field_name, checked)
        if checked == str(path):
            path.unlink()

    monkeypatch.setattr(tls, "_check_readable", check_then_vanish)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("cert emptied", "tls_cert"),  # truncated by a rewrite in place, not yet written
        ("key vanished after its check", "tls_key"),
        ("client CA vanished after its check", "tls_client_ca"),
    ],
)
def test_a_file_half_replaced_while_reloading_keeps_the_last_good_context(
    tls_files: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    change: str,
    field: str,
) -> None:
    monkeypatch.setattr(tls, "CHECK_INTERVAL", 0.0)
    files = {"cert": tls_files.server_cert, "key": tls_files.server_key, "ca": tls_files.ca}
    paths = {name: tmp_path / f"{name}.pem" for name in files}
    for name, source in files.items():
        shutil.copy(source, paths[name])
    reloading = tls.reloading_server(str(paths["cert"]), str(paths["key"]), str(paths["ca"]))
    first = reloading.current()
    if change == "cert emptied":
        paths["cert"].write_bytes(b"")
    else:
        victim = paths["key" if field == "tls_key" else "ca"]
        os.utime(victim, ns=(1, 1))  # a change for the stamp
        _vanish_after_check(victim, monkeypatch)
    assert reloading.current() is first  # no exception: the last good context
    kept = [r.getMessage() for r in caplog.records if "kept the previous" in r.getMessage()]
    assert len(kept) == 1 and f": {field}: " in kept[0], kept
