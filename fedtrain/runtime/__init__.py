"""Network drivers: the gRPC aggregation server, site daemons and their mutual-TLS setup.

`server/` is the aggregation server and `site/` the site daemon; neither imports the
other. What both ends speak lives here beside them: the protobuf messages (`proto/`),
the chunk codec (`wire`), RPC names (`rpc`), TLS and the federation CA (`tls`,
`tls_config`), proof of identity on a call (`peer_auth`, `secagg_identity`), the
configuration files (`config`), the Status RPC's client (`status`), and what the CLI
uses to run either end (`lifecycle`, `allocator`, `demo`).
"""
