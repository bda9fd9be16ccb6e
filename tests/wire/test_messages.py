"""The typed wire (kvstore.wire.messages, codes, args): one argument validator, and error codes
a client matches instead of message text."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest

from kvstore.client.learn import Learner, LearnTarget
from kvstore.errors import DaemonError
from kvstore.wire import daemon_client, protocol
from kvstore.wire.args import arg
from kvstore.wire.codes import ErrorCode, legacy_code
from kvstore.wire.messages import (
    OPS,
    EvictReply,
    EvictRequest,
    LearnReply,
    Owned,
    PutBlocksRequest,
    Record,
    Unknown,
)


def test_a_bool_is_not_an_int_anywhere():
    with pytest.raises(ValueError, match="argument 'to_size' must be <class 'int'>, not bool"):
        EvictRequest.from_wire({"to_size": True})
    with pytest.raises(ValueError, match="argument 'nbytes' must be"):
        arg({"nbytes": True}, "nbytes", int)
    assert EvictRequest.from_wire({"to_size": 0}).to_size == 0  # a filter: down to 0 bytes
    assert arg({"sliceable": True}, "sliceable", bool) is True
    assert arg({}, "x", int, 7) == 7
    with pytest.raises(ValueError, match="argument 'x' is required"):
        arg({"x": None}, "x", int, required=True)


def test_requests_and_replies_round_trip_with_the_wire_names():
    req = EvictRequest(keys=[b"k" * 32], label="a", unpinned=True, to_size=5)
    assert list(req.to_wire()) == ["keys", "label", "model", "unpinned", "stale", "all", "to_size"]
    assert EvictRequest.from_wire(req.to_wire()) == req
    reply = EvictReply(
        1, 10, [Owned("a", "m", "/p.toml", True)], ["ab"], [Unknown("cd", "b", "m", "?")]
    )
    assert EvictReply.from_wire(reply.to_wire()) == reply
    blocks = PutBlocksRequest(b"f" * 16, b"\0" * 8, [Record(0, 2, b"x")], "learned", "m", {})
    assert blocks.to_wire()["records"] == [{"start": 0, "end": 2, "blob": b"x"}]
    assert PutBlocksRequest.from_wire(blocks.to_wire()) == blocks
    # an older daemon's reply lacks fields: they read as their defaults
    assert LearnReply.from_wire({"want": [[0, 4]]}) == LearnReply([[0, 4]], [], None)
    assert set(OPS) >= {"ping", "learn", "put_blocks", "touch_blocks", "evict", "stats"}


def test_legacy_code_reads_only_a_version_1_daemons_texts():
    assert legacy_code("unknown command 'learn'") is ErrorCode.UNKNOWN_OP
    assert legacy_code("too many connections (max_connections=1)") is ErrorCode.BUSY
    assert legacy_code("learn: argument 'tokens' is required") is None


def _fake_daemon(home, replies):
    """A socket that answers each connection's requests with `replies`, in order."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(daemon_client.socket_path(home)))
    listener.listen(4)

    def serve():
        conn, _ = listener.accept()
        with conn:
            for reply in replies:
                if protocol.recv(conn, timeout=5) is None:
                    return
                protocol.send(conn, reply)

    t = threading.Thread(target=serve)
    t.start()
    return listener, t


@pytest.mark.parametrize(
    "error",
    [
        # a new daemon: its text may say anything, the code decides
        protocol.error("no operation named 'learn' here", ErrorCode.UNKNOWN_OP),
        # a version-1 daemon: no code, its text is read (legacy_code)
        protocol.error("unknown command 'learn'"),
    ],
    ids=["code", "legacy-text"],
)
def test_the_client_reacts_to_the_code_not_the_text(tmp_path, error):
    home = tmp_path / "h"
    home.mkdir()
    ping = protocol.ok({"pid": 1, "home": str(home), "uptime": 0.0})  # a version-1 ping
    listener, t = _fake_daemon(home, [ping, error, error])
    try:
        client = daemon_client.connect(home)
        assert client is not None and client.info.protocol == 1
        assert client.supports("learn") is None  # a version-1 daemon does not say
        with client:
            with pytest.raises(DaemonError) as e:
                client.request("learn")
            assert e.value.code is ErrorCode.UNKNOWN_OP
            learner = Learner(home, writer=SimpleNamespace())
            target = LearnTarget(b"f" * 16, "m", None, {}, sliceable=False)
            learner._learn(client, "m", target, [1, 2, 3], [])
            assert learner._unsupported  # learning is off for this daemon, quietly
    finally:
        t.join(10)
        listener.close()


def test_an_error_whose_text_looks_legacy_but_whose_code_differs_is_that_code(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    ping = protocol.ok({"pid": 1, "home": "", "uptime": 0.0, "protocol": 2, "ops": ["ping"]})
    said = protocol.error("learn: unknown command in the tokens", ErrorCode.BAD_ARGUMENT)
    listener, t = _fake_daemon(home, [ping, said])
    try:
        client = daemon_client.connect(home)
        assert client is not None and client.supports("ping") and not client.supports("learn")
        with client, pytest.raises(DaemonError) as e:
            client.request("learn")
        assert e.value.code is ErrorCode.BAD_ARGUMENT
    finally:
        t.join(10)
        listener.close()


@pytest.mark.parametrize("name", list(OPS))
def test_every_operations_reply_reads_back_what_it_wrote(name):
    reply = OPS[name][1]()
    assert type(reply).from_wire(reply.to_wire()) == reply


def test_fleet_checked_takes_entry_keys_and_string_fields_only():
    from kvstore.wire.messages import FleetCheckedRequest

    key = bytes(32)
    ok = {"passed": [key], "refused": [{"key": key, "what": "x", "uploader": "box-1", "label": ""}]}
    assert FleetCheckedRequest.from_wire(ok).refused[0]["uploader"] == "box-1"
    with pytest.raises(ValueError, match="argument 'passed' must be a list of 32-byte keys"):
        FleetCheckedRequest.from_wire({"passed": [b"short"]})
    with pytest.raises(ValueError, match="argument 'refused' must be maps with a 32-byte 'key'"):
        FleetCheckedRequest.from_wire({"refused": [{"key": "not bytes"}]})
    with pytest.raises(ValueError, match="'uploader' must be a string"):
        FleetCheckedRequest.from_wire({"refused": [{"key": key, "uploader": 7}]})
