"""``flowsched coordinator``'s TLS flags for etcd: every unusable setting ends with status 2 and
one line naming the flag, before anything listens (table-driven, the real command)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from flowsched.protocol import write_token

if TYPE_CHECKING:
    from conftest import TlsFiles

HTTPS = ["--etcd", "https://127.0.0.1:2379"]

#: id -> (flags; {ca} {cert} {key} {stranger_key} {dir} are replaced), what stderr must name
CASES = {
    "cert-without-key": ([*HTTPS, "--etcd-cert", "{cert}"], "--etcd-cert: needs --etcd-key"),
    "key-without-cert": ([*HTTPS, "--etcd-key", "{key}"], "--etcd-key: needs --etcd-cert"),
    "cacert-with-http-url": (
        ["--etcd", "http://127.0.0.1:2379", "--etcd-cacert", "{ca}"],
        "--etcd-cacert: TLS files need an https:// etcd URL"),
    "client-cert-with-http-url": (
        ["--etcd", "http://127.0.0.1:2379", "--etcd-cert", "{cert}", "--etcd-key", "{key}"],
        "--etcd-cert: TLS files need an https:// etcd URL"),
    "tls-flag-without-etcd": (["--etcd-cacert", "{ca}"], "--etcd-cacert: TLS to etcd, only"),
    "cacert-missing": ([*HTTPS, "--etcd-cacert", "{dir}/nope.pem"], "--etcd-cacert: cannot read"),
    "cacert-not-pem": (
        [*HTTPS, "--etcd-cacert", "{dir}/token"], "--etcd-cacert: {dir}/token is not a PEM CA"),
    "cert-not-pem": (
        [*HTTPS, "--etcd-cert", "{key}", "--etcd-key", "{key}"],
        "--etcd-cert: {key} is not a PEM certificate"),
    "key-not-pem": (
        [*HTTPS, "--etcd-cert", "{cert}", "--etcd-key", "{ca}"],
        "--etcd-key: {ca} is not a PEM private key"),
    "key-missing": (
        [*HTTPS, "--etcd-cert", "{cert}", "--etcd-key", "{dir}/nope.key"],
        "--etcd-key: cannot read"),
    "key-of-another-cert": (
        [*HTTPS, "--etcd-cert", "{cert}", "--etcd-key", "{stranger_key}"],
        "is not the private key of the certificate"),
}  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), list(CASES.values()), ids=list(CASES))
def test_unusable_etcd_tls_flags_exit_2_with_one_line_naming_the_flag(
    flags: list[str], message: str, tmp_path: Path, tls_files: TlsFiles
) -> None:
    write_token(tmp_path / "token")
    names = {
        "{ca}": tls_files.ca, "{cert}": tls_files.client_cert, "{key}": tls_files.client_key,
        "{stranger_key}": tls_files.stranger_key, "{dir}": tmp_path,
    }  # fmt: skip
    for name, path in names.items():
        flags = [flag.replace(name, str(path)) for flag in flags]
        message = message.replace(name, str(path))
    proc = subprocess.run(
        [sys.executable, "-m", "flowsched", "coordinator", "--token-file",
         str(tmp_path / "token"), "--listen", "127.0.0.1:0", "--metrics-port", "0", *flags],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "FLOWSCHED_NO_UVLOOP": "1"},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert proc.stdout == ""  # never got as far as listening
