"""Learned prefixes, one room: the policy (what recurs), chain hashes, the block store (records in
the store's environment), the record codec, the index of what the store holds and the store as a
running process's cold tier. The daemon's and the client's learn modules are its thin ends."""
