"""Learned prefixes, one room: the policy (what recurs), chain hashes, the block store (records in
the store's environment) and the record codec. The daemon's and the client's learn modules are
its thin ends."""
