"""``growpage serve``'s bad addresses end the command before a model loads: a port out of range
is a usage error (argparse), an address that cannot be listened on one line naming it, with
exit status 2."""

from __future__ import annotations

import socket

import pytest

from growpage.cli import main
from growpage.server import cli as server_cli


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test."""

    def build_llm(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(server_cli, "build_llm", build_llm)


@pytest.mark.parametrize("port", ["-1", "65536", "70000", "80.5", "http"])
def test_a_port_out_of_range_is_refused_by_the_parser(no_model, capsys, port):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", port])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --port: expected a port number from 0 to 65535, got '{port}'" in err


def test_a_port_in_use_is_named_in_one_line(no_model, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"growpage: error: cannot listen on 127.0.0.1:{port} (")
    assert err.endswith(")\n") and err.count("\n") == 1 and "in use" in err


@pytest.mark.parametrize(
    "host",
    [
        "192.0.2.1",  # TEST-NET-1: no interface of this machine has it
        "a..b",  # not a host name (IDNA refuses the empty label)
    ],
)
def test_a_host_that_cannot_be_listened_on_is_named(no_model, capsys, host):
    assert main(["serve", "--host", host, "--port", "8123"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"growpage: error: cannot listen on {host}:8123 (")
    assert err.endswith(")\n") and err.count("\n") == 1


def test_listen_takes_the_address_and_a_second_listen_is_refused():
    """Port 0 is one the system picks; the sockets listen at once, so the address is held
    while the model loads."""
    sockets = server_cli.listen("127.0.0.1", 0)
    try:
        assert len(sockets) == 1
        port = sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into the backlog before any server runs
        with pytest.raises(server_cli.GrowPageError, match=rf"127\.0\.0\.1:{port} \("):
            server_cli.listen("127.0.0.1", port)
    finally:
        for sock in sockets:
            sock.close()
