"""The operations on a store: each one function over the store and typed request and reply
values (kvstore.wire.messages). The daemon's handlers decode a frame, call one and encode its
reply; the CLI calls the same function itself when no daemon holds the home, or sends the request
through the socket when one does (`route`). Operations never log: their callers do, from the
reply (the CLI's own path has no log handler, so a log line would reach its stderr).
"""
