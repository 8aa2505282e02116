"""The aggregation server: `app.AggregationServer` owns the gRPC server, the `servicer`
that answers sites, and the `coordinator` that runs rounds (synchronous `rounds`,
`secure_round` under secure aggregation, `buffered` for FedBuff) over the uploads
folded as they arrive (`uploads`), with checkpoints, an audit log and admission rules.

Nothing here is imported by the site daemon (`fedtrain.runtime.site`); what both
ends share lives in `fedtrain.runtime`.
"""
