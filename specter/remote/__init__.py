"""Everything that crosses a process boundary: the ZeroMQ channel and its servers, the shared-memory
slot table, host store and counters, the verifier's remote link and experts, the draft's remote
proposer, and the wire fuzzer. ``specter/protocol.py`` (the messages) stays at the top so that the
in-process code imports it without this package; ``specter/experts/`` is purely in-process.
"""
