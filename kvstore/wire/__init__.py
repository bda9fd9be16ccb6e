"""The daemon's socket: the wire format both ends share, and the client end of it."""
