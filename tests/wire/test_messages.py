"""The typed wire (kvstore.wire.messages, codes, args): one argument validator, and error codes
a client matches instead of message text."""

from __future__ import annotations

import socket
import threading

import msgpack
import pytest

from kvstore.errors import DaemonError
from kvstore.wire import daemon_client, protocol
from kvstore.wire.args import arg
from kvstore.wire.codes import ErrorCode
from kvstore.wire.messages import (
    OPS,
    PROTOCOL_VERSION,
    REQUESTS,
    EvictReply,
    EvictRequest,
    LearnReply,
    LearnRequest,
    Owned,
    PingReply,
    PingRequest,
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


def _ping(home, version=PROTOCOL_VERSION):
    return protocol.ok({"pid": 1, "home": str(home), "uptime": 0.0, "protocol": version,
                        "ops": list(OPS)})  # fmt: skip


@pytest.mark.parametrize("version", [None, 1, PROTOCOL_VERSION + 1])
def test_a_daemon_of_another_protocol_version_is_refused_at_connect(tmp_path, version):
    """The version is checked once, at connect: no request adapts to an older daemon after, and
    the caller is told (never None: it would then write the store beside that daemon)."""
    home = tmp_path / "h"
    home.mkdir()
    ping = protocol.ok({"pid": 1, "home": str(home), "uptime": 0.0})  # a version-1 ping
    if version is not None:
        ping = _ping(home, version)
    listener, t = _fake_daemon(home, [ping])
    try:
        with pytest.raises(DaemonError, match="protocol version") as e:
            daemon_client.connect(home)
        assert e.value.code is ErrorCode.PROTOCOL
    finally:
        t.join(10)
        listener.close()


def test_the_client_reacts_to_the_code_not_the_text(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    said = protocol.error("no operation named 'learn' here", ErrorCode.UNKNOWN_OP)
    listener, t = _fake_daemon(home, [_ping(home), said])
    try:
        client = daemon_client.connect(home)
        assert client is not None and client.info.protocol == PROTOCOL_VERSION
        with client, pytest.raises(DaemonError) as e:
            client.send(LearnRequest(b"f" * 16, b"\0" * 4))
        assert e.value.code is ErrorCode.UNKNOWN_OP
    finally:
        t.join(10)
        listener.close()


def test_an_error_whose_text_looks_like_another_code_is_its_own_code(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    said = protocol.error("learn: unknown command in the tokens", ErrorCode.BAD_ARGUMENT)
    listener, t = _fake_daemon(home, [_ping(home), said])
    try:
        client = daemon_client.connect(home)
        assert client is not None and "ping" in client.info.ops
        with client, pytest.raises(DaemonError) as e:
            client.send(LearnRequest(b"f" * 16, b"\0" * 4))
        assert e.value.code is ErrorCode.BAD_ARGUMENT
    finally:
        t.join(10)
        listener.close()


def test_send_answers_the_reply_type_the_request_names(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    listener, t = _fake_daemon(home, [_ping(home), _ping(home)])
    try:
        client = daemon_client.connect(home)
        assert client is not None
        with client:
            reply = client.send(PingRequest())
        assert isinstance(reply, PingReply) and reply.ops == list(OPS)
    finally:
        t.join(10)
        listener.close()


def test_every_operation_names_its_reply_and_the_daemon_a_handler_for_each():
    from kvstore.daemon.commands import Commands

    assert [r.op for r in REQUESTS] == list(OPS)
    assert all(isinstance(r.reply, type) for r in REQUESTS)
    handlers = {n[4:] for n in dir(Commands) if n.startswith("cmd_")}
    assert handlers == set(OPS)
    broken = type("Broken", (Commands,), {"cmd_format_disk": lambda self, req, conn: None})
    with pytest.raises(RuntimeError, match="format_disk"):
        broken._register(object.__new__(broken))


def test_the_wire_sizes_are_the_stores():
    from kvstore.store import keys
    from kvstore.wire import args

    assert (args.FINGERPRINT_BYTES, args.KEY_BYTES) == (keys.FINGERPRINT_BYTES, keys.KEY_BYTES)


@pytest.mark.parametrize("name", list(OPS))
def test_every_operations_reply_reads_back_what_it_wrote(name):
    reply = OPS[name].reply()
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


def test_the_wire_imports_no_storage():
    """Both ends share kvstore.wire: it holds the frames and messages, none of the store."""
    import ast
    from pathlib import Path

    import kvstore.wire

    for path in Path(kvstore.wire.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("kvstore.store", "kvstore.ops", "kvstore.warm")), (
                    f"{path.name} imports {name}"
                )


def test_a_warm_reply_carries_typed_reports_as_the_map_it_always_sent():
    from kvstore.wire.messages import PinResult, Purged, WarmReply, WarmReport

    pin, gone = PinResult("m", "sys", "ab", 9, "warmed"), Purged("cd", "old", "m", "stale")
    report = WarmReport(pins=[pin], purged=[gone], manifest="/p/m.toml")
    (sent,) = WarmReply([report]).to_wire()["reports"]
    assert list(sent) == ["pins", "purged", "released", "adopted", "models_loaded", "seconds",
                          "stopped", "manifest", "warmed", "failed", "deferred"]  # fmt: skip
    assert (sent["warmed"], sent["failed"], sent["pins"][0]["status"]) == (1, 0, "warmed")
    wire = msgpack.unpackb(msgpack.packb({"reports": [sent]}))
    assert WarmReply.from_wire(wire) == WarmReply([report])
