"""``arpo serve --tls-cert/--tls-key`` end to end: the command in a subprocess on 127.0.0.1 serves HTTPS with a
certificate made here, says so at start-up, and the official ``openai`` client talks to it with the key."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")
x509 = pytest.importorskip("cryptography.x509")

KEY = "tls-test-key-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM files)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def test_tls_serves_https_and_says_so(tmp_path):
    import httpx

    from arpo_algo.models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", num_layers=2, hidden_size=64, seed=0)
    cert, key = self_signed(tmp_path)
    key_file = tmp_path / "api_key"
    key_file.write_text(KEY)
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - closed below
    env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0"}
    env.pop("ARPO_API_KEY", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arpo_algo.cli",
            "serve",
            f"tiny={model}",
            "--port",
            str(port),
            "--tools",
            "python",
            "--max-tokens",
            "8",
            "--api-key-file",
            str(key_file),
            "--tls-cert",
            cert,
            "--tls-key",
            key,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while "TLS: " not in (text := (tmp_path / "serve.log").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(1)
        assert "TLS: on" in text and f"https://127.0.0.1:{port}" in text and KEY not in text, text[-3000:]
        http = httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=120)
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1", api_key=KEY, http_client=http, max_retries=0, timeout=120
        )
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].message.content is not None
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        url = f"https://127.0.0.1:{port}/v1/chat/completions"
        assert (
            http.post(url, content=body, headers={**headers, "Origin": f"https://127.0.0.1:{port}"}).status_code == 200
        )
        assert (
            http.post(url, content=body, headers={**headers, "Origin": f"http://127.0.0.1:{port}"}).status_code == 403
        )
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).raise_for_status()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
    assert "shutting down" in (tmp_path / "serve.log").read_text()


def test_the_readiness_poll_accepts_its_own_self_signed_certificate(tmp_path):
    """Bug: `arpo serve --tls-cert` polled its own /health with certificate checks on, so a self-signed certificate
    (one that need not name 127.0.0.1) never became ready. The poll takes any certificate of its own server."""
    import http.server
    import json
    import threading

    from serve.cli.serve import wait_ready

    cert, key = self_signed(tmp_path)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert wait_ready(f"https://127.0.0.1:{server.server_address[1]}", 20, verify=False) == {"status": "ok"}
    finally:
        server.shutdown()
        server.server_close()
