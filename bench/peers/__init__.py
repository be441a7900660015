"""The systems under test and the peers' known traffic (bench stage: a system name + a model -> a
`System`; a peer -> its ledger).

Imported as `peers.<module>` with bench/ on sys.path (the drivers in bench/ run as scripts;
tests load them with tests/bench_modules.py).
"""
