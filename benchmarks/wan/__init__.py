"""fedtrain and Flower 1.42 over emulated WAN links (network namespaces + a userspace shaper).

`links` holds the pure logic (links, scenarios, line-rate bound, the shaper's config
file), `emulator` the namespaces and the shaper process, `run` the CLI. See
`benchmarks/wan/README.md`.
"""
